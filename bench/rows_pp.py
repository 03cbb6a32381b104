"""Pipeline rows: megazero's 1F1B, GPipe and interleaved 1F1B against ``torch.distributed.pipelining``
Schedule1F1B / ScheduleGPipe / ScheduleInterleaved1F1B, at pp = 2 and 4 with the same micro-batch
count, on the same stage modules.

Both sides run the very same model chunks (``build_model_chunks``: chunk c of rank r is virtual
stage c*pp + r, v = 2 for interleaved), from the same init: ours through ``run_schedule``, torch's
wrapped in ``PipelineStage`` (the last stage returns logits, torch's ``loss_fn`` is the mean
cross-entropy, gradients scaled by 1/m like ours). Both then sum the tied-embedding gradients of
the first and last stage (the ZeRO-0 grad sync's ``finalize_grads``, as the trainer does) and step
torch AdamW (no clipping), so only the schedule and its point-to-point exchange differ.

Theory: the pipeline bubble (p-1)/m (interleaved (p-1)/(v m)) beside (1) the bubble of the order
our schedule executed, replayed with fixed op times and free communication (``order_bubble``), and
(2) the measured ``step / busy - 1``, busy = the slowest rank's forward + backward time inside the
step (the definition of bench/bench_pipeline.py).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench.bench_pipeline import BusyClock, instrument_compute, order_bubble
from bench.common import Spec, Variant, largest_over_ranks, run_variants, spawn, step_batches, torch_adamw
from bench.steps import as_dicts
from megazero.config import ParallelConfig, ZeroConfig
from megazero.models.gpt import activation_shape, build_model_chunks, masked_mean
from megazero.parallel.pipeline import PipelineStats, run_schedule
from megazero.parallel.topology import Topology
from megazero.parallel.zero import wrap_data_parallel

SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved", 2))


def _chunks(spec: Spec, topo, name: str, v: int):
    return build_model_chunks(spec.model_cfg(), ParallelConfig(pp=topo.pp_size, pipeline_schedule=name,
                                                               virtual_stages=v), topo, seed=1234)


def _named(chunks):
    return [(n, p) for c in chunks for n, p in c.named_parameters()]


def build_ours(spec: Spec, topo, name: str, v: int, record: dict, busy: BusyClock):
    chunks = _chunks(spec, topo, name, v)
    sync = wrap_data_parallel(chunks, topo, ZeroConfig())      # dp = 1: the tied-embedding sum only
    opt = torch_adamw(_named(chunks), spec.opt_cfg(clip=0.0))
    shape = activation_shape(spec.model_cfg(), spec.micro_batch)

    def step(micro):
        sync.zero_grad()
        stats = PipelineStats()
        busy.seconds = 0.0
        t0 = time.perf_counter()
        losses = run_schedule(chunks, as_dicts(micro), topo.pipeline(), loss_fn=masked_mean, schedule=name,
                              tensor_shape=shape, stats=stats, grad_sync=sync)
        sync.finalize_grads()
        record.setdefault("step", []).append(time.perf_counter() - t0)
        record.setdefault("busy", []).append(busy.seconds)
        record["order"] = stats.order
        opt.step()
        return sum(x.item() for x in losses) / len(losses) if losses else float("nan")

    return step, None


class _StageModule(nn.Module):
    """One of our GPT chunks as a torch PipelineStage submodule: forward(x) -> hidden or logits."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)


def pipelining_loss(logits, target):
    """``torch.distributed.pipelining``'s loss_fn on our last stage: the mean cross-entropy of [b, s, V]
    logits; the chunk returns them as a view of [s, b, V] storage, so they are flattened in that order
    (no copy) with the targets to match."""
    if not logits.is_contiguous():
        logits, target = logits.transpose(0, 1), target.t()
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_torch(spec: Spec, topo, name: str, v: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    chunks = _chunks(spec, topo, name, v)
    pp, r = topo.pp_size, topo.pp_rank
    b, s, h = spec.micro_batch, spec.seq, spec.hidden
    stages = []
    for c, chunk in enumerate(chunks):
        index = c * pp + r
        example = (torch.zeros(b, s, dtype=torch.long) if index == 0 else torch.zeros(s, b, h),)
        stages.append(PipelineStage(_StageModule(chunk), index, pp * v, torch.device("cpu"),
                                    input_args=example, group=topo.pp_group))
    sync = wrap_data_parallel(chunks, topo, ZeroConfig())      # dp = 1: the tied-embedding sum only
    m = spec.pp_micro_batches
    if name == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=pipelining_loss)
    else:
        sched = (Schedule1F1B if name == "1f1b" else ScheduleGPipe)(stages[0], m, loss_fn=pipelining_loss)
    opt = torch_adamw(_named(chunks), spec.opt_cfg(clip=0.0))

    def step(micro):
        sync.zero_grad()
        tokens = torch.cat([x for x, _, _ in micro])
        labels = torch.cat([y for _, y, _ in micro])
        losses = []
        if topo.is_first_stage:
            sched.step(tokens, target=labels if topo.is_last_stage else None, losses=losses)
        elif topo.is_last_stage:
            sched.step(target=labels, losses=losses)
        else:
            sched.step()
        sync.finalize_grads()
        opt.step()
        return sum(x.item() for x in losses) / len(losses) if losses else float("nan")

    return step, None


def pp_worker(rank: int, world: int, spec: Spec) -> dict:
    topo = Topology(pp=world)
    busy = instrument_compute()
    records = {n: {} for n, _ in SCHEDULES}
    vs = []
    for name, v in SCHEDULES:
        vs += [Variant(f"ours-{name}", lambda n=name, v=v: build_ours(spec, topo, n, v, records[n], busy)),
               Variant(f"torch-{name}", lambda n=name, v=v: build_torch(spec, topo, n, v))]
    out = run_variants(vs, step_batches(spec, spec.rounds, 1, 0, micro=spec.pp_micro_batches))
    theory = {}
    for name, v in SCHEDULES:
        rec = records[name]
        every = [None] * world
        dist.all_gather_object(every, rec["order"])
        timed = len(out[f"ours-{name}"]["times"])         # the timed rounds are the last records
        steps = torch.tensor(rec["step"][len(rec["step"]) - timed:], dtype=torch.float64)
        busy = torch.tensor(rec["busy"][len(rec["busy"]) - timed:], dtype=torch.float64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        measured = sorted((steps / busy - 1).tolist())
        theory[name] = {"analytic": (world - 1) / (v * spec.pp_micro_batches),
                        "order": order_bubble(every, world, v),
                        "measured": measured[len(measured) // 2] if measured else float("nan")}
    out["_theory"] = theory
    return out


def run_pp(spec: Spec, pp: int) -> dict:
    """The last stage's results (it holds the losses) with the largest peak RSS over the ranks."""
    return largest_over_ranks(spawn(pp, pp_worker, spec), ("peak_rss_mib",), keep=-1)
