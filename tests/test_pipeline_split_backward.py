"""Split backward for linear layers: I (input gradients) + W (deferred weight gradients) equals a
full backward, bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.parallel.pipeline.split_backward import WeightGradStore, split_linear


def _params(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 16), (48,), (16, 48), (16,)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _mlp(x, params, linear):
    w1, b1, w2, b2 = params
    return linear(F.gelu(linear(x, w1, b1)), w2, b2)


def _inputs(seed: int, dtype=torch.float32, shape=(5, 3, 16)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=dtype).requires_grad_(),         # [s, b, h] or [n, h]
            torch.randn(shape, generator=g, dtype=dtype))                          # output gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(5, 3, 16), (37, 16)])
def test_input_grad_then_weight_grad_equals_full_backward(dtype, shape):
    ref, split = _params(0, dtype), _params(0, dtype)
    x_ref, dy = _inputs(1, dtype, shape)
    x = x_ref.detach().clone().requires_grad_()
    torch.autograd.backward(_mlp(x_ref, ref, F.linear), grad_tensors=dy)

    store = WeightGradStore()
    y = _mlp(x, split, lambda a, w, b: split_linear(a, w, b, store))
    with store.input_grad_only() as w:
        torch.autograd.backward(y, grad_tensors=dy)
    assert torch.equal(x.grad, x_ref.grad)                      # I: the input gradient, exactly
    assert all(p.grad is None for p in split) and len(w) == 2   # no weight gradient yet
    w.run()                                                     # W
    for p, q in zip(split, ref):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="has run already"):
        w.run()


def test_deferred_weight_grads_accumulate_over_micro_batches_in_any_order():
    """Two micro-batches: I0, I1, then W1 before W0 (as a zero-bubble schedule may), equal to two
    full backwards accumulating into .grad."""
    ref, split = _params(0), _params(0)
    store, works = WeightGradStore(), []
    for mb in range(2):
        x, dy = _inputs(10 + mb)
        torch.autograd.backward(_mlp(x, ref, F.linear), grad_tensors=dy)
        y = _mlp(x.detach().clone().requires_grad_(), split, lambda a, w, b: split_linear(a, w, b, store))
        with store.input_grad_only() as w:
            torch.autograd.backward(y, grad_tensors=dy)
        works.append(w)
    works[1].run()
    works[0].run()
    for p, q in zip(split, ref):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)   # summed in the other order


def test_outside_the_block_it_is_a_plain_linear():
    ref, split = _params(0), _params(0)
    x, dy = _inputs(1)
    store = WeightGradStore()
    torch.autograd.backward(_mlp(x, ref, F.linear), grad_tensors=dy)
    torch.autograd.backward(_mlp(x.detach(), split, lambda a, w, b: split_linear(a, w, b, store)), grad_tensors=dy)
    for p, q in zip(split, ref):
        assert torch.equal(p.grad, q.grad)


def test_frozen_weights_queue_nothing():
    w, b = torch.randn(4, 3), torch.randn(4)
    x = torch.randn(2, 3, requires_grad=True)
    store = WeightGradStore()
    with store.input_grad_only() as work:
        split_linear(x, w, b, store).sum().backward()
    assert len(work) == 0 and torch.equal(x.grad, torch.ones(2, 4) @ w)
