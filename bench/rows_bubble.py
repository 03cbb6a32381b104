"""Pipeline-bubble rows: per schedule, the step time, the measured idle (bubble) fraction of every rank
beside the schedule's theoretical bubble, and the peak live activation bytes, at pp = 2 and 4 with
m = pp and m = 4 pp micro-batches; ``torch.distributed.pipelining``'s Schedule1F1B and
ScheduleZBVZeroBubble on the same model as the peers.

Ours: every schedule of :data:`SCHEDULES` (one entry per schedule: its name and chunks per rank) runs
the same GPT (:data:`BUBBLE_SHAPE`, untied output layer, fp32) through the trainer's own pipeline path:
``build_model_chunks`` for the schedule's placement, ``run_schedule`` with the ZeRO-0 grad sync, torch
AdamW. Measured per rank: ``PipelineStats(time_waits=True)``, the executor's clock around every wait for
a pipeline receive (and, at the step's end, for the sends), plus the time the rank is done while the
slowest one still runs, over the slowest rank's time in ``run_schedule`` (the ranks start each step
together, after a barrier): its idle fraction (median over the timed rounds, :func:`idle_per_rank`).
The table gives each rank's and their mean, which is what the theory counts: the simulator's bubble
(``zero_bubble.theory``: the schedule's own lists replayed with F = I = W = 1 and a full backward B = 2,
no communication cost), and the same lists replayed with each rank's measured seconds per F, B, I and W call
(``PipelineStats(time_computes=True)``), the bubble the schedule promises at this model's real costs.

Peak activation memory: one extra step per variant under the profiler's memory events
(``LiveTensorBytes``, opened at the step's start), the peak of the bytes allocated inside the step and
still live: the activations held for backward, the p2p buffers and the step's transients (gradient
buffers exist before the step). The largest rank's figure, and the predicted activation sets in flight
on the busiest rank.

Peers: the same layers (``GPT(cfg, layer_ids=...)`` per stage, same init) wrapped in ``PipelineStage``:
Schedule1F1B with one stage per rank, ScheduleZBVZeroBubble with two stages per rank in a V (rank r
holds stages r and 2pp-1-r, the loss on rank 0), mean cross-entropy. Their idle time is not observable
from outside their scheduler: step time and peak live bytes only.

All variants of a pp live in the same pp processes and take turns, one step each per round in a
rotated order (:func:`common.run_variants`): step ms = median over rounds of the slowest rank. With pp
4 on a 2-core machine, 2 ranks share each core: a waiting rank lends its core to a busy one, so the
measured idle fraction mixes the schedule's bubble with time-sharing (the section says ranks per core).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from bench.common import WARMUP_STEPS, Spec, Variant, cores, num_params, run_variants, spawn, step_batches, torch_adamw
from bench.rows_pp import pipelining_loss
from bench.steps import as_dicts
from megazero.config import ParallelConfig, ZeroConfig
from megazero.memory.measure import LiveTensorBytes
from megazero.models.gpt import GPT, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.pipeline import PipelineStats, run_schedule, schedule_by_name
from megazero.parallel.pipeline.actions import Kind
from megazero.parallel.pipeline.zero_bubble import theory
from megazero.parallel.topology import Topology
from megazero.parallel.zero import wrap_data_parallel

# Our schedules: name -> model chunks per rank. Adding a schedule to the section is one entry here.
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2}
# Peers: name -> the torch.distributed.pipelining class and whether its stages sit in a V (two per rank).
PEERS = {"torch-1f1b": ("Schedule1F1B", False), "torch-zbv": ("ScheduleZBVZeroBubble", True)}
BUBBLE_SHAPE = Spec(layers=8, hidden=256, heads=4, seq=64, vocab=1024, micro_batch=1, rounds=5, untied=True)
# 30M+ parameters: a micro-batch's compute large beside the split backward's per-call cost (graph walk,
# hooks: 1-2 ms a chunk whatever the shape), as at the sizes pipelines are used at
BUBBLE_LARGE = Spec(layers=8, hidden=576, heads=8, seq=128, vocab=1024, micro_batch=1, rounds=5, untied=True)
QUICK_BUBBLE = Spec(layers=4, hidden=64, heads=4, seq=32, vocab=512, micro_batch=2, rounds=4, untied=True)
BASE, TARGET = "1f1b", "zb-h1"
THEORY_PP = 0.10              # target: ZB-H1's measured bubble within 10 points of its theory
MEMORY_TOL = 0.10             # target: ZB-H1's peak activation bytes within 10% of 1F1B's


def _peak_step_bytes(fn) -> int:
    """Peak bytes allocated inside ``fn()`` and live at once (the step's activations and transients)."""
    with LiveTensorBytes() as probe:
        fn()
    return probe.peak


def build_ours(spec: Spec, topo, name: str, m: int, record: dict):
    """Our ``name`` schedule over the first ``m`` micro-batches of a step; fills ``record``."""
    cfg = spec.model_cfg()
    chunks = build_model_chunks(cfg, ParallelConfig(pp=topo.pp_size, pipeline_schedule=name,
                                                    virtual_stages=SCHEDULES[name]), topo, seed=1234)
    sync = wrap_data_parallel(chunks, topo, ZeroConfig())
    opt = torch_adamw([(n, p) for c in chunks for n, p in c.named_parameters()], spec.opt_cfg(clip=0.0))
    shape = activation_shape(cfg, spec.micro_batch)

    def step(micro):
        sync.zero_grad()
        stats = PipelineStats(time_waits=True, time_computes=True)
        t0 = time.perf_counter()
        losses = run_schedule(chunks, as_dicts(micro[:m]), topo.pipeline(), loss_fn=masked_mean, schedule=name,
                              tensor_shape=shape, stats=stats, grad_sync=sync)
        took = time.perf_counter() - t0
        record.setdefault("wait", []).append(stats.wait_s)
        record.setdefault("took", []).append(took)
        record.setdefault("costs", []).append({k: stats.compute_s[k] / stats.computes[k] for k in stats.computes})
        sync.finalize_grads()
        opt.step()
        return sum(x.item() for x in losses) / len(losses) if losses else float("nan")

    return step, None


class _Stage(nn.Module):
    """Layers of our GPT as a PipelineStage submodule: forward(x) -> hidden, or logits on the last stage."""

    def __init__(self, spec: Spec, index: int, stages: int):
        super().__init__()
        per = spec.layers // stages
        self.gpt = GPT(spec.model_cfg(), None, layer_ids=range(index * per, (index + 1) * per),
                       pre_process=index == 0, post_process=index == stages - 1, seed=1234)

    def forward(self, x):
        return self.gpt(x)


def build_peer(spec: Spec, topo, name: str, m: int):
    """``torch.distributed.pipelining``'s schedule ``name`` (:data:`PEERS`) over the first m micro-batches."""
    import torch.distributed.pipelining as tp

    cls, v_shape = PEERS[name]
    pp, r = topo.pp_size, topo.pp_rank
    stages = 2 * pp if v_shape else pp
    ids = [r, stages - 1 - r] if v_shape else [r]
    b, s, h = spec.micro_batch, spec.seq, spec.hidden
    mods = [_Stage(spec, k, stages) for k in ids]
    pipe = [tp.PipelineStage(mod, k, stages, torch.device("cpu"), group=topo.pp_group,
                             input_args=(torch.zeros(b, s, dtype=torch.long) if k == 0 else torch.zeros(s, b, h),))
            for mod, k in zip(mods, ids)]
    sched = getattr(tp, cls)(pipe if v_shape else pipe[0], m, loss_fn=pipelining_loss)
    opt = torch_adamw([(n, p) for mod in mods for n, p in mod.named_parameters()], spec.opt_cfg(clip=0.0))
    holds_first, holds_last = 0 in ids, stages - 1 in ids

    def step(micro):
        opt.zero_grad(set_to_none=False)
        tokens = torch.cat([x for x, _, _ in micro[:m]])
        labels = torch.cat([y for _, y, _ in micro[:m]])
        losses = []
        args = (tokens,) if holds_first else ()
        kwargs = {"target": labels, "losses": losses} if holds_last else {}
        sched.step(*args, **kwargs)
        opt.step()
        return sum(x.item() for x in losses) / len(losses) if losses else float("nan")

    return step, None


def _variant_name(name: str, m: int) -> str:
    return f"{name} m{m}"


def bubble_worker(rank: int, world: int, spec: Spec) -> dict:
    topo = Topology(pp=world)
    ms = (world, 4 * world)
    records = {(n, m): {} for n in SCHEDULES for m in ms}
    builds = {}
    for m in ms:
        for n in SCHEDULES:
            builds[_variant_name(n, m)] = lambda n=n, m=m: build_ours(spec, topo, n, m, records[n, m])
        for n in PEERS:
            builds[_variant_name(n, m)] = lambda n=n, m=m: build_peer(spec, topo, n, m)
    variants = [Variant(vname, build) for vname, build in builds.items()]
    batches = step_batches(spec, spec.rounds, 1, 0, micro=max(ms))
    out = run_variants(variants, batches)
    timed = spec.rounds - WARMUP_STEPS                   # the last records are the timed rounds'
    for (n, m), rec in records.items():
        out[_variant_name(n, m)]["wait_took"] = list(zip(rec["wait"][-timed:], rec["took"][-timed:]))
        rounds = rec["costs"][-timed:]                   # seconds per call of each compute kind
        out[_variant_name(n, m)]["costs"] = {k: statistics.median(c[k] for c in rounds) for k in rounds[0]}
    for vname, build in builds.items():                  # one more step each, under the memory probe
        step, _ = build()
        step(batches[0])
        dist.barrier()
        out[vname]["peak_act"] = _peak_step_bytes(lambda: step(batches[1]))
    every = [None] * world
    dist.all_gather_object(every, {k: {"wait_took": r.get("wait_took"), "costs": r.get("costs"),
                                       "peak_act": r["peak_act"]} for k, r in out.items()})
    for k, r in out.items():
        r["idle_per_rank"] = idle_per_rank([e[k]["wait_took"] for e in every])
        r["costs_per_rank"] = [e[k]["costs"] for e in every]
        r["peak_act_per_rank"] = [e[k]["peak_act"] for e in every]
    return out


def idle_per_rank(wait_took: list) -> list:
    """Each rank's idle fraction of the pipeline's step, median over the timed rounds, from
    ``wait_took[rank][round] = (seconds waiting for pipeline p2p, seconds in run_schedule)``: the step
    lasts as long as its slowest rank (the ranks start together, after a barrier, and the optimizer step
    that follows waits for all of them), so a rank's idle time is its waits plus the tail it spends
    done while another still computes -- the simulator's bubble (idle share of pp ranks x the
    makespan), measured. Without the tail, a schedule whose ranks finish apart (1F1B: the last stage
    ends a backward before the first) reads less idle than it is. None where a rank has no figures."""
    if any(w is None for w in wait_took):
        return [None] * len(wait_took)
    per_rank = [[] for _ in wait_took]
    for rounds in zip(*wait_took):
        makespan = max(took for _, took in rounds)
        for r, (wait, took) in enumerate(rounds):
            per_rank[r].append((wait + makespan - took) / makespan)
    return [statistics.median(x) for x in per_rank]


def run_bubble(spec: Spec, pps, log=print) -> dict:
    """{pp: {variant name: figures}} for each pp in ``pps`` (a fresh group of pp processes each)."""
    res = {}
    for pp in pps:
        log(f"pipeline-bubble: pp={pp}, m={pp} and {4 * pp}")
        res[pp] = spawn(pp, bubble_worker, spec)[0]
    return res


def _theory(name: str, pp: int, m: int, costs=None) -> tuple[float, int]:
    """The schedule's bubble and busiest rank's in-flight micro-batches: at unit costs, or replayed with
    ``costs`` (per rank, {"F": seconds per call, ...}) as measured in the same run."""
    durations = None if costs is None else [{Kind(k): t for k, t in c.items()} for c in costs]
    bubble, peaks = theory(schedule_by_name(name), pp, m, SCHEDULES[name], durations)
    return bubble, max(peaks)


def _costs_cell(costs: list[dict]) -> str:
    """Per rank, ms per call of each compute kind the schedule ran: 'F 4.1 B 8.0 / F 4.3 B 9.9'."""
    return " / ".join(" ".join(f"{k} {1e3 * t:.1f}" for k, t in c.items()) for c in costs)


def _target_line(pp: int, m: int, zb: dict, one: dict) -> str:
    """The issue's three targets for ZB-H1 at (pp, m), each marked met or not."""
    below = zb["mean_idle"] < one["mean_idle"]
    off = abs(zb["mean_idle"] - zb["theory_measured"])
    act = max(zb["peak_act_per_rank"]) / max(one["peak_act_per_rank"])
    return (f"- pp {pp}, m {m}: ZB-H1's measured bubble {zb['mean_idle']:.3f} "
            f"{'below' if below else '**not below**'} 1F1B's {one['mean_idle']:.3f}; "
            f"{100 * off:.1f} points from its theory at the measured costs {zb['theory_measured']:.3f} "
            f"({'within' if off <= THEORY_PP else '**outside**'} {100 * THEORY_PP:.0f}); peak activations "
            f"{act:.2f}x 1F1B's ({'within' if abs(act - 1) <= MEMORY_TOL else '**outside**'} {100 * MEMORY_TOL:.0f}%)")


def bubble_section(runs: list) -> list[str]:
    """The BENCHMARKS.md section: for each (spec, results) of ``runs``, a table with one row per (pp, m,
    variant), then the targets."""
    n_cores = cores()
    pps = sorted({pp for _, results in runs for pp in results})
    ranks = ", ".join(f"pp {pp}: {pp} ranks on {n_cores} cores" for pp in pps)
    out = ["## Pipeline bubble: measured idle time per schedule beside its theory", "",
           f"{runs[0][0].rounds} steps per variant (the first 2 untimed); gloo "
           f"on {n_cores} cores, one torch thread per rank ({ranks}). Idle = the rank's time waiting for pipeline "
           "p2p (megazero's executor clock, `PipelineStats(time_waits=True)`) plus the time it is done while the "
           "slowest rank still runs (the ranks start each step together and the optimizer step waits for all), "
           "over the slowest rank's step: the simulator's idle share of pp ranks x the makespan, measured; "
           "median over the timed rounds, per rank (rank 0 first) and their mean; theory = the simulator's "
           "bubble of the same lists (F = I = W = 1, B = 2, free p2p); at measured costs = the same lists "
           "replayed with each rank's "
           "own median seconds per F, B, I and W call in this run (the costs column, ms per call, rank 0 "
           "first; free p2p): the zero-bubble paper's bubble from profiled T_F, T_B, T_W, where I costs more "
           "than W (attention's backward is all input gradient), I + W more than B (the split's graph walk "
           "and hooks, 1-2 ms per chunk and micro-batch: a large share at the tiny shape, little at 30M+), the "
           "first stage's I is empty (nothing to send back: its backward is all W) and the last "
           "stage (the head and the loss) costs more than the others. The target compares the measured "
           "idle with the latter. Peak act = the largest rank's peak of bytes allocated inside one "
           "step and live at once (activations, p2p buffers, transients; live tensor bytes, not RSS): from its I to "
           "its W a ZB-H1 micro-batch keeps each weight matmul's input and output gradient "
           "(megazero/parallel/pipeline/split_backward.py), about a full activation set at this shape (no "
           "dropout, fused attention), and the last stage holds pp of them (the output layer's weight gradient is computed "
           "in I, so its logits gradient does not wait). Ranks that "
           "share a core lend it while they wait, so at pp > cores the idle figures mix bubble and time-sharing. "
           "The torch rows are torch.distributed.pipelining on the same layers (Schedule1F1B; "
           "ScheduleZBVZeroBubble with two stages per rank in a V); their idle time is internal to their "
           "scheduler. Timings on this shared machine move by up to ~30% between runs.", ""]
    for spec, results in runs:
        out += _shape_table(spec, results)
    return out


def _shape_table(spec: Spec, results: dict) -> list[str]:
    rows, checks = [], []
    for pp, res in results.items():
        for m in (pp, 4 * pp):
            base = res[_variant_name(BASE, m)]
            base_ms = statistics.median(base["times"])
            base_act = max(base["peak_act_per_rank"])
            for name in list(SCHEDULES) + list(PEERS):
                r = res[_variant_name(name, m)]
                ms_step = statistics.median(r["times"])
                act = max(r["peak_act_per_rank"])
                if name in SCHEDULES:
                    idle = r["idle_per_rank"]
                    mean_idle = sum(idle) / len(idle)
                    bubble, peak_mb = _theory(name, pp, m)
                    measured, _ = _theory(name, pp, m, r["costs_per_rank"])
                    cells = [" / ".join(f"{x:.2f}" for x in idle), f"{mean_idle:.3f}", f"{bubble:.3f}",
                             f"{measured:.3f}", _costs_cell(r["costs_per_rank"]), str(peak_mb)]
                    r["mean_idle"], r["theory"], r["theory_measured"] = mean_idle, bubble, measured
                else:
                    cells = ["n/a (inside torch's scheduler)", "-", "-", "-", "-", "-"]
                rows.append(f"| {pp} | {m} | {name} | {1e3 * ms_step:.0f} | {ms_step / base_ms:.2f}x | "
                            + " | ".join(cells) + f" | {act / 2**20:.1f} | {act / base_act:.2f}x |")
            checks.append(_target_line(pp, m, res[_variant_name(TARGET, m)], base))
    params = num_params(spec.model_cfg())
    return [f"### {spec.describe()}; {params / 1e6:.1f}M parameters", "",
            "| pp | m | schedule | step ms | vs 1f1b | idle per rank | idle mean | theory | at measured costs | "
            "costs (ms per call) | peak act (micro-batches, predicted) | peak act MiB | vs 1f1b |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, "", "Targets (ZB-H1 against 1F1B):", *checks, ""]


__all__ = ["BUBBLE_LARGE", "BUBBLE_SHAPE", "PEERS", "QUICK_BUBBLE", "SCHEDULES", "bubble_section", "idle_per_rank",
           "run_bubble"]
