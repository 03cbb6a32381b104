"""Stored-piece geometry (megazero/checkpoint/regions.py) against brute force on small tensors."""
import itertools
import random

import torch

from megazero.checkpoint.regions import flat_boxes, numel, overlap_runs, piece_boxes


def _elements(box, a, b):
    """Global coordinates of the piece (box, flat [a, b)), in the box's row-major order."""
    return list(itertools.product(*(range(lo, hi) for lo, hi in box)))[a:b]


def test_docstring_example():
    assert piece_boxes([[0, 4], [3, 6]], 5, 11) == [[[1, 2], [5, 6]], [[2, 3], [3, 6]], [[3, 4], [3, 5]]]


def test_flat_boxes_cover_the_range_exactly():
    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        n = numel([[0, s] for s in shape])
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        boxes = flat_boxes(shape, a, b)
        assert len(boxes) <= 2 * len(shape) - 1
        covered = [c for box in boxes for c in itertools.product(*(range(lo, hi) for lo, hi in box))]
        assert covered == _elements([[0, s] for s in shape], a, b)


def test_overlap_runs_copy_exactly_the_shared_elements():
    """A global tensor stored as one piece and needed as another: copying the runs gives the
    needed piece's shared elements, and nothing else is touched."""
    rng = random.Random(1)
    for _ in range(300):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        full = torch.arange(numel([[0, s] for s in shape])).reshape(shape)

        def piece():
            box = [sorted(rng.sample(range(s + 1), 2)) if s > 1 else [0, 1] for s in shape]
            m = numel(box)
            a = rng.randint(0, m)
            return box, (a, rng.randint(a, m))

        (sbox, srange), (dbox, drange) = piece(), piece()
        src = torch.stack([full[c] for c in _elements(sbox, *srange)]) if srange[1] > srange[0] else torch.empty(0)
        dst = torch.full((drange[1] - drange[0],), -1, dtype=full.dtype)
        for s, d, n in overlap_runs(sbox, srange, dbox, drange):
            dst[d:d + n] = src[s:s + n]
        shared = set(_elements(sbox, *srange))
        for i, c in enumerate(_elements(dbox, *drange)):
            assert dst[i].item() == (full[c].item() if c in shared else -1)
