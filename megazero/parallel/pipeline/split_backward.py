"""The split backward of zero-bubble pipeline schedules (Qi et al., ICLR 2024): a backward pass ``I``
that computes only the gradients a stage must send back (its input gradient), and a later ``W``
that computes the weight gradients, run when the pipeline would otherwise sit idle.

A linear layer is where the split pays: its input gradient is ``dY @ W`` and its weight gradient
``dY^T @ X`` (about half the backward's FLOPs), and the latter needs nothing from the next layer's
backward. :func:`split_linear` is ``F.linear`` whose weight gradient can be held back::

    store = WeightGradStore()
    y = split_linear(x, weight, bias, store)          # forward as usual
    with store.input_grad_only() as w:                # I: input gradients; weight work is queued
        torch.autograd.backward(y, grad_tensors=dy)
    ...                                               # send x.grad back, run other micro-batches
    w.run()                                           # W: weight (and bias) gradients into .grad

Outside ``input_grad_only()`` it is an ordinary linear layer (full backward). ``w.run()`` adds to
``.grad`` as autograd would (set on the first gradient, summed after), with the same kernels as the
full backward, so I + W gives the full backward's gradients bit for bit. Between I and W the layer's
input and output gradient stay alive: that is the activation memory a zero-bubble schedule counts
until W. In a tensor-parallel layer the communication of the tensor-parallel regions carries input
gradients, so it all happens in I and W stays local (tests/test_pipeline_split_backward.py runs the
column- and row-parallel MLP at tp=2, with and without sequence parallelism); the layers in
``megazero/parallel/tensor.py`` take it by calling :func:`split_linear` where they call ``F.linear``.
Still to come: parameters' post-accumulate-grad hooks do not fire for gradients added by W (the ZeRO
bucket hand-off for deferred gradients), and the split of the other layer kinds.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


class WeightGradWork:
    """The weight-gradient work queued during one ``input_grad_only()`` block: the ``W`` step."""

    def __init__(self):
        self._items: list = []
        self.done = False

    def __len__(self) -> int:
        return len(self._items)

    def run(self) -> None:
        """Compute the queued weight gradients and add them to the parameters' ``.grad``."""
        if self.done:
            raise RuntimeError("this weight-gradient work (W) has run already")
        for fn in self._items:
            fn()
        self._items, self.done = [], True


class WeightGradStore:
    """Where :func:`split_linear` layers queue their weight gradients while a backward runs inside
    :meth:`input_grad_only`."""

    def __init__(self):
        self._collecting: list | None = None

    @contextmanager
    def input_grad_only(self):
        """Backward passes run in this block compute input gradients only; yields the
        :class:`WeightGradWork` that computes the rest."""
        work = WeightGradWork()
        outer, self._collecting = self._collecting, work._items
        try:
            yield work
        finally:
            self._collecting = outer

    def defer(self, fn) -> bool:
        """Queue ``fn`` if a backward is collecting; False (run it now) otherwise."""
        if self._collecting is None:
            return False
        self._collecting.append(fn)
        return True


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,), weight, bias = ctx.saved_tensors, ctx.weight, ctx.bias
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return dx, None, None, None

        def weight_grads():                 # autograd's own kernels for linear: dY^T X, the sum of dY
            dy2 = dy.reshape(-1, dy.shape[-1])
            gw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if want_w else None
            gb = dy2.sum(0) if want_b else None
            return gw, gb

        def run_w():
            with torch.no_grad():
                gw, gb = weight_grads()
            if gw is not None:
                _accumulate(weight, gw)
            if gb is not None:
                _accumulate(bias, gb)

        if ctx.store is not None and ctx.store.defer(run_w):
            return dx, None, None, None
        gw, gb = weight_grads()
        return dx, gw, gb, None


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 store: WeightGradStore | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight and bias gradients go to ``store`` when its
    backward runs inside ``store.input_grad_only()`` (see the module docstring)."""
    return _SplitLinear.apply(x, weight, bias, store)
