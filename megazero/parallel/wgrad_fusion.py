"""Gradient-accumulation fusion (Megatron's ``--gradient-accumulation-fusion``): a linear layer's weight
gradient made straight into the fp32 main gradient of a bf16 (or fp16) weight.

With fp32 main gradients and parameters in a narrower dtype, autograd would make a fresh bf16 weight
gradient every backward and the grad sync would fold it into the fp32 bucket storage (one more kernel and
one gradient-sized tensor per weight per micro-batch). Where the fusion applies, the grad sync gives each
such weight its fp32 target, ``weight.main_grad`` (a view of its bucket's storage: :func:`install_main_grad`),
and :func:`linear` runs :class:`LinearIntoMainGrad`, whose backward accumulates ``dY^T X`` into it:

    CUDA    one GEMM writing fp32: ``addmm(main_grad, dY^T, X, out_dtype=float32, out=main_grad)``
    CPU     ``main_grad += dY^T @ X``: the same product and add as autograd's gradient folded by the hook,
            so the result is bitwise unchanged; marked one kernel (:func:`megazero.kernels.one_kernel`),
            the GEMM a GPU runs

The backward then marks the weight (``grad_added_to_main_grad``) and returns an uninitialised gradient
(an allocation, no kernel), so that autograd still runs the weight's post-accumulate-grad hook, through
which the grad sync counts its bucket down; the hook drops that gradient unread. The dummy is why a
weight must have no other use in the same backward (it would be summed into garbage): the grad sync
installs no target on the tied word embedding. SwiGLU's interleaved gate/up weight (:func:`gate_up`) is two
products of its even and odd rows, each adding into its rows of the target and one of them returning the dummy.
Input and bias gradients are autograd's own formulas (``dY @ W``, ``dY`` summed over tokens), bitwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.kernels import one_kernel

MAIN_GRAD = "main_grad"                       # the fp32 target of a weight's gradient
ADDED = "grad_added_to_main_grad"             # set by the fused backward, cleared by the grad sync's hook


def install_main_grad(param: torch.nn.Parameter, storage: torch.Tensor) -> None:
    """Give ``param`` its fp32 gradient target ``storage`` (flat, ``param.numel()`` elements)."""
    setattr(param, MAIN_GRAD, storage.view(param.shape))
    setattr(param, ADDED, False)


def take_fused(param: torch.nn.Parameter) -> bool:
    """Was the gradient of this backward already added to ``param.main_grad`` by the fused backward? If so,
    forget the mark and the dummy ``.grad`` autograd stored."""
    if not getattr(param, ADDED, False):
        return False
    setattr(param, ADDED, False)
    param.grad = None
    return True


def fuses(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does a linear of ``x`` by ``weight`` accumulate its weight gradient into ``weight.main_grad``? Where the
    grad sync installed one, in a training forward outside a compiled region, for an input whose products
    autograd would run as the 2-D ``mm`` this backward runs (contiguous)."""
    return (getattr(weight, MAIN_GRAD, None) is not None and weight.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and x.dim() >= 2 and x.is_contiguous())


_FP32_OUT_ADDMM = "dtype_out" in torch.ops.aten.addmm.overloads()     # a GEMM writing fp32 from bf16 inputs


def _accumulate(main_grad: torch.Tensor, grad2d: torch.Tensor, x2d: torch.Tensor) -> None:
    """``main_grad += dY^T @ X`` in fp32. On CUDA one GEMM accumulating into ``main_grad`` (rows with a stride, as
    SwiGLU's halves, are a leading dimension to cuBLAS); elsewhere the product in the layout autograd's ``mm``
    backward takes for a weight laid out as ``main_grad`` (contiguous rows: ``dY^T X``; every other row:
    ``(X^T dY)^T``), then the add."""
    if main_grad.is_cuda and main_grad.dtype != grad2d.dtype and _FP32_OUT_ADDMM:
        torch.addmm(main_grad, grad2d.t(), x2d, out_dtype=main_grad.dtype, out=main_grad)
    elif main_grad.is_contiguous():
        main_grad.add_(grad2d.t().mm(x2d))
    else:
        main_grad.add_(x2d.t().mm(grad2d).t())


class LinearIntoMainGrad(torch.autograd.Function):
    """``F.linear(x, weight[rows], bias)`` whose weight gradient is accumulated into ``weight.main_grad[rows]``
    (see the module docstring). ``rows``: a slice of the weight's rows, or None for all of them. ``reports``:
    return the dummy weight gradient that runs the grad sync's hook; of several uses of one weight in a
    backward (SwiGLU's two halves) one reports, so that autograd has no dummies to add."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, reports):
        ctx.save_for_backward(x, weight)
        ctx.param = weight            # the parameter itself: a saved tensor comes back another object under recompute
        ctx.has_bias, ctx.rows, ctx.reports = bias is not None, rows, reports
        return F.linear(x, weight if rows is None else weight[rows], bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = ctx.rows
        grad2d = grad.reshape(-1, grad.shape[-1])
        w = weight if rows is None else weight[rows]
        grad_x = grad2d.mm(w).view(x.shape) if ctx.needs_input_grad[0] else None
        target = getattr(ctx.param, MAIN_GRAD)
        one_kernel("wgrad_accumulate", _accumulate, target if rows is None else target[rows], grad2d,
                   x.reshape(-1, x.shape[-1]))
        setattr(ctx.param, ADDED, True)
        grad_bias = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, torch.empty_like(weight) if ctx.reports else None, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, its weight gradient accumulated into ``weight.main_grad`` where that
    applies (:func:`fuses`)."""
    if fuses(x, weight):
        return LinearIntoMainGrad.apply(x, weight, bias, None, True)
    return F.linear(x, weight, bias)


def gate_up(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's two halves of one interleaved weight (gate rows 0::2, up rows 1::2, bias likewise): two products,
    each weight gradient accumulated into its rows of ``weight.main_grad`` where that applies (:func:`fuses`)."""
    halves = (slice(0, None, 2), slice(1, None, 2))
    biases = (None, None) if bias is None else interleaved_rows(bias)
    if fuses(x, weight):
        return tuple(LinearIntoMainGrad.apply(x, weight, b, rows, rows is halves[0]) for rows, b in zip(halves, biases))
    return tuple(F.linear(x, w, b) for w, b in zip(interleaved_rows(weight), biases))


def interleaved_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The even (gate) and odd (up) rows of SwiGLU's interleaved fc1 weight or bias, as strided views whose
    gradients come back as one stack (two slices' would cost a zero-filled tensor each and their sum)."""
    return t.unflatten(0, (-1, 2)).unbind(1)
