"""The by-hand backward of a plain matrix product equals what its autograd node computes, bit for bit,
for every input, operand layout, alpha and beta."""
from __future__ import annotations

import pytest
import torch

from megazero.parallel.pipeline.matmul_grads import operand_grad, saved_operand_names


def _operand(rows: int, cols: int, column_major: bool, g: torch.Generator) -> torch.Tensor:
    t = torch.randn(cols, rows, generator=g).t() if column_major else torch.randn(rows, cols, generator=g)
    return t.requires_grad_()


CASES = {   # name -> (make the output from A, B and a bias)
    "mm": lambda a, b, bias: torch.mm(a, b),
    "addmm": lambda a, b, bias: torch.addmm(bias, a, b),
    "addmm-alpha-beta": lambda a, b, bias: torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
    "linear": lambda a, b, bias: torch.nn.functional.linear(a, b.t(), bias),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("a_cm,b_cm", [(False, False), (False, True), (True, False), (True, True)])
def test_every_input_matches_the_node(case, a_cm, b_cm):
    g = torch.Generator().manual_seed(0)
    a, b = _operand(12, 8, a_cm, g), _operand(8, 5, b_cm, g)
    bias = torch.randn(5, generator=g).requires_grad_()
    out = CASES[case](a, b, bias)
    node = out.grad_fn
    names = saved_operand_names(node)
    assert names is not None, node.name()
    operands = [getattr(node, "_saved_" + n) for n in names]
    dy = torch.randn(out.shape, generator=g)
    expected = node(dy)                        # what autograd's node sends along each input
    expected = expected if isinstance(expected, tuple) else (expected,)
    checked = 0
    for k, (child, _) in enumerate(node.next_functions):
        if child is None:
            continue
        got = operand_grad(node, k, dy, operands)
        want = expected[k]
        if got.shape != want.shape:            # a broadcast bias: the engine sums it down
            got = got.sum_to_size(want.shape)
        assert torch.equal(got, want), (case, k)
        assert got.stride() == want.stride(), (case, k)   # the layout AccumulateGrad takes as it is
        checked += 1
    assert checked >= 2


def test_other_nodes_are_left_to_autograd():
    x = torch.randn(2, 3, 4, requires_grad=True)
    assert saved_operand_names(torch.bmm(x, x.transpose(1, 2)).grad_fn) is None
    assert saved_operand_names((x * 2).grad_fn) is None
