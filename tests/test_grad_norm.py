"""The gradient norm's sum of squares over a range (megazero/parallel/zero/grad_norm.py)."""
import torch

from megazero.parallel.zero.grad_norm import NORM_ROW, squared_norm, squared_norms


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


def _one_range_at_a_time(t):
    """The squared norm as it was computed before the ranges were batched: rows of NORM_ROW, then the tail."""
    whole = t.numel() // NORM_ROW * NORM_ROW
    sq = torch.zeros((), dtype=torch.float64)
    if whole:
        sq += torch.linalg.vector_norm(t[:whole].view(-1, NORM_ROW), dim=1).double().square().sum()
    if whole < t.numel():
        sq += torch.linalg.vector_norm(t[whole:]).double() ** 2
    return sq


def test_squared_norms_of_many_ranges_are_bitwise_each_ranges_own():
    """The batched norms (row norms of each range, one cast and square for all, a sum per range) equal each
    range's norm computed alone bitwise: whole rows only, rows and a tail, a tail only, an empty range."""
    torch.manual_seed(0)
    flat = torch.randn(5 * NORM_ROW + 777) * 3
    cuts = [(0, 2 * NORM_ROW), (2 * NORM_ROW, 3 * NORM_ROW + 5), (3 * NORM_ROW + 5, 3 * NORM_ROW + 5),
            (3 * NORM_ROW + 5, 3 * NORM_ROW + 900), (3 * NORM_ROW + 900, 5 * NORM_ROW + 777)]
    ranges = [flat[a:b] for a, b in cuts]
    for batched, own in zip(squared_norms(ranges), [_one_range_at_a_time(r) for r in ranges]):
        assert batched.dtype == torch.float64 and torch.equal(batched, own), (batched, own)
