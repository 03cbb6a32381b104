"""ZB-V (zero_bubble_v.py): the V placement, deadlock-free for pp 2-8, m 1-16 by the simulator, a bubble
below ZB-H1's (and 1F1B's) for m >= pp at 1F1B's memory, run by the real executor on threads (the turn
of the V handed over locally), its picture in the docs, on gloo processes the same loss, gradients and
parameters as the serial model, and ``--pipeline-schedule zb-v`` through pretrain_gpt.main against the
serial run (losses and the saved parameters; the checkpoint loads at pp 1)."""
from __future__ import annotations

import itertools

import pytest
from helpers.pipeline_sim import run_on_threads

from megazero.parallel.pipeline import one_f_one_b, simulate
from megazero.parallel.pipeline.actions import Compute, Exchange, Kind, Op, P2P
from megazero.parallel.pipeline.partition import V, placements
from megazero.parallel.pipeline.simulate import ScheduleError
from megazero.parallel.pipeline.zero_bubble import theory, zb_h1
from megazero.parallel.pipeline.zero_bubble_v import zb_v


def test_v_placement_puts_both_ends_on_rank_0():
    """L = 8, pp = 2: stages 0 1 | 2 3 on ranks 0 1 | 1 0; embedding on rank 0 chunk 0, loss on rank 0 chunk 1."""
    got = [[(p.layer_ids, p.pre_process, p.post_process) for p in placements(8, 2, r, 2, V)] for r in range(2)]
    assert got == [[((0, 1), True, False), ((6, 7), False, True)],
                   [((2, 3), False, False), ((4, 5), False, False)]]
    layers = sorted(i for r in range(4) for p in placements(16, 4, r, 2, V) for i in p.layer_ids)
    assert layers == list(range(16))


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_list_is_deadlock_free_and_beats_zb_h1_at_1f1b_memory(pp):
    for m in range(1, 17):
        for fo in (False, True):
            simulate(zb_v(pp, m, 2, fo), m, 2, fo, shape=V)            # raises ScheduleError otherwise
        bubble, peaks = theory(zb_v, pp, m, 2)
        assert max(peaks) <= 2 * pp        # chunk sets of half a rank's layers: 1F1B's rank-0 peak of pp
        if m >= pp:
            assert bubble < theory(zb_h1, pp, m)[0] < theory(one_f_one_b, pp, m)[0]
            assert bubble >= (pp - 1) / (6 * m + pp - 1) - 1e-12           # the paper's ZB-V bound


def test_pp4_m8_reaches_the_papers_bubble():
    """(pp-1)/(6m+pp-1) = 3/51, about half of ZB-H1's 3/27 at pp 4, m 8."""
    assert theory(zb_v, 4, 8, 2)[0] == pytest.approx(3 / 51)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_turn_is_local_and_the_loss_is_on_rank_0(pp):
    lists = zb_v(pp, 2 * pp)
    ops = [{(p.op, p.chunk) for a in acts if isinstance(a, Exchange) for p in a.ops} for acts in lists]
    turn = {(Op.SEND_NEXT, 0), (Op.RECV_NEXT, 0), (Op.RECV_PREV, 1), (Op.SEND_PREV, 1)}
    assert not ops[pp - 1] & turn                         # the last rank's chunk 0 feeds its chunk 1 locally
    assert not ops[0] & {(Op.SEND_NEXT, 1), (Op.SEND_PREV, 0)}   # the loss and the embedding end there
    bad = list(lists[pp - 1])                             # a list that sends the turn anyway is reported
    i = next(k for k, a in enumerate(bad) if a == Compute(Kind.FORWARD, 0, 0))
    bad.insert(i + 1, Exchange((P2P(Op.SEND_NEXT, 0, 0),)))
    with pytest.raises(ScheduleError, match="is on this rank: the hand-off is local"):
        simulate(lists[:-1] + [bad], 2 * pp, 2, shape=V)


@pytest.mark.parametrize("pp,m", list(itertools.product([2, 3, 4], [1, 4, 7])))
def test_executor_runs_the_v_on_threads(pp, m):
    for fo in (False, True):
        runs = run_on_threads(zb_v, pp, m, 2, fo)
        if fo:
            continue
        for run in runs:
            order = run.stats.order
            for c, i in itertools.product(range(2), range(m)):
                assert order.index(("F", c, i)) < order.index(("I", c, i)) < order.index(("W", c, i))
            assert run.stats.in_flight == 0


def test_v_other_than_two_is_refused():
    with pytest.raises(ValueError, match="two model chunks per rank in a V"):
        zb_v(2, 4, 1)


def test_rendered_picture_is_the_docs():
    from pathlib import Path

    from megazero.parallel.pipeline.simulate import render
    picture = render(zb_v(4, 8), shape=V)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    assert f"```\n{picture}\n```" in docs
