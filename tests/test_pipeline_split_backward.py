"""Split backward for linear layers: I (input gradients) + W (deferred weight gradients) equals a
full backward, bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import run_on_ranks

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


def _tp_mlp_body(rank, world, sp):
    """A Megatron MLP on tp=2 (column-parallel, gelu, row-parallel; with sequence parallelism the
    input is gathered and the output reduce-scattered along the sequence), its matmuls as
    split_linear or as F.linear. Returns the gradients of both: the tp communication happens in I
    (it carries input gradients), W is local."""
    from megazero.parallel.tensor import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                          reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region)
    from megazero.parallel.topology import Topology

    group = Topology(tp=world).tp_group
    w1, b1, w2, b2 = (p.detach() for p in _params(0))
    shards = [w1.chunk(world, 0)[rank], b1.chunk(world, 0)[rank], w2.chunk(world, 1)[rank], b2]
    x_full, dy_full = _inputs(1, shape=(6, 3, 16))
    x0, dy = (x_full.chunk(world, 0)[rank], dy_full.chunk(world, 0)[rank]) if sp else (x_full.detach(), dy_full)
    store, grads = WeightGradStore(), {}
    for name, linear in (("full", F.linear), ("split", lambda a, w, b: split_linear(a, w, b, store))):
        params = [s.clone().requires_grad_() for s in shards]
        x = x0.detach().clone().requires_grad_()
        h = gather_from_sequence_parallel_region(x, group) if sp else copy_to_tp_region(x, group)
        y = linear(F.gelu(linear(h, params[0], params[1])), params[2], None)
        y = reduce_scatter_to_sequence_parallel_region(y, group) if sp else reduce_from_tp_region(y, group)
        y = y + params[3]
        with store.input_grad_only() as w:
            torch.autograd.backward(y, grad_tensors=dy)
        input_grad_before_w, pending = x.grad.clone(), len(w)
        held_back = [p.grad is None for p in params[:3]]
        w.run()
        grads[name] = [input_grad_before_w] + [p.grad for p in params]
        grads[name + " deferred"] = (pending, held_back)
    return grads


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_split_backward_through_column_and_row_parallel_layers(sp):
    for grads in run_on_ranks(2, _tp_mlp_body, sp, timeout=120):
        assert grads["full deferred"] == (0, [False] * 3)
        assert grads["split deferred"] == (2, [True] * 3)      # both matmuls' weight (and bias) work waited for W
        for full, split in zip(grads["full"], grads["split"]):
            assert torch.equal(full, split)
