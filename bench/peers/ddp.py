"""DDP as its users write it, optionally with ``ZeroRedundancyOptimizer`` (torch's ZeRO-1): torch
AdamW, ``no_sync`` on all but the last micro-batch, ``clip_grad_norm_``.

    torchrun --nproc-per-node 4 -m bench.peers.ddp [--zero-redundancy] [shape flags]
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.peers.plain import ddp_bucket_bytes, init, masked_mean_loss, parse, plain_model, timed_loop

sys.argv, ZERO = [x for x in sys.argv if x != "--zero-redundancy"], "--zero-redundancy" in sys.argv
a = parse(__doc__)
rank, world = init()
model = DDP(plain_model(a))
num_params = sum(p.numel() for p in model.parameters())
decay = [p for p in model.parameters() if p.ndim >= 2]
no_decay = [p for p in model.parameters() if p.ndim < 2]
if ZERO:
    opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=a.lr, weight_decay=a.weight_decay)
    opt.add_param_group({"params": no_decay, "weight_decay": 0.0})
else:
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr)


def step(micro):
    total = 0.0
    for i, mb in enumerate(micro):
        with model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
            loss = masked_mean_loss(model, mb) / len(micro)
            loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


timed_loop(a, "torch-ddp-zero" if ZERO else "torch-ddp", step, num_params, lambda: ddp_bucket_bytes(model))
