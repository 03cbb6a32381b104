"""The gloo bandwidth between the ranks of this machine, for the communication floor: the most bytes
per second each rank sends in any way a data-parallel trainer moves its gradients and parameters --
all-reduce, all-gather and reduce-scatter of ``--mib`` MiB messages (the trainer's bucket size, say),
one at a time or ``--in-flight`` of them launched together (gloo runs collectives of one group on
several threads) -- with ring accounting ((N-1)/N of the message per rank for all-gather and
reduce-scatter, twice that for all-reduce), each the median of ``--repeats``. The floor takes the
best: a time no trainer sending those bytes can beat on this machine. Rank 0 prints one JSON line
with every way's rate and the best.

    torchrun --nproc-per-node 4 -m bench.peers.gloo_bandwidth --mib 16 --in-flight 1 2 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--mib", type=float, default=16.0, help="message size in MiB")
ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 4], help="messages launched together")
ap.add_argument("--repeats", type=int, default=5)
a = ap.parse_args()
dist.init_process_group("gloo")
n = dist.get_world_size()
numel = int(a.mib * 2**20) // 4 // n * n


def collective(name: str, full: torch.Tensor, shard: torch.Tensor):
    """Launch one ``name`` collective on one message (async); its work handle."""
    if name == "all_reduce":
        return dist.all_reduce(full, async_op=True)
    if name == "all_gather":
        return dist.all_gather_into_tensor(full, shard, async_op=True)
    return dist.reduce_scatter_tensor(shard, full, async_op=True)


RING_SHARE = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
rates = {}
for k in a.in_flight:
    messages = [(torch.ones(numel), torch.ones(numel // n)) for _ in range(k)]
    for name, share in RING_SHARE.items():
        sent = k * share * numel * 4
        for work in [collective(name, *m) for m in messages]:      # warm: the pairs' buffers
            work.wait()
        seconds = []
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for work in [collective(name, *m) for m in messages]:
                work.wait()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds.append(t.item())
        rates[f"{name} x{k}"] = sent / statistics.median(seconds)
if dist.get_rank() == 0:
    best = max(rates, key=rates.get)
    print(json.dumps({"world": n, "mib": a.mib, "bytes_per_s": rates, "best": best}), flush=True)
dist.destroy_process_group()
