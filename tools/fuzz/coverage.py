"""Coverage of a campaign: which axis values and which pairs of axis values its layouts exercised.

    cov = Coverage()
    for d in draws: cov.add(d)
    allowed = allowed_pairs(samples=2000, seed=0)        # what the configuration rules let the sampler draw
    print(cov.describe(allowed))

Both layouts of a draw (the first and the resumed one) count: each trains. The allowed pairs are
estimated by drawing layouts without training them (the sampler's rejection against ``validate()``), so
a pair the rules allow but the sampler draws very rarely may be missing from both sides.

A campaign that must cover every allowed pair in few draws picks each draw among several candidate
seeds (:func:`most_covering`: the one adding the most pairs not yet covered), the greedy step of
pairwise test design; each chosen draw still reruns alone from its seed.
"""
from __future__ import annotations

import itertools
import random
from collections import Counter

from megazero.errors import ConfigError
from tools.fuzz.sampler import (
    AXES,
    COMMON,
    MODEL_AXES,
    ROUTER_AXES,
    Draw,
    draw,
    draw_fp8,
    draw_layout,
    model_flags,
    parse_and_validate,
    pick_axes,
    switch_family,
    with_fp8,
)

Pair = tuple[tuple[str, object], tuple[str, object]]


def pairs_of(axes: dict) -> set[Pair]:
    """Every pair of (axis, value) of one layout, axes in :data:`AXES` order."""
    items = [(name, axes[name]) for name in AXES]
    return set(itertools.combinations(items, 2))


class Coverage:
    def __init__(self) -> None:
        self.values: dict[str, Counter] = {name: Counter() for name in AXES}
        self.pairs: Counter = Counter()
        self.layouts = 0

    def add_axes(self, axes: dict) -> None:
        self.layouts += 1
        for name in AXES:
            self.values[name][axes[name]] += 1
        self.pairs.update(pairs_of(axes))

    def add(self, d: Draw) -> None:
        self.add_axes(d.axes)
        self.add_axes(d.resume_axes)

    def describe(self, allowed: set[Pair] | None = None) -> str:
        lines = [f"axes covered ({self.layouts} layouts):"]
        for name, counts in self.values.items():
            lines.append(f"  {name:20s} " + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items(), key=str)))
        if allowed is not None:
            missing = sorted(allowed - set(self.pairs), key=str)
            lines.append(f"pairs of axis values covered: {len(allowed) - len(missing)} of {len(allowed)} allowed "
                         f"({100 * (len(allowed) - len(missing)) / max(len(allowed), 1):.1f}%); "
                         f"{len(set(self.pairs) - allowed)} covered pairs not in the estimate")
            lines += [f"  not covered: {a[0]}={a[1]} x {b[0]}={b[1]}" for a, b in missing[:40]]
            if len(missing) > 40:
                lines.append(f"  ... {len(missing) - 40} more")
        else:
            lines.append(f"pairs of axis values covered: {len(self.pairs)}")
        return "\n".join(lines)


def most_covering(seeds, cov: Coverage) -> Draw:
    """Of the draws of ``seeds``, the one whose two layouts add the most pairs ``cov`` has not covered
    (the first such seed on a tie). Example: with candidates 8, a campaign's draw i is chosen from
    seeds ``seed + 8i`` .. ``seed + 8i + 7``."""
    best, best_new = None, -1
    for seed in seeds:
        d = draw(seed)
        new = len((pairs_of(d.axes) | pairs_of(d.resume_axes)) - cov.pairs.keys())
        if new > best_new:
            best, best_new = d, new
    return best


def allowed_pairs(samples: int = 2000, seed: int = 0) -> set[Pair]:
    """The pairs of axis values seen in ``samples`` valid layouts drawn (and validated, not trained)."""
    rng, out, n = random.Random(seed), set(), 0
    while n < samples:
        model = {**pick_axes(rng, MODEL_AXES), **pick_axes(rng, ROUTER_AXES)}
        model["family"] = switch_family(rng, model["family"])
        try:
            parse_and_validate(COMMON + model_flags(model), 1)
        except ConfigError:
            continue
        axes, world, flags = draw_layout(rng, model)
        fp8, (gather,) = draw_fp8(rng, model, [(axes, world, flags)])
        out |= pairs_of(with_fp8(axes, flags, fp8, gather)[0])
        n += 1
    return out
