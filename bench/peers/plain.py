"""What the peer scripts share, kept out of them so each reads like the script its users write: the
shape flags, the model, the data, and the timed loop that prints one JSON line.

The model is ``PlainGPT`` (bench/common.py): GPT-2 written plainly in PyTorch (``nn.Linear`` layers,
``[b, s, h]``), with the weights megazero's GPT gets from the same seed, so every side trains the same
numbers. The data: each step's global batch drawn from one seeded generator, each rank keeping its
share (``common.step_batches``). Timing: a barrier, the step, the slowest rank's seconds. Memory: the
peak RSS over the timed steps and the peak live tensor bytes of an untimed step after them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import time

import torch
import torch.distributed as dist

from bench.common import GPT, PlainGPT, Spec, step_batches
from megazero.memory.measure import LiveTensorBytes, reachable_tensor_bytes


def parse(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    for name, default in (("layers", 8), ("hidden", 768), ("heads", 12), ("seq", 64), ("vocab", 8192),
                          ("micro-batch", 1), ("micro-batches", 1), ("steps", 7), ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="append the JSON line here too")
    return ap.parse_args()


def spec_of(a: argparse.Namespace) -> Spec:
    return Spec(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, vocab=a.vocab,
                micro_batch=a.micro_batch, micro_batches=a.micro_batches, untied=True, lr=a.lr)


def init() -> tuple[int, int]:
    """The process group from torchrun's environment: (rank, world)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def plain_model(a: argparse.Namespace) -> PlainGPT:
    """The plain GPT with the weights of megazero's ``GPT(cfg, seed=1234)``."""
    cfg = spec_of(a).model_cfg()
    return PlainGPT(cfg).load_from(GPT(cfg, seed=1234))


def batches(a: argparse.Namespace, rank: int, world: int) -> list[list[tuple]]:
    """Per step, this rank's (tokens, labels, loss_mask) micro-batches: ``a.steps`` and the
    :data:`MEASURED_STEPS` after them."""
    return step_batches(spec_of(a), a.steps + MEASURED_STEPS, world, rank)


# After the timed steps, untimed: the peak live tensor bytes of the last one, counted as
# ``pretrain_gpt.py --measure-live-bytes`` counts its last iteration (megazero.memory.LastStepLiveBytes):
# the profiler opens a step early, and counting starts over at the last step's start from the bytes
# alive there, so the frees of the step before's gradients are seen.
MEASURED_STEPS = 2


def ddp_bucket_bytes(model) -> int:
    """Bytes of the gradient buckets a ``DistributedDataParallel`` module's C++ reducer holds for the
    whole run (beside the ``.grad`` tensors, unless ``gradient_as_bucket_view``): tensors no Python
    object reaches, so :func:`reachable_tensor_bytes` misses them. DDP reports their sizes in its
    logging data (``bucket_sizes``, bytes, one per bucket)."""
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(x) for x in re.findall(r"\d+", sizes))


def timed_loop(a: argparse.Namespace, name: str, step, num_params: int, held_elsewhere=None) -> None:
    """Run ``step(micro_batches) -> loss`` for ``a.steps`` steps, then :data:`MEASURED_STEPS` untimed
    ones measuring live bytes; rank 0 prints (and appends to ``--out``) {"name", "params", "step_s":
    slowest rank's seconds of each timed step, "losses" (the timed steps'), "peak_rss_mib",
    "peak_live_mib" (largest rank's)}. The first ``a.warmup`` steps are not timed. ``held_elsewhere()``:
    bytes of tensors alive throughout that Python cannot reach (DDP's buckets: :func:`ddp_bucket_bytes`),
    added to the bytes alive at the measured step's start."""
    rank, world = dist.get_rank(), dist.get_world_size()
    times, losses = [], []
    micro_batches = batches(a, rank, world)
    for i, micro in enumerate(micro_batches[:a.steps]):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(float(step(micro)))
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= a.warmup:
            times.append(t.item())
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    with LiveTensorBytes() as probe:
        step(micro_batches[a.steps])
        probe.mark(reachable_tensor_bytes() + (held_elsewhere() if held_elsewhere else 0))
        step(micro_batches[a.steps + 1])
    live = torch.tensor([probe.peak / 2**20], dtype=torch.float64)
    dist.all_reduce(live, op=dist.ReduceOp.MAX)
    if rank == 0:
        line = json.dumps({"name": name, "params": num_params, "step_s": times, "losses": losses,
                           "peak_rss_mib": rss.item(), "peak_live_mib": live.item()})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    dist.barrier()
    dist.destroy_process_group()


def masked_mean_loss(model, micro: tuple) -> torch.Tensor:
    tokens, labels, _mask = micro                         # every position counts: the mask is all ones
    return model(tokens, labels)
