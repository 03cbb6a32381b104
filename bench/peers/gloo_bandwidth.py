"""The gloo bandwidth between the ranks of this machine, for the communication floor: the bytes each
rank sends per second in an all-gather and a reduce-scatter of ``--mib`` MiB (ring accounting:
(N-1)/N of the full tensor per rank), median of ``--repeats``. Rank 0 prints one JSON line.

    torchrun --nproc-per-node 4 bench/peers/gloo_bandwidth.py --mib 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--mib", type=int, default=64)
ap.add_argument("--repeats", type=int, default=5)
a = ap.parse_args()
dist.init_process_group("gloo")
n = dist.get_world_size()
full = torch.ones(a.mib * 2**20 // 4)
shard = torch.empty(full.numel() // n)
sent = (n - 1) / n * full.numel() * 4
rates = {}
for name, op in (("all_gather", lambda: dist.all_gather_into_tensor(full, shard)),
                 ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full))):
    op()
    seconds = []
    for _ in range(a.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds.append(t.item())
    rates[name] = sent / statistics.median(seconds)
if dist.get_rank() == 0:
    print(json.dumps({"world": n, "bytes_per_s": rates}), flush=True)
dist.destroy_process_group()
