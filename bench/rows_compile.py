"""Compile rows: ``--compile`` (regional ``torch.compile`` of every transformer layer,
:mod:`megazero.compile`) against the same eager step, for ZeRO 0, 1 and 3 (dp only) at the scale
section's shapes (:data:`rows_scale.SCALE_SHAPES`) and dp = 2 and 4, one tp 2 and one pp 2 row; and
our compiled ZeRO-3 against FSDP2 compiled the way torchtitan does it.

Both sides of a row are built and stepped by the trainer's own code: ``parse_job`` on the trainer's
flags (``--compile`` or not), ``build_model_chunks`` on the meta device, ``compile_model`` before
``build_engine`` (as ``pretrain_gpt.py`` does), then ``train_step``. The peer, ``torch-fsdp2-compiled``,
is our GPT with each layer ``torch.compile(layer, fullgraph=True)`` put back in its place, then
``fully_shard`` per layer and on the root (torchtitan's ``apply_compile`` then ``apply_fsdp``), stepped
with torch AdamW under the same hyper-parameters; its loss is averaged over the ranks as
``train_step``'s is. Its layers run the same ``TransformerLayer`` code as ours, so in processes where ours
compiled first, dynamo's cache already holds the graph (the guards pass): both sides then run the same
kernels, and the row compares what surrounds them (ZeRO-3's gathers and reductions against FSDP2's).

The tp 2 and pp 2 rows (no data parallelism, ZeRO-0) run at one shape, :data:`TP_PP_SHAPE` (46M
parameters); the pp row's step takes :data:`PP_MICRO_BATCHES` micro-batches through 1F1B.

Each group (a layout and its variants: eager, compiled and, for ZeRO-3, the peer) runs in its own
processes, one step of each variant per round in a rotated order (:func:`common.run_variants`): ms =
median step (slowest rank), ratio = median of the per-round ratios. Peak live MiB: the largest rank's
peak of live tensor bytes in the second warm-up step, as in the scale section.

Compile time: ``run_variants`` gives every variant a throwaway build and step before its measured
build; that first step of a compiled variant is where dynamo traces and inductor compiles the layer's
forward and backward. Reported per compiled variant: that first step's time (slowest rank) less the
eager variant's first step in the same processes, and dynamo's own compile seconds (``CompileStats``),
with the inductor FX-graph cache's hits and misses in that step: a run of the section starts from an
empty cache directory (a fresh ``TORCHINDUCTOR_CACHE_DIR``), so the first group of each layer shape
compiles cold ("cold": misses only) and the later groups load what it stored ("warm": hits only),
which is what a restarted run pays. Graphs compiled after the first step (recompiles) are counted
too: there should be none.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from bench.common import (
    GPT,
    WARMUP_STEPS,
    Spec,
    Variant,
    largest_over_ranks,
    losses_over_ranks,
    run_variants,
    spawn,
    step_batches,
    torch_adamw,
    trainer_argv,
)
from bench.rows_scale import EARLY_LOSS_TOL, EARLY_STEPS, FINAL_LOSS_TOL, SCALE_SHAPES
from bench.steps import as_dicts, torch_step
from megazero.cli.job import parse_job
from megazero.compile import CompileStats, compile_model
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train_step

COMPILE_SHAPES = SCALE_SHAPES
QUICK_COMPILE = (Spec(layers=2, hidden=128, heads=4, seq=32, vocab=1024, micro_batch=1, micro_batches=1, rounds=4,
                      untied=True),)
STAGES = (3, 1, 0)            # ZeRO-3 first: its row, the one with a target, compiles its shape cold
TP_PP_SHAPE = SCALE_SHAPES[1]  # the tp and pp rows' shape (12x512, 46M parameters)
PP_MICRO_BATCHES = 4          # micro-batches per step in the pp row (1F1B)
PEER = "torch-fsdp2-compiled"
# (compiled, other) -> (comparison, bound, from how many parameters on): the step-time ratio compiled /
# other must stay strictly below 1.0 against eager ZeRO-3 from 46M parameters on (compiling must pay where
# the layers' work is large), at most 1.0 against the peer at any size. Rows without one are shown only.
TARGETS = {("ours-zero3-compiled", "ours-zero3"): ("<", 1.0, 46_000_000), ("ours-zero3-compiled", PEER): ("<=", 1.0, 0)}


@dataclass(frozen=True)
class Group:
    """One set of processes: the shape, the layout (tp x pp x dp, ZeRO stage) and so its variants."""

    spec: Spec
    dp: int = 1
    tp: int = 1
    pp: int = 1
    stage: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def eager(self) -> str:
        """Our eager variant's name (the group's name: ``--variants`` picks groups by it)."""
        return f"ours-tp{self.tp}" if self.tp > 1 else f"ours-pp{self.pp}" if self.pp > 1 else f"ours-zero{self.stage}"

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank and step."""
        return PP_MICRO_BATCHES if self.pp > 1 else self.spec.micro_batches

    def layout(self) -> str:
        if self.tp > 1:
            return f"tp {self.tp}, ZeRO-{self.stage}"
        if self.pp > 1:
            return f"pp {self.pp} 1F1B, {self.micro_batches} micro-batches, ZeRO-{self.stage}"
        return f"dp {self.dp}, ZeRO-{self.stage}"

    @property
    def has_peer(self) -> bool:
        """Is FSDP2 + compile timed beside ours (ZeRO-3, dp only)?"""
        return self.stage == 3 and self.tp == self.pp == 1

    def pairs(self) -> list[tuple[str, str]]:
        """(compiled, other) rows of this group."""
        compiled = self.eager + "-compiled"
        return [(compiled, self.eager)] + ([(compiled, PEER)] if self.has_peer else [])

    def argv(self, compiled: bool) -> list[str]:
        """The trainer's flags for this group (the Spec's AdamW, clipping, seed and batch)."""
        s = self.spec
        opt = s.opt_cfg()
        return trainer_argv(s.layers, s.hidden, s.heads, s.seq, s.vocab, s.micro_batch,
                            "--zero-stage", self.stage, "--tensor-model-parallel-size", self.tp,
                            "--pipeline-model-parallel-size", self.pp,
                            "--global-batch-size", s.micro_batch * self.micro_batches * self.dp,
                            "--lr", opt.lr, "--weight-decay", opt.weight_decay, "--clip-grad", opt.clip_grad,
                            "--seed", 1234, *(["--untie-embeddings-and-output-weights"] if s.untied else []),
                            *(["--compile"] if compiled else []))


def groups(shapes, tp_pp: Spec, dps: list[int], only: list[str] | None = None) -> list[Group]:
    """Every group of the section: each shape at each dp and stage, then the tp 2 and pp 2 rows at shape
    ``tp_pp``. ``only``: the groups whose eager variant is named."""
    out = [Group(spec, dp=dp, stage=stage) for spec in shapes for dp in dps for stage in STAGES]
    out += [Group(tp_pp, tp=2), Group(tp_pp, pp=2)]
    return [g for g in out if not only or g.eager in only]


# -------------------------------------------------------------------------------------- variants
class FirstStep:
    """Wraps a variant's step: the first call in the process (the throwaway build's step, where a
    compiled variant compiles) is timed, with dynamo's and the FX-graph cache's counters over it;
    graphs compiled by any later call are summed (recompiles). Reading the counters takes microseconds,
    for every variant alike."""

    def __init__(self):
        self.first: dict | None = None
        self.recompiles = 0

    def wrap(self, step):
        def run(micro):
            from torch._dynamo.utils import counters

            before = CompileStats.now()
            hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
            t0 = time.perf_counter()
            loss = step(micro)
            seconds = time.perf_counter() - t0
            after = CompileStats.now()
            if self.first is None:
                self.first = {"seconds": seconds, "graphs": after.graphs - before.graphs,
                              "breaks": after.graph_breaks - before.graph_breaks,
                              "compile_seconds": after.seconds - before.seconds,
                              "cache_hits": counters["inductor"]["fxgraph_cache_hit"] - hits,
                              "cache_misses": counters["inductor"]["fxgraph_cache_miss"] - misses}
            else:
                self.recompiles += after.graphs - before.graphs
            return loss

        return run


def build_ours(group: Group, topo: Topology, compiled: bool, first: FirstStep):
    """Our trainer's path, as ``pretrain_gpt.py`` takes it: chunks, ``compile_model`` (with
    ``--compile``), the engine, ``train_step``."""
    job, _ = parse_job(group.argv(compiled), group.world)
    spec = get_model_spec(job.model.model_family)
    chunks = build_model_chunks(spec, job, topo, device="meta" if job.zero.sharded_init else None)
    compile_model(chunks, spec.compile_regions, job.compilation)       # nothing without --compile
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)

    def step(micro) -> float:
        return train_step(chunks, as_dicts(micro), topo, engine, job, spec).loss

    return first.wrap(step), (lambda: {"state": engine.model_state_bytes()})


def build_fsdp2_compiled(group: Group, first: FirstStep):
    """FSDP2 as torchtitan builds it with compilation on: every layer ``torch.compile``d whole
    (``fullgraph=True``) and put back in the layer dict, then ``fully_shard`` per layer and on the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    job, _ = parse_job(group.argv(True), group.world)
    model = GPT(job.model, seed=1234)
    for key, layer in list(model.layers.items()):
        model.layers.register_module(key, torch.compile(layer, fullgraph=True))
    mesh = init_device_mesh("cpu", (group.world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch_adamw(model.named_parameters(), job.optimizer)

    def no_sync(last):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def step(micro) -> float:
        """torch's step; the loss averaged over the ranks (``train_step`` reports that mean)."""
        loss = torch.tensor([torch_step(model, opt, micro, job.optimizer.clip_grad, no_sync=no_sync)],
                            dtype=torch.float64)
        dist.all_reduce(loss)
        return loss.item() / group.world

    return first.wrap(step), None


def compile_worker(rank: int, world: int, group: Group) -> dict:
    """The group's variants on this rank: run_variants' results, each with its first step's record."""
    job, _ = parse_job(group.argv(False), world)
    topo = Topology(job.parallel.tp, job.parallel.pp, job.parallel.dp, order=job.parallel.order,
                    replicas=job.parallel.data_parallel_replicas)
    firsts = {name: FirstStep() for name in (group.eager, group.eager + "-compiled", PEER)}
    variants = [Variant(group.eager, lambda: build_ours(group, topo, False, firsts[group.eager])),
                Variant(group.eager + "-compiled",
                        lambda: build_ours(group, topo, True, firsts[group.eager + "-compiled"]))]
    if group.has_peer:
        variants.append(Variant(PEER, lambda: build_fsdp2_compiled(group, firsts[PEER])))
    batches = step_batches(group.spec, group.spec.rounds, topo.dp_size, topo.dp_rank, micro=group.micro_batches)
    res = run_variants(variants, batches, live_memory=True)
    for name, r in res.items():
        if "losses" in r:
            r["first"], r["recompiles"] = firsts[name].first, firsts[name].recompiles
    return res


def run_group(group: Group) -> dict:
    """Rank 0's results of the group's variants, with the figures every rank has folded in: the early
    and final losses of each rank, the largest peaks, the slowest first step, the most graphs."""
    per_rank = spawn(group.world, compile_worker, group)
    res = largest_over_ranks(per_rank, ("peak_live_mib", "peak_rss_mib", "recompiles"))
    for name, r in losses_over_ranks(res, per_rank, EARLY_STEPS).items():
        if "losses" in r:
            r["first"] = {k: max(pr[name]["first"][k] for pr in per_rank) for k in r["first"]}
    return res


def run_compile(shapes, tp_pp: Spec, dps: list[int], only: list[str] | None = None, rounds: int | None = None,
                log=print) -> list[tuple[Group, dict]]:
    """[(group, run_group(group)), ...] for the whole section (:func:`groups`), in one fresh inductor cache
    directory (removed at the end; the environment is restored). ``rounds``: instead of the shapes' own."""
    if rounds:
        shapes, tp_pp = tuple(replace(s, rounds=rounds) for s in shapes), replace(tp_pp, rounds=rounds)
    cache = tempfile.mkdtemp(prefix="megazero_bench_inductor_")
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache                      # inherited by the spawned ranks
    out = []
    try:
        for g in groups(shapes, tp_pp, dps, only):
            names = [b for _, b in g.pairs()]
            log(f"compile {g.spec.layers}x{g.spec.hidden} {g.layout()}: {g.eager}-compiled vs {', '.join(names)}")
            out.append((g, run_group(g)))
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(cache, ignore_errors=True)
    return out


__all__ = ["COMPILE_SHAPES", "QUICK_COMPILE", "TP_PP_SHAPE", "Group", "groups", "run_compile", "run_group",
           "TARGETS", "PEER", "WARMUP_STEPS", "EARLY_STEPS", "EARLY_LOSS_TOL", "FINAL_LOSS_TOL"]
