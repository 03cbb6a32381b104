"""The ZeRO engine: what the training loop drives each step, for every stage, and its accounting.

    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    engine.zero_grad()
    losses = run_schedule(chunks, micro_batches, topo, loss_fn=..., loss_scale=engine.loss_scale, grad_sync=engine)
    engine.finalize_grads()
    grad_norm, skipped = engine.step()

Files below this one, each importing only those above it in this list: ``buckets`` (flat layout),
``offload`` (state kept in host memory or swap files), ``grad_sync`` (stages 0-2: gradient buckets and
their reduction), ``units`` (the ZeRO-3 gather units a model declares), ``param_sync`` (stage 3:
parameters sharded and gathered per unit), ``quantize`` and ``zeropp`` (ZeRO++: int8 collectives, hpZ's
secondary shards, the hierarchical gradient reduce), ``optimizer`` (AdamW over the owned shard of every bucket),
``stages`` (each stage's optimizer: owned range, norm group, publishing), ``experts`` (MoE experts over the
expert-data-parallel group: two engines in one).

With ``--offload-optimizer`` / ``--offload-params`` nvme the engine owns this rank's swap directory:
``engine.close()`` removes it (so does interpreter exit).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero.buckets import nbytes
from megazero.parallel.zero.experts import (ExpertDataTopology, ExpertParallelEngine, dense_view, expert_view,
                                            is_expert)
from megazero.parallel.zero.grad_sync import BucketedGradSync, wrap_data_parallel
from megazero.parallel.zero.swap import SwapDir
from megazero.parallel.zero.optimizer import BucketAdamW
from megazero.parallel.zero.stages import ZeroStage3Optimizer, build_optimizer
from megazero.parallel.zero.param_sync import ShardedParamSync
from megazero.parallel.zero.zeropp import MicrobatchQuantizedGradSync, QuantizedGradSync, ZeroPlusPlusParamSync


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


OFFLOADED_KEYS = {"host": ("params", "grads", "master_weights", "optimizer_state", "buffers"),
                  "nvme": ("params", "master_weights", "optimizer_state")}


def model_state_bytes(grad_sync: BucketedGradSync, optimizer: BucketAdamW | None = None) -> dict[str, int]:
    """Bytes this rank holds right now in model parameters, gradients, fp32 master weights (only
    those that are separate from the parameters) and optimizer state (Adam m and v), plus the total.
    Padding is included. Measure after ``step()``: that is the steady state between steps.
    ``grads_peak`` (not in the total) is the most gradient memory held at once so far, which for
    stage 2 includes the transient full-size buckets of backward.

    These are device bytes. What offloading keeps elsewhere is counted apart, by the same names:
    ``host_params``, ``host_grads`` (the fp32 gradient copy), ``host_master_weights``,
    ``host_optimizer_state``, ``host_buffers`` (staging and swap buffers), ``host_total``, and
    ``nvme_params``, ``nvme_master_weights``, ``nvme_optimizer_state``, ``nvme_total`` (all 0 without
    offload; on a CPU run "device" and "host" are the same memory, counted apart all the same)."""
    out = {
        "params": sum(nbytes(b) for b in grad_sync.param_buffers),
        "grads": sum(nbytes(t) for t in grad_sync.held_grad_tensors()),
        "master_weights": optimizer.master_bytes() if optimizer is not None else 0,
        "optimizer_state": optimizer.state_bytes() if optimizer is not None else 0,
    }
    out["total"] = sum(out.values())
    out["grads_peak"] = grad_sync.peak_grad_bytes
    offloaded = {**grad_sync.offloaded_bytes(), **(optimizer.offloaded_bytes() if optimizer is not None else {})}
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
    """What the training loop drives each step: the gradient sync and the optimizer, together
    (the protocol in the module docstring)."""

    def __init__(self, grad_sync: BucketedGradSync, optimizer: BucketAdamW, swap: SwapDir | None = None):
        self.grad_sync, self.optimizer = grad_sync, optimizer
        self.comm_log = grad_sync.comm_log
        self.swap = swap

    def close(self) -> None:
        """Stop the offload I/O threads and remove the swap files (a no-op without offload). The engine
        is unusable afterwards."""
        self.optimizer.close()
        self.grad_sync.close()
        if self.swap is not None:
            self.swap.close()

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
        self.optimizer.wait_params()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.wait_params()
        self.optimizer.load_state_dict(state)

    def _pieces(self, ranges, weights: bool, optimizer: bool) -> list[StatePiece]:
        out = []
        for bucket, lo, hi in ranges:
            for slot in bucket.slots:
                a, b = max(lo, slot.start), min(hi, slot.end)
                if a >= b:
                    continue
                tensors = {"model": self.grad_sync.param_values(bucket, a, b)} if weights else {}
                if optimizer:
                    tensors.update(self.optimizer.state_views(bucket, a, b))
                out.append(StatePiece(slot.name, slot.param, slot.shape, a - slot.start, b - slot.start, tensors))
        return out

    def saved_pieces(self) -> list[StatePiece]:
        """What this rank writes to a checkpoint: for every bucket, its data-parallel shard of the
        elements, weights and optimizer state (at stage 0 too: replicated state is written once,
        split over the dp ranks, in parallel)."""
        self.optimizer.wait_params()
        return self._pieces([(b, *self.grad_sync.shard_range(b)) for b in self.grad_sync.buckets], True, True)

    def loaded_pieces(self, weights_only: bool = False) -> list[StatePiece]:
        """What this rank fills from a checkpoint: the weights it holds (stages 0-2 whole tp-local
        parameters, stage 3 its shard) and, unless ``weights_only``, the optimizer state it owns."""
        self.optimizer.wait_params()
        sync = self.grad_sync
        weight_ranges = [(b, *(sync.shard_range(b) if isinstance(sync, ShardedParamSync) else (0, b.numel)))
                         for b in sync.buckets]
        pieces = self._pieces(weight_ranges, True, False)
        if not weights_only:
            pieces += self._pieces([(r.bucket, r.lo, r.hi) for r in self.optimizer.ranges], False, True)
        return pieces

    def loaded(self, step: int, loss_scaler: dict | None, weights_only: bool) -> None:
        """After the pieces were filled: the optimizer's step count and loss scaler, or (weights only)
        fresh fp32 masters from the loaded weights."""
        if weights_only:
            self.optimizer.refresh_masters()
            return
        self.optimizer.refresh_masters(fp32_only=True)     # a checkpoint has no masters of fp32 parameters
        self.optimizer.step_count = int(step)
        if self.optimizer.scaler is not None and loss_scaler:
            self.optimizer.scaler.load_state_dict(loss_scaler)

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        """Inside: every parameter of the chunks holds its full tp-local value (stages 0-2 always do).
        With ``write_back``, on a normal exit the parameters become the truth: the fp32 masters are
        refreshed from them (matters for bf16/fp16). Call on every rank (stage 3 gathers here)."""
        self.optimizer.wait_params()
        yield
        if write_back:
            self.optimizer.refresh_masters()


class ZeroStage3Engine(ZeroEngine):
    """The ZeroEngine protocol for stage 3; adds the gathered-parameter figures to the accounting
    and :meth:`gathered_parameters` for code that reads or writes whole parameters."""

    def model_state_bytes(self) -> dict[str, int]:
        """As for stages 0-2 (``params`` = this rank's shards), plus the temporaries: ``gathered_params``
        (now), ``gathered_params_peak`` bytes and ``gathered_units_peak`` units gathered at once so far."""
        out = model_state_bytes(self.grad_sync, self.optimizer)
        out["gathered_params"] = self.grad_sync.gathered_bytes
        out["gathered_params_peak"] = self.grad_sync.gathered_bytes_peak
        out["gathered_units_peak"] = self.grad_sync.live_units_peak
        out["hpz_secondary_params"] = getattr(self.grad_sync, "secondary_bytes", int)()   # within params
        return out

    def loaded(self, step: int, loss_scaler: dict | None, weights_only: bool) -> None:
        """As for stages 0-2; gathered copies of the old values (if any) are dropped first."""
        self.grad_sync.release_all()
        super().loaded(step, loss_scaler, weights_only)

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        """Inside: every parameter holds its full tp-local value (a collective over dp: all ranks).
        ``write_back=True``: on a normal exit the (possibly modified in place) values become the
        truth -- each rank copies its slice into its shard and refreshes its fp32 masters."""
        newly = self.grad_sync.gather_all()
        ok = False
        try:
            yield
            ok = True
        finally:
            if ok and write_back:
                self.grad_sync.write_back()
                self.optimizer.refresh_masters()
            for u in newly:
                self.grad_sync.release(u)


def _build_stage3_engine(chunks, topo: Topology, zero_cfg: ZeroConfig, opt_cfg: OptimizerConfig,
                         precision: PrecisionConfig | None = None, swap: SwapDir | None = None) -> ZeroStage3Engine:
    """Shard this rank's chunks over dp (parameters move into shards: build after the model,
    before the first forward) and build the stage-3 optimizer."""
    zeropp = zero_cfg.quantized_weights or zero_cfg.hpz_partition_size > 1 or zero_cfg.quantized_gradients
    sync = (ZeroPlusPlusParamSync if zeropp else ShardedParamSync)(chunks, topo, zero_cfg, swap=swap)
    optimizer = ZeroStage3Optimizer(sync, opt_cfg, precision, swap=swap)
    sync.reset_peaks()
    return ZeroStage3Engine(sync, optimizer, swap)


def _swap_dir(zero_cfg: ZeroConfig, topo: Topology) -> SwapDir | None:
    """This rank's swap directory under --nvme-path when anything is offloaded to nvme."""
    if "nvme" not in (zero_cfg.offload_optimizer, zero_cfg.offload_params):
        return None
    if not zero_cfg.nvme_path:
        raise ValueError("offloading to nvme needs --nvme-path DIR")
    return SwapDir(zero_cfg.nvme_path, topo.rank)


def build_engine(chunks, topo: Topology, zero_cfg: ZeroConfig, opt_cfg: OptimizerConfig,
                 precision: PrecisionConfig | None = None, *, grad_sync_cls: type | None = None) -> ZeroEngine:
    """Wrap this rank's model chunks for ``zero_cfg.zero_stage`` and build the matching optimizer.
    Build it after the model and before the first forward: parameters move into the DP buffers.
    ``grad_sync_cls``: see :func:`megazero.parallel.zero.grad_sync.wrap_data_parallel`.

    With expert parallelism (``topo.ep_size > 1`` and MoE experts in the chunks) the result is an
    :class:`~megazero.parallel.zero.experts.ExpertParallelEngine`: the same stage twice, the dense
    parameters over dp and the experts over the expert-data-parallel group."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if getattr(topo, "ep_size", 1) > 1 and any(is_expert(p) for c in chunks for p in c.parameters()):
        if "nvme" in (zero_cfg.offload_optimizer, zero_cfg.offload_params):
            raise ValueError("--offload-optimizer/--offload-params nvme with --expert-model-parallel-size > 1 "
                             "is not supported: offload to cpu or drop expert parallelism")
        dense = _build_one(dense_view(chunks), topo, zero_cfg, opt_cfg, precision, grad_sync_cls)
        experts = _build_one(expert_view(chunks), ExpertDataTopology(topo), zero_cfg, opt_cfg,
                             precision, grad_sync_cls)
        for part in (experts.grad_sync, experts.optimizer, experts):   # one byte log for the step
            part.comm_log = dense.comm_log
        return ExpertParallelEngine(dense, experts, topo)
    return _build_one(chunks, topo, zero_cfg, opt_cfg, precision, grad_sync_cls)


def _build_one(chunks, topo, zero_cfg: ZeroConfig, opt_cfg: OptimizerConfig, precision: PrecisionConfig | None,
               grad_sync_cls: type | None) -> ZeroEngine:
    """One engine of ``zero_cfg.zero_stage`` over the chunks' parameters and ``topo``'s dp group."""
    if zero_cfg.keep_params_gathered and zero_cfg.zero_stage != 3:
        raise ValueError(f"--zero3-keep-params-gathered applies to --zero-stage 3 only (got stage "
                         f"{zero_cfg.zero_stage}): drop the flag or use stage 3")
    if zero_cfg.offload_optimizer != "none" and zero_cfg.zero_stage == 0:
        raise ValueError("--offload-optimizer needs --zero-stage 1, 2 or 3")
    if zero_cfg.offload_params != "none" and zero_cfg.zero_stage != 3:
        raise ValueError("--offload-params applies to --zero-stage 3 only")
    if (zero_cfg.quantized_weights or zero_cfg.hpz_partition_size > 1) and zero_cfg.zero_stage != 3:
        raise ValueError("--zero-quantized-weights and --zero-hpz-partition-size apply to --zero-stage 3 only")
    if zero_cfg.quantized_gradients and zero_cfg.zero_stage not in (2, 3):
        raise ValueError("--zero-quantized-gradients applies to --zero-stage 2 or 3")
    swap = _swap_dir(zero_cfg, topo)
    try:
        if zero_cfg.zero_stage == 3:
            if grad_sync_cls is not None:
                raise ValueError("grad_sync_cls applies to ZeRO stages 0-2, not --zero-stage 3")
            return _build_stage3_engine(chunks, topo, zero_cfg, opt_cfg, precision, swap)
        if zero_cfg.quantized_gradients and grad_sync_cls is None:       # ZeRO++ qgZ at stage 2
            qgz = MicrobatchQuantizedGradSync if zero_cfg.reduce_each_microbatch else QuantizedGradSync
            grad_sync = qgz(chunks, topo, zero_cfg)
        else:
            grad_sync = wrap_data_parallel(chunks, topo, zero_cfg, grad_sync_cls=grad_sync_cls)
        return ZeroEngine(grad_sync, build_optimizer(grad_sync, opt_cfg, precision, swap=swap), swap)
    except BaseException:
        if swap is not None:
            swap.close()
        raise
