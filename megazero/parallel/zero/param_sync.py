"""ZeRO stage 3's parameter component: parameters sharded over dp, gathered per unit around forward and
backward. Stage 3 is stage 2's sharded gradient sync (:class:`.sharded_grads.ShardedGradSync`) composed
with :class:`ShardedParams` (the engine's stage table): gradients, fp32 master weights and Adam state
are sharded as at stage 2, and the parameters too.

Flags: ``--zero-stage 3``, ``--zero3-prefetch-layers K`` (``ZeroConfig.prefetch_layers``, default 1),
``--zero3-keep-params-gathered`` (``ZeroConfig.keep_params_gathered``). With tp and pp, every
(tp rank, pipeline stage) shards its own tp-local chunk over its dp group; nothing else changes.

Who holds what (dp = N ranks). Every model chunk is cut into *units* that are gathered as one: the
embedding, each transformer layer, and the head (final norm + output layer). Each unit's
parameters are laid out flat in buckets exactly as in :mod:`megazero.parallel.zero.buckets` (reverse
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
  reduce-scatter is retired (at most ``reductions_in_flight(3)`` = 1 reduction in flight; the
  unit being computed holds its own), plus a 1/N scratch shard when the shard already holds
  earlier micro-batches (``grads_peak``; the grad sync is stage 2's, :mod:`.sharded_grads`). The tied
  word embedding on a pp = 1 chunk holds its full gradient from the head's backward to the
  embedding's, since both add to it.

Communication per rank per step (bytes of the parameter dtype, ring accounting of
:mod:`megazero.parallel.counted_comm`, M micro-batches on this rank's chunk):

    default (reshard after forward)   M * 3Ψ(N-1)/N   all-gather in forward, all-gather in backward,
                                                      reduce-scatter of the gradients, per micro-batch
    keep_params_gathered=True             2Ψ(N-1)/N   each unit gathered once per step (first use)
                                                      and kept until its backward in the step's
                                                      last micro-batch; gradients accumulate
                                                      full-size over the micro-batches and are
                                                      reduce-scattered once, in that backward

So the default costs 1.5x the traffic of ZeRO-1/2 (at M = 1) for a parameter footprint of
2Ψ/N + 2 units; ``keep_params_gathered`` has ZeRO-2's traffic for every M but holds the stage's
full parameters (and, with M > 1, gradients: 4Ψ) from its first forward into the last backward,
which frees each unit once its backward is done and reduces its gradients as it goes, and only
16Ψ/N between steps (PyTorch FSDP's ``reshard_after_forward=False``, which also reshards after
backward). With pipeline parallelism each stage shards its own chunk; the default re-gathers per
micro-batch (M micro-batches, 3MΨ), which is where keeping the parameters gathered pays off most.

One exception to 3Ψ: with pp = 1 and a tied output layer, the word embedding is used by the
embedding unit and again by the head, so it is gathered twice in forward and twice in backward:
3Ψ + 2Ψ_emb (N-1)/N per micro-batch. With pp > 1 each stage uses its copy once: exactly 3Ψ.

Units are the model's declaration (``zero3_plan()``, :mod:`megazero.parallel.zero.units`).
Hooks (installed by :class:`ShardedParams`, nothing to call from the model):
forward pre-hook of a unit's module -> gather (or wait for the prefetch), prefetch the next
``prefetch_layers`` units, and route the input through an identity autograd function whose
backward releases the unit once its backward is done; forward post-hook -> free the gathered
buffers and hook the output's gradient, which gathers the unit again before its backward and
prefetches the units before it. The grad sync's end-of-backward callback calls
:meth:`ShardedParams.after_backward`, which frees whatever is left, and then launches the
reduce-scatters of buckets whose gradients were not all produced. Releasing frees the full
buffer's storage in place (``untyped_storage().resize_(0)``, as PyTorch FSDP2 does) rather than
replacing it, so views of a weight that autograd saved in forward (``weight.t()`` in a matmul)
read the re-gathered values in backward instead of pinning the forward's copy in memory.

A forward without autograd (evaluation) releases every unit after use in both modes.
Outside forward/backward a released parameter is an empty tensor (``p.numel() == 0``): read or
write parameter values inside ``engine.gathered_parameters()``.

Components (passed in, so the variants compose instead of multiplying classes): ``gathering`` fills a
unit's buckets from the shards (:mod:`.zeropp`: ``AllGather``, a plain all-gather; ZeRO++'s qwZ/hpZ
send int8 or gather a node-local secondary shard instead), ``shards`` says where the shards live
(:mod:`.offload_params`: the device, host memory or swap files). The gradients' own components (the
``reducer``, :mod:`.reducers`, qgZ) are the grad sync's.

Who calls what, one micro-batch on a chunk (default mode): the unit's forward hooks gather, prefetch
and release it; its output's gradient hook gathers it again and calls the grad sync's
``watch_backward``; the gradients arrive in the grad sync's buckets, which reduce-scatters them as they
fill; ``_PostBackward`` releases each unit after its backward; at the end of the backward the grad sync
calls :meth:`ShardedParams.after_backward` (release what is left), and after the step's last
reduction :meth:`ShardedParams.after_grad_sync`. The optimizer reads and writes the shards through
:meth:`ShardedParams.values` and :meth:`ShardedParams.write` (:mod:`.publish`'s ``WriteShards``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn

from megazero.parallel.zero.buckets import Bucket, ParamSlot, nbytes, plan_params, single_dtype
from megazero.parallel.zero.materialize import initial_value, storage_device, swap_in
from megazero.parallel.zero.offload_params import DeviceShards
from megazero.parallel.zero.units import in_backward, plan_of
from megazero.parallel.zero.zeropp import AllGather, build_gathering


@dataclass
class Unit:
    """Parameters gathered and released together; ``buckets`` hold their flat layout.

    Each bucket's ``param_data`` is the full-size buffer (storage freed while released) and
    ``shard`` the persistent 1/N slice this rank owns."""

    name: str
    chunk_id: int
    buckets: list[Bucket] = field(default_factory=list)
    state: str = "released"           # released | gathering | gathered
    first_use: int = -1               # index of the first trigger using it: its backward is the unit's last
    handles: list = field(default_factory=list)
    staging: list = field(default_factory=list)   # offloaded shards' device copies, until gathered


@dataclass
class Trigger:
    """A use of units at run time: the module's hooks gather ``units`` (see ``units.UnitUse``)."""

    name: str
    chunk_id: int
    index: int
    units: list[Unit]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's input; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, params, trigger, x):
        ctx.params, ctx.trigger = params, trigger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.params.after_unit_backward(ctx.trigger)
        return None, None, grad


def gathered_unit_bytes(unit_sizes: list[list[int]], elem_bytes: int, prefetch_layers: int, keep: bool) -> int:
    """Most bytes of gathered parameters held at once: per chunk, the largest ``1 + prefetch_layers``
    consecutive units (the one computing and the ones prefetched); with ``keep`` (parameters kept
    gathered), every unit of every chunk. ``unit_sizes[c]``: chunk c's padded unit sizes in use order."""
    if keep:
        return elem_bytes * sum(x for cu in unit_sizes for x in cu)
    window = 1 + prefetch_layers
    return elem_bytes * max((sum(cu[i:i + window]) for cu in unit_sizes for i in range(len(cu))), default=0)


class ShardedParams:
    """Stage 3's parameters over one bucket group's ``dp`` view (see the module docstring): the shards,
    the units and their hooks, prefetch, gather and release.

    The parameter component of a :class:`~megazero.parallel.zero.sharded_grads.ShardedGradSync` (its
    ``params``; the protocol is :class:`~megazero.parallel.zero.replicated_params.ReplicatedParams`'):
    the grad sync calls it at the points of a step where stage 3 differs from stage 2, and the hooks
    here call back into the grad sync (``watch_backward``, ``is_reducing``). Components: ``shards``,
    where the shards live (:mod:`.offload_params`), and ``gathering``, how a unit is filled from them
    (:mod:`.zeropp`). ``prefetch_layers`` uses are gathered ahead; ``keep_gathered``
    (``--zero3-keep-params-gathered``) holds each unit from its first use to its last backward of
    the step.
    """

    def __init__(self, shards=None, gathering=None, *, prefetch_layers: int = 1, keep_gathered: bool = False):
        self.shards = shards if shards is not None else DeviceShards()
        self.gathering = gathering if gathering is not None else AllGather()
        self.prefetch_layers, self.keep = prefetch_layers, bool(keep_gathered)
        self.units: list[Unit] = []
        self.triggers: list[list[Trigger]] = []
        self.buckets: list[Bucket] = []
        self.buffers: list[torch.Tensor] = []       # device memory held: the shards (not offloaded), hpZ's
        self.live_units = self.live_units_peak = 0
        self.gathered_bytes = self.gathered_bytes_peak = 0
        self._hooks = []                   # forward hook handles (remove() to unwrap)
        self._trigger_modules: list[list[tuple[nn.Module, nn.Module]]] = []

    @classmethod
    def from_config(cls, zero_cfg, shards=None) -> "ShardedParams":
        """The component for a ZeRO config, over the engine's shard store ``shards`` (shared by its
        bucket groups): the gathering it asks for (qwZ, hpZ), its prefetch and keep-gathered switches."""
        z = zero_cfg
        return cls(shards, build_gathering(z.quantized_weights, z.quantization_block_size, z.hpz_partition_size),
                   prefetch_layers=z.prefetch_layers, keep_gathered=z.keep_params_gathered)

    def attach(self, sync) -> None:
        """The grad sync this holds the parameters of: its dp view and byte log, and its backward state."""
        self.sync, self.dp, self.comm_log = sync, sync.dp, sync.comm_log

    @property
    def on_device(self) -> bool:
        """The shards (the optimizer's ranges) are device memory, not offloaded."""
        return not self.shards.offloaded

    # ----------------------------------------------------------------- layout
    def build_chunk(self, chunk_id: int, chunk: nn.Module, first_index: int) -> list[Bucket]:
        """Lay the chunk's declared units out in buckets (each unit its own, numbered from ``first_index``)
        of which this rank holds only its shard; record the units' uses (triggers). Returns the buckets."""
        plan = plan_of(chunk)
        single_dtype([m for members in plan.units.values() for m in members], chunk_id)
        by_name, built = {}, []
        for name, members in plan.units.items():
            unit = by_name[name] = Unit(name, chunk_id)
            built += self._build_unit(chunk, unit, members[::-1], first_index + len(built))   # reverse: backward order
            self.units.append(unit)
        self.triggers.append([Trigger(use.name, chunk_id, i, [by_name[u] for u in use.units])
                              for i, use in enumerate(plan.uses)])
        for trig in reversed(self.triggers[-1]):
            for u in trig.units:
                u.first_use = trig.index
        self._trigger_modules.append([(use.pre_module, use.post_module) for use in plan.uses])
        return built

    def _build_unit(self, chunk: nn.Module, unit: Unit, named: list[tuple[str, nn.Parameter]],
                    first_index: int) -> list[Bucket]:
        """Lay the unit out in buckets and fill this rank's shard of each, one parameter at a time (its
        current value, or its initial value for a meta parameter): the unit is never whole here."""
        n, rank = self.dp.size, self.dp.rank
        for members, padded in plan_params(named, sys.maxsize, n):
            first = named[members[0][0]][1]
            dtype, device = first.dtype, storage_device(first, self.dp.device)
            bucket = Bucket(unit.chunk_id, first_index + len(unit.buckets), 0, padded, padded // n)
            bucket.param_data = torch.empty(padded, dtype=dtype, device=device)   # storage only while gathered
            bucket.param_data.untyped_storage().resize_(0)
            bucket.empty = torch.empty(0, dtype=dtype, device=device)
            lo, hi = bucket.shard_range(rank)
            self.shards.allocate(bucket, hi - lo, dtype, device)
            with self.shards.filling(bucket) as shard:
                for i, start, end in members:
                    name, p = named[i]
                    shape = p.shape
                    a, b = max(lo, start), min(hi, end)
                    if a < b:
                        with torch.no_grad():
                            shard[a - lo:b - lo].copy_(initial_value(chunk, name, p).reshape(-1)[a - start:b - start])
                    p = swap_in(chunk, name, p, bucket.empty)
                    bucket.slots.append(ParamSlot(name, p, bucket, start, end, shape))
            if not self.shards.offloaded:               # device memory only (offloaded: offloaded_bytes)
                self.buffers.append(bucket.shard)
            self.buckets.append(bucket)
            unit.buckets.append(bucket)
        return unit.buckets

    def install(self) -> None:
        """Every chunk is laid out: the gathering's own buffers (hpZ), then the forward hooks."""
        self.gathering.attach(self)
        for chunk_id in range(len(self.triggers)):
            self._install_hooks(chunk_id)

    # ---------------------------------------------------------- gather/release
    def gather(self, unit: Unit, exact: bool = False) -> None:
        """Launch the all-gather of ``unit`` (asynchronous); :meth:`wait` completes it. ``exact``: the
        shards' own values even where ZeRO++ would quantize them (:mod:`.zeropp`)."""
        if unit.state != "released":
            return
        for b in unit.buckets:
            b.param_data.untyped_storage().resize_(b.numel * b.param_data.element_size())
            source = self.shards.source(b)     # the shard on the device (a staging copy when offloaded)
            unit.handles.append((b, self.gathering.launch(b, source, exact)))
            if source is not b.shard:
                unit.staging.append(source)
            self.gathered_bytes += nbytes(b.param_data)
        unit.state = "gathering"
        self.live_units += 1
        self.live_units_peak = max(self.live_units_peak, self.live_units)
        self.gathered_bytes_peak = max(self.gathered_bytes_peak, self.gathered_bytes)

    def wait(self, unit: Unit) -> None:
        """Gather ``unit`` if needed and wait until its parameters hold their full values."""
        self.gather(unit)
        if unit.state != "gathering":
            return
        for b, pending in unit.handles:
            self.gathering.finish(b, pending)
        unit.handles, unit.staging = [], []
        for b in unit.buckets:
            for s in b.slots:
                s.param.data = b.param_data[s.start:s.end].view(s.shape)
        unit.state = "gathered"

    def release(self, unit: Unit, count: bool = True) -> None:
        """Free the unit's full buffers. Views saved by autograd keep pointing at the same storage,
        which the next gather refills with the same values."""
        if unit.state == "released":
            return
        if unit.state == "gathering":
            self.wait(unit)
        for b in unit.buckets:
            for s in b.slots:
                s.param.data = b.empty
            b.param_data.untyped_storage().resize_(0)
            if count:
                self.gathered_bytes -= nbytes(b.param_data)
        unit.state = "released"
        if count:
            self.live_units -= 1

    def gather_all(self) -> list[Unit]:
        """Gather every unit now (blocking); returns the ones that were released before."""
        newly = [u for u in self.units if u.state == "released"]
        for u in newly:
            self.gather(u, exact=True)
        for u in self.units:
            self.wait(u)
        return newly

    def release_all(self, chunk_id: int | None = None) -> None:
        for u in self.units:
            if chunk_id is None or u.chunk_id == chunk_id:
                self.release(u)

    # ---------------------------------------------- the optimizer, the engine
    def values(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """View of the values of bucket elements [lo, hi), which must lie in this rank's shard (on the
        device, on the host, or of the swap file)."""
        base, end = self.held_range(bucket)
        if lo < base or hi > end:
            raise IndexError(f"rank {self.dp.rank} holds the parameters of bucket elements [{base}, {end}), "
                             f"asked for [{lo}, {hi})")
        return self.shards.view(bucket)[lo - base:hi - base]

    def held_range(self, bucket: Bucket) -> tuple[int, int]:
        """The bucket elements whose values this rank holds: its shard."""
        return bucket.shard_range(self.dp.rank)

    def write(self, bucket: Bucket, lo: int, hi: int, values: torch.Tensor) -> None:
        """Store ``values`` as the parameters of bucket elements [lo, hi), which lie in this rank's shard
        (the optimizer publishing; the next gather reads them). :meth:`flush` completes the writes."""
        base = self.held_range(bucket)[0]
        self.shards.write(bucket, lo - base, hi - base, values)

    def flush(self) -> None:
        """New shards were published: finish the writes; cached copies (hpZ) are stale."""
        self.shards.flush()
        self.gathering.invalidate()

    def reset_peaks(self) -> None:
        """Restart the peak counts of gathered units and bytes from now."""
        self.live_units_peak, self.gathered_bytes_peak = self.live_units, self.gathered_bytes

    def accounting(self) -> dict[str, int]:
        """What ``model_state_bytes`` adds: ``gathered_params`` (now), ``gathered_params_peak`` bytes and
        ``gathered_units_peak`` units gathered at once so far, hpZ's ``hpz_secondary_params`` (within
        ``params``)."""
        return {"gathered_params": self.gathered_bytes, "gathered_params_peak": self.gathered_bytes_peak,
                "gathered_units_peak": self.live_units_peak, "hpz_secondary_params": self.gathering.held_bytes()}

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this rank's slice of every gathered full buffer into its shard (the values there
        become the truth)."""
        for u in self.units:
            if u.state != "released":
                self.wait(u)
                for b in u.buckets:
                    lo, hi = self.held_range(b)
                    self.shards.write(b, 0, hi - lo, b.param_data[lo:hi])
        self.flush()

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self, chunk_id: int) -> None:
        for trig, (pre, post) in zip(self.triggers[chunk_id], self._trigger_modules[chunk_id]):
            self._hooks.append(pre.register_forward_pre_hook(partial(self._pre_forward, trig)))
            self._hooks.append(post.register_forward_hook(partial(self._post_forward, trig)))

    def _prefetch(self, trig: Trigger, direction: int) -> None:
        """Launch the gathers of the next ``prefetch_layers`` triggers (forward: +1, backward: -1)."""
        trigs = self.triggers[trig.chunk_id]
        for j in range(1, self.prefetch_layers + 1):
            idx = trig.index + direction * j
            if 0 <= idx < len(trigs):
                for u in trigs[idx].units:
                    self.gather(u)
        idx = trig.index + direction * (self.prefetch_layers + 1)   # offloaded shards: read one further ahead
        if self.shards.offloaded and 0 <= idx < len(trigs):
            for u in trigs[idx].units:
                if u.state == "released":
                    for b in u.buckets:
                        self.shards.prefetch(b)

    def _pre_forward(self, trig: Trigger, module, args):
        for u in trig.units:
            self.wait(u)
        if in_backward():                     # activation recomputation: gathered by _pre_backward
            return None
        self._prefetch(trig, +1)
        if torch.is_grad_enabled() and args and torch.is_tensor(args[0]) and args[0].requires_grad:
            return (_PostBackward.apply(self, trig, args[0]),) + tuple(args[1:])
        return None

    def _post_forward(self, trig: Trigger, module, args, output) -> None:
        if in_backward():
            return
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(partial(self._pre_backward, trig))
        if not self.keep or not torch.is_grad_enabled():     # evaluation: no backward will need it
            for u in trig.units:
                self.release(u)

    def _pre_backward(self, trig: Trigger, grad) -> None:
        """Gradient of the trigger's output is ready: its backward is next. Gather it, prefetch."""
        self.sync.watch_backward(trig.chunk_id)
        for u in trig.units:
            self.wait(u)
        self._prefetch(trig, -1)

    def after_unit_backward(self, trig: Trigger) -> None:
        """A use's backward is done (called by :class:`_PostBackward`): free its units by default;
        with ``keep_params_gathered`` only in the step's last backward of the chunk (its gradients are
        being reduced) and only the units this use is the first of (a tied word embedding, used by
        the embedding and the head, stays until the embedding's backward): nothing needs them again
        this step, so the gathered parameters shrink through that backward as FSDP's do."""
        if not self.keep:
            done = trig.units
        elif self.sync.is_reducing(trig.chunk_id):
            done = [u for u in trig.units if u.first_use == trig.index]
        else:
            done = []
        for u in done:
            self.release(u)

    # -------------------------------------------------- the points of a step
    def after_backward(self, chunk_id: int) -> None:
        """After each backward of a chunk, before its reductions are launched: free what is still
        gathered (default mode)."""
        if not self.keep:
            self.release_all(chunk_id)

    def before_weight_grad(self, chunk_id: int) -> None:
        """Gather the chunk's units again for W (a zero-bubble schedule's weight-gradient pass). W
        re-runs the backward nodes that take a weight (for the weight's half only), and those nodes
        hold views of the weights that releasing emptied; holding every unit from I until W instead
        would keep the chunk's whole parameters gathered through the steady phase (W of a
        micro-batch runs several actions after its I), which is ``--zero3-keep-params-gathered``'s
        memory: with that flag nothing is gathered again here. The cost otherwise: one more
        all-gather of the chunk per micro-batch (4 instead of 3 parameter-sized transfers)."""
        for u in self.units:
            if u.chunk_id == chunk_id:
                self.gather(u)
        for u in self.units:
            if u.chunk_id == chunk_id:
                self.wait(u)

    def after_weight_grad(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """After a W, before its end of backward (:meth:`after_backward`): ``keep_params_gathered``
        frees the chunk after the step's last W (its I released nothing: the grad sync's
        ``before_input_grad`` marks it as not reducing)."""
        if self.keep and is_last_microbatch:
            self.release_all(chunk_id)

    def after_grad_sync(self) -> None:
        """Every reduction of the step is done: release all gathered parameters."""
        self.release_all()
