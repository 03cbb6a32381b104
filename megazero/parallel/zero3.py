"""ZeRO stage 3: parameters, gradients, fp32 master weights and Adam state all sharded over dp.

Flags: ``--zero-stage 3``, ``--zero3-prefetch-layers K`` (``ZeroConfig.prefetch_layers``, default 1),
``--zero3-keep-params-gathered`` (``ZeroConfig.keep_params_gathered``). With tp and pp, every
(tp rank, pipeline stage) shards its own tp-local chunk over its dp group; nothing else changes.

Who holds what (dp = N ranks). Every model chunk is cut into *units* that are gathered as one: the
embedding, each transformer layer, and the head (final norm + output layer). Each unit's
parameters are laid out flat in buckets exactly as in :mod:`megazero.parallel.data` (reverse
registration order, padded to N equal 64-element-aligned shards, the tied word embedding in a
bucket of its own) and rank r keeps only shard r of every bucket. Worked example, N = 2, a layer
unit with w (6) and b (2), pad multiple 1::

    bucket [b0 b1 w0 w1 w2 w3 w4 w5]      rank 0 keeps [b0 b1 w0 w1], rank 1 keeps [w2 w3 w4 w5]
    forward of the layer:  all-gather the bucket into a full buffer, run, free the buffer
    backward of the layer: all-gather again, run, free; the gradient bucket is reduce-scattered
                           (averaged over dp) and rank r adds the result into its gradient shard
    optimizer step:        rank r updates its shard only (fp32 master + Adam m, v); nothing is
                           all-gathered after the step -- the next forward gathers what it needs

Memory per rank, mixed precision (Ψ parameters, K = 12): 2Ψ/N params + 2Ψ/N grads + 4Ψ/N fp32
masters + 8Ψ/N Adam = 16Ψ/N between steps (``model_state_bytes``; plus the padding of each unit to
a multiple of 64 N elements). Temporary buffers on top of it, per rank:

* gathered parameters: the units of at most ``1 + prefetch_layers`` consecutive modules (the one
  computing and the ones prefetched), e.g. 2 transformer layers with the default
  ``prefetch_layers=1`` (``gathered_units_peak``, ``gathered_params_peak``).
* gradients: the full-size gradient of a unit from its first gradient in a backward until its
  reduce-scatter completes (at most 2 reductions in flight; the unit being computed may hold
  its own), plus a 1/N receive buffer when the shard already holds earlier micro-batches
  (``grads_peak``). The tied word embedding on a pp = 1 chunk holds its full gradient from the
  head's backward to the embedding's, since both add to it.

Communication per rank per step (bytes of the parameter dtype, ring accounting of
:mod:`megazero.parallel.counted_comm`, M micro-batches on this rank's chunk):

    default (reshard after forward)   M * 3Ψ(N-1)/N   all-gather in forward, all-gather in backward,
                                                      reduce-scatter of the gradients, per micro-batch
    keep_params_gathered=True             2Ψ(N-1)/N   each unit gathered once per step (first use)
                                                      and kept until the step's gradients are
                                                      reduced; gradients accumulate full-size over
                                                      the micro-batches and are reduce-scattered once

So the default costs 1.5x the traffic of ZeRO-1/2 (at M = 1) for a parameter footprint of
2Ψ/N + 2 units; ``keep_params_gathered`` has ZeRO-2's traffic for every M but holds the stage's
full parameters and gradients (4Ψ) from its first forward to the end of the step, and only
16Ψ/N between steps (PyTorch FSDP's ``reshard_after_forward=False``). With pipeline parallelism
each stage shards its own chunk; the default re-gathers per micro-batch (M micro-batches, 3MΨ),
which is where keeping the parameters gathered pays off most.

One exception to 3Ψ: with pp = 1 and a tied output layer, the word embedding is used by the
embedding unit and again by the head, so it is gathered twice in forward and twice in backward:
3Ψ + 2Ψ_emb (N-1)/N per micro-batch. With pp > 1 each stage uses its copy once: exactly 3Ψ.

Hooks (installed by :class:`ShardedParamSync`, nothing to call from the model):
forward pre-hook of a unit's module -> gather (or wait for the prefetch), prefetch the next
``prefetch_layers`` units, and route the input through an identity autograd function whose
backward releases the unit once its backward is done; forward post-hook -> free the gathered
buffers and hook the output's gradient, which gathers the unit again before its backward and
prefetches the units before it. An end-of-backward callback frees whatever is left and launches
the reduce-scatters of buckets whose gradients were not all produced. Releasing frees the full
buffer's storage in place (``untyped_storage().resize_(0)``, as PyTorch FSDP2 does) rather than
replacing it, so views of a weight that autograd saved in forward (``weight.t()`` in a matmul)
read the re-gathered values in backward instead of pinning the forward's copy in memory.

A forward without autograd (evaluation) releases every unit after use in both modes.
Outside forward/backward a released parameter is an empty tensor (``p.numel() == 0``): read or
write parameter values inside ``engine.gathered_parameters()``.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.data import Bucket, ParamSlot, ShardedGradSync, _nbytes, _weak_hook, plan_buckets
from megazero.parallel.topology import Topology
from megazero.parallel.zero import ZeroEngine, _BucketAdamW, model_state_bytes


MAX_REDUCTIONS_IN_FLIGHT = 2   # gradient buckets whose reduce-scatter may still be running


@dataclass
class Unit:
    """Parameters gathered and released together; ``buckets`` hold their flat layout.

    Each bucket's ``param_data`` is the full-size buffer (storage freed while released) and
    ``shard`` (set as an attribute) the persistent 1/N slice this rank owns."""

    name: str
    chunk_id: int
    buckets: list[Bucket] = field(default_factory=list)
    state: str = "released"           # released | gathering | gathered
    handles: list = field(default_factory=list)


@dataclass
class Trigger:
    """A module whose forward needs ``units`` gathered: the embedding, a layer, or the head."""

    name: str
    chunk_id: int
    index: int
    units: list[Unit]


def plan_units(chunk: nn.Module):
    """Split a chunk into units: ``(units, triggers)`` where ``units`` maps a unit name to its
    ``[(param name, param)]`` and ``triggers`` lists ``(name, pre_module, post_module, unit names)``
    in forward order. ``pre_module``'s forward pre-hook gathers; ``post_module``'s forward hook
    releases.

    GPT chunk (megazero.models.gpt): ``embedding`` (first stage), ``layers.<i>`` each, ``head``
    (final norm + untied output layer; its pre-hook is the final norm and it is released when the
    chunk's forward ends, since the logits use the output weight after the norm). The tied word
    embedding is a unit of its own (``word_embeddings``) when the head uses it: on a chunk with
    both ends, both triggers name it. Any other module: one unit, the whole module.
    """
    is_gpt = hasattr(chunk, "layers") and hasattr(chunk, "pre_process") and hasattr(chunk, "post_process")
    if not is_gpt:
        return {"module": _trainable(chunk, "")}, [("module", chunk, chunk, ["module"])]
    units, triggers = {}, []
    tied_head = chunk.post_process and getattr(chunk, "tied", False)
    word = chunk.embedding.word_embeddings.weight if hasattr(chunk, "embedding") else None
    if tied_head:
        units["word_embeddings"] = [("embedding.word_embeddings.weight", word)]
    if chunk.pre_process:
        rest = [(n, p) for n, p in _trainable(chunk.embedding, "embedding.") if not (tied_head and p is word)]
        names = (["embedding"] if rest else []) + (["word_embeddings"] if tied_head else [])
        if rest:
            units["embedding"] = rest
        triggers.append(("embedding", chunk.embedding, chunk.embedding, names))
    for key, layer in chunk.layers.items():
        units[f"layers.{key}"] = _trainable(layer, f"layers.{key}.")
        triggers.append((f"layers.{key}", layer, layer, [f"layers.{key}"]))
    if chunk.post_process:
        head = _trainable(chunk.final_norm, "final_norm.")
        if hasattr(chunk, "output_layer"):
            head += _trainable(chunk.output_layer, "output_layer.")
        units["head"] = head
        triggers.append(("head", chunk.final_norm, chunk, ["head"] + (["word_embeddings"] if tied_head else [])))
    covered = {id(p) for members in units.values() for _, p in members}
    missing = [n for n, p in chunk.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise ValueError(f"ZeRO-3 does not know when parameters {missing} are used: GPT chunks have "
                         f"embedding / layers / final_norm / output_layer only (--zero-stage 3)")
    return units, triggers


def _trainable(module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    return [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's input; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, sync, trigger, x):
        ctx.sync, ctx.trigger = sync, trigger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sync._post_backward(ctx.trigger)
        return None, None, grad


def _in_backward() -> bool:
    """True while autograd runs a backward (a forward here is activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ShardedParamSync(ShardedGradSync):
    """Stage 3 parameter and gradient sharding over ``topo.dp_group`` (see the module docstring).

    Gradients reuse stage 2's machinery (full-size bucket storage from the first gradient until
    the reduce-scatter, shards until ``zero_grad``); what differs is that parameters live as
    shards too, and that by default every micro-batch's gradients are reduce-scattered and
    accumulated into the shard (with ``keep_params_gathered`` only the last micro-batch's, as in
    stage 2).
    """

    def __init__(self, chunks, topo: Topology, zero_cfg: ZeroConfig | None = None, *,
                 comm_log: CommLog | None = None):
        self.units: list[Unit] = []
        self.triggers: list[list[Trigger]] = []
        self._pending_add: dict[int, torch.Tensor] = {}
        self._in_flight: list[Bucket] = []
        self._graph_task: dict[int, int] = {}
        self.live_units = self.live_units_peak = 0
        self.gathered_bytes = self.gathered_bytes_peak = 0
        self._hooks = []                   # forward hook handles (remove() to unwrap)
        self._trigger_modules: list[list[tuple[nn.Module, nn.Module]]] = []
        cfg = zero_cfg or ZeroConfig(zero_stage=3)
        if cfg.prefetch_layers < 0:
            raise ValueError(f"--zero3-prefetch-layers must be >= 0, got {cfg.prefetch_layers}")
        super().__init__(chunks, topo, cfg, comm_log=comm_log)
        self.keep = bool(self.cfg.keep_params_gathered)
        for chunk_id, chunk in enumerate(self.chunks):
            self._install_hooks(chunk_id, chunk)

    # ----------------------------------------------------------------- layout
    def _build_chunk(self, chunk_id: int, chunk: nn.Module) -> None:
        unit_params, trigger_specs = plan_units(chunk)
        dtypes = {p.dtype for members in unit_params.values() for _, p in members}
        if len(dtypes) > 1:
            raise ValueError(f"model chunk {chunk_id} mixes parameter dtypes {sorted(map(str, dtypes))}: "
                             f"build the model in one dtype (--bf16 / --fp16 or fp32)")
        by_name = {}
        for name, members in unit_params.items():
            unit = by_name[name] = Unit(name, chunk_id)
            self._build_unit(unit, members[::-1])           # reverse: roughly backward order
            self.units.append(unit)
        self.triggers.append([Trigger(name, chunk_id, i, [by_name[u] for u in names])
                              for i, (name, _, _, names) in enumerate(trigger_specs)])
        self._trigger_modules.append([(pre, post) for _, pre, post, _ in trigger_specs])
        self.grad_buffers.append(None)

    def _build_unit(self, unit: Unit, named: list[tuple[str, nn.Parameter]]) -> None:
        plan = plan_buckets([p.numel() for _, p in named],
                            [bool(getattr(p, "shared_embedding", False)) for _, p in named],
                            sys.maxsize, self.dp_size)
        for members, padded in plan:
            dtype, device = named[members[0][0]][1].dtype, named[members[0][0]][1].device
            bucket = Bucket(unit.chunk_id, len(self.buckets), 0, padded, padded // self.dp_size)
            bucket.param_data = torch.zeros(padded, dtype=dtype, device=device)
            for i, start, end in members:
                name, p = named[i]
                bucket.param_data[start:end].copy_(p.data.reshape(-1))
                slot = ParamSlot(name, p, bucket, start, end)
                slot.shape = p.shape
                bucket.slots.append(slot)
                self.slots.append(slot)
                self._slot_of[id(p)] = slot
                p.register_post_accumulate_grad_hook(_weak_hook(self))
            lo, hi = self.shard_range(bucket)
            bucket.shard = bucket.param_data[lo:hi].clone()
            bucket.empty = torch.empty(0, dtype=dtype, device=device)
            self.param_buffers.append(bucket.shard)
            self.buckets.append(bucket)
            unit.buckets.append(bucket)
        unit.state = "gathered"
        self._release(unit, count=False)

    # ---------------------------------------------------------- gather/release
    def _gather(self, unit: Unit) -> None:
        """Launch the all-gather of ``unit`` (asynchronous); :meth:`_wait` completes it."""
        if unit.state != "released":
            return
        for b in unit.buckets:
            b.param_data.untyped_storage().resize_(b.numel * b.param_data.element_size())
            unit.handles.append(comm.all_gather(b.param_data, b.shard, self.dp_group, self.comm_log, "dp",
                                                async_op=True))
            self.gathered_bytes += _nbytes(b.param_data)
        unit.state = "gathering"
        self.live_units += 1
        self.live_units_peak = max(self.live_units_peak, self.live_units)
        self.gathered_bytes_peak = max(self.gathered_bytes_peak, self.gathered_bytes)

    def _wait(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.state != "gathering":
            return
        for h in unit.handles:
            if h is not None:
                h.wait()
        unit.handles = []
        for b in unit.buckets:
            for s in b.slots:
                s.param.data = b.param_data[s.start:s.end].view(s.shape)
        unit.state = "gathered"

    def _release(self, unit: Unit, count: bool = True) -> None:
        """Free the unit's full buffers. Views saved by autograd keep pointing at the same storage,
        which the next gather refills with the same values."""
        if unit.state == "released":
            return
        if unit.state == "gathering":
            self._wait(unit)
        for b in unit.buckets:
            for s in b.slots:
                s.param.data = b.empty
            b.param_data.untyped_storage().resize_(0)
            if count:
                self.gathered_bytes -= _nbytes(b.param_data)
        unit.state = "released"
        if count:
            self.live_units -= 1

    def gather_all(self) -> list[Unit]:
        """Gather every unit now (blocking); returns the ones that were released before."""
        newly = [u for u in self.units if u.state == "released"]
        for u in newly:
            self._gather(u)
        for u in self.units:
            self._wait(u)
        return newly

    def reset_peaks(self) -> None:
        """Restart the peak counts of gathered units / bytes and of gradient bytes from now."""
        self.live_units_peak, self.gathered_bytes_peak, self._peak = self.live_units, self.gathered_bytes, self._held

    def release_all(self, chunk_id: int | None = None) -> None:
        for u in self.units:
            if chunk_id is None or u.chunk_id == chunk_id:
                self._release(u)

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this rank's slice of every gathered full buffer into its shard (the values there
        become the truth)."""
        for u in self.units:
            if u.state != "released":
                self._wait(u)
                for b in u.buckets:
                    lo, hi = self.shard_range(b)
                    b.shard.copy_(b.param_data[lo:hi])

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self, chunk_id: int, chunk: nn.Module) -> None:
        for trig, (pre, post) in zip(self.triggers[chunk_id], self._trigger_modules[chunk_id]):
            self._hooks.append(pre.register_forward_pre_hook(partial(self._pre_forward, trig)))
            self._hooks.append(post.register_forward_hook(partial(self._post_forward, trig)))

    def _prefetch(self, trig: Trigger, direction: int) -> None:
        """Launch the gathers of the next ``prefetch_layers`` triggers (forward: +1, backward: -1)."""
        trigs = self.triggers[trig.chunk_id]
        for j in range(1, self.cfg.prefetch_layers + 1):
            idx = trig.index + direction * j
            if 0 <= idx < len(trigs):
                for u in trigs[idx].units:
                    self._gather(u)

    def _pre_forward(self, trig: Trigger, module, args):
        for u in trig.units:
            self._wait(u)
        if _in_backward():                     # activation recomputation: gathered by _pre_backward
            return None
        self._prefetch(trig, +1)
        if torch.is_grad_enabled() and args and torch.is_tensor(args[0]) and args[0].requires_grad:
            return (_PostBackward.apply(self, trig, args[0]),) + tuple(args[1:])
        return None

    def _post_forward(self, trig: Trigger, module, args, output) -> None:
        if _in_backward():
            return
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(partial(self._pre_backward, trig))
        if not self.keep or not torch.is_grad_enabled():     # evaluation: no backward will need it
            for u in trig.units:
                self._release(u)

    def _pre_backward(self, trig: Trigger, grad) -> None:
        """Gradient of the trigger's output is ready: its backward is next. Gather it, prefetch."""
        task = torch._C._current_graph_task_id()
        if self._graph_task.get(trig.chunk_id) != task:
            self._graph_task[trig.chunk_id] = task
            torch.autograd.Variable._execution_engine.queue_callback(
                partial(self._end_of_backward, trig.chunk_id))
        for u in trig.units:
            self._wait(u)
        self._prefetch(trig, -1)

    def _post_backward(self, trig: Trigger) -> None:
        if not self.keep:
            for u in trig.units:
                self._release(u)

    def _end_of_backward(self, chunk_id: int) -> None:
        """After each backward of a chunk: free what is still gathered (default mode) and launch the
        reduce-scatter of every bucket that has gradients but did not complete its countdown."""
        self._graph_task.pop(chunk_id, None)
        if not self.keep:
            self.release_all(chunk_id)
        for b in self.buckets:
            if b.chunk_id == chunk_id:
                if self._sync_now[chunk_id] and b.grad_data is not None and not b.launched:
                    self._start(b)
                b.pending = len(b.slots)

    # -------------------------------------------------------------- gradients
    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """Default: reduce every micro-batch. keep_params_gathered: only on the last one."""
        self._sync_now[chunk_id] = is_last_microbatch or not self.keep
        self._synced = False
        for b in self.buckets:                 # the previous micro-batch's reductions must land first
            if b.chunk_id == chunk_id and b.launched:
                self._settle(b)

    def _settle(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        self._after_reduce(bucket)

    def _ensure_grad_storage(self, bucket: Bucket) -> torch.Tensor:
        if bucket.launched:       # the previous backward's reduction is pending (no before_backward)
            old = bucket.grad_data.untyped_storage().data_ptr()
            fresh = [(s.param, s.param.grad) for s in bucket.slots if s.param.grad is not None
                     and s.param.grad.untyped_storage().data_ptr() != old]
            self._settle(bucket)
            for p, g in fresh:
                p.grad = g
        return super()._ensure_grad_storage(bucket)

    def _start(self, bucket: Bucket) -> None:
        """Launch the bucket's reduce-scatter; settle older ones beyond ``MAX_REDUCTIONS_IN_FLIGHT``
        so that the full-size gradients of at most that many buckets wait on the network."""
        super()._start(bucket)
        self._in_flight = [b for b in self._in_flight if b.launched] + [bucket]
        while len(self._in_flight) > MAX_REDUCTIONS_IN_FLIGHT:
            self._settle(self._in_flight.pop(0))

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        if id(bucket) not in self.grad_shards:     # first reduction of the step: straight into the shard
            return super()._launch(bucket, grad_data)
        tmp = self._pending_add[id(bucket)] = torch.empty(bucket.shard_size, dtype=grad_data.dtype,
                                                          device=grad_data.device)
        self._track(_nbytes(tmp))
        return comm.reduce_scatter(tmp, grad_data, self.dp_group, self.comm_log, "dp", async_op=True)

    def _after_reduce(self, bucket: Bucket) -> None:
        tmp = self._pending_add.pop(id(bucket), None)
        if tmp is not None:
            self.grad_shards[id(bucket)].add_(tmp)
            self._held -= _nbytes(tmp)
        super()._after_reduce(bucket)
        bucket.launched = False

    def finish_grad_sync(self) -> None:
        """Reduce what is left, wait for every reduction, release all gathered parameters."""
        for b in self.buckets:
            if b.grad_data is not None and not b.launched:
                self._start(b)
        for b in self.buckets:
            if b.launched:
                self._settle(b)
            if id(b) not in self.grad_shards:      # no gradient at all this step
                self.grad_shards[id(b)] = torch.zeros_like(b.shard)
                self._track(_nbytes(b.shard))
            b.pending = len(b.slots)
        self.release_all()
        self._synced = True


class ZeroStage3Optimizer(_BucketAdamW):
    """AdamW on this rank's shard of every bucket; publishing = writing the shard (no all-gather:
    the next forward gathers)."""

    def _check_grad_sync(self, grad_sync) -> None:
        if not isinstance(grad_sync, ShardedParamSync):
            raise TypeError("ZeroStage3Optimizer needs ShardedParamSync (--zero-stage 3)")

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.grad_sync.shard_range(bucket)

    def _range_params(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        return bucket.shard

    def _norm_group(self):
        return dist.group.WORLD, "world"

    def _publish(self) -> None:
        self.grad_sync.release_all()              # gathered copies would be stale
        for r in self.ranges:
            if not r.master_is_param:
                r.bucket.shard.copy_(r.master)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """fp32 masters from the (written back) shards: bf16/fp16 only, fp32 masters are the shards."""
        for r in self.ranges:
            if not r.master_is_param:
                r.master.copy_(r.bucket.shard)


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
        return out

    @contextmanager
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
                self.grad_sync._release(u)


def build_stage3_engine(chunks, topo: Topology, zero_cfg: ZeroConfig, opt_cfg: OptimizerConfig,
                        precision: PrecisionConfig | None = None) -> ZeroStage3Engine:
    """Shard this rank's chunks over dp (parameters move into shards: build after the model,
    before the first forward) and build the stage-3 optimizer."""
    sync = ShardedParamSync(chunks, topo, zero_cfg)
    newly = sync.gather_all()          # the optimizer reads parameter shapes (weight decay on >= 2-D)
    try:
        optimizer = ZeroStage3Optimizer(sync, opt_cfg, precision)
    finally:
        for u in newly:
            sync._release(u)
        sync.reset_peaks()
    return ZeroStage3Engine(sync, optimizer)
