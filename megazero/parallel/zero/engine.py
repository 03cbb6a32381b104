"""The ZeRO engine: what the training loop drives each step, for every stage, and its accounting.

    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    engine.zero_grad()
    losses = run_schedule(chunks, micro_batches, topo.pipeline(), loss_fn=..., loss_scale=engine.loss_scale,
                          grad_sync=engine)
    engine.finalize_grads()
    grad_norm, skipped = engine.step()

One engine over *bucket groups*, one optimizer, one loss scaler, one global norm. A bucket group is a
grad sync over some of the chunks' parameters with its own data-parallel view: without experts there is
one, over every parameter and the dp group; with expert parallelism (ep > 1) the experts form a second
group over the expert-data-parallel group (:func:`bucket_group_views`). Worked example, dp = 4, ep = 2,
E = 4 experts, ZeRO-1: dp ranks 0-3 each hold the dense model and own 1/4 of every dense bucket; dp
ranks 0 and 2 hold experts 0-1 and own halves of their buckets, ranks 1 and 3 experts 2-3. One step:
both groups reduce-scatter their buckets (gradients averaged over all 4 dp ranks), the optimizer sums
the norm over both (each element once), clips, steps every owned range, and each group all-gathers
over its own ranks. A non-finite gradient is named whichever group holds it; fp16's overflow check,
the checkpoint's step count and loss scale are the one optimizer's.

The stage table (:data:`STAGES`) is where a ``--zero-stage`` becomes parts: one frozen :class:`Stage`
per stage names its grad sync class, its parameter component, whether the grad sync sums buckets with
a reducer, when it reduces, and the optimizer's publish policy. :func:`build_grad_sync`,
:func:`build_engine` and :func:`build_optimizer` read everything from it::

    stage  grad sync              parameters                           reducer  each micro-batch      publish
    0      AllReduceGradSync      ReplicatedParams (whole everywhere)  -        no                    Replicated
    1      ReduceScatterGradSync  ReplicatedParams                     -        no                    AllGatherShards
    2      ShardedGradSync        ReplicatedParams                     yes      with the flag         AllGatherShards
    3      ShardedGradSync        ShardedParams (a shard, per unit)    yes      unless kept gathered  WriteShards

So stage 3 is stage 2's gradient sync composed with sharded parameters; no stage's class derives from
another's. The switches are components or arguments passed to those parts, not subclasses: the reducer
(:mod:`.reducers`, qgZ), reducing every micro-batch, stage 3's gathering (:mod:`.zeropp`: qwZ, hpZ),
its prefetch and keep-gathered mode and where its shards live (:mod:`.offload_params`), where the
optimizer state lives (:mod:`.offload`), the overlapped parameter gather of stages 1-2 (:mod:`.publish`).

The engine trusts its job: the ZeRO config was checked against the layout by
:func:`megazero.config.validate` (which refuses, for instance, ``--zero3-keep-params-gathered`` below
stage 3), and is not checked again here.

With ``--offload-optimizer`` / ``--offload-params`` nvme the engine owns this rank's swap directory:
``engine.close()`` removes it (so does interpreter exit).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megazero.config import FLAG, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.groups import DataParallel
from megazero.parallel.params import attribute
from megazero.parallel.topology import Topology
from megazero.parallel.zero.buckets import nbytes
from megazero.parallel.zero.fp8_gather import forget_weight_amaxes
from megazero.parallel.zero.grad_sync import (
    AllReduceGradSync,
    BucketedGradSync,
    ReduceScatterGradSync,
)
from megazero.parallel.zero.offload_params import build_param_shards
from megazero.parallel.zero.optimizer import BucketAdamW
from megazero.parallel.zero.param_sync import ShardedParams
from megazero.parallel.zero.publish import AllGatherShards, Replicated, WriteShards
from megazero.parallel.zero.reducers import build_reducer
from megazero.parallel.zero.replicated_params import ReplicatedParams
from megazero.parallel.zero.sharded_grads import ShardedGradSync, reductions_in_flight
from megazero.parallel.zero.swap import SwapDir
from megazero.parallel.zero.units import ParamSubset


def when_flagged(zero_cfg: ZeroConfig) -> bool:
    """Stage 2 reduces every micro-batch with ``--zero2-reduce-each-microbatch``."""
    return zero_cfg.reduce_each_microbatch


def unless_kept_gathered(zero_cfg: ZeroConfig) -> bool:
    """Stage 3 reduces every micro-batch (its backward releases the parameters) unless
    ``--zero3-keep-params-gathered`` holds them, and the full gradients, until the step's last."""
    return not zero_cfg.keep_params_gathered


@dataclass(frozen=True)
class Stage:
    """What a ZeRO stage is made of, for each bucket group and the one optimizer.

    ``grad_sync``: the class that reduces and holds the gradients over the group's dp; ``params``: its
    parameter component (whole parameters, or a shard gathered per unit), built by its ``from_config``;
    ``reducer``: the grad sync sums a bucket with a reducer component (:func:`build_reducer`: the plain
    reduce-scatter or qgZ's), at most ``reductions_in_flight`` at once; ``reduce_each_microbatch``: when
    it reduces after every micro-batch's backward rather than the step's last (None: a grad sync without
    that switch); ``publish``: the optimizer's policy (owned ranges, how new weights reach the model),
    built by its ``from_config``."""

    grad_sync: type
    params: type
    reducer: bool
    reduce_each_microbatch: Callable[[ZeroConfig], bool] | None
    publish: type


STAGES = {0: Stage(AllReduceGradSync, ReplicatedParams, False, None, Replicated),
          1: Stage(ReduceScatterGradSync, ReplicatedParams, False, None, AllGatherShards),
          2: Stage(ShardedGradSync, ReplicatedParams, True, when_flagged, AllGatherShards),
          3: Stage(ShardedGradSync, ShardedParams, True, unless_kept_gathered, WriteShards)}


@dataclass
class StatePiece:
    """Elements [lo, hi) of one parameter's flattened tp-local tensor, and 1-D views of what this rank
    holds there: ``tensors`` maps ``model`` (the weights) and/or ``master``, ``exp_avg``,
    ``exp_avg_sq`` to views of ``hi - lo`` elements. Checkpoints read and write through these."""

    name: str
    param: nn.Parameter          # for its declarations (split dim, vocabulary padding, tied copy)
    shape: torch.Size            # the tp-local shape
    lo: int
    hi: int
    tensors: dict[str, torch.Tensor]


def is_expert(p) -> bool:
    """Does ``p`` belong to the experts' bucket group (``expert_parallel``: ep ranks hold different ones)?"""
    return bool(attribute(p, "expert_parallel"))


def bucket_group_filters(ep: int, has_experts: bool) -> list[tuple[str, object]]:
    """(name, parameter filter or None for all) of each bucket group (pure: the memory estimator lays out
    the same groups). The experts are a group of their own only with ep > 1: their gradients differ
    between the ep ranks of an expert group, so they cannot share buckets with the dense parameters."""
    if ep > 1 and has_experts:
        return [("dense", lambda p: not is_expert(p)), ("experts", is_expert)]
    return [("all", None)]


def bucket_group_views(topo: Topology, has_experts: bool) -> list[tuple[str, DataParallel, object]]:
    """(name, data-parallel view, filter) of each bucket group: the experts over the expert-data-parallel
    group, everything else over the data x context-parallel group (the data-parallel group at cp 1), or,
    with ``--data-parallel-replicas``, over one replica's shard group (:meth:`Topology.data_shard`)."""
    return [(name, topo.expert_data_parallel() if name == "experts" else topo.data_shard(), keep)
            for name, keep in bucket_group_filters(topo.ep_size, has_experts)]


def _first_replica(dp: DataParallel) -> bool:
    """Is this rank in the first replica of ``dp``'s replica dimension (always, without one)?"""
    return dp.replicas is None or dp.replicas.ranks[0] == dist.get_rank()


OFFLOADED_KEYS = {"host": ("params", "grads", "delayed_grads", "master_weights", "optimizer_state", "buffers"),
                  "nvme": ("params", "master_weights", "optimizer_state")}


def model_state_bytes(syncs, optimizer: BucketAdamW | None = None, shards=None) -> dict[str, int]:
    """Bytes this rank holds right now in model parameters, gradients, fp32 master weights (only
    those that are separate from the parameters) and optimizer state (Adam m and v), plus the total.
    Padding is included. Measure after ``step()``: that is the steady state between steps.
    ``grads_peak`` (not in the total) is the most gradient memory held at once so far, which for
    stage 2 includes the transient full-size buckets of backward.

    These are device bytes. What offloading keeps elsewhere is counted apart, by the same names:
    ``host_params``, ``host_grads`` (the fp32 gradient copy), ``host_delayed_grads`` (those the delayed
    update steps with), ``host_master_weights``,
    ``host_optimizer_state``, ``host_buffers`` (staging and swap buffers), ``host_total``, and
    ``nvme_params``, ``nvme_master_weights``, ``nvme_optimizer_state``, ``nvme_total`` (all 0 without
    offload; on a CPU run "device" and "host" are the same memory, counted apart all the same)."""
    syncs = list(syncs) if isinstance(syncs, (list, tuple)) else [syncs]
    out = {
        "params": sum(nbytes(b) for s in syncs for b in s.params.buffers),
        "grads": sum(nbytes(t) for s in syncs for t in s.held_grad_tensors()),
        "master_weights": optimizer.master_bytes() if optimizer is not None else 0,
        "optimizer_state": optimizer.state_bytes() if optimizer is not None else 0,
    }
    out["total"] = sum(out.values())
    out["grads_peak"] = sum(s.peak_grad_bytes for s in syncs)
    offloaded = {**(shards.offloaded_bytes() if shards is not None else {}),
                 **(optimizer.offloaded_bytes() if optimizer is not None else {})}
    for where, keys in OFFLOADED_KEYS.items():
        for key in keys:
            out[f"{where}_{key}"] = offloaded.get(f"{where}_{key}", 0)
        out[f"{where}_total"] = sum(out[f"{where}_{key}"] for key in keys)
    return out


def zero_paper_bytes(psi: int, n: int, stage: int) -> float:
    """Model-state bytes per rank in the ZeRO paper for mixed-precision Adam (K = 12):
    stage 0: 2Ψ + 2Ψ + 12Ψ; stage 1: 4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N."""
    return {0: 16.0 * psi, 1: 4.0 * psi + 12.0 * psi / n, 2: 2.0 * psi + 14.0 * psi / n,
            3: 16.0 * psi / n}[stage]


class ZeroEngine:
    """What the training loop drives each step: the bucket groups' grad syncs and the one optimizer
    (the protocol in the module docstring). ``bucket_groups``: the grad syncs, dense first."""

    def __init__(self, syncs: list[BucketedGradSync], optimizer: BucketAdamW, stage: int, *,
                 swap: SwapDir | None = None, shards=None):
        self.bucket_groups, self.optimizer, self.stage = list(syncs), optimizer, stage
        self.comm_log = optimizer.comm_log
        self.swap, self.shards = swap, shards

    def close(self) -> None:
        """Stop the offload I/O threads and remove the swap files (a no-op without offload). The engine
        is unusable afterwards."""
        self.optimizer.close()
        for sync in self.bucket_groups:
            sync.close()
        if self.shards is not None:
            self.shards.close()
        if self.swap is not None:
            self.swap.close()

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        for sync in self.bucket_groups:
            sync.before_backward(chunk_id, is_last_microbatch)

    def before_input_grad(self, chunk_id: int) -> None:
        for sync in self.bucket_groups:
            sync.before_input_grad(chunk_id)

    @contextlib.contextmanager
    def weight_grad(self, chunk_id: int, is_last_microbatch: bool):
        """The W of a split backward, in every bucket group (``BucketedGradSync.weight_grad``)."""
        with contextlib.ExitStack() as stack:
            for sync in self.bucket_groups:
                stack.enter_context(sync.weight_grad(chunk_id, is_last_microbatch))
            yield

    def finalize_grads(self) -> None:
        for sync in self.bucket_groups:
            sync.finalize_grads()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def combine_replicas_with(self, reducer) -> None:
        """Have every bucket group combine its reduced shards across replicas with ``reducer`` (the torchft
        replica groups' average; :class:`~megazero.parallel.zero.grad_sync.GroupReplicaSum` says what it does)."""
        for sync in self.bucket_groups:
            sync.replica_reducer = reducer

    def step(self, iteration: int | None = None) -> tuple[float, bool]:
        """(global grad norm, skipped) of one optimizer step; ``iteration`` names it in messages."""
        return self.optimizer.step(iteration)

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        self.optimizer.set_lr(lr, decoupled_lr)

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    @property
    def params_overflowed(self) -> bool:
        """Did the last applied step leave a non-finite fp16/bf16 parameter (its master beyond the type)?"""
        return self.optimizer.params_overflowed

    def nonfinite_parameters(self, limit: int = 3, everywhere: bool = False) -> list[str]:
        """Names of parameters whose reduced gradient is not finite (``everywhere``: over all ranks, a
        collective; :meth:`BucketAdamW.nonfinite_parameters`)."""
        return self.optimizer.nonfinite_parameters(limit, everywhere)

    def model_state_bytes(self) -> dict[str, int]:
        """:func:`model_state_bytes`, and what the parameter components add, summed over the bucket
        groups: at stage 3 the temporaries, ``gathered_params`` (now), ``gathered_params_peak`` bytes and
        ``gathered_units_peak`` units gathered at once so far, and ZeRO++ hpZ's ``hpz_secondary_params``
        (within ``params``)."""
        out = model_state_bytes(self.bucket_groups, self.optimizer, self.shards)
        for sync in self.bucket_groups:
            for key, value in sync.params.accounting().items():
                out[key] = out.get(key, 0) + value
        return out

    def state_dict(self) -> dict:
        self.optimizer.wait_params()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.wait_params()
        self.optimizer.load_state_dict(state)

    def _pieces(self, sync, ranges, weights: bool, optimizer: bool) -> list[StatePiece]:
        out = []
        for bucket, lo, hi in ranges:
            for slot in bucket.slots:
                a, b = max(lo, slot.start), min(hi, slot.end)
                if a >= b:
                    continue
                tensors = {"model": sync.params.values(bucket, a, b)} if weights else {}
                if optimizer:
                    tensors.update(self.optimizer.state_views(bucket, a, b))
                out.append(StatePiece(slot.name, slot.param, slot.shape, a - slot.start, b - slot.start, tensors))
        return out

    def saved_pieces(self) -> list[StatePiece]:
        """What this rank writes to a checkpoint: for every bucket, its data-parallel shard of the
        elements, weights and optimizer state (at stage 0 too: replicated state is written once,
        split over the dp ranks, in parallel; with ``--data-parallel-replicas``, by the first replica's
        ranks only)."""
        self.optimizer.wait_params()
        return [p for sync in self.bucket_groups if _first_replica(sync.dp)
                for p in self._pieces(sync, [(b, *sync.shard_range(b)) for b in sync.buckets], True, True)]

    def loaded_pieces(self, weights_only: bool = False) -> list[StatePiece]:
        """What this rank fills from a checkpoint: the weights it holds (stages 0-2 whole tp-local
        parameters, stage 3 its shard) and, unless ``weights_only``, the optimizer state it owns."""
        self.optimizer.wait_params()
        pieces = []
        for sync in self.bucket_groups:
            pieces += self._pieces(sync, [(b, *sync.params.held_range(b)) for b in sync.buckets], True, False)
        if not weights_only:
            for sync in self.bucket_groups:
                pieces += self._pieces(sync, [(r.bucket, r.lo, r.hi) for r in self.optimizer.ranges
                                              if r.sync is sync], False, True)
        return pieces

    def loaded(self, step: int, loss_scaler: dict | None, weights_only: bool) -> None:
        """After the pieces were filled: the optimizer's step count and loss scaler, or (weights only)
        fresh fp32 masters from the loaded weights. Gathered copies of the old values (stage 3) go first."""
        for sync in self.bucket_groups:
            sync.params.release_all()
        forget_weight_amaxes(self.bucket_groups)
        if weights_only:
            self.optimizer.refresh_masters()
            return
        self.optimizer.refresh_masters(fp32_only=True)     # a checkpoint has no masters of fp32 parameters
        self.optimizer.step_count = int(step)
        if self.optimizer.scaler is not None and loss_scaler:
            self.optimizer.scaler.load_state_dict(loss_scaler)

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        """Inside: every parameter of the chunks holds its full tp-local value (stages 0-2 always do;
        stage 3 gathers here, a collective over dp: call on every rank). ``write_back=True``: on a
        normal exit the (possibly modified in place) values become the truth -- each rank copies its
        slice into its shard and refreshes its fp32 masters."""
        self.optimizer.wait_params()
        self.optimizer.publish.exact()                    # stages 1-2 after an FP8 parameter all-gather
        newly = [(sync.params, sync.params.gather_all()) for sync in self.bucket_groups]
        ok = False
        try:
            yield
            ok = True
        finally:
            if ok and write_back:
                for sync in self.bucket_groups:
                    sync.params.write_back()
                self.optimizer.refresh_masters()
                forget_weight_amaxes(self.bucket_groups)
            for params, units in newly:
                for u in units:
                    params.release(u)


def _swap_dir(zero_cfg: ZeroConfig, rank: int) -> SwapDir | None:
    """This rank's swap directory under --nvme-path when anything is offloaded to nvme."""
    if "nvme" not in (zero_cfg.offload_optimizer, zero_cfg.offload_params):
        return None
    return SwapDir(zero_cfg.nvme_path, rank)


def _reduction_parts(stage: Stage, zero_cfg: ZeroConfig, dp: DataParallel, comm_log: CommLog) -> dict:
    """The arguments the stage's table entry gives its grad sync beyond the common ones: the reducer, its
    bound in flight and when it reduces (none for stages 0 and 1)."""
    z, parts = zero_cfg, {}
    if stage.reducer:
        parts["reducer"] = build_reducer(dp, comm_log, z.quantized_gradients, z.quantization_block_size)
        parts["max_in_flight"] = reductions_in_flight(z.zero_stage, z.overlap_grad_reduce)
    if stage.reduce_each_microbatch is not None:
        parts["reduce_each_microbatch"] = stage.reduce_each_microbatch(z)
    return parts


def build_grad_sync(chunks, dp: DataParallel, topo: Topology, zero_cfg: ZeroConfig, comm_log: CommLog, *,
                    grad_sync_cls: type | None = None, shards=None) -> BucketedGradSync:
    """One bucket group's grad sync over ``dp``, made of the parts :data:`STAGES` lists for
    ``zero_cfg.zero_stage``; ``shards``: stage 3's shard store (shared by the bucket groups; default the
    device). ``grad_sync_cls`` replaces the stage's class (with its default components) where the
    parameters are replicated; the one useful override is ``AllReduceGradSync`` at stage 1 (the ZeRO-1
    optimizer only reads its shard, so an all-reduce works as well as a reduce-scatter, at 2Ψ(N-1)/N
    instead of Ψ(N-1)/N; bench/bench_zero.py measures both)."""
    z = zero_cfg
    stage = STAGES[z.zero_stage]
    kw = dict(tp=topo.tensor_parallel(), pipeline=topo.pipeline(), comm_log=comm_log)
    if grad_sync_cls is not None:
        if stage.params is not ReplicatedParams:
            raise ValueError(f"grad_sync_cls applies to ZeRO stages 0-2, not {FLAG.zero_stage} 3")
        return grad_sync_cls(chunks, dp, z, **kw)
    parts = _reduction_parts(stage, z, dp, comm_log)
    return stage.grad_sync(chunks, dp, z, params=stage.params.from_config(z, shards), **parts, **kw)


def build_engine(chunks, topo: Topology, zero_cfg: ZeroConfig, opt_cfg: OptimizerConfig,
                 precision: PrecisionConfig | None = None, *, grad_sync_cls: type | None = None) -> ZeroEngine:
    """Wrap this rank's model chunks for ``zero_cfg.zero_stage`` and build the one optimizer over every
    bucket group, from the parts :data:`STAGES` lists. Build it after the model and before the first
    forward: parameters move into the engine's buffers. ``zero_cfg`` is a validated job's
    (:func:`megazero.config.validate`): nothing is checked again. ``grad_sync_cls``: see
    :func:`build_grad_sync`."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    z = zero_cfg
    comm_log = CommLog(topo.ranks_per_node)
    swap = _swap_dir(z, topo.rank)
    try:
        # Stage 3's shard store, one for every bucket group (stages 0-2 hold no shards: the device's, unused).
        shards = build_param_shards(z.offload_params, topo.device, z.offload_pin_memory, swap)
        has_experts = any(is_expert(p) for c in chunks for p in c.parameters())
        syncs = []
        for _, dp, keep in bucket_group_views(topo, has_experts):
            members = chunks if keep is None else [ParamSubset(c, keep) for c in chunks]
            syncs.append(build_grad_sync(members, dp, topo, z, comm_log, grad_sync_cls=grad_sync_cls, shards=shards))
        publish = STAGES[z.zero_stage].publish.from_config(syncs, z)
        optimizer = BucketAdamW(syncs, opt_cfg, precision, publish=publish, replica=topo.model_replica(), swap=swap)
        for sync in syncs:
            sync.reset_peaks()
        return ZeroEngine(syncs, optimizer, z.zero_stage, swap=swap, shards=shards)
    except BaseException:
        if swap is not None:
            swap.close()
        raise


def wrap_data_parallel(chunks, topo: Topology, zero_cfg: ZeroConfig, *, comm_log: CommLog | None = None,
                       grad_sync_cls: type | None = None) -> BucketedGradSync:
    """A single grad sync over all of ``chunks`` and ``topo``'s data-parallel group (stages 0-2, whose
    parameters are replicated): for code that drives the sync without the engine (tests, benchmarks, a
    gradient finalisation at dp 1); over dp x cp under context parallelism."""
    if STAGES[zero_cfg.zero_stage].params is not ReplicatedParams:
        raise ValueError(f"{FLAG.zero_stage} {zero_cfg.zero_stage}: wrap_data_parallel builds stages 0, 1 and 2")
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    comm_log = comm_log if comm_log is not None else CommLog(topo.ranks_per_node)
    return build_grad_sync(chunks, topo.data_context_parallel(), topo, zero_cfg, comm_log, grad_sync_cls=grad_sync_cls)


def build_optimizer(syncs, opt_cfg: OptimizerConfig, precision: PrecisionConfig | None = None,
                    stage: int | None = None, *, swap: SwapDir | None = None, replica=None) -> BucketAdamW:
    """The optimizer over grad syncs built by :func:`wrap_data_parallel`, with the publish policy
    :data:`STAGES` lists for ``stage`` (default: the syncs' ``zero_stage``); ``swap``: where
    ``--offload-optimizer nvme`` keeps its file."""
    syncs = list(syncs) if isinstance(syncs, (list, tuple)) else [syncs]
    stage = syncs[0].cfg.zero_stage if stage is None else stage
    if stage not in STAGES:
        raise ValueError(f"{FLAG.zero_stage} {stage}: only 0, 1, 2 and 3 are implemented")
    publish = STAGES[stage].publish.from_config(syncs, syncs[0].cfg)
    return BucketAdamW(syncs, opt_cfg, precision, publish=publish, replica=replica, swap=swap)
