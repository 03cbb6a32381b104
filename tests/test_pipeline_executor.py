"""The executor: lists are checked once per (schedule, pp, m, v) before anything runs, and each
rank's list drives the runner and the p2p batches (the schedules' end-to-end runs are in
tests/test_pipeline.py: on threads for many pp and m, on gloo against the serial model)."""
from __future__ import annotations

import pytest
from helpers.pipeline_sim import FakeRunner, layout

from megazero.parallel.pipeline import Compute, Kind, ScheduleError, checked_schedule, execute, one_f_one_b
from megazero.parallel.pipeline.actions import B, F


def test_checked_schedule_runs_the_checker_once_and_rejects_bad_lists():
    calls = []

    def counted(pp, m, v, forward_only):
        calls.append((pp, m, v, forward_only))
        return one_f_one_b(pp, m, v, forward_only)

    first = checked_schedule(counted, 4, 8, 1, False)
    assert checked_schedule(counted, 4, 8, 1, False) is first and calls == [(4, 8, 1, False)]
    assert isinstance(first, tuple) and all(isinstance(acts, tuple) for acts in first)

    def dropped_receive(pp, m, v, forward_only):
        lists = [list(acts) for acts in one_f_one_b(pp, m, v, forward_only)]
        del lists[1][0]
        return lists

    with pytest.raises(ScheduleError, match=r"rank 1 action 0 \(F\(chunk 0, micro-batch 0\)\) would block"):
        checked_schedule(dropped_receive, 2, 2, 1, False)
    with pytest.raises(ValueError, match="gave 1 action lists for 2 pipeline ranks"):
        checked_schedule(lambda pp, m, v, fo: [[F(0, 0)]], 2, 1, 1, True)


def test_execute_runs_computes_in_list_order_without_comm():
    runner = FakeRunner(layout(1, 0), 1, 2)
    execute([F(0, 1), F(0, 0), B(0, 0), B(0, 1)], runner, None)
    assert runner.stats.order == [("F", 0, 1), ("F", 0, 0), ("B", 0, 0), ("B", 0, 1)]
    assert runner.stats.peak_in_flight == 2


def test_split_backward_runs_i_then_w_and_holds_the_micro_batch_until_w():
    runner = FakeRunner(layout(1, 0), 1, 2)
    execute([F(0, 0), Compute(Kind.BACKWARD_INPUT, 0, 0), F(0, 1), Compute(Kind.BACKWARD_WEIGHT, 0, 0),
             Compute(Kind.BACKWARD_INPUT, 0, 1), Compute(Kind.BACKWARD_WEIGHT, 0, 1)], runner, None)
    assert runner.stats.order == [("F", 0, 0), ("I", 0, 0), ("F", 0, 1), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)]
    assert runner.stats.peak_in_flight == 2
