"""The backward of a plain matrix product (``torch.mm``, ``torch.addmm``: every linear layer, column- or
row-parallel) for one input at a time, computed from its autograd node as the node itself would: the
split backward's ``W`` (``split_backward.py``) uses it to compute a weight's half of a matmul it deferred
without an autograd pass through the node.

For ``Y = A @ B`` (``addmm``: ``Y = beta * bias + alpha * A @ B``), given ``dY``::

    dA = dY @ B^T          dB = A^T @ dY          dbias = beta * dY   (summed to the bias's shape)

in the layout autograd's kernel gives: where the operand was column-major (a linear layer's ``B`` is its
weight transposed), the product is formed transposed, so the gradient keeps the parameter's layout and
``AccumulateGrad`` takes it as it is. Same kernels, same operands, same order: the gradient is the full
backward's bit for bit (tests/test_pipeline_matmul_grads.py against the node for every input and layout;
tests/test_pipeline_split_backward.py through W).
"""
from __future__ import annotations

import torch


def saved_operand_names(node) -> tuple[str, str] | None:
    """The names of ``node``'s two saved matrix operands (``node._saved_<name>``), first operand first, if
    it is a node this module computes by hand; else None."""
    return _OPERANDS.get(node.name())


def operand_grad(node, k: int, dy: torch.Tensor, operands: list) -> torch.Tensor:
    """The gradient ``node`` sends along its input ``k`` (its ``next_functions[k]``) for output gradient
    ``dy``, from its saved ``operands`` (as :func:`saved_operand_names` orders them). A bias's gradient
    comes at ``dy``'s shape; the caller sums it to the bias's, as autograd's engine does."""
    first, second = operands
    if node.name() == "AddmmBackward0":
        if k == 0:                              # the bias
            return dy if node._saved_beta == 1 else dy * node._saved_beta
        alpha, k = node._saved_alpha, k - 1
        names = ("mat1", "mat2")
    else:
        alpha, names = 1, ("self", "mat2")
    if k == 0:                                  # dA = dY @ B^T
        return _product(dy, second, _layout(node, names[0]), alpha, first=True)
    return _product(dy, first, _layout(node, names[1]), alpha, first=False)   # dB = A^T @ dY


def _layout(node, name: str) -> bool:
    """Was the operand ``name`` of ``node`` column-major (strides (1, rows))?"""
    sizes, strides = getattr(node, f"_saved_{name}_sym_sizes"), getattr(node, f"_saved_{name}_sym_strides")
    return strides[0] == 1 and strides[1] == sizes[0]


def _product(dy, other, column_major: bool, alpha, first: bool) -> torch.Tensor:
    if first:
        g = other.mm(dy.t()).t() if column_major else dy.mm(other.t())
    else:
        g = dy.t().mm(other).t() if column_major else other.t().mm(dy)
    return g if alpha == 1 else g * alpha


_OPERANDS = {"AddmmBackward0": ("mat1", "mat2"), "MmBackward0": ("self", "mat2")}
