"""Measure the pipeline bubble: time per step of 1F1B, GPipe and interleaved 1F1B against the analytic
bubble, for pp = 2 and 4 and m = 4, 8, 16 micro-batches.

    python -m bench.bench_pipeline                     # spawns its own gloo processes (CPU)
    python -m bench.bench_pipeline --pp 2 --micro-batches 8 16 --reps 7

Method. For each pp a fresh group of pp processes (one torch thread each) builds a small GPT, split
into pp stages (v = 2 chunks per rank for interleaved). Then:

1. Per-micro-batch compute of each stage, t_r: forward + backward of one micro-batch through all of
   rank r's chunks, with no communication (random activations in, random gradients back), all ranks
   at once, median of 3 runs. The pipeline can go no faster than its slowest stage, so the ideal
   (bubble-free) step is ``ideal = m * max_r t_r``.
2. Step time: one full ``run_schedule`` (forward and backward of m micro-batches, tied-embedding
   grad sync), started together on all ranks (a barrier in this script only) and taken as the
   slowest rank's time, measured right after its own t_r so that both see the same machine load.
   Configurations are visited round-robin, ``--reps`` times, after one warm-up round; the table
   shows medians (the bubble column is the median of the per-round ratios).
3. Measured bubble = ``step / ideal - 1``: idle (plus p2p) time relative to the ideal compute time.
   A second estimate uses ``busy``, the slowest rank's forward + backward time inside the same step
   (StageRunner calls timed by this script), ``step / busy - 1``: no separate measurement, so it is
   less exposed to the machine's load changing between the two.
   That is the quantity of Narayanan et al.'s analytic bubble fraction ``(p-1)/m`` for GPipe and
   1F1B and ``(p-1)/(v*m)`` for interleaved 1F1B (bubble time / ideal time). It also contains the
   p2p cost (interleaved sends v times more messages) and any stage imbalance, so expect it above
   the analytic figure.
4. Order bubble: the F/B order each rank actually executed (``PipelineStats.order``, first round),
   replayed with fixed op times and free communication (:func:`order_bubble`). It isolates the
   schedule from the machine: it must equal the analytic figure, and does.

Caveats printed with the table: with more processes than cores (pp=4 on a 2-core machine) the
ranks time-share the cores, the measured compute times include waiting for a core, idle ranks give
their core to busy ones, and the measured bubble is distorted in either direction. Timings on shared
machines move by up to ~30% between runs (more under heavy load: the load average is printed), so
compare configurations within one run and trust the "order" column for the schedule itself. On
gloo each exchange costs a TCP round trip, and interleaving makes v times more of them, so on CPU
its measured bubble is usually no better than 1F1B's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.common import cores, spawn
from megazero.config import ParallelConfig, ZeroConfig
from megazero.models.gpt import GPTConfig, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.pipeline import PipelineStats, run_schedule
from megazero.parallel.topology import Topology
from megazero.parallel.zero import wrap_data_parallel

SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved", 2))


def _model_cfg(a) -> GPTConfig:
    return GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       seq_length=a.seq, vocab_size=a.vocab, make_vocab_size_divisible_by=64)


def _batches(cfg: GPTConfig, m: int, b: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g),
             "labels": torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g),
             "loss_mask": torch.ones(b, cfg.seq_length)} for _ in range(m)]


def _stage_compute_time(chunks, sync, cfg, b, reps) -> float:
    """Median seconds of forward + backward of one micro-batch through all of this rank's chunks."""
    mb = _batches(cfg, 1, b)[0]
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for chunk in chunks:
            x = mb["tokens"] if chunk.pre_process else torch.randn(cfg.seq_length, b, cfg.hidden_size,
                                                                   requires_grad=True)
            out = chunk(x, mb["labels"] if chunk.post_process else None)
            if chunk.post_process:
                out.mean().backward()
            else:
                out.backward(torch.randn_like(out))
        times.append(time.perf_counter() - t0)
    sync.zero_grad()
    return statistics.median(times[1:])


def order_bubble(orders: list[list[tuple]], pp: int, v: int, t_f: float = 1.0, t_b: float = 2.0) -> float:
    """Bubble of the executed order alone: replay each rank's (F|B, chunk, micro) sequence with fixed
    times (a chunk's forward t_f / v, backward t_b / v), each op starting when its rank is free and
    its input exists (F after the previous virtual stage's F; B after the next stage's B and its own
    F). Returns makespan / (m * (t_f + t_b)) - 1 -- what the schedule would give with no noise and
    free communication: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for interleaved."""
    last_vs, end, free = pp * v - 1, {}, [0.0] * pp
    pos, total = [0] * pp, sum(len(o) for o in orders)
    while len(end) < total:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, c, i = orders[r][pos[r]]
                vs = c * pp + r
                deps = [("F", vs - 1, i)] if kind == "F" and vs > 0 else []
                if kind == "B":
                    deps = [("F", vs, i)] + ([("B", vs + 1, i)] if vs < last_vs else [])
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                free[r] = end[(kind, vs, i)] = start + (t_f if kind == "F" else t_b) / v
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the executed orders cannot be replayed (cyclic dependency)")
    m = sum(1 for k, _, _ in orders[0] if k == "F") // v
    return max(free) / (m * (t_f + t_b)) - 1


class BusyClock:
    """Seconds this process spent in pipeline forward and backward calls since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0


def instrument_compute() -> BusyClock:
    """Time every StageRunner.forward/backward of this process (bench-only; CPU wall time, meaningful
    without CUDA) into the clock returned."""
    from megazero.parallel.pipeline.runner import StageRunner

    clock = BusyClock()

    def timed(fn):
        def wrapper(self, *args):
            t0 = time.perf_counter()
            try:
                return fn(self, *args)
            finally:
                clock.seconds += time.perf_counter() - t0
        return wrapper

    StageRunner.forward, StageRunner.backward = timed(StageRunner.forward), timed(StageRunner.backward)
    return clock


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank: int, pp: int, a) -> dict | None:
    """Every configuration on this rank; rank 0 returns the medians, the others None."""
    topo = Topology(pp=pp)
    cfg = _model_cfg(a)
    busy = instrument_compute()
    chunks_of = {name: build_model_chunks(cfg, ParallelConfig(pp=pp, pipeline_schedule=name, virtual_stages=v),
                                          topo, seed=1234) for name, v in SCHEDULES}
    syncs = {name: wrap_data_parallel(chunks, topo, ZeroConfig()) for name, chunks in chunks_of.items()}
    shape = activation_shape(cfg, a.micro_batch_size)
    configs = [(name, v, m) for m in a.micro_batches for name, v in SCHEDULES]
    rows = {c: [] for c in configs}
    orders = {}
    for rep in range(a.reps + 1):                      # round 0 warms up
        for name, v, m in configs:
            chunks = chunks_of[name]
            stage = _max_over_ranks(_stage_compute_time(chunks, syncs[name], cfg, a.micro_batch_size, 3))
            mbs = _batches(cfg, m, a.micro_batch_size)
            dist.barrier()
            busy.seconds = 0.0
            t0 = time.perf_counter()
            stats = PipelineStats()
            run_schedule(chunks, mbs, topo.pipeline(), loss_fn=masked_mean, schedule=name, tensor_shape=shape, stats=stats,
                         grad_sync=syncs[name])
            syncs[name].finalize_grads()          # the tied-embedding sum, as the trainer does
            step = _max_over_ranks(time.perf_counter() - t0)
            busy_s = _max_over_ranks(busy.seconds)
            syncs[name].zero_grad()
            if rep:
                rows[(name, v, m)].append((step, m * stage, busy_s))
            else:
                every = [None] * pp
                dist.all_gather_object(every, stats.order)
                orders[(name, v, m)] = order_bubble(every, pp, v)
    if rank != 0:
        return None
    med = statistics.median
    return {c: dict(step=med(s for s, _, _ in r), ideal=med(i for _, i, _ in r), busy=med(b for _, _, b in r),
                    vs_ideal=med(s / i - 1 for s, i, _ in r), vs_busy=med(s / b - 1 for s, _, b in r),
                    order=orders[c])
            for c, r in rows.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=5, help="timed rounds over all configurations (median)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1200.0)
    a = ap.parse_args(argv)
    n_cores = cores()
    print(f"GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, vocab {a.vocab}, micro-batch "
          f"{a.micro_batch_size}; gloo on CPU, 1 thread per rank, {n_cores} cores; medians of {a.reps} rounds")
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'pp':>3} {'schedule':>12} {'v':>2} {'m':>3} {'step ms':>8} {'ideal ms':>9} {'bubble':>7} "
          f"{'busy ms':>8} {'bubble':>7} {'order':>6} {'analytic':>9}")
    for pp in a.pp:
        res = spawn(pp, _worker, a, timeout=a.timeout)[0]
        for m in a.micro_batches:
            for name, v in SCHEDULES:
                r = res[(name, v, m)]
                print(f"{pp:>3} {name:>12} {v:>2} {m:>3} {r['step'] * 1e3:>8.1f} {r['ideal'] * 1e3:>9.1f} "
                      f"{r['vs_ideal']:>7.3f} {r['busy'] * 1e3:>8.1f} {r['vs_busy']:>7.3f} {r['order']:>6.3f} "
                      f"{(pp - 1) / (v * m):>9.3f}")
        if pp > n_cores:
            print(f"    note: pp={pp} runs {pp} processes on {n_cores} cores (oversubscribed): ranks time-share "
                  f"cores, so compute times include waiting for a core, idle stages lend theirs to busy "
                  f"ones, and the measured bubbles are distorted (in either direction)")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("bubble (1st) = step / ideal - 1, ideal = m * slowest stage's per-micro-batch F+B measured alone;\n"
          "bubble (2nd) = step / busy - 1, busy = slowest rank's F+B time inside the same step;\n"
          "order = the executed F/B order replayed with F=1, B=2 and free p2p; "
          "analytic = (p-1)/m, interleaved (p-1)/(v*m)")


if __name__ == "__main__":
    main()
