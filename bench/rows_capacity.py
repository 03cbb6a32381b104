"""Capacity: on dp CPU ranks and a fixed memory budget per rank, the largest GPT (layer count at a
fixed width) whose whole life -- construction, ``steps`` training steps, a checkpoint save and a load --
stays within the budget; megazero ZeRO 0/1/2/3 against FSDP2 and DeepSpeed ZeRO-3.

What is measured. Each run is ``dp`` fresh gloo processes (one torch thread each) going through
four phases, each inside a :class:`megazero.memory.LiveTensorBytes` block chained to the previous
one (``alive=previous.end``, ``gc.collect()`` before the first):

* ``construct``: the model as a user at the edge of memory builds it. Ours: ``build_model_chunks``
  on the meta device, then ``build_engine`` (the engine materialises every parameter where it lives,
  shard by shard under ZeRO-3). FSDP2: the same ``GPT`` built on the meta device, ``fully_shard`` on
  every layer and the root, ``to_empty(device="cpu")``, then each parameter's initial value written
  into its shard (:func:`init_fsdp2_shards`, torch's recommended large-model path). DeepSpeed: the
  ``GPT`` built under ``deepspeed.zero.Init`` (its large-model path: each module's parameters are
  partitioned as soon as the module exists) and initialised through ``zero.GatheredParameters``
  one parameter at a time, then ``deepspeed.initialize``. Every side draws the same initial values
  (``GPT.full_init``: the whole tensor of one parameter at a time, then its slice).
* ``steps``: ``steps`` training steps (AdamW, weight decay, clipping at 1.0), each in its own block;
  at least two, so that a step's backward runs beside optimizer states made lazily by the first step.
* ``save``: ours ``save_checkpoint`` (sharded files); FSDP2 ``torch.distributed.checkpoint.save``
  of ``get_state_dict(model, optimizer)``; DeepSpeed ``engine.save_checkpoint``.
* ``load``: the checkpoint read back into the *live* model and optimizer (what a restart into an
  existing process does; the load's buffers come on top of the states): ours ``load_checkpoint``,
  FSDP2 ``dcp.load`` + ``set_state_dict``, DeepSpeed ``engine.load_checkpoint``.

The figure compared with the budget is the largest peak of any phase on any rank, in **live tensor
bytes** (all tensors alive, counted from the torch profiler's allocation events: exact for the
tensors, blind to the allocator's caching, the interpreter and the libraries; so it is not resident
memory). All three frameworks allocate torch tensors, so the same probe measures them alike. The
profiler follows the thread that runs the phase: a tensor freed in a gloo worker thread would stay
counted (an upper bound); with tp = pp = 1 none of the collectives here frees its buffers that way.

Budget and search. The budget (``CapacitySpec.budget_mib``) is fixed; a run "fits" when its peak is
at most the budget. Memory grows about linearly with the layer count L, so per variant the search
measures L at a first guess (ours: the estimator's answer; the peers: ours ZeRO-3's) and at L + 1,
fits peak(L) = a + bL through the two measured points nearest the boundary, measures at the
predicted largest L, and repeats until it holds an L measured to fit and L + 1 measured not to fit
(:func:`largest_fitting`). Every figure reported is measured; predictions only choose what to run.

Beside each of our variants, what ``tools/estimate_memory.py`` predicts
(:func:`megazero.memory.estimate.estimate_memory`, device ``cpu``): its peak per rank at the measured
L and the largest L whose estimated peak fits the budget. The estimator models construction and a
training step; the save and load phases are outside its scope.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from bench.common import (
    GPT,
    deepspeed_config,
    deepspeed_error,
    deepspeed_param_groups,
    num_params,
    random_micro_batches,
    reachable_tensor_bytes,
    spawn,
    torch_adamw,
    trainer_argv,
    trainer_engine,
)
from bench.steps import as_tuples, deepspeed_step, torch_step
from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.cli.job import parse_job
from megazero.memory import LiveTensorBytes
from megazero.memory.estimate import estimate_memory
from megazero.parallel.topology import Topology
from megazero.state import TrainState
from megazero.training import train_step

MIB = 2**20
SEED = 1234
STAGES = (0, 1, 2, 3)
OURS = tuple(f"ours-zero{s}" for s in STAGES)
PEERS = ("torch-fsdp2", "ds-zero3")
VARIANTS = OURS + PEERS
PHASES = ("construct", "steps", "save", "load")


# ------------------------------------------------------------------------------------------ spec
@dataclass(frozen=True)
class CapacitySpec:
    """The fixed width, batch and budget of the search; only the layer count varies."""

    hidden: int = 256
    heads: int = 8
    seq: int = 64
    vocab: int = 4096
    micro_batch: int = 1
    dp: int = 4
    steps: int = 3
    budget_mib: float = 72.0
    max_layers: int = 40           # the search never goes above this many layers

    def argv(self, layers: int, stage: int) -> list[str]:
        """The trainer's flags for this shape (one micro-batch per rank and step, fp32)."""
        return trainer_argv(layers, self.hidden, self.heads, self.seq, self.vocab, self.micro_batch,
                            "--zero-stage", stage)

    def job(self, layers: int, stage: int):
        """The validated JobConfig at ``layers`` layers and ZeRO ``stage`` on ``dp`` ranks."""
        job, _ = parse_job(self.argv(layers, stage), self.dp)
        return job

    @property
    def budget(self) -> int:
        return int(self.budget_mib * MIB)

    def describe(self) -> str:
        return (f"GPT L layers x {self.hidden} hidden, {self.heads} heads, seq {self.seq}, vocab {self.vocab}, "
                f"micro-batch {self.micro_batch}, fp32; dp = {self.dp} CPU ranks, {self.steps} "
                f"step{'s' if self.steps != 1 else ''}")


# At least two steps everywhere: torch's AdamW (FSDP2, DeepSpeed's client optimizers) makes its states in
# the first step's optimizer call, after backward, so only a later step's backward holds them beside the
# activations and gathered layers, as every step of a run does (ours makes them at construction).
QUICK_CAPACITY = CapacitySpec(hidden=64, heads=4, seq=32, vocab=512, dp=2, steps=2, budget_mib=4.0, max_layers=12)


def params_at(spec: CapacitySpec, layers: int) -> int:
    """Parameters of the whole model at ``layers`` layers."""
    return num_params(spec.job(layers, 0).model)


def estimated_peak(spec: CapacitySpec, layers: int, stage: int) -> int:
    """The estimator's peak bytes per rank (the binding pipeline stage) for ZeRO ``stage``."""
    return max(e.total for e in estimate_memory(spec.job(layers, stage), "cpu"))


def estimated_largest(spec: CapacitySpec, stage: int) -> int:
    """The largest L (up to ``max_layers``) whose estimated peak fits the budget; 0 if none."""
    best = 0
    for layers in range(1, spec.max_layers + 1):
        if estimated_peak(spec, layers, stage) > spec.budget:
            break
        best = layers
    return best


# ---------------------------------------------------------------------------------------- phases
class PhaseMeter:
    """Chained :class:`LiveTensorBytes` blocks: the peak live bytes of each named phase (a phase
    entered several times keeps its largest peak).

    Between phases (after a barrier: nothing in flight) the chain is re-anchored on
    :func:`reachable_tensor_bytes`: the profiler follows only the thread that runs the block, so a
    tensor whose last reference dies in a gloo worker thread (an async collective's buffer) would
    stay counted in every later phase, by a different amount on each rank and run. ``drift`` keeps
    the largest such correction (bytes the profiler still counted that nothing held)."""

    def __init__(self) -> None:
        self.base = reachable_tensor_bytes()
        self.alive, self.drift = 0, 0
        self.previous: LiveTensorBytes | None = None
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        with LiveTensorBytes(alive=self.alive, after=self.previous) as probe:
            yield
        self.peaks[name] = max(self.peaks.get(name, 0), probe.peak)
        dist.barrier()
        reachable = reachable_tensor_bytes() - self.base
        self.drift = max(self.drift, probe.end - reachable)
        self.alive, self.previous = reachable, probe


def micro_batches(spec: CapacitySpec, count: int, step: int, rank: int) -> list[dict]:
    """This rank's ``count`` micro-batches of step ``step`` (seeded; the same for every variant)."""
    return random_micro_batches(spec.vocab, spec.micro_batch, spec.seq, count, step, rank)


# ------------------------------------------------------------------------------------- variants
class Ours:
    """megazero at ZeRO ``stage``: meta-device chunks, ``build_engine``, ``train_step``, sharded
    checkpoints."""

    def __init__(self, spec: CapacitySpec, layers: int, stage: int):
        self.job = spec.job(layers, stage)
        self.topo = Topology(dp=spec.dp)
        self.chunks, self.engine = trainer_engine(self.job, self.topo)
        self.micro = self.job.num_micro_batches

    def step(self, micro: list[dict]) -> float:
        return train_step(self.chunks, micro, self.topo, self.engine, self.job).loss

    def save(self, path: str, steps: int) -> None:
        save_checkpoint(path, TrainState(steps, 0, 0), chunks=self.chunks, engine=self.engine, topo=self.topo,
                        job=self.job)

    def load(self, path: str) -> None:
        load_checkpoint(path, chunks=self.chunks, engine=self.engine, topo=self.topo, job=self.job)


def norm_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that belong to layer norms (initialised to ones / zeros)."""
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    return {n for n, _ in model.named_parameters() if n.rpartition(".")[0] in norms}


@torch.no_grad()
def init_fsdp2_shards(model: GPT) -> None:
    """Give every FSDP2-sharded parameter its initial value: the whole value of one parameter at a
    time (``GPT.full_init``, the same numbers as ours), sliced locally into this rank's shard."""
    from torch.distributed.tensor import distribute_tensor

    norms = norm_parameter_names(model)
    for name, p in model.named_parameters():
        full = model.full_init(name, tuple(p.shape), model.seed, is_norm=name in norms)
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))


class Fsdp2:
    """torch FSDP2 on the same GPT: meta device, ``fully_shard`` per layer and root, ``to_empty``,
    sharded init; torch AdamW; torch.distributed.checkpoint with sharded state dicts."""

    def __init__(self, spec: CapacitySpec, layers: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        job = spec.job(layers, 3)
        self.clip, self.micro = job.optimizer.clip_grad, job.num_micro_batches
        model = GPT(job.model, seed=SEED, device="meta")
        mesh = init_device_mesh("cpu", (spec.dp,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        init_fsdp2_shards(model)
        self.model, self.opt = model, torch_adamw(model.named_parameters(), job.optimizer)

    def step(self, micro: list[dict]) -> float:
        return torch_step(self.model, self.opt, as_tuples(micro), self.clip, set_to_none=True)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: str, steps: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=path)

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def zero_init_gpt_class():
    """A ``GPT`` whose initialisation works under ``deepspeed.zero.Init``: by the time ``GPT``
    initialises, DeepSpeed has partitioned every sub-module's parameters, so each is gathered in
    turn (``zero.GatheredParameters``), filled with its initial value and partitioned again."""
    import deepspeed

    class ZeroInitGPT(GPT):
        @torch.no_grad()
        def reset_parameters(self, seed: int) -> None:
            self.seed = seed
            for name, p in self.named_parameters():
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.copy_(self.initial_value(name))

    return ZeroInitGPT


def layer_elements(job) -> int:
    """Parameter elements of one transformer layer (4 h x h matrices' worth of attention and MLP)."""
    h, f = job.model.hidden_size, job.model.ffn_hidden_size
    return 4 * h * h + 2 * h * f + 9 * h + f


def zero3_options(job) -> dict:
    """DeepSpeed ZeRO-3 sized like ours, as a user at the edge of memory sizes it: gradients reduced
    in buckets of our ``--bucket-size`` elements (DeepSpeed's default 5e8 allocates a 2 GB bucket),
    one layer's parameters prefetched (ours: ``--zero3-prefetch-layers 1``; the default 5e7 elements
    would prefetch this whole model). The other options keep DeepSpeed's defaults."""
    return {"stage": 3, "reduce_bucket_size": job.zero.bucket_size,
            "stage3_prefetch_bucket_size": layer_elements(job)}


class DeepSpeedZero3:
    """DeepSpeed ZeRO-3 (CPU accelerator, gloo): the GPT built under ``zero.Init``,
    ``deepspeed.initialize``, ``engine.save_checkpoint`` / ``engine.load_checkpoint``."""

    TAG = "capacity"

    def __init__(self, spec: CapacitySpec, layers: int):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        job = spec.job(layers, 3)
        self.micro = job.num_micro_batches
        config = deepspeed_config(job.optimizer, job.train.micro_batch_size, job.num_micro_batches,
                                  zero3_options(job))
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):
            model = zero_init_gpt_class()(job.model, seed=SEED)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=deepspeed_param_groups(
            model, job.optimizer), config=config)

    def step(self, micro: list[dict]) -> float:
        return deepspeed_step(self.engine, as_tuples(micro))

    def save(self, path: str, steps: int) -> None:
        self.engine.save_checkpoint(path, tag=self.TAG)

    def load(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag=self.TAG)


def build_variant(name: str, spec: CapacitySpec, layers: int):
    """The runner of variant ``name`` (``ours-zero<s>``, ``torch-fsdp2`` or ``ds-zero3``)."""
    if name in OURS:
        return Ours(spec, layers, int(name[-1]))
    if name == "torch-fsdp2":
        return Fsdp2(spec, layers)
    if name == "ds-zero3":
        return DeepSpeedZero3(spec, layers)
    raise ValueError(f"unknown capacity variant {name!r}; choose from {VARIANTS}")


@contextlib.contextmanager
def quiet_stderr():
    """Send file descriptor 2 to /dev/null for the block: the profiler behind LiveTensorBytes prints
    two lines per block and rank from C++. A failure still reaches the parent: ``spawn`` sends the
    traceback through its queue."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def capacity_worker(rank: int, world: int, name: str, spec: CapacitySpec, layers: int, ckpt_dir: str) -> dict:
    """One rank of one run: per-phase peak live tensor bytes and the losses."""
    with quiet_stderr():
        return run_phases(rank, name, spec, layers, ckpt_dir)


def run_phases(rank: int, name: str, spec: CapacitySpec, layers: int, ckpt_dir: str) -> dict:
    """Construction, ``spec.steps`` steps, save, load, each phase measured (see the module docstring)."""
    torch.manual_seed(0)
    meter, losses = PhaseMeter(), []
    with meter.phase("construct"):
        runner = build_variant(name, spec, layers)
    for step in range(spec.steps):
        with meter.phase("steps"):
            losses.append(runner.step(micro_batches(spec, runner.micro, step, rank)))
    with meter.phase("save"):
        runner.save(ckpt_dir, spec.steps)
    with meter.phase("load"):
        runner.load(ckpt_dir)
    return {"peaks": meter.peaks, "losses": losses, "drift": meter.drift}


# ---------------------------------------------------------------------------------------- search
@dataclass
class Run:
    """One measured run: the largest peak over ranks and phases, and each phase's peak."""

    layers: int
    peak: int
    phases: dict
    seconds: float
    loss: float
    drift: int = 0          # the largest re-anchoring correction on any rank (see PhaseMeter)


def measure(name: str, spec: CapacitySpec, layers: int) -> Run:
    """Run variant ``name`` at ``layers`` layers on ``spec.dp`` fresh processes."""
    ckpt_dir = tempfile.mkdtemp(prefix="megazero_capacity_")
    t0 = time.perf_counter()
    try:
        per_rank = spawn(spec.dp, capacity_worker, name, spec, layers, ckpt_dir)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    phases = {p: max(r["peaks"].get(p, 0) for r in per_rank) for p in PHASES}
    return Run(layers, max(phases.values()), phases, time.perf_counter() - t0, per_rank[0]["losses"][-1],
               max(r["drift"] for r in per_rank))


def boundary(peaks: dict[int, int], budget: int, max_layers: int) -> tuple[int, int]:
    """(lo, hi): hi the smallest L measured over the budget (max_layers + 1 if none), lo the largest
    L below hi measured to fit (0 if none)."""
    hi = min((L for L, p in peaks.items() if p > budget), default=max_layers + 1)
    lo = max((L for L, p in peaks.items() if p <= budget and L < hi), default=0)
    return lo, hi


def predict(peaks: dict[int, int], budget: int, lo: int, hi: int, slope: float | None = None) -> int:
    """The next L to measure, strictly between lo and hi: the largest L under the budget on the line
    peak(L) = a + bL through the two measured points nearest the boundary (through the one point
    with slope ``slope`` when only one is measured); else the step next to what is known."""
    near = sorted(peaks, key=lambda L: min(abs(L - lo), abs(L - hi)))[:2]
    if len(near) == 2:
        (l1, p1), (l2, p2) = sorted((L, peaks[L]) for L in near)
        slope = (p2 - p1) / (l2 - l1)
    else:
        l1, p1 = near[0], peaks[near[0]]
    if slope is not None and slope > 0:
        return min(max(l1 + math.floor((budget - p1) / slope), lo + 1), hi - 1)
    return lo + 1 if lo > 0 else hi - 1


def largest_fitting(measure_at: Callable[[int], int], budget: int, guess: int, max_layers: int,
                    slope: float | None = None) -> tuple[int, dict]:
    """The largest L in [1, max_layers] measured to fit ``budget`` with L + 1 measured not to fit
    (L = max_layers when that fits; 0 when L = 1 does not). ``measure_at(L)`` returns a peak; it is
    called at ``guess`` first, then at predicted points (:func:`predict`, ``slope``: bytes per layer
    to assume until two points are measured) until the boundary is pinned.
    Returns (L, {L: peak} of every measurement)."""
    guess = min(max(guess, 1), max_layers)
    peaks = {guess: measure_at(guess)}
    while True:
        lo, hi = boundary(peaks, budget, max_layers)
        if hi == lo + 1:
            return lo, peaks
        L = predict(peaks, budget, lo, hi, slope)
        peaks[L] = measure_at(L)


# ------------------------------------------------------------------------------------------ rows
@dataclass
class CapacityRow:
    """One variant's answer and the runs behind it."""

    name: str
    layers: int = 0
    runs: dict = field(default_factory=dict)          # L -> Run
    params: int = 0
    estimated_peak: int | None = None               # ours only: the estimator at ``layers``
    estimated_layers: int | None = None             # ours only: the estimator's largest L
    unavailable: str | None = None

    def run_at(self, layers: int) -> Run | None:
        return self.runs.get(layers)


def deepspeed_unavailable() -> str | None:
    """None when DeepSpeed imports here, else why not."""
    e = deepspeed_error()
    return None if e is None else f"DeepSpeed not installed / not importable ({type(e).__name__}: {str(e)[:100]})"


def measured_slope(row: "CapacityRow") -> float | None:
    """Bytes per layer between the row's answer and the next layer (both measured), if any."""
    a, b = row.run_at(row.layers), row.run_at(row.layers + 1)
    return (b.peak - a.peak) if a and b else None


def search_variant(name: str, spec: CapacitySpec, guess: int, slope: float | None, log=print) -> CapacityRow:
    """Find ``name``'s largest fitting L by measurement, starting at ``guess`` with ``slope`` bytes per
    layer assumed (ours: the estimator's answer and slope); the estimator's figures for ours."""
    row = CapacityRow(name)
    if name in OURS:
        stage = int(name[-1])
        row.estimated_layers = estimated_largest(spec, stage)
        guess = row.estimated_layers or guess
        slope = estimated_peak(spec, guess + 1, stage) - estimated_peak(spec, guess, stage)

    def measure_at(layers: int) -> int:
        run = measure(name, spec, layers)
        row.runs[layers] = run
        verdict = "fits" if run.peak <= spec.budget else "over"
        log(f"  {name} L={layers}: peak {run.peak / MIB:.2f} MiB ({verdict}; {run.seconds:.0f} s)")
        return run.peak

    try:
        row.layers, _ = largest_fitting(measure_at, spec.budget, guess, spec.max_layers, slope)
    except RuntimeError as e:                       # a rank failed: report why, do not invent numbers
        row.unavailable = f"failed: {str(e).strip().splitlines()[-1][:160]}"
        return row
    row.params = params_at(spec, max(row.layers, 1))
    if name in OURS and row.layers:
        row.estimated_peak = estimated_peak(spec, row.layers, int(name[-1]))
    return row


def run_capacity(spec: CapacitySpec, only: list[str] | None = None, with_deepspeed: bool = True,
                 log=print) -> list[CapacityRow]:
    """Every variant's row: ours first (ZeRO-3's answer and slope are the peers' first guess)."""
    rows, guess, slope = [], max(1, spec.max_layers // 4), None
    for name in VARIANTS:
        if only is not None and name not in only:
            continue
        why = None if name != "ds-zero3" else (deepspeed_unavailable() if with_deepspeed
                                               else "skipped (--no-deepspeed)")
        if why:
            rows.append(CapacityRow(name, unavailable=why))
            continue
        log(f"capacity {name}")
        row = search_variant(name, spec, guess, slope, log)
        if name == "ours-zero3" and row.layers:
            guess, slope = row.layers, measured_slope(row)
        rows.append(row)
    return rows


__all__ = ["CapacitySpec", "QUICK_CAPACITY", "CapacityRow", "Run", "PHASES", "VARIANTS", "run_capacity",
           "largest_fitting", "boundary", "predict", "measure", "estimated_peak", "estimated_largest"]
