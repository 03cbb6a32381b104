"""The schedule checker: broken action lists are reported with the rank and the action that would
block; valid ones get their timeline, bubble and peak in-flight activations."""
from __future__ import annotations

import pytest

from megazero.parallel.pipeline import (
    P2P,
    Compute,
    Exchange,
    Kind,
    Op,
    ScheduleError,
    gpipe,
    one_f_one_b,
    render,
    simulate,
)
from megazero.parallel.pipeline.actions import B, F


def _mutable(lists):
    return [list(acts) for acts in lists]


def test_swapped_batches_deadlock_and_name_the_blocked_ranks():
    """GPipe pp=2 m=2, rank 0 asks for the first gradient before sending the second activation:
    rank 0 waits for a gradient while rank 1 waits for that activation."""
    lists = _mutable(gpipe(2, 2))
    assert lists[0][3] == Exchange((P2P(Op.SEND_NEXT, 0, 1),)) and lists[0][4] == Exchange((P2P(Op.RECV_NEXT, 0, 0),))
    lists[0][3], lists[0][4] = lists[0][4], lists[0][3]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(lists)
    e = err.value
    assert (e.rank, e.index, e.action) == (0, 3, lists[0][3])
    msg = str(e)
    assert "rank 0 blocks at action 3 (exchange[recv-next gradient (chunk 0, micro-batch 0)])" in msg
    assert "rank 1 blocks at action 2 (exchange[recv-prev activation (chunk 0, micro-batch 1)])" in msg


def test_swapped_compute_breaks_a_data_dependency():
    """1F1B pp=4 m=8: the last rank's first backward moved before its forward."""
    lists = _mutable(one_f_one_b(4, 8))
    assert lists[3][1:3] == [F(0, 0), B(0, 0)]
    lists[3][1], lists[3][2] = lists[3][2], lists[3][1]
    expected = r"rank 3 action 1 \(B\(chunk 0, micro-batch 0\)\) runs before its forward"
    with pytest.raises(ScheduleError, match=expected) as err:
        simulate(lists)
    assert (err.value.rank, err.value.index, err.value.action) == (3, 1, B(0, 0))


def test_dropped_receive_is_reported_where_the_data_is_missing():
    """1F1B pp=4 m=8: rank 2 drops its first receive; its first forward would wait forever."""
    lists = _mutable(one_f_one_b(4, 8))
    assert lists[2][0] == Exchange((P2P(Op.RECV_PREV, 0, 0),))
    del lists[2][0]
    with pytest.raises(ScheduleError, match=r"rank 2 action 0 \(F\(chunk 0, micro-batch 0\)\) would block: "
                                            r"its input activation has not arrived") as err:
        simulate(lists)
    assert (err.value.rank, err.value.index) == (2, 0)


def test_dropped_receive_inside_a_batch():
    """The gradient receive taken out of rank 0's first steady batch: its backward has no input."""
    lists = _mutable(one_f_one_b(2, 4))
    k = next(k for k, a in enumerate(lists[0]) if isinstance(a, Exchange) and len(a.ops) == 2)
    lists[0][k] = Exchange(lists[0][k].ops[:1])
    with pytest.raises(ScheduleError, match=r"rank 0 action \d+ \(B\(chunk 0, micro-batch 0\)\) would block: "
                                            r"its output gradient has not arrived"):
        simulate(lists)


def test_received_messages_are_checked_against_what_the_action_expects():
    """Rank 1 of GPipe pp=2 takes micro-batch 1's activation first, but rank 0 sends micro-batch 0 first."""
    lists = _mutable(gpipe(2, 2, 1, True))
    lists[1] = [Exchange((P2P(Op.RECV_PREV, 0, 1),)), Exchange((P2P(Op.RECV_PREV, 0, 0),)), F(0, 0), F(0, 1)]
    with pytest.raises(ScheduleError, match=r"rank 1 action 0 .* receives the activation for virtual stage 1, "
                                            r"micro-batch 1, but message 0 from rank 0 is the activation for "
                                            r"virtual stage 1, micro-batch 0"):
        simulate(lists)


def test_incomplete_and_impossible_lists():
    with pytest.raises(ScheduleError, match=r"rank 0 never runs B\(chunk 0, micro-batch 1\)") as err:
        simulate([[F(0, 0), B(0, 0), F(0, 1)]], m=2, v=1, forward_only=False)
    assert err.value.rank == 0 and err.value.action == B(0, 1)
    with pytest.raises(ScheduleError, match="virtual stage 0 has no previous stage"):
        simulate([[Exchange((P2P(Op.RECV_PREV, 0, 0),)), F(0, 0)]], m=1, v=1, forward_only=True)
    with pytest.raises(ScheduleError, match="not computed yet"):
        simulate([[Exchange((P2P(Op.SEND_NEXT, 0, 0),)), F(0, 0)], [Exchange((P2P(Op.RECV_PREV, 0, 0),)), F(0, 0)]],
                 m=1, v=1, forward_only=True)
    with pytest.raises(ScheduleError, match="runs a second time"):
        simulate([[F(0, 0), F(0, 0)]], m=1, v=1, forward_only=True)
    with pytest.raises(ScheduleError, match="is a backward in a forward-only schedule"):
        simulate([[F(0, 0), B(0, 0)]], m=1, v=1, forward_only=True)
    with pytest.raises(ScheduleError, match="receives the activation of chunk 0 micro-batch 1 and never uses it"):
        simulate([[F(0, 0), Exchange((P2P(Op.SEND_NEXT, 0, 0),)), F(0, 1), Exchange((P2P(Op.SEND_NEXT, 0, 1),))],
                  [Exchange((P2P(Op.RECV_PREV, 0, 0),)), F(0, 0), Exchange((P2P(Op.RECV_PREV, 0, 1),))]],
                 forward_only=True)


def test_split_backward_is_checked_and_counted_until_w():
    """I (input gradient) then W (weight gradient): the activations count as held until W."""
    i, w = Compute(Kind.BACKWARD_INPUT, 0, 0), Compute(Kind.BACKWARD_WEIGHT, 0, 0)
    tl = simulate([[F(0, 0), F(0, 1), i, Compute(Kind.BACKWARD_INPUT, 0, 1), w, Compute(Kind.BACKWARD_WEIGHT, 0, 1)]])
    assert tl.peak_in_flight == (2,)
    with pytest.raises(ScheduleError, match=r"runs before the input-gradient backward \(I\)"):
        simulate([[F(0, 0), w, i]])


def test_timeline_peaks_bubble_and_durations():
    tl = simulate(one_f_one_b(4, 8))
    assert tl.peak_in_flight == (4, 3, 2, 1)
    assert tl.makespan == 2 * (8 + 4 - 1) and tl.bubble_fraction == pytest.approx(3 / 11)
    # Backward twice as long as forward: the same bubble fraction, stretched.
    slow_b = simulate(one_f_one_b(4, 8), durations={Kind.BACKWARD: 2.0})
    assert slow_b.makespan == 3 * (8 + 4 - 1) and slow_b.bubble_fraction == pytest.approx(3 / 11)
    assert render(one_f_one_b(2, 2), durations={Kind.BACKWARD: 2.0}) == (
        "rank 0: F0 F1 .. .. B0 B0 .. B1 B1\n"
        "rank 1: .. F0 B0 B0 F1 B1 B1 .. ..")


def test_durations_per_rank():
    """Measured costs differ by rank: ZB-H1 at pp 2, m 8 with the last rank's I twice as long. That rank
    is then the bottleneck, busy from 1 to 33 (8 x (F + I + W) = 32 units after rank 0's first F), rank 0
    24 units of those 33: bubble 1 - 56 / 66."""
    from megazero.parallel.pipeline import schedule_by_name

    units = {Kind.FORWARD: 1.0, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.0}
    lists = schedule_by_name("zb-h1")(2, 8, 1, False)
    tl = simulate(lists, durations=[units, {**units, Kind.BACKWARD_INPUT: 2.0}])
    assert tl.makespan == 33 and tl.bubble_fraction == pytest.approx(1 - 56 / 66)
    assert simulate(lists, durations=[units, units]).makespan == simulate(lists, durations=units).makespan
    with pytest.raises(ValueError, match="durations for 3 ranks, lists for 2"):
        simulate(lists, durations=[units] * 3)


def test_v_shape_peers_and_wire_slots():
    """In the V (pp 3, two chunks) rank 1's chunk 1 gets its activation from rank 2 and its chunk 0 from
    rank 0 (both "recv-prev", on different wires), and rank 2 hands chunk 0's output to its chunk 1 with
    no message. The same lists do not run as the loop, and a batch may not put two ops on one wire."""
    from megazero.parallel.pipeline.partition import V
    fwd = [[F(0, 0), Exchange((P2P(Op.SEND_NEXT, 0, 0),)), Exchange((P2P(Op.RECV_PREV, 1, 0),)), F(1, 0)],
           [Exchange((P2P(Op.RECV_PREV, 0, 0),)), F(0, 0), Exchange((P2P(Op.SEND_NEXT, 0, 0),)),
            Exchange((P2P(Op.RECV_PREV, 1, 0),)), F(1, 0), Exchange((P2P(Op.SEND_NEXT, 1, 0),))],
           [Exchange((P2P(Op.RECV_PREV, 0, 0),)), F(0, 0), F(1, 0), Exchange((P2P(Op.SEND_NEXT, 1, 0),))]]
    assert simulate(fwd, 1, 2, True, shape=V).makespan == 6      # 6 stages, the turn on rank 2 is local
    with pytest.raises(ScheduleError, match="rank 2 action 2 .* would block"):
        simulate(fwd, 1, 2, True)                                # the same lists read as the loop deadlock
    two = Exchange((P2P(Op.SEND_NEXT, 0, 0), P2P(Op.SEND_PREV, 1, 0)))   # both to rank 1 on the send-next wire
    with pytest.raises(ScheduleError, match="two operations on the same wire slot"):
        simulate([[F(0, 0), two], fwd[1], fwd[2]], 1, 2, True, shape=V)
