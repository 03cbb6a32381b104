"""FP8 matrix products for linear layers, their scales agreed over the ranks that split a tensor.

A linear layer ``y = x W^T + b`` (x [M, K] tokens by input features, W [N, K]) runs three products a
step; under FP8 each takes two operands cast to an 8-bit float, each with a scale that maps its largest
magnitude (amax) onto the format's largest value (448 for e4m3, 57344 for e5m2)::

    forward   y  = x  @ W^T      x: e4m3  along K      W: e4m3  along K
    dgrad     dx = dy @ W        dy: e4m3 or e5m2 (``hybrid``) along N      W along N
    wgrad     dW = dy^T @ x      dy along M            x along M

"along D" is the product's inner dimension: a row-wise scale is one per row of the operand over D, a
tensor-wise one is one for the whole operand. The product accumulates in fp32 and is scaled back
(``torch._scaled_mm``), giving the parameters' dtype.

**The scales are agreed where a tensor is split.** The serial model computes each amax over the whole
tensor; a parallel run holds pieces. So each amax is all-reduced (MAX) over the groups that split the
dimensions it covers, and every rank casts its piece with the serial run's scale: the FP8 values are
the serial run's, and a parallel FP8 run equals the serial FP8 run to fp32 rounding, not to FP8 noise.
Which groups split which dimension of one linear (:class:`Splits`, declared by the model)::

    column-parallel (N over tp)   W tensor-wise: tp     dy tensor-wise / along M: none, along N: tp
    row-parallel    (K over tp)   x and W along K and tensor-wise: tp
    context parallel (M over cp)  x and dy tensor-wise and along M: cp
    experts under sequence parallelism: M over tp too (each tp rank routes its own slice)

Sequence parallelism needs nothing more for the dense layers: the column-parallel input is gathered
before the product and the row-parallel output gradient after it, so both hold every token.

Worked example, row-parallel 8 -> 4 at tp 2, tensor-wise: rank r holds x[:, 4r:4r+4] and W[:, 4r:4r+4].
Each computes its pieces' amax, the MAX all-reduce gives both the amax of the whole x (and W), each
casts with that scale, multiplies its pieces (fp32 partial sums) and the row-parallel all-reduce adds
the two halves: the serial FP8 product, summed in another order.

**Recipes** (``--fp8-recipe``, :class:`megazero.config.FP8Config`): ``tensorwise`` and ``rowwise`` scale
from the current values (a MAX all-reduce per split operand, a handful of scalars or one row vector);
``delayed`` from the amax history of earlier steps (``--fp8-amax-history-len`` entries, their max or
most recent), so a step's products need no collective: every linear records its operands' amaxes, and
:func:`finish_step` agrees them once at the end of the step over every rank holding the layer (tp, then
dp x cp, or the expert-data-parallel group for experts; Transformer Engine's amax reduction group) and
pushes them into the histories. The first step, with no history, scales as ``tensorwise`` does. At dp
2 a step's amax is the max over both ranks' micro-batches, what the serial run over all of them
records, so delayed scaling equals the serial run under any layout too. One unit differs: each rank
back-propagates its micro-batches' losses divided by its own micro-batch count (dp averages later), so
an output gradient's amax at dp d is d times the serial run's, as is its scale's inverse: the FP8 values
are the same, and a history saved at one dp is rescaled when loaded at another (:func:`load_history_state`).

What comes from torchao (the ``fp8`` extra): its scale from an amax (``amax_to_scale``, in float64 as
its compiled and eager paths agree), its saturating cast (``to_fp8_saturated``) and its ``_scaled_mm``
wrapper for tensor-wise products (``addmm_float8_unwrapped``: output dtype and bias rules). Ours: which
groups agree each amax (torchao agrees over a DTensor device mesh, not the process groups these layers
take), the delayed histories, and row-wise products, which we scale back in fp32 after an unscaled
``_scaled_mm`` (torchao's wrapper rounds a row-wise fp32 output through bf16, which would make a
row-parallel layer's partial sums differ from the serial product by bf16 rounding).

Shapes: on CUDA ``_scaled_mm`` needs the inner dimension a multiple of 16, so layers whose local in or
out features are not stay in the parameters' precision (:func:`suits_fp8`; the start line names them),
and a product over tokens (wgrad) pads M to a multiple of 16 with zeros there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megazero.config import FLAG, FP8Config
from megazero.parallel import wgrad_fusion
from megazero.parallel.raw_comm import all_reduce, group_size

X, W, G = 0, 1, 2                     # the operands whose amaxes a linear records: input, weight, output gradient
OPERANDS = ("input", "weight", "output gradient")


_TORCHAO = None


def _torchao():
    """torchao's scaling, casting and ``_scaled_mm`` wrapper, imported on first use (1-2 s; only FP8 runs pay)
    with its import-time notices about GPU kernels it could not load silenced; kept, so that later calls
    (inside a compiled layer too) read one global."""
    global _TORCHAO
    if _TORCHAO is not None:
        return _TORCHAO
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.float8.float8_ops import addmm_float8_unwrapped
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    _TORCHAO = amax_to_scale, to_fp8_saturated, addmm_float8_unwrapped
    return _TORCHAO


@dataclass(frozen=True)
class Recipe:
    """What :class:`megazero.config.FP8Config` asks of every FP8 linear."""

    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    rowwise: bool
    delayed: bool
    history_len: int
    use_max: bool
    margin: int
    param_gather: bool = False            # ZeRO gathers the weight in FP8 (megazero.parallel.zero.fp8_gather)

    @classmethod
    def from_config(cls, cfg: FP8Config) -> Recipe:
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
        return cls(e4m3, e5m2 if cfg.fp8_format == "hybrid" else e4m3, cfg.recipe == "rowwise",
                   cfg.recipe == "delayed", cfg.history_len, cfg.amax_compute_algo == "max", cfg.fp8_margin,
                   cfg.fp8_param_gather)


@dataclass(frozen=True)
class Splits:
    """The process groups splitting one linear's dimensions against the serial model (only groups of more
    than one rank): ``in_features`` K (row-parallel: tp), ``out_features`` N (column-parallel: tp),
    ``tokens`` M (cp; for experts under sequence parallelism, tp too)."""

    in_features: tuple = ()
    out_features: tuple = ()
    tokens: tuple = ()

    @classmethod
    def of(cls, in_features=(), out_features=(), tokens=()) -> Splits:
        def real(groups):
            return tuple(g for g in groups if g is not None and group_size(g) > 1)
        return cls(real(in_features), real(out_features), real(tokens))


@dataclass
class FP8Layer:
    """A model's declaration of one linear that may run in FP8: its parameter-name prefix, the module whose
    attribute ``attr`` holds its :class:`LinearFP8` (None: not FP8), its local in/out features, how it is
    split, and whether it is an expert (its delayed amaxes are agreed over the expert-data-parallel ranks)."""

    name: str
    holder: Any
    in_features: int
    out_features: int
    splits: Splits
    expert: bool = False
    attr: str = "fp8"
    unsuitable: str | None = None       # declared but never FP8, with why


def suits_fp8(layer: FP8Layer) -> bool:
    """Whether the layer's local dimensions suit FP8 products on every device (multiples of 16)."""
    return layer.in_features % 16 == 0 and layer.out_features % 16 == 0


class LinearFP8:
    """One FP8 linear's scaling: its recipe, its splits and, for the delayed recipe, its amax history
    ([3, history] for input, weight and output gradient, newest first) and this step's amaxes so far.

    ``weight_amax``: set by ZeRO's FP8 parameter all-gather (``--fp8-param-gather``), the amax of the
    weight's exact values agreed over every rank holding a piece of it; the weight then holds values
    rounded through FP8, whose own amax may differ, so this one is what the weight's scale and the
    delayed history take. None when the weight holds its exact values."""

    def __init__(self, recipe: Recipe, splits: Splits, expert: bool = False):
        self.recipe, self.splits, self.expert = recipe, splits, expert
        self.history: torch.Tensor | None = None       # delayed: set by the first finish_step
        self.current: torch.Tensor | None = None       # delayed: this step's local amaxes [3]
        self.weight_amax: torch.Tensor | None = None   # --fp8-param-gather: the exact weight's agreed amax

    # -- the groups each amax is agreed over (current scaling)
    def tensor_groups(self, operand: int) -> tuple:
        s = self.splits
        return {X: s.tokens + s.in_features, W: s.out_features + s.in_features, G: s.tokens + s.out_features}[operand]

    def scaled(self, t: torch.Tensor, operand: int, along: int | None, groups: tuple, dtype: torch.dtype,
               record: bool = False):
        """``t`` [rows, D] cast to ``dtype`` and its scale: one per row over D (``along`` the inner dim,
        row-wise recipe) agreed over ``groups``, else one for the tensor (current amax agreed over the
        operand's tensor groups, or the delayed history's). ``record``: add the amax to this step's
        (delayed recipe, in training)."""
        gathered_weight = operand == W and along is None and self.weight_amax is not None
        local = self.weight_amax if gathered_weight else _amax(t, along)
        if record and self.recipe.delayed:
            self._record(operand, local)
        if along is not None:
            scale = self._to_scale(_agree(local, groups), dtype)
        else:
            scale = self.tensor_scale(operand, local, dtype, agreed=gathered_weight)
        return self.cast(t, scale, dtype), scale

    def tensor_scale(self, operand: int, amax: torch.Tensor, dtype: torch.dtype, agreed: bool = True) -> torch.Tensor:
        """The one scale of an operand: the delayed history's once there is one, else from the current
        ``amax`` of the whole tensor (``agreed=False``: this rank's piece's, agreed here over the
        operand's tensor groups, a collective)."""
        if self.recipe.delayed and self.history is not None:
            return self._to_scale(self._from_history(operand), dtype)
        if not agreed:
            amax = _agree(amax, self.tensor_groups(operand))
        return self._to_scale(amax, dtype)

    def weight_scale(self, agreed_amax: torch.Tensor) -> torch.Tensor:
        """The scale the forward product casts the weight with when the weight's amax, agreed over every
        rank holding a piece of it, is ``agreed_amax``: what ZeRO's FP8 parameter all-gather casts with,
        so that the products re-cast the gathered values to the same FP8 values."""
        return self.tensor_scale(W, agreed_amax, self.recipe.forward_dtype)

    def weight_groups(self) -> tuple:
        """The groups splitting the weight (its amax is agreed over them; tp for a parallel layer)."""
        return self.tensor_groups(W)

    @staticmethod
    def cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t * scale`` cast to the FP8 ``dtype``, saturating at its largest value."""
        _, to_fp8_saturated, _ = _torchao()
        return to_fp8_saturated(t.float() * scale, dtype)

    def _to_scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        amax_to_scale, _, _ = _torchao()
        scale = amax_to_scale(amax, dtype)
        if self.recipe.margin:
            scale = scale / 2.0 ** self.recipe.margin
        return scale

    def _record(self, operand: int, amax: torch.Tensor) -> None:
        if self.current is None:
            self.current = torch.zeros(3, dtype=torch.float32, device=amax.device)
        self.current[operand] = torch.maximum(self.current[operand], amax.detach())

    def _from_history(self, operand: int) -> torch.Tensor:
        h = self.history[operand]
        return h.max() if self.recipe.use_max else h[0]


def _amax(t: torch.Tensor, along: int | None) -> torch.Tensor:
    """max |t| (fp32) over the tensor, or over dim ``along`` (kept); 0 for an empty tensor."""
    if along is None:
        return t.abs().max().float() if t.numel() else torch.zeros((), device=t.device)
    if t.numel() == 0:
        shape = list(t.shape)
        shape[along] = 1
        return torch.zeros(shape, device=t.device)
    return t.abs().amax(dim=along, keepdim=True).float()


def _agree(amax: torch.Tensor, groups: tuple) -> torch.Tensor:
    for g in groups:
        amax = all_reduce(amax.clone(), g, op=dist.ReduceOp.MAX)
    return amax


def _product(a8, sa, b8, sb, out_dtype) -> torch.Tensor:
    """``(a8 / sa) @ (b8 / sb)^T`` in ``out_dtype`` for row-major a8 [M, D] and b8 [N, D] (D innermost in
    both), accumulated in fp32. Tensor-wise through torchao's ``_scaled_mm`` wrapper; row-wise unscaled,
    then both scales applied in fp32 (see the module docstring)."""
    if a8.device.type == "cuda" and a8.shape[1] % 16:
        pad = 16 - a8.shape[1] % 16
        a8 = torch.cat([a8, a8.new_zeros(a8.shape[0], pad)], 1)
        b8 = torch.cat([b8, b8.new_zeros(b8.shape[0], pad)], 1)
    if a8.device.type == "cpu":
        return _product_on_cpu(a8, sa, b8, sb, out_dtype)
    return _product_scaled_mm(a8, sa, b8, sb, out_dtype)


def _product_scaled_mm(a8, sa, b8, sb, out_dtype) -> torch.Tensor:
    """:func:`_product` through ``torch._scaled_mm`` (the accelerator's FP8 kernel): tensor-wise by
    torchao's wrapper, row-wise unscaled then scaled in fp32."""
    if sa.numel() == 1 and sb.numel() == 1:
        _, _, addmm = _torchao()
        return addmm(a8, sa, b8.t(), sb, out_dtype)
    one = torch.ones((), device=a8.device)
    out = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * sa.reciprocal() * sb.reciprocal().t()).to(out_dtype)


def _product_on_cpu(a8, sa, b8, sb, out_dtype) -> torch.Tensor:
    """The product :func:`_product` computes, on a CPU: the FP8 operands widened to fp32 (exactly), an fp32
    matrix product, both scales applied in fp32, then ``out_dtype``. ``torch._scaled_mm`` computes the
    same on a CPU with a reference kernel some thousand times slower than an fp32 product (seconds for
    one 1024 x 128 x 384 product), which would make an FP8 run there unusable; the two differ only in
    the order of fp32 summation."""
    out = a8.float() @ b8.float().t()
    return (out * sa.reciprocal() * sb.reciprocal().reshape(1, -1)).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    """``y = x W^T + b`` with its three products in FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: LinearFP8, record: bool):
        r = fp8.recipe
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        along = 1 if r.rowwise else None
        s = fp8.splits
        x8, sx = fp8.scaled(x2, X, along, s.in_features, r.forward_dtype, record)
        w8, sw = fp8.scaled(weight, W, along, s.in_features, r.forward_dtype, record)
        y = _product(x8, sx, w8, sw, x.dtype)
        if bias is not None:
            y = y + bias
        ctx.fp8, ctx.has_bias, ctx.lead, ctx.weight_dtype, ctx.record = fp8, bias is not None, lead, weight.dtype, record
        if r.rowwise:                            # scaled again along other dims in backward
            ctx.save_for_backward(x2, weight)
        else:
            ctx.save_for_backward(x8, sx, w8, sw)
        return y                                 # [tokens, out]: the caller restores the leading dims

    @staticmethod
    def backward(ctx, dy):
        fp8 = ctx.fp8
        r, s = fp8.recipe, fp8.splits
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if r.rowwise:
            x2, weight = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                g8, sg = fp8.scaled(dy2, G, 1, s.out_features, r.backward_dtype)
                wt8, swt = fp8.scaled(weight.t().contiguous(), W, 1, s.out_features, r.forward_dtype)
                dx = _product(g8, sg, wt8, swt, dy.dtype)
            if ctx.needs_input_grad[1]:
                gt8, sgt = fp8.scaled(dy2.t().contiguous(), G, 1, s.tokens, r.backward_dtype)
                xt8, sxt = fp8.scaled(x2.t().contiguous(), X, 1, s.tokens, r.forward_dtype)
                dw = _product(gt8, sgt, xt8, sxt, weight.dtype)
        else:
            x8, sx, w8, sw = ctx.saved_tensors
            g8, sg = fp8.scaled(dy2, G, None, (), r.backward_dtype, ctx.record)
            if ctx.needs_input_grad[0]:
                dx = _product(g8, sg, w8.t().contiguous(), sw, dy.dtype)
            if ctx.needs_input_grad[1]:
                dw = _product(g8.t().contiguous(), sg, x8.t().contiguous(), sx, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        if dx is not None:
            dx = dx.reshape(*ctx.lead, dx.shape[-1])
        return dx, dw, db, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: LinearFP8 | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, in FP8 when ``fp8`` is given (the layers' one entry point); else its
    weight gradient made into the fp32 main gradient where the grad sync installed one
    (:mod:`megazero.parallel.wgrad_fusion`)."""
    if fp8 is None:
        return wgrad_fusion.linear(x, weight, bias)
    y = _FP8Linear.apply(x, weight, bias, fp8, torch.is_grad_enabled())     # delayed: amaxes of training only
    return y.reshape(*x.shape[:-1], weight.shape[0])   # a view made outside the Function: callers may write into it


@dataclass
class Enabled:
    """What :func:`enable` did to one chunk: the FP8 linears by name, and the layers left out with why."""

    linears: dict[str, LinearFP8] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)


def enable(chunk, layers: list[FP8Layer], cfg: FP8Config) -> Enabled:
    """Give each declared layer of ``chunk`` whose dimensions suit FP8 its :class:`LinearFP8` (the others
    are listed in ``left_out`` with the reason); the result is kept on the chunk for :func:`finish_step`."""
    recipe = Recipe.from_config(cfg)
    _torchao()                                   # imported here, outside any compiled layer's trace
    done = Enabled()
    for layer in layers:
        if layer.unsuitable:
            done.left_out[layer.name] = layer.unsuitable
            continue
        if not suits_fp8(layer):
            done.left_out[layer.name] = (f"local dimensions {layer.in_features} -> {layer.out_features} "
                                         f"are not multiples of 16")
            continue
        state = LinearFP8(recipe, layer.splits, layer.expert)
        setattr(layer.holder, layer.attr, state)
        if layer.attr == "fp8":                  # ZeRO's FP8 parameter all-gather finds the scaling here
            layer.holder.weight.fp8_linear = state
        done.linears[layer.name] = state
    chunk._fp8 = done
    return done


def describe(cfg: FP8Config, chunks, dtype_name: str) -> str:
    """The start line's FP8 part (empty without FP8): the format and recipe, how many linears of these chunks
    run in FP8, and which stay in ``dtype_name`` and why. Example::

        fp8: hybrid (e4m3 forward, e5m2 gradients), delayed scaling (history 1024, max) on 32 linear layers
        of this rank's chunks; in bf16: the output layer (--fp8-head), layers.0.attention.key_value (...)"""
    if not cfg.enabled:
        return ""
    fmt = "hybrid (e4m3 forward, e5m2 gradients)" if cfg.fp8_format == "hybrid" else "e4m3"
    how = (f"delayed scaling (history {cfg.history_len}, {cfg.amax_compute_algo})" if cfg.recipe == "delayed"
           else f"{cfg.recipe} scaling")
    margin = f", margin {cfg.fp8_margin}" if cfg.fp8_margin else ""
    done = enabled_on(chunks)
    count = sum(len(e.linears) for e in done)
    left = [f"{name} ({why})" for e in done for name, why in e.left_out.items()]
    if not cfg.fp8_head and any(getattr(c, "post_process", False) for c in chunks):
        left.insert(0, f"the output layer ({FLAG.fp8_head} to include it)")
    kept = f"; in {dtype_name}: " + ", ".join(left) if left else ""
    return f"\n fp8: {fmt}, {how}{margin} on {count} linear layers of this rank's chunks{kept}"


def enabled_on(chunks) -> list[Enabled]:
    return [c._fp8 for c in chunks if getattr(c, "_fp8", None) is not None]


def finish_step(chunks, tp_group, dense_group, expert_group, device) -> None:
    """End of a training step, delayed recipe: agree this step's amaxes of every FP8 linear of ``chunks``
    (MAX over tp, then over ``dense_group`` -- dp x cp -- or, for experts, ``expert_group``) and push
    them into the histories. Every rank holding the layers calls it (a collective); a no-op for the
    other recipes and without FP8. A linear whose amaxes are not finite (an fp16 overflow, a step the
    loss scaler skips) keeps its history as it was: a NaN or inf there would scale every later step's
    gradients to NaN, and the run would never step again. An operand that saw no value (an expert no token
    chose) repeats its newest amax, keeping its scale (Transformer Engine's rule), where a 0 would
    saturate every value of its next step."""
    states = [s for e in enabled_on(chunks) for s in e.linears.values() if s.recipe.delayed]
    if not states:
        return
    for expert in (False, True):
        mine = [s for s in states if s.expert == expert]
        if not mine:
            continue
        amaxes = torch.stack([s.current if s.current is not None else torch.zeros(3, device=device)
                              for s in mine])     # a linear that saw no token this step records 0
        amaxes = torch.nan_to_num(amaxes, nan=float("inf"))          # MAX over ranks then agrees everywhere
        amaxes = _agree(amaxes, (tp_group, expert_group if expert else dense_group))
        finite = torch.isfinite(amaxes).all(dim=1)
        saw = (amaxes > 0).all(dim=1)
        first = (finite & saw).tolist() if any(s.history is None for s in mine) else None
        for i, (s, row) in enumerate(zip(mine, amaxes)):
            s.current = None
            if s.history is None:
                if not first[i]:
                    continue                     # no history yet: the next step scales from current values
                s.history = torch.zeros(3, s.recipe.history_len, device=row.device)
            # an operand that saw no value this step (an expert no token chose) keeps its last scale
            row = torch.where(row > 0, row, s.history[:, 0])
            pushed = torch.cat([row.unsqueeze(1), s.history[:, :-1]], dim=1)
            s.history = torch.where(finite[i], pushed, s.history)


def history_state(chunks, expert: bool | None = None) -> dict[str, torch.Tensor]:
    """The delayed recipe's amax histories by linear name ([3, history]; agreed, so the same on every rank
    holding the layer): what a checkpoint keeps to resume the scales. ``expert``: only the experts' (True)
    or only the dense layers' (False) linears."""
    return {name: s.history for e in enabled_on(chunks) for name, s in e.linears.items()
            if s.history is not None and expert in (None, s.expert)}


def delayed_linears(chunks) -> list[str]:
    """The names of the linears of ``chunks`` that scale from amax histories (the delayed recipe)."""
    return [name for e in enabled_on(chunks) for name, s in e.linears.items() if s.recipe.delayed]


def load_history_state(chunks, state: dict[str, torch.Tensor], device, saved_dp: int = 1, dp: int = 1) -> None:
    """Put saved amax histories back (those of linears this rank holds; a history of another length is cut
    or padded with zeros at its old end). ``saved_dp``, ``dp``: the data-parallel sizes of the run that
    saved them and of this one; the output-gradient row is rescaled by ``dp / saved_dp`` when they differ
    (see the module docstring)."""
    for e in enabled_on(chunks):
        for name, s in e.linears.items():
            if name in state and s.recipe.delayed:
                saved = state[name].float()
                if dp != saved_dp:
                    saved = saved.clone()
                    saved[G] *= dp / saved_dp
                keep = min(saved.shape[1], s.recipe.history_len)
                h = torch.zeros(3, s.recipe.history_len, device=device)
                h[:, :keep] = saved[:, :keep].to(device)
                s.history = h
