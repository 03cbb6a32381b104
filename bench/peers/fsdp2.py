"""FSDP2 as its users write it: ``fully_shard`` on each transformer block, then on the root; torch
AdamW; gradient accumulation with ``set_requires_gradient_sync``; ``clip_grad_norm_``.

    torchrun --nproc-per-node 4 -m bench.peers.fsdp2 [--no-reshard] [shape flags]
"""
from __future__ import annotations

import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.peers.plain import init, masked_mean_loss, parse, plain_model, timed_loop

sys.argv, NO_RESHARD = [x for x in sys.argv if x != "--no-reshard"], "--no-reshard" in sys.argv
a = parse(__doc__)
rank, world = init()
model = plain_model(a)
num_params = sum(p.numel() for p in model.parameters())
mesh = init_device_mesh("cpu", (world,))
for block in model.blocks:
    fully_shard(block, mesh=mesh, reshard_after_forward=not NO_RESHARD)
fully_shard(model, mesh=mesh, reshard_after_forward=not NO_RESHARD)
decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                         {"params": no_decay, "weight_decay": 0.0}], lr=a.lr)


def step(micro):
    total = 0.0
    for i, mb in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        loss = masked_mean_loss(model, mb) / len(micro)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


timed_loop(a, "torch-fsdp2-noreshard" if NO_RESHARD else "torch-fsdp2", step, num_params)
