"""Which kernels the layers and the optimizer run, and the line the trainer prints about it at start: the
one place where a layer's norm, SwiGLU and RoPE are picked for the device.

    normalisation   apex's FusedLayerNorm / FusedRMSNorm on CUDA when the real apex (NVIDIA's, with its
                    CUDA extensions) is importable; torch's module everywhere else. Under ``--compile``
                    torch's: inductor fuses a norm into its layer's graph, which apex's extension would break.
    RMSNorm         (torch's module, :func:`rms_norm`) Liger-Kernel's Triton kernel on CUDA when
                    ``liger-kernel`` is installed (``pip install megazero[gpu]``); else torch's fused
                    ``F.rms_norm`` on CUDA; on a CPU and under ``--compile`` :class:`RMSNormFunction`, which
                    keeps only x and the per-row statistic for backward (a CPU's composite ``F.rms_norm``
                    also keeps the normalised x).
    SwiGLU          (:func:`swiglu`) silu(gate) * up keeping only gate and up for backward (torch's own
                    autograd also keeps silu(gate): one tensor of ffn features per token more), through
                    :class:`SwiGLUFunction`: on CUDA its forward and backward are each one compiled
                    elementwise kernel (Megatron's fused bias-SwiGLU does the same), or Liger-Kernel's
                    ``LigerSiLUMulFunction`` when installed; on a CPU plain torch ops (one more in backward
                    than torch's autograd runs: silu(gate) again); under ``--compile`` inside the layer's graph.
    RoPE            (:func:`rope`, called by :mod:`megazero.models.gpt.rotary`) through :class:`RoPEFunction`,
                    keeping only the cos/sin table slice the layers share: on CUDA its forward and backward are
                    each one compiled elementwise kernel (torch's ops are five each way, per tensor rotated);
                    on a CPU torch's ops, bitwise torch's autograd; under ``--compile`` inside the layer's
                    graph. Liger's RoPE kernel takes HF's [b, heads, s, d] layout and would cost two transposes
                    of ours ([s, b, heads, d]), so it is not used.
    AdamW           torch's fused kernel (``torch._fused_adamw_``) over the flat fp32 shards: one kernel for
                    the whole update, as apex's FusedAdam is (so apex's is not used).

Each kernel that runs as one fused kernel on CUDA (Liger's, torch's fused norm, or one compiled kernel) runs on
a CPU as several torch ops; :func:`one_kernel` marks such a region, so that the op census
(:mod:`megazero.census`) counts it as the one kernel a GPU runs.

PyPI's package named ``apex`` is unrelated to NVIDIA's: only an ``apex`` that provides
``apex.normalization.FusedLayerNorm`` counts. Which kernels ran is printed at start (:func:`describe_kernels`).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _python_dispatch


def one_kernel(name: str, fn, *args):
    """``fn(*args)``: a computation that runs as one fused kernel on CUDA (``name`` says which) but may run as
    several torch ops here. Outside the op census it is just the call; a census counting the step
    (:class:`megazero.census.OpCensus`, the dispatch mode in force) counts it as one kernel reading the tensors
    in ``args`` and writing those it returns. A GEMM inside (a product with a fused epilogue) stays a GEMM."""
    if torch.compiler.is_compiling():
        return fn(*args)
    count = getattr(_python_dispatch._get_current_dispatch_mode(), "count_one_kernel", None)
    return fn(*args) if count is None else count(name, fn, args)


def apex_norms():
    """(FusedLayerNorm, FusedRMSNorm) of NVIDIA's apex, or None when it is not importable."""
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except (ImportError, AttributeError, OSError):
        return None
    return FusedLayerNorm, FusedRMSNorm


def use_apex_norms(device: torch.device) -> bool:
    """Build the norms with apex's fused kernels? On CUDA, with the real apex only."""
    return torch.device(device).type == "cuda" and apex_norms() is not None


def apex_norm(kind: str, hidden: int, eps: float, dtype, device) -> nn.Module:
    """apex's fused LayerNorm or RMSNorm over ``hidden`` features, in ``dtype`` on ``device``."""
    fused_layer_norm, fused_rms_norm = apex_norms()
    norm = fused_layer_norm(hidden, eps=eps) if kind == "LayerNorm" else fused_rms_norm(hidden, eps=eps)
    return norm.to(dtype=dtype, device=device)


def liger_kernels():
    """Liger-Kernel's autograd functions this module uses (``rms_norm``: LigerRMSNormFunction, ``silu_mul``:
    LigerSiLUMulFunction), or None when ``liger-kernel`` (and its Triton) is not importable."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except (ImportError, AttributeError, OSError, RuntimeError):
        return None
    return SimpleNamespace(rms_norm=LigerRMSNormFunction, silu_mul=LigerSiLUMulFunction)


def use_liger(device: torch.device) -> bool:
    """Run RMSNorm and SwiGLU with Liger-Kernel's Triton kernels? On CUDA, when it is installed."""
    return torch.device(device).type == "cuda" and liger_kernels() is not None


class RMSNormFunction(torch.autograd.Function):
    """weight * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) over the last dim, in float32 (as HF's
    LlamaRMSNorm). Keeps only x and rstd for backward, as a fused kernel does (composite ``F.rms_norm``
    on a CPU also keeps the normalised x: one more activation-sized tensor per norm)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, rstd = one_kernel("rms_norm", rms_norm_forward, x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = one_kernel("rms_norm_backward", rms_norm_backward, grad, x, weight, rstd)
        return grad_x, grad_weight, None


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * x * rstd in x's dtype, rstd in float32 or wider): :class:`RMSNormFunction`'s forward."""
    wide = torch.promote_types(x.dtype, torch.float32)       # float32, or float64 for float64
    rstd = torch.rsqrt(x.to(wide).pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x.to(wide) * rstd).to(x.dtype), rstd


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of x, gradient of the weight) of :func:`rms_norm_forward` for the output's gradient ``grad``."""
    normed = x.to(rstd.dtype) * rstd
    grad = grad.to(rstd.dtype)
    grad_weight = (grad * normed.to(x.dtype).to(rstd.dtype)).reshape(-1, grad.shape[-1]).sum(0)
    scaled = grad * weight.to(rstd.dtype)
    grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim scaled by ``weight`` (by 1 + ``weight`` when ``zero_centred``), by the
    kernel the device has (the module docstring's table)."""
    if not torch.compiler.is_compiling() and x.is_cuda:
        liger = liger_kernels()
        if liger is not None:
            return liger.rms_norm.apply(x, weight, eps, 1.0 if zero_centred else 0.0, "llama", False)
        return F.rms_norm(x, x.shape[-1:], weight + 1 if zero_centred else weight, eps)
    return RMSNormFunction.apply(x, weight + 1 if zero_centred else weight, eps)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of silu(gate) * up for the output's gradient ``grad``: torch's autograd's own ops and
    order (so the result is bitwise autograd's), with silu(gate) made again rather than kept."""
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


@functools.cache
def _compiled(fn):
    """``fn`` as one compiled kernel (a CUDA device's SwiGLU; compiled at first use, for each shape)."""
    return torch.compile(fn, dynamic=False)


def fused(fn, like: torch.Tensor):
    """``fn`` as the device of ``like`` runs a computation it fuses: compiled into one kernel (or the few a
    reduction needs) on CUDA, as its torch ops elsewhere and inside a compiled region (which fuses it with
    its neighbours). Pass the result to :func:`one_kernel` so the op census counts it as the GPU runs it."""
    return _compiled(fn) if like.is_cuda and not torch.compiler.is_compiling() else fn


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up keeping only ``gate`` and ``up`` for backward. ``fused``: forward and backward each run
    as one compiled elementwise kernel (CUDA); else as torch's ops, bitwise torch's autograd."""

    @staticmethod
    def forward(ctx, gate, up, fused: bool):
        ctx.save_for_backward(gate, up)
        ctx.fused = fused
        return one_kernel("swiglu", _compiled(swiglu_forward) if fused else swiglu_forward, gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = one_kernel("swiglu_backward", _compiled(swiglu_backward) if ctx.fused else swiglu_backward,
                                        grad, gate, up)
        return grad_gate, grad_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, by the kernel the device has (the module docstring's table); every path keeps only
    ``gate`` and ``up`` for backward."""
    if torch.compiler.is_compiling():
        return SwiGLUFunction.apply(gate, up, False)            # inductor fuses it into the layer's graph
    if gate.is_cuda:
        liger = liger_kernels()
        if liger is not None and gate.is_contiguous() and up.is_contiguous():
            return liger.silu_mul.apply(gate, up)
        return SwiGLUFunction.apply(gate, up, True)
    return SwiGLUFunction.apply(gate, up, False)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim: RoPE's "rotate half" pairing of feature j with j + d/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on the first ``cos.shape[-1]`` features of ``x``; the rest pass through
    (partial rotary)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of x of :func:`rope_forward` for the output's gradient ``grad``: torch's autograd's own ops
    and order (so the result is bitwise autograd's)."""
    rotary = cos.shape[-1]
    partial = rotary != grad.shape[-1]
    grad_rot = grad[..., :rotary] if partial else grad
    by_sin = grad_rot * sin
    first, second = by_sin[..., :rotary // 2], by_sin[..., rotary // 2:]
    # rotate_half's backward, then the sum; contiguous as autograd's (its sum adds into the contiguous cat's
    # result), whatever the layout of ``grad``, so a reshape after it needs no copy
    grad_x = torch.cat((second, -first), dim=-1) + grad_rot * cos
    if not partial:
        return grad_x
    # autograd sums the two slices' zero-filled gradients: + 0.0 turns a -0 into +0 as that sum does
    return torch.cat((grad_x, grad[..., rotary:]), dim=-1) + 0.0


class RoPEFunction(torch.autograd.Function):
    """:func:`rope_forward` keeping only ``cos`` and ``sin`` (the layers' shared table slice) for backward. On
    CUDA forward and backward each run as one compiled elementwise kernel; else as torch's ops, bitwise torch's
    autograd."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return one_kernel("rope", fused(rope_forward, x), x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return one_kernel("rope_backward", fused(rope_backward, grad), grad, cos, sin), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` [..., head_dim] by the table slice ``cos``, ``sin`` [..., rotary_dim] (broadcast to ``x``;
    rotary_dim <= head_dim, the features past it pass through), by the kernel the device has (the module
    docstring's table); every path keeps only ``cos`` and ``sin`` for backward."""
    if torch.compiler.is_compiling():
        return rope_forward(x, cos, sin)                       # inductor fuses it into the layer's graph
    return RoPEFunction.apply(x, cos, sin)


def describe_kernels(device: torch.device, compiling: bool, zero_centred_norms: bool = False) -> str:
    """The start-of-run line naming the kernels in use and why (``zero_centred_norms``: the model's norms
    scale by 1 + weight, which apex's modules do not, so they are torch's)."""
    cuda = torch.device(device).type == "cuda"
    liger = use_liger(device) and not compiling
    if use_apex_norms(device) and zero_centred_norms:
        norms = "torch (zero-centred norm weights; apex's scale by the weight itself)"
    elif use_apex_norms(device) and not compiling:
        norms = "apex fused (FusedLayerNorm / FusedRMSNorm)"
    elif apex_norms() is not None and compiling:
        norms = "torch (compiled into each layer; apex's would break the graph)"
    else:
        norms = "torch" + ("" if cuda else " (CPU)") + ("" if apex_norms() is not None else ", apex not installed")
    if liger and not use_apex_norms(device):
        norms += "; RMSNorm Liger-Kernel"
    if compiling:
        swiglu_kernels = "compiled into each layer"
    elif liger:
        swiglu_kernels = "Liger-Kernel"
    elif cuda:
        swiglu_kernels = "one compiled kernel each way" + ("" if liger_kernels() is not None else
                                                          ", liger-kernel not installed")
    else:
        swiglu_kernels = "torch (CPU)"
    rope_kernels = ("compiled into each layer" if compiling else "one compiled kernel each way" if cuda else
                    "torch (CPU)")
    return (f" kernels: normalisation {norms} | SwiGLU {swiglu_kernels}, keeps gate and up | RoPE {rope_kernels} | "
            f"AdamW torch fused (one kernel over the flat shards)")
