"""The gradient norm's sum of squares over a range (megazero/parallel/zero/grad_norm.py)."""
import torch

from megazero.parallel.zero.grad_norm import squared_norm


def test_squared_norm_of_a_long_range_is_float64_accurate():
    """The gradient norm's sum of squares over a 400k-element fp32 range within 1e-7 of float64, however the
    range is cut (one float32 norm over it is ~6e-6 off: enough for two layouts that cut the gradients into
    other ranges to differ in the gradient norm)."""
    g = torch.randn(400_001, generator=torch.Generator().manual_seed(0)) * 1e-3
    want = float(torch.linalg.vector_norm(g.double()) ** 2)
    assert abs(float(torch.linalg.vector_norm(g).double() ** 2) - want) / want > 1e-6     # the float32 norm
    assert abs(float(squared_norm(g)) - want) / want < 1e-7
    halves = float(squared_norm(g[:200_000]) + squared_norm(g[200_000:]))
    assert abs(halves - want) / want < 1e-7
