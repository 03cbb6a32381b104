"""Optimizers over the bucketed gradients of :mod:`megazero.parallel.data`: AdamW with fp32 master
weights, optional ZeRO sharding over the data-parallel group, global-norm clipping, fp16 loss scaling.

Who holds what (dp = N ranks, one bucket of 2N elements, rank r owns elements [2r, 2r + 2))::

    class                   grads after the sync      fp32 master + Adam m, v     after step
    DataParallelOptimizer   all N: full bucket        all N: full bucket           copy master -> params
    ZeroStage1Optimizer     full buffer, shard valid  rank r: its shard only       copy shard, all-gather
    ZeroStage2Optimizer     rank r: its shard only    rank r: its shard only       copy shard, all-gather

All three share :class:`_BucketAdamW`, which steps one (bucket, owned range) at a time:
unscale (fp16) -> inf/nan check over all ranks (skip + shrink the scale on overflow) -> global
gradient norm -> clip -> AdamW on the flat fp32 range -> publish the new weights to the model.
With fp32 parameters the "master" of a range *is* the model's parameter buffer (a view: no copy,
no extra memory); with bf16/fp16 it is a separate fp32 tensor.

Global norm: every element of the full model is counted exactly once across the world --
dp: sharded optimizers count their own shard (sum over all ranks); the unsharded one counts the
full gradient and sums over the model-parallel group only, since dp replicas are identical;
tp: a ``tensor_parallel`` parameter counts on every tp rank (distinct shards), a replicated one
only on tp rank 0; pp: each stage its own parameters, and the tied embedding's last-stage copy
(``shared_embedding`` on the last stage when pp > 1) is not counted.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.config import OptimizerConfig, PrecisionConfig
from megazero.optim import adamw_update, merge_ranges, wants_weight_decay
from megazero.parallel import counted_comm as comm
from megazero.parallel.data import (AllReduceGradSync, Bucket, ParamSlot, ReduceScatterGradSync,
                                    ShardedGradSync, _BucketedGradSync)
from megazero.precision import DynamicLossScaler

log = logging.getLogger(__name__)


@dataclass
class _RangeState:
    """Optimizer state of elements [lo, hi) of one bucket (ranges below are relative to lo)."""

    bucket: Bucket
    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_ranges: list[tuple[int, int]]
    norm_ranges: list[tuple[int, int]]
    master_is_param: bool


class _BucketAdamW:
    """Shared step logic; subclasses choose the owned range, the norm group and how to publish."""

    def __init__(self, grad_sync: _BucketedGradSync, opt_cfg: OptimizerConfig | None = None,
                 precision: PrecisionConfig | None = None):
        self._check_grad_sync(grad_sync)
        self.grad_sync, self.topo = grad_sync, grad_sync.topo
        self.cfg = opt_cfg or OptimizerConfig()
        self.lr = self.cfg.lr
        self.comm_log = grad_sync.comm_log
        precision = precision or PrecisionConfig()
        self.scaler = DynamicLossScaler.from_config(precision) if precision.fp16 else None
        self.step_count = 0
        self.ranges = [self._make_range(b) for b in grad_sync.buckets]

    def _check_grad_sync(self, grad_sync) -> None:
        pass

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        raise NotImplementedError

    def _norm_group(self):
        raise NotImplementedError

    def _range_params(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """The model's values of bucket elements [lo, hi) (stage 3: the rank's persistent shard)."""
        return bucket.param_data[lo:hi]

    def _publish(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ setup
    def _make_range(self, bucket: Bucket) -> _RangeState:
        lo, hi = self._owned_range(bucket)
        params = self._range_params(bucket, lo, hi)
        is_fp32 = params.dtype == torch.float32
        master = params if is_fp32 else params.detach().float().clone()
        decay, norm = [], []
        for slot in bucket.slots:
            a, b = max(lo, slot.start) - lo, min(hi, slot.end) - lo
            if a >= b:
                continue
            if wants_weight_decay(slot.param):
                decay.append((a, b))
            if self._counts_in_norm(slot):
                norm.append((a, b))
        return _RangeState(bucket, lo, hi, master, torch.zeros_like(master), torch.zeros_like(master),
                           merge_ranges(decay), merge_ranges(norm), is_fp32)

    def _counts_in_norm(self, slot: ParamSlot) -> bool:
        p, topo = slot.param, self.topo
        if not getattr(p, "tensor_parallel", False) and topo.tp_rank != 0:
            return False      # replicated across tp: tp rank 0 counts it
        if getattr(p, "shared_embedding", False) and topo.pp_size > 1 and topo.is_last_stage:
            return False      # the tied embedding is counted on the first stage
        return True

    # ------------------------------------------------------------------- step
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()

    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        """Clip and apply one AdamW step; returns (global grad norm before clipping, skipped)."""
        self.grad_sync.check_synced()
        grads = [self._main_grad(r) for r in self.ranges]
        if self.scaler is not None and self._found_inf(grads):
            old = self.scaler.scale
            self.scaler.update(found_inf=True)
            log.warning("fp16: inf/nan in gradients, skipping step %d; loss scale %g -> %g",
                        self.step_count + 1, old, self.scaler.scale)
            return float("inf"), True
        norm = self.global_grad_norm(grads)
        if self.cfg.clip_grad > 0:
            coef = min(self.cfg.clip_grad / (norm + 1e-6), 1.0)
            for g in grads:
                g.mul_(coef)
        self.step_count += 1
        rs = self.ranges
        adamw_update([r.master for r in rs], grads, [r.exp_avg for r in rs], [r.exp_avg_sq for r in rs],
                     step=self.step_count, lr=self.lr, beta1=self.cfg.adam_beta1, beta2=self.cfg.adam_beta2,
                     eps=self.cfg.adam_eps, weight_decay=self.cfg.weight_decay,
                     decay_ranges=[r.decay_ranges for r in rs])
        self._publish()
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        return norm, False

    def _main_grad(self, r: _RangeState) -> torch.Tensor:
        """fp32, unscaled gradient of the owned range (a view when already fp32, else a copy)."""
        g = self.grad_sync.reduced_grad(r.bucket, r.lo, r.hi)
        g = g if g.dtype == torch.float32 else g.float()
        if self.scaler is not None:
            g.mul_(1.0 / self.scaler.scale)
        return g

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        flag = torch.zeros(1, dtype=torch.float32, device=self.topo.device)
        for g in grads:                      # no host sync per tensor: one .item() at the end
            flag += (~torch.isfinite(g)).any()
        comm.all_reduce(flag, dist.group.WORLD, self.comm_log, "world", op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def global_grad_norm(self, grads: list[torch.Tensor] | None = None) -> float:
        """L2 norm of the whole model's gradient, each element counted once (see module doc)."""
        if grads is None:
            grads = [self._main_grad(r) for r in self.ranges]
        sq = torch.zeros(1, dtype=torch.float64, device=self.topo.device)
        for r, g in zip(self.ranges, grads):
            for a, b in r.norm_ranges:
                sq += torch.linalg.vector_norm(g[a:b]).double() ** 2
        group, tag = self._norm_group()
        comm.all_reduce(sq, group, self.comm_log, tag)
        return math.sqrt(sq.item())

    # ------------------------------------------------------------- checkpoint
    _STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

    def _pieces(self):
        """(slot, range state, a, b): elements [a, b) of the bucket that are this rank's part of slot."""
        for r in self.ranges:
            for slot in r.bucket.slots:
                a, b = max(r.lo, slot.start), min(r.hi, slot.end)
                if a < b:
                    yield slot, r, a, b

    def state_dict(self) -> dict:
        """This rank's optimizer state by parameter name, as flat fp32 pieces::

            {"step": 3, "loss_scaler": {...} | None,
             "params": {"layers.0.mlp.dense_h_to_4h.weight":
                            {"offset": 128, "master": [n], "exp_avg": [n], "exp_avg_sq": [n]}, ...}}

        ``offset`` is where the piece starts in the flattened (tp-local) parameter. The pieces of all
        DP ranks merge into whole tensors (:func:`merge_optimizer_states`); :meth:`load_state_dict`
        takes any pieces covering this rank's part, so a state saved at one dp size / ZeRO stage
        loads into another. Plain tensors, numbers and strings only (safe to ``torch.save``).
        """
        params = {}
        for slot, r, a, b in self._pieces():
            sl = slice(a - r.lo, b - r.lo)
            params[slot.name] = {"offset": a - slot.start,
                                 **{k: getattr(r, k)[sl].clone() for k in self._STATE_KEYS}}
        return {"step": self.step_count, "loss_scaler": self.scaler.state_dict() if self.scaler else None,
                "params": params}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load pieces (e.g. whole tensors at offset 0) and write the masters into the model's
        parameters. A collective over dp for ZeRO stages (the parameter all-gather): call on all ranks."""
        self.step_count = int(state["step"])
        if self.scaler is not None and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
        for slot, r, a, b in self._pieces():
            piece = state["params"].get(slot.name)
            if piece is None:
                raise KeyError(f"optimizer state has no entry for parameter {slot.name!r}: the checkpoint "
                               f"was saved from a different model")
            lo = a - slot.start - int(piece["offset"])
            hi = lo + (b - a)
            if lo < 0 or hi > piece["master"].numel():
                raise ValueError(f"optimizer state for {slot.name!r} covers elements [{piece['offset']}, "
                                 f"{piece['offset'] + piece['master'].numel()}) but this rank needs "
                                 f"[{a - slot.start}, {b - slot.start}): merge the DP ranks' pieces first "
                                 f"(merge_optimizer_states)")
            for k in self._STATE_KEYS:
                getattr(r, k)[a - r.lo:b - r.lo].copy_(piece[k][lo:hi])
        self._publish()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Make the fp32 masters equal the model's parameters again (after the parameters were
        written directly, e.g. by a checkpoint load). A no-op for fp32, where they are the same memory."""
        for r in self.ranges:
            if not r.master_is_param:
                r.master.copy_(r.bucket.param_data[r.lo:r.hi])

    # ------------------------------------------------------------- accounting
    def master_bytes(self) -> int:
        return sum(r.master.numel() * 4 for r in self.ranges if not r.master_is_param)

    def state_bytes(self) -> int:
        return sum((r.exp_avg.numel() + r.exp_avg_sq.numel()) * 4 for r in self.ranges)


class DataParallelOptimizer(_BucketAdamW):
    """Stage 0: every DP rank keeps fp32 masters and Adam state for every parameter."""

    def _check_grad_sync(self, grad_sync) -> None:
        if type(grad_sync) is not AllReduceGradSync:
            raise TypeError("DataParallelOptimizer needs full gradients: use AllReduceGradSync (--zero-stage 0)")

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return 0, bucket.numel

    def _norm_group(self):
        return self.topo.mp_group, "mp"

    def _publish(self) -> None:
        for r in self.ranges:
            if not r.master_is_param:
                r.bucket.param_data[r.lo:r.hi].copy_(r.master)


class ZeroStage1Optimizer(_BucketAdamW):
    """ZeRO-1: rank r keeps fp32 masters and Adam state for shard r of every bucket, steps it and
    all-gathers the updated parameters over dp. Gradients stay full-size (ReduceScatterGradSync, or
    AllReduceGradSync where an all-reduce is the cheaper collective)."""

    def _check_grad_sync(self, grad_sync) -> None:
        if type(grad_sync) not in (ReduceScatterGradSync, AllReduceGradSync):
            raise TypeError("ZeroStage1Optimizer needs ReduceScatterGradSync or AllReduceGradSync (--zero-stage 1)")

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.grad_sync.shard_range(bucket)

    def _norm_group(self):
        return dist.group.WORLD, "world"

    def _publish(self) -> None:
        handles = []
        for r in self.ranges:
            shard = r.bucket.param_data[r.lo:r.hi]
            if not r.master_is_param:
                shard.copy_(r.master)
            handles.append(comm.all_gather(r.bucket.param_data, shard, self.grad_sync.dp_group,
                                           self.comm_log, "dp", async_op=True))
        for h in handles:
            if h is not None:
                h.wait()


class ZeroStage2Optimizer(ZeroStage1Optimizer):
    """ZeRO-2: as stage 1, over gradients that are themselves sharded (ShardedGradSync)."""

    def _check_grad_sync(self, grad_sync) -> None:
        if not isinstance(grad_sync, ShardedGradSync):
            raise TypeError("ZeroStage2Optimizer needs ShardedGradSync (--zero-stage 2)")


OPTIMIZER_BY_STAGE = {0: DataParallelOptimizer, 1: ZeroStage1Optimizer, 2: ZeroStage2Optimizer}


def build_optimizer(grad_sync: _BucketedGradSync, opt_cfg: OptimizerConfig,
                    precision: PrecisionConfig | None = None, stage: int | None = None) -> _BucketAdamW:
    """The optimizer for ``stage`` (default: the grad sync's ``zero_stage``)."""
    stage = grad_sync.cfg.zero_stage if stage is None else stage
    if stage not in OPTIMIZER_BY_STAGE:
        raise ValueError(f"--zero-stage {stage}: only 0, 1 and 2 are implemented")
    return OPTIMIZER_BY_STAGE[stage](grad_sync, opt_cfg, precision)


def merge_optimizer_states(states: list[dict]) -> dict:
    """Merge the ``state_dict()`` of every DP rank (same tp and pp position) into whole flattened
    tensors at offset 0, loadable at any dp size or ZeRO stage."""
    merged: dict[str, dict] = {}
    for state in states:
        for name, piece in state["params"].items():
            merged.setdefault(name, []).append(piece)
    params = {}
    for name, pieces in merged.items():
        pieces.sort(key=lambda p: p["offset"])
        end = 0
        for p in pieces:
            if int(p["offset"]) != end:
                raise ValueError(f"optimizer pieces of {name!r} leave a gap or overlap at element {end}: "
                                 f"pass the state of every DP rank exactly once")
            end += p["master"].numel()
        params[name] = {"offset": 0, **{k: torch.cat([p[k] for p in pieces]) for k in _BucketAdamW._STATE_KEYS}}
    return {"step": states[0]["step"], "loss_scaler": states[0]["loss_scaler"], "params": params}


def model_state_bytes(grad_sync: _BucketedGradSync, optimizer: _BucketAdamW | None = None) -> dict[str, int]:
    """Bytes this rank holds right now in model parameters, gradients, fp32 master weights (only
    those that are separate from the parameters) and optimizer state (Adam m and v), plus the total.
    Padding is included. Measure after ``step()``: that is the steady state between steps.
    ``grads_peak`` (not in the total) is the most gradient memory held at once so far, which for
    stage 2 includes the transient full-size buckets of backward."""
    out = {
        "params": sum(b.numel() * b.element_size() for b in grad_sync.param_buffers),
        "grads": sum(t.numel() * t.element_size() for t in grad_sync.held_grad_tensors()),
        "master_weights": optimizer.master_bytes() if optimizer is not None else 0,
        "optimizer_state": optimizer.state_bytes() if optimizer is not None else 0,
    }
    out["total"] = sum(out.values())
    out["grads_peak"] = grad_sync.peak_grad_bytes
    return out


def zero_paper_bytes(psi: int, n: int, stage: int) -> float:
    """Model-state bytes per rank in the ZeRO paper for mixed-precision Adam (K = 12):
    stage 0: 2Ψ + 2Ψ + 12Ψ; stage 1: 4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N."""
    return {0: 16.0 * psi, 1: 4.0 * psi + 12.0 * psi / n, 2: 2.0 * psi + 14.0 * psi / n,
            3: 16.0 * psi / n}[stage]


class ZeroEngine:
    """What the training loop drives each step: the gradient sync and the optimizer, together.

        engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
        engine.zero_grad()
        losses = run_schedule(chunks, micro_batches, topo, loss_scale=engine.loss_scale, grad_sync=engine)
        engine.finalize_grads()
        grad_norm, skipped = engine.step()
    """

    def __init__(self, grad_sync: _BucketedGradSync, optimizer: _BucketAdamW):
        self.grad_sync, self.optimizer = grad_sync, optimizer
        self.comm_log = grad_sync.comm_log

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        self.grad_sync.before_backward(chunk_id, is_last_microbatch)

    def finalize_grads(self) -> None:
        self.grad_sync.finalize_grads()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, bool]:
        return self.optimizer.step()

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    def model_state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self.grad_sync, self.optimizer)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        """Inside: every parameter of the chunks holds its full tp-local value (stages 0-2 always do).
        With ``write_back``, on a normal exit the parameters become the truth: the fp32 masters are
        refreshed from them (matters for bf16/fp16). Call on every rank (stage 3 gathers here)."""
        yield
        if write_back:
            self.optimizer.refresh_masters()


def build_engine(chunks, topo, zero_cfg, opt_cfg: OptimizerConfig, precision: PrecisionConfig | None = None,
                 *, grad_sync_cls: type | None = None) -> ZeroEngine:
    """Wrap this rank's model chunks for ``zero_cfg.zero_stage`` and build the matching optimizer.
    Build it after the model and before the first forward: parameters move into the DP buffers.
    ``grad_sync_cls``: see :func:`megazero.parallel.data.wrap_data_parallel`. Stage 3 returns a
    :class:`megazero.parallel.zero3.ZeroStage3Engine`."""
    from megazero.parallel.data import wrap_data_parallel

    if zero_cfg.keep_params_gathered and zero_cfg.zero_stage != 3:
        raise ValueError(f"--zero3-keep-params-gathered applies to --zero-stage 3 only (got stage "
                         f"{zero_cfg.zero_stage}): drop the flag or use stage 3")
    if zero_cfg.zero_stage == 3:
        if grad_sync_cls is not None:
            raise ValueError("grad_sync_cls applies to ZeRO stages 0-2, not --zero-stage 3")
        from megazero.parallel.zero3 import build_stage3_engine
        return build_stage3_engine(chunks, topo, zero_cfg, opt_cfg, precision)

    grad_sync = wrap_data_parallel(chunks, topo, zero_cfg, grad_sync_cls=grad_sync_cls)
    return ZeroEngine(grad_sync, build_optimizer(grad_sync, opt_cfg, precision))
