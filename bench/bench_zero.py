"""dp = 2 on one machine: megazero's data parallelism / ZeRO against torch's own, same tiny GPT.

    OMP_NUM_THREADS=1 python -m bench.bench_zero [--rounds 8] [--layers 4 --hidden 256]

Pairs compared:

    ours ZeRO-0 (bucketed all-reduce, fp32 AdamW)      vs  torch DistributedDataParallel + AdamW
    ours ZeRO-1 (reduce-scatter + all-gather)          vs  DDP + ZeroRedundancyOptimizer(AdamW)
    plus ours ZeRO-1 over all-reduced gradients (the cheaper collective on gloo) and ours ZeRO-2,
    also against DDP + ZeroRedundancyOptimizer.
    ours ZeRO-3 (per-unit gather, prefetch 1)          vs  FSDP2 (fully_shard on every layer + root)
    ours ZeRO-3, keep_params_gathered                  vs  FSDP2, reshard_after_forward=False

Every variant trains the same GPT from the same init on the same data (2 micro-batches per step,
clipping at 1.0) and must end at the same loss; the script checks that.

Step time: one pair of processes holds all variants and runs one step of each per round, in a
rotated order, so every variant sees the same machine load (step times on shared machines drift
by tens of percent between runs). Reported: median step time of rank 0 over the rounds after a
warmup, and the median over rounds of the ratio to the torch peer's step in the same round.
Memory: each variant then runs alone in 2 fresh processes for a few steps; peak RSS per rank
(max over ranks), its growth from after the model is built, model-state bytes per rank
(params + grads + separate fp32 master + Adam state, as held after a step) and the most gradient
memory held at once during the steps (ZeRO-2 frees full-size buckets once reduced).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch.distributed as dist

from bench.common import Spec, rss_mib, spawn, step_batches
from bench.rows_dp import build_ddp, build_fsdp2, build_ours
from megazero.parallel.topology import Topology
from megazero.parallel.zero import AllReduceGradSync

VARIANTS = ["ours-zero0", "torch-ddp", "ours-zero1", "torch-ddp-zero", "ours-zero1-allreduce", "ours-zero2",
            "ours-zero3", "torch-fsdp2", "ours-zero3-keep", "torch-fsdp2-keep"]
PEERS = {"ours-zero0": "torch-ddp", "ours-zero1": "torch-ddp-zero", "ours-zero1-allreduce": "torch-ddp-zero",
         "ours-zero2": "torch-ddp-zero", "ours-zero3": "torch-fsdp2", "ours-zero3-keep": "torch-fsdp2-keep"}
STAGES = {"ours-zero0": 0, "ours-zero1": 1, "ours-zero1-allreduce": 1, "ours-zero2": 2, "ours-zero3": 3,
          "ours-zero3-keep": 3}
MICRO, MB = 2, 2


def _spec(args) -> Spec:
    return Spec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                micro_batch=MB, micro_batches=MICRO)


def _build(variant: str, args, topo):
    """(step function, model-state bytes function -> (total, peak grads)) for a variant, on a fresh
    GPT (the step and model builders are shared with bench/run.py: bench/rows_dp.py)."""
    spec = _spec(args)
    if variant.startswith("ours"):
        cls = AllReduceGradSync if variant == "ours-zero1-allreduce" else None
        step, extra = build_ours(spec, topo, STAGES[variant], cls, keep_params_gathered=variant.endswith("keep"))
        return step, (lambda: (extra()["state"]["total"], extra()["state"]["grads_peak"]))
    if variant.startswith("torch-fsdp2"):
        step, extra = build_fsdp2(spec, 2, reshard_after_forward=not variant.endswith("keep"))
        return step, (lambda: (extra()["total"], extra()["grads"]))
    step, extra = build_ddp(spec, zero_redundancy=variant == "torch-ddp-zero")
    return step, (lambda: (extra()["total"], extra()["grads"]))


def _timing_worker(rank: int, world: int, variants: list[str], args) -> tuple:
    """All variants in one process pair, one step each per round, rotated order: (rank, times, losses)."""
    topo = Topology(dp=world)
    steps = {v: _build(v, args, topo)[0] for v in variants}
    batches = step_batches(_spec(args), args.rounds, world, rank)
    times = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    for i, micro in enumerate(batches):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses[v].append(steps[v](micro))
            times[v].append(time.perf_counter() - t0)
    return rank, times, losses


def _memory_worker(rank: int, world: int, variant: str, args) -> tuple:
    """One variant alone: (rank, peak RSS, its growth from after the model is built, model-state bytes)."""
    topo = Topology(dp=world)
    rss_model = rss_mib()
    step, state_bytes = _build(variant, args, topo)
    for micro in step_batches(_spec(args), 3, world, rank):
        step(micro)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rank, peak, peak - rss_model, state_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="steps per variant (first --warmup not timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    variants = args.variants.split(",")
    t0 = time.perf_counter()
    timing = spawn(2, _timing_worker, variants, args)
    memory = {v: spawn(2, _memory_worker, v, args) for v in variants}
    report(variants, timing, memory, args)
    print(f"(benchmark wall time {time.perf_counter() - t0:.0f} s)")


def report(variants, timing, memory, args) -> None:
    _, times, losses = timing[0]
    w = args.warmup
    print(f"dp=2, GPT {args.layers} layers x {args.hidden} hidden, seq {args.seq}, vocab {args.vocab}, "
          f"{MICRO} micro-batches of {MB} per rank, fp32, gloo, {args.rounds - w} timed rounds")
    print("| variant | median step (ms) | vs torch peer (median of per-round ratios) | peak RSS/rank (MiB) "
          "| RSS growth/rank (MiB) | model states/rank (MiB) | peak grads/rank (MiB) | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        peer = PEERS.get(v)
        ratio = ""
        if peer in times:
            ratio = f"{statistics.median(a / b for a, b in zip(times[v][w:], times[peer][w:])):.2f}x"
        peak = max(r[1] for r in memory[v])
        growth = max(r[2] for r in memory[v])
        states = max(r[3][0] for r in memory[v]) / 2**20
        grads_peak = max(r[3][1] for r in memory[v]) / 2**20
        print(f"| {v} | {1000 * statistics.median(times[v][w:]):.1f} | {ratio} | {peak:.0f} | {growth:.0f} "
              f"| {states:.1f} | {grads_peak:.1f} | {losses[v][-1]:.5f} |")
    final = {v: losses[v][-1] for v in variants}
    spread = max(final.values()) - min(final.values())
    print(f"final-loss spread across variants: {spread:.2e} "
          f"({'same loss' if spread <= 1e-5 * max(final.values()) else 'MISMATCH'})")


if __name__ == "__main__":
    main()
