"""Geometry of stored pieces: which elements of a global tensor a piece holds, and how two overlap.

A *piece* is the part of a tensor one rank stores or needs: a rectangular ``box`` of the global tensor
(``[[lo, hi], ...]`` per dim: its tp-local region) and a flat range ``[a, b)`` of the box's elements in
row-major order (its ZeRO shard of that region; the whole box is ``[0, numel(box))``). Worked
example: a [4, 6] tensor split on dim 1 over tp = 2, tp rank 1, whose ZeRO shard is flat [5, 11)::

    box [[0, 4], [3, 6]]   (a 4 x 3 region)      box-flat order:   0  1  2 | 3  4  5 | 6  7  8 | 9 10 11
    flat [5, 11)           -> elements           rows 1..3:              .  .  5 | 6  7  8 | 9 10  .
    as boxes (global):     [[1, 2], [5, 6]], [[2, 3], [3, 6]], [[3, 4], [3, 5]]

Two pieces overlap in a set of boxes; each box's rows (all dims but the last fixed) are contiguous
*runs* in both pieces' flat orders, which is how data is copied from a stored piece into a needed one.
"""
from __future__ import annotations

import itertools
import math

Box = list[list[int]]


def numel(box: Box) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in box)


def shape_of(box: Box) -> list[int]:
    return [hi - lo for lo, hi in box]


def flat_boxes(shape: list[int], a: int, b: int) -> list[Box]:
    """Boxes (in coordinates of a tensor of ``shape``) whose union is flat range [a, b) of its
    row-major order: at most 2 * ndim - 1 of them, in order."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [[[a, b]]] if shape else [[]]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner
    if first == last:
        return [[[first, first + 1]] + sub for sub in flat_boxes(shape[1:], a - first * inner, b - first * inner)]
    out = []
    if a % inner:                                   # a partial first row
        out += [[[first, first + 1]] + sub for sub in flat_boxes(shape[1:], a % inner, inner)]
        first += 1
    full_end = b // inner
    if full_end > first:                            # whole rows
        out.append([[first, full_end]] + [[0, n] for n in shape[1:]])
    if b % inner:                                   # a partial last row
        out += [[[full_end, full_end + 1]] + sub for sub in flat_boxes(shape[1:], 0, b % inner)]
    return out


def piece_boxes(box: Box, a: int, b: int) -> list[Box]:
    """Global boxes of the piece (``box``, flat [a, b))."""
    return [[[lo + x, lo + y] for (x, y), (lo, _) in zip(sub, box)] for sub in flat_boxes(shape_of(box), a, b)]


def intersect(p: Box, q: Box) -> Box | None:
    out = [[max(a, c), min(b, d)] for (a, b), (c, d) in zip(p, q)]
    return out if all(lo < hi for lo, hi in out) else None


def strides(box: Box) -> list[int]:
    shape = shape_of(box)
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def runs(part: Box, src_box: Box, dst_box: Box) -> list[tuple[int, int, int]]:
    """``(src flat, dst flat, length)`` runs copying box ``part`` (inside both boxes) from ``src_box``'s
    row-major order to ``dst_box``'s. Rows are merged into one run where both orders are contiguous."""
    if not part:                                    # a 0-d tensor
        return [(0, 0, 1)]
    s_str, d_str = strides(src_box), strides(dst_box)
    # the longest trailing block of dims that ``part`` covers whole in both boxes is contiguous in both
    k = len(part) - 1
    while k > 0 and part[k] == src_box[k] == dst_box[k]:
        k -= 1
    length = math.prod(hi - lo for lo, hi in part[k:])
    out = []
    for idx in itertools.product(*(range(lo, hi) for lo, hi in part[:k])):
        coords = list(idx) + [lo for lo, _ in part[k:]]
        src = sum((x - lo) * s for x, (lo, _), s in zip(coords, src_box, s_str))
        dst = sum((x - lo) * s for x, (lo, _), s in zip(coords, dst_box, d_str))
        out.append((src, dst, length))
    return out


def overlap_runs(src_box: Box, src_range: tuple[int, int], dst_box: Box,
                 dst_range: tuple[int, int]) -> list[tuple[int, int, int]]:
    """Runs ``(src offset, dst offset, length)`` of the elements two pieces share, offsets relative to
    each piece's flat start (``src_range[0]``, ``dst_range[0]``), sorted by source offset."""
    out = []
    for s in piece_boxes(src_box, *src_range):
        for d in piece_boxes(dst_box, *dst_range):
            part = intersect(s, d)
            if part is not None:
                out += [(x - src_range[0], y - dst_range[0], n) for x, y, n in runs(part, src_box, dst_box)]
    return sorted(out)
