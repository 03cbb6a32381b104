"""The ZeRO optimizer: AdamW (or, under ``--optimizer muon``, Muon for the layers' matrices and AdamW for the
rest: :mod:`.muon`) with fp32 master weights over every bucket group of the engine, with global-norm clipping
and fp16 loss scaling; one optimizer, one loss scaler and one global norm for the dense parameters and the
experts alike.

Who holds what (dp = N ranks, one bucket of 2N elements, rank r owns elements [2r, 2r + 2)); the stage's
policy object (:mod:`.publish`) says which::

    stage   grads after the sync      fp32 master + Adam m, v     after step
    0       all N: full bucket        all N: full bucket           copy master -> params
    1       full buffer, shard valid  rank r: its shard only       copy shard, all-gather
    2       rank r: its shard only    rank r: its shard only       copy shard, all-gather
    3       rank r: its shard only    rank r: its shard only       copy into the param shard

:class:`BucketAdamW` steps one (bucket, owned range) at a time: unscale (fp16) -> inf/nan check over all
ranks (skip + shrink the scale on overflow) -> global gradient norm -> clip -> AdamW on the flat fp32
range -> publish the new weights to the model. Each range belongs to one grad sync (a bucket group with
its own data-parallel group: dense parameters over dp, experts over the expert-data-parallel group).
With fp32 parameters the "master" of a range *is* the model's parameter buffer (a view: no copy, no
extra memory); with bf16/fp16 it is a separate fp32 tensor.

Where the fp32 state lives is the job of a state object: :class:`ResidentState` keeps it on the
device beside the parameters; ``--offload-optimizer cpu / nvme`` keeps it in host memory or in a swap
file and runs the update there (:mod:`megazero.parallel.zero.offload`). The step's logic above is the
same for both.

Global norm: every element of the full model is counted exactly once across the world. Each rank sums
the squares of the gradient elements it holds that :func:`megazero.parallel.params.counts_once` picks (a
tp shard on every tp rank, a replicated parameter on tp rank 0, a ``tied_copy`` nowhere), per bucket
group, divides each group's sum by the ranks holding the same elements (stage 0: its dp size; sharded
stages: 1) and the sum over the world is the square of the norm. With a single bucket group at stage 0
the replicas are skipped instead: the sum runs over the model-parallel group only (tp x pp).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero.config import OptimizerConfig, PrecisionConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.groups import ModelReplica
from megazero.parallel.params import attribute, counts_once
from megazero.parallel.zero.adamw import adamw_update, complement_ranges, decays, merge_ranges
from megazero.parallel.zero.buckets import Bucket
from megazero.parallel.zero.grad_norm import squared_norms
from megazero.parallel.zero.grad_sync import BucketedGradSync
from megazero.parallel.zero.muon import Muon
from megazero.parallel.zero.offload import (
    DelayedUpdate,
    OffloadedOptimizerState,
    build_optimizer_state,
)
from megazero.parallel.zero.publish import Replicated
from megazero.parallel.zero.swap import SwapDir
from megazero.precision import DynamicLossScaler

log = logging.getLogger(__name__)


@dataclass
class RangeState:
    """Optimizer state of elements [lo, hi) of one bucket of grad sync ``sync`` (ranges below are
    relative to lo).

    ``master``, ``exp_avg``, ``exp_avg_sq``: the fp32 tensors where they are in memory (on the device, or
    on the host with ``--offload-optimizer cpu``); None when they live in a swap file. ``param_fp32``: the
    parameters are fp32, so the masters equal them bitwise and are not stored in checkpoints;
    ``master_is_param``: moreover the master *is* the parameter memory. ``decoupled_ranges``: the elements of
    parameters marked ``embedding_or_output``, which step at ``--decoupled-lr`` when it is given."""

    sync: BucketedGradSync
    bucket: Bucket
    lo: int
    hi: int
    master: torch.Tensor | None
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    decay_ranges: list[tuple[int, int]]
    norm_ranges: list[tuple[int, int]]
    master_is_param: bool
    param_fp32: bool = False
    decoupled_ranges: list[tuple[int, int]] = field(default_factory=list)   # embedding / output: --decoupled-lr


class ResidentState:
    """The fp32 masters and Adam moments on the device, beside the parameters (no offload).

    The protocol :class:`BucketAdamW` drives (``offload.OffloadedOptimizerState`` is the other side):
    ``views(k)`` range k's state tensors, ``main_grads()`` the fp32 reduced gradients, ``update(...)`` AdamW
    and the new parameters stored with ``write``, ``write_params(write)`` parameters from the masters,
    ``set_masters(k, values)``, ``offloaded_bytes()``, ``close()``."""

    def __init__(self, opt: BucketAdamW):
        self.opt = opt
        for k, r in enumerate(opt.ranges):
            params = opt.range_params(r)
            on_device = r.sync.params.on_device
            r.master_is_param = r.param_fp32 and on_device
            if r.master_is_param:
                r.master = params
            else:
                device = params.device if on_device else opt.device
                r.master = torch.empty(r.hi - r.lo, dtype=torch.float32, device=device)
                r.master.copy_(params)
            r.exp_avg, r.exp_avg_sq = torch.zeros_like(r.master), torch.zeros_like(r.master)

    def views(self, k: int) -> dict[str, torch.Tensor]:
        r = self.opt.ranges[k]
        return {"master": r.master, "exp_avg": r.exp_avg, "exp_avg_sq": r.exp_avg_sq}

    def main_grads(self) -> list[torch.Tensor]:
        """fp32 reduced gradient of every owned range (a view when already fp32, else a copy)."""
        return [g if g.dtype == torch.float32 else g.float() for g in self.opt.reduced_grads()]

    def update(self, grads: list[torch.Tensor], decay_ranges: list[list[tuple[int, int]]], *, write,
               **hyper) -> None:
        rs = self.opt.ranges
        adamw_update([r.master for r in rs], grads, [r.exp_avg for r in rs], [r.exp_avg_sq for r in rs],
                     decay_ranges=decay_ranges, **hyper)
        self.write_params(write)

    def write_params(self, write) -> None:
        for k, r in enumerate(self.opt.ranges):
            if not r.master_is_param:
                write(k, 0, r.hi - r.lo, r.master)

    def set_masters(self, k: int, values: torch.Tensor) -> None:
        r = self.opt.ranges[k]
        if not r.master_is_param:
            r.master.copy_(values)

    def offloaded_bytes(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class BucketAdamW:
    """AdamW over the owned ranges of every bucket of ``syncs`` (the engine's bucket groups).

    ``publish``: the stage's policy (:mod:`.publish`; default stage 0's). ``replica``: the
    model-parallel group the unsharded optimizer of a single bucket group sums its norm over.
    ``swap``: where ``--offload-optimizer nvme`` keeps its file."""

    def __init__(self, syncs: BucketedGradSync | list[BucketedGradSync], opt_cfg: OptimizerConfig | None = None,
                 precision: PrecisionConfig | None = None, *, publish=None, replica: ModelReplica | None = None,
                 swap: SwapDir | None = None):
        self.syncs = list(syncs) if isinstance(syncs, (list, tuple)) else [syncs]
        first = self.syncs[0]
        self.device, self.comm_log = first.dp.device, first.comm_log
        self.tp_rank = first.tp.rank
        self.publish = publish if publish is not None else Replicated(self.syncs)
        self.replica = replica
        self.cfg = opt_cfg or OptimizerConfig()
        self.lr, self.decoupled_lr = self.cfg.lr, self.cfg.decoupled_lr
        precision = precision or PrecisionConfig()
        self.scaler = DynamicLossScaler.from_config(precision) if precision.fp16 else None
        self.precision_name = precision.dtype_name
        self.step_count = 0
        self.params_overflowed = False      # the last applied step's cast gave a non-finite fp16/bf16 value here
        self.ranges = [self._make_range(sync, b) for sync in self.syncs for b in sync.buckets]
        self._index_of = {id(r.bucket): k for k, r in enumerate(self.ranges)}
        self.muon = Muon(self, self.cfg) if self.cfg.muon else None
        self._adam_ranges = None if self.muon is None else \
            [complement_ranges(self.muon.ranges(k), r.hi - r.lo) for k, r in enumerate(self.ranges)]
        self.states = self._build_states(first.cfg, swap)
        self.delayed = DelayedUpdate(self.states) if first.cfg.offload_delayed_update else None

    def _build_states(self, zero_cfg, swap: SwapDir | None):
        """Where the fp32 state lives: on the device, or (``--offload-optimizer``) on the host / NVMe,
        with the reduced gradients copied there as they land."""
        where = zero_cfg.offload_optimizer
        if where == "none":
            return ResidentState(self)
        dtype = self.ranges[0].bucket.param_data.dtype if self.ranges else torch.float32
        grad_dtype = self.syncs[0].grad_dtype(dtype)
        on_host = self.device.type == "cpu" and grad_dtype == torch.float32
        states = build_optimizer_state(where, [r.hi - r.lo for r in self.ranges], self.device, dtype,
                                       zero_cfg.offload_sub_group_size, zero_cfg.offload_pin_memory, swap,
                                       device_grads=self.reduced_grads if on_host else None)
        for k, r in enumerate(self.ranges):
            states.set_masters(k, self.range_params(r))
            r.master, r.exp_avg, r.exp_avg_sq = states.host_views(k)
        for sync in self.syncs:
            sync.on_reduced = self._grad_landed
        return states

    def reduced_grads(self) -> list[torch.Tensor]:
        """The reduced gradient of every owned range, as views of the gradient buffers."""
        return [r.sync.reduced_grad(r.bucket, r.lo, r.hi) for r in self.ranges]

    def _grad_landed(self, bucket: Bucket, lo: int, hi: int) -> None:
        """The reduced gradient of bucket elements [lo, hi) changed: copy the owned part to the host."""
        k = self._index_of.get(id(bucket))
        if k is None:
            return
        r = self.ranges[k]
        a, b = max(lo, r.lo), min(hi, r.hi)
        if a < b:
            self.states.copy_grad(k, a - r.lo, b - r.lo, r.sync.reduced_grad(bucket, a, b))

    @property
    def offloaded(self) -> bool:
        return isinstance(self.states, OffloadedOptimizerState)

    def range_params(self, r: RangeState) -> torch.Tensor:
        """The model's values of range ``r``'s elements, from its grad sync's parameter component (stage 3:
        the rank's persistent shard)."""
        return r.sync.params.values(r.bucket, r.lo, r.hi)

    def _write_params(self, k: int, a: int, b: int, values: torch.Tensor) -> None:
        """Store ``values`` as the parameters of range k's elements [a, b) (relative to the range)."""
        r = self.ranges[k]
        r.sync.params.write(r.bucket, r.lo + a, r.lo + b, values)

    def wait_params(self) -> None:
        """Return once the parameters hold the last step's values (stages 1-2 with
        ``--overlap-param-gather`` may still be gathering them; ``--offload-delayed-update``: its pending
        update is applied now). A collective where publishing is (every rank calls it)."""
        if self.delayed is not None:
            self.publish.before_write()
            if self.delayed.settle():
                self.states.write_params(self._write_params)
                self.publish.share(self.ranges)
        self.publish.wait()

    def _publish(self) -> None:
        """Parameters from the masters, then shared (after a state was loaded)."""
        self.publish.before_write()
        self.states.write_params(self._write_params)
        self.publish.share(self.ranges)

    # ------------------------------------------------------------------ setup
    def _make_range(self, sync: BucketedGradSync, bucket: Bucket) -> RangeState:
        """The range's bookkeeping; its tensors come from the state object (``_build_states``)."""
        lo, hi = self.publish.owned_range(sync, bucket)
        is_fp32 = bucket.param_data.dtype == torch.float32
        decay, norm, decoupled = [], [], []
        for slot in bucket.slots:
            a, b = max(lo, slot.start) - lo, min(hi, slot.end) - lo
            if a >= b:
                continue
            if decays(slot.shape):
                decay.append((a, b))
            if counts_once(slot.param, self.tp_rank):
                norm.append((a, b))
            if attribute(slot.param, "embedding_or_output"):
                decoupled.append((a, b))
        return RangeState(sync, bucket, lo, hi, None, None, None, merge_ranges(decay), merge_ranges(norm), False,
                          is_fp32, merge_ranges(decoupled))

    # ------------------------------------------------------------------- step
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """This step's learning rate; ``decoupled_lr`` that of the ``embedding_or_output`` parameters (None:
        they follow ``lr``)."""
        self.lr, self.decoupled_lr = lr, decoupled_lr

    def zero_grad(self) -> None:
        for sync in self.syncs:
            sync.zero_grad()

    @torch.no_grad()
    def step(self, iteration: int | None = None) -> tuple[float, bool]:
        """Clip and apply one AdamW step over every bucket group; returns (global grad norm before
        clipping, skipped). ``iteration``: the training iteration, for the messages (default: the
        optimizer's own count of applied steps + 1).

        A step whose gradients are not finite is never applied: under fp16 the loss scale is lowered
        (the usual overflow, found in any bucket group on any rank), in bf16 and fp32 the step is
        reported skipped with its norm (inf or nan) and the trainer decides whether the run stops
        (``--check-for-nan-in-loss-and-grad``). Every rank takes the same decision: the norm and the
        overflow flag are global.

        After an applied step with fp16/bf16 parameters, :attr:`params_overflowed` says whether a
        parameter this rank wrote is not finite (its fp32 master is beyond what the type holds): a
        local flag the trainer combines over the ranks."""
        for sync in self.syncs:
            sync.check_synced()
        where = f"iteration {iteration}" if iteration is not None else f"optimizer step {self.step_count + 1}"
        grads = self._main_grads()
        if self.scaler is not None and self._found_inf(grads):
            old = self.scaler.scale
            self.scaler.update(found_inf=True)
            log.warning("%s: %s gradients overflowed (inf/nan): step skipped; loss scale %g -> %g",
                        where, self.precision_name, old, self.scaler.scale)
            return float("inf"), True
        norm = self.global_grad_norm(grads)
        if not math.isfinite(norm):
            log.warning("%s: %s gradient norm %s is not finite: step not applied", where, self.precision_name, norm)
            return norm, True
        if self.cfg.clip_grad > 0:
            coef = min(self.cfg.clip_grad / (norm + 1e-6), 1.0)
            torch._foreach_mul_(grads, coef)     # one kernel for every range; bitwise each range's mul_
        self.step_count += 1
        self.publish.before_write()
        if self.delayed is not None:
            return self._delayed_step(grads, norm)
        muon = {}
        if self.muon is not None:
            self.muon.step(grads, [r.master for r in self.ranges], [r.exp_avg for r in self.ranges], lr=self.lr,
                           weight_decay=self.cfg.weight_decay)
            muon = {"only_ranges": self._adam_ranges}
        self.states.update(grads, [r.decay_ranges for r in self.ranges], write=self._write_params, **muon,
                           step=self.step_count, lr=self.lr, decoupled_lr=self.decoupled_lr,
                           decoupled_ranges=[r.decoupled_ranges for r in self.ranges],
                           beta1=self.cfg.adam_beta1, beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps,
                           weight_decay=self.cfg.weight_decay)
        self.publish.share(self.ranges)
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        self.params_overflowed = self._local_params_overflowed()
        return norm, False

    def _delayed_step(self, grads: list[torch.Tensor], norm: float) -> tuple[float, bool]:
        """:meth:`step` under ``--offload-delayed-update`` (:class:`DelayedUpdate`): the previous step's update
        becomes the parameters, then this step's starts in the background."""
        if self.delayed.settle():
            self.states.write_params(self._write_params)
            self.publish.share(self.ranges)
            self.params_overflowed = self._local_params_overflowed()
        else:
            self.params_overflowed = False
        self.delayed.launch(grads, decay_ranges=[r.decay_ranges for r in self.ranges], step=self.step_count,
                            lr=self.lr, decoupled_lr=self.decoupled_lr,
                            decoupled_ranges=[r.decoupled_ranges for r in self.ranges], beta1=self.cfg.adam_beta1,
                            beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps, weight_decay=self.cfg.weight_decay)
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        return norm, False

    def _local_params_overflowed(self) -> bool:
        """Whether an fp16/bf16 parameter value this rank owns (and has just written) is not finite.
        Parameters kept off the device (ZeRO-3 ``--offload-params``) are left to the checkpoint's check."""
        ranges = [r for r in self.ranges if not r.param_fp32 and r.sync.params.on_device]
        if not ranges:
            return False
        # The largest magnitude of each range (one foreach kernel for them all): inf or nan where a value is.
        values = [self.range_params(r) for r in ranges]
        largest = torch._foreach_norm([v for v in values if v.numel()], float("inf"))
        return bool(largest) and not bool(torch.isfinite(torch.stack(largest).to(self.device)).all())

    def _main_grads(self) -> list[torch.Tensor]:
        """fp32, unscaled gradient of every owned range (where the state lives: the device or the host)."""
        grads = self.states.main_grads()
        if self.scaler is not None:
            for g in grads:
                g.mul_(1.0 / self.scaler.scale)
        return grads

    def _grads_device(self, grads: list[torch.Tensor]) -> torch.device:
        return grads[0].device if grads else self.device

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        flag = torch.zeros(1, dtype=torch.float32, device=self._grads_device(grads))
        for g in grads:                      # no host sync per tensor: one .item() at the end
            flag += (~torch.isfinite(g)).any()
        flag = flag.to(self.device)
        comm.all_reduce(flag, dist.group.WORLD, self.comm_log, "world", op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def global_grad_norm(self, grads: list[torch.Tensor] | None = None) -> float:
        """L2 norm of the whole model's gradient, each element counted once (see module doc)."""
        if grads is None:
            grads = self._main_grads()
        if not self.publish.sharded and len(self.syncs) == 1:       # replicated over dp: sum over tp x pp
            sq = self.local_norm_sq(grads, self.syncs[0])
            comm.all_reduce(sq, self.replica.group if self.replica else None, self.comm_log, "mp")
            return math.sqrt(sq.item())
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for sync in self.syncs:
            sq += self.local_norm_sq(grads, sync) / self.publish.replicas(sync)
        comm.all_reduce(sq, dist.group.WORLD, self.comm_log, "world")
        return math.sqrt(sq.item())

    def local_norm_sq(self, grads: list[torch.Tensor], sync: BucketedGradSync) -> torch.Tensor:
        """Squared L2 norm (float64, [1], on this rank's device) of the gradients of ``sync``'s owned
        ranges that count once (see the module doc), before any sum over ranks."""
        sq = torch.zeros(1, dtype=torch.float64, device=self._grads_device(grads))
        pieces = [g[a:b] for r, g in zip(self.ranges, grads) if r.sync is sync for a, b in r.norm_ranges]
        for value in squared_norms(pieces):         # summed in range order, one range at a time
            sq += value
        return sq.to(self.device)

    def nonfinite_parameters(self, limit: int = 3, everywhere: bool = False) -> list[str]:
        """Names of (at most ``limit``) parameters whose reduced gradient held on this rank is not
        finite: what a stopped run names, dense or expert alike. Cheap: one pass over the rank's shards.
        ``everywhere``: the first ``limit`` over all ranks, in rank order (a collective: every rank calls
        it), so rank 0 can name a gradient only another rank holds (an expert, or another shard)."""
        names = []
        for slot, r, a, b in self._pieces():
            g = r.sync.reduced_grad(r.bucket, a, b)
            if not bool(torch.isfinite(g).all()) and slot.name not in names:
                names.append(slot.name)
                if len(names) == limit:
                    break
        if not everywhere or not dist.is_initialized():
            return names
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, names)
        merged = []
        for rank_names in per_rank:
            merged += [n for n in rank_names if n not in merged]
        return merged[:limit]

    # ------------------------------------------------------------- checkpoint
    _STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

    def state_views(self, bucket: Bucket, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Views of the optimizer state of bucket elements [lo, hi) (inside this rank's range):
        ``exp_avg``, ``exp_avg_sq`` and, when the fp32 masters are not the parameters themselves,
        ``master``."""
        k = self._index_of[id(bucket)]
        r = self.ranges[k]
        if lo < r.lo or hi > r.hi:
            raise IndexError(f"the optimizer holds bucket elements [{r.lo}, {r.hi}), asked for [{lo}, {hi})")
        keys = self._STATE_KEYS[1:] if r.param_fp32 else self._STATE_KEYS
        views = self.states.views(k)
        return {key: views[key][lo - r.lo:hi - r.lo] for key in keys}

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
            views = self.states.views(self._index_of[id(r.bucket)])
            params[slot.name] = {"offset": a - slot.start,
                                 **{k: views[k][sl].clone() for k in self._STATE_KEYS}}
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
            views = self.states.views(self._index_of[id(r.bucket)])
            for k in self._STATE_KEYS:
                views[k][a - r.lo:b - r.lo].copy_(piece[k][lo:hi])
        self._publish()

    @torch.no_grad()
    def refresh_masters(self, fp32_only: bool = False) -> None:
        """Make the fp32 masters equal the model's parameters again (after the parameters were
        written directly, e.g. by a checkpoint load). A no-op where they are the same memory.
        ``fp32_only``: only where the parameters are fp32 (a checkpoint holds no masters for them)."""
        for k, r in enumerate(self.ranges):
            if not r.master_is_param and (r.param_fp32 or not fp32_only):
                self.states.set_masters(k, self.range_params(r))

    def close(self) -> None:
        """Stop the offload I/O threads and the overlapped gathers (the swap files belong to the engine). A
        delayed update still pending is waited for and dropped (a save applies it first)."""
        if self.delayed is not None:
            self.delayed.settle()
            self.delayed.close()
        self.publish.close()
        self.states.close()

    # ------------------------------------------------------------- accounting
    def master_bytes(self) -> int:
        """Device bytes of fp32 masters that are separate from the parameters."""
        if self.offloaded:
            return 0
        return sum(r.master.numel() * 4 for r in self.ranges if not r.master_is_param)

    def state_bytes(self) -> int:
        """Device bytes of the Adam moments."""
        if self.offloaded:
            return 0
        return sum((r.exp_avg.numel() + r.exp_avg_sq.numel()) * 4 for r in self.ranges)

    def offloaded_bytes(self) -> dict[str, int]:
        """Host and NVMe bytes of the offloaded state (``host_*`` / ``nvme_*`` keys)."""
        out = self.states.offloaded_bytes()
        if self.delayed is not None:
            out["host_delayed_grads"] = 4 * sum(r.hi - r.lo for r in self.ranges)
        return out

    @property
    def offload_stats(self):
        """Time and bytes of the offloaded work (``offload.OffloadStats``), None without offload."""
        return getattr(self.states, "stats", None)


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
        params[name] = {"offset": 0, **{k: torch.cat([p[k] for p in pieces]) for k in BucketAdamW._STATE_KEYS}}
    return {"step": states[0]["step"], "loss_scaler": states[0]["loss_scaler"], "params": params}

