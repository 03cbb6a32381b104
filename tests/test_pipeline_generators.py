"""Schedule generators: every list they write is deadlock-free and complete, batched as the p2p
rules require, and draws as the docs show it (pure Python, no processes)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from megazero.parallel.pipeline import (
    GENERATORS,
    P2P,
    Exchange,
    Op,
    gpipe,
    interleaved_one_f_one_b,
    interleaved_warmup,
    no_pipelining,
    one_f_one_b,
    render,
    simulate,
)
from megazero.parallel.pipeline.actions import B, F


def _cases():
    """Every generated schedule for pp 2-8, m 1-16: GPipe, 1F1B, and interleaved at v=2 where m % pp == 0."""
    for pp in range(2, 9):
        for m in range(1, 17):
            for fo in (False, True):
                yield gpipe, pp, m, 1, fo
                yield one_f_one_b, pp, m, 1, fo
                if m % pp == 0:
                    yield interleaved_one_f_one_b, pp, m, 2, fo


def test_every_generated_schedule_is_deadlock_free_and_as_predicted():
    t0, n = time.perf_counter(), 0
    for gen, pp, m, v, fo in _cases():
        tl = simulate(gen(pp, m, v, fo), m, v, fo)          # raises ScheduleError on any defect
        n += 1
        if fo:
            assert tl.peak_in_flight == (0,) * pp
            continue
        # With one time unit per chunk forward and backward, the bubble is the textbook one.
        assert tl.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12), (gen.__name__, pp, m)
        for r, peak in enumerate(tl.peak_in_flight):
            if gen is gpipe:
                assert peak == m
            elif gen is one_f_one_b:
                assert peak == min(pp - r, m)
            else:
                assert peak == min(interleaved_warmup(m, pp, r, v) + 1, m * v)
    assert n == 2 * (2 * 7 * 16 + sum(16 // pp for pp in range(2, 9)))
    assert time.perf_counter() - t0 < 10, "the schedule sweep should stay fast (pure Python)"


def test_no_pipelining_is_forward_backward_per_micro_batch():
    assert no_pipelining(1, 2) == [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)]]
    assert no_pipelining(1, 2, 1, True) == [[F(0, 0), F(0, 1)]]
    with pytest.raises(ValueError, match="pp=1"):
        no_pipelining(2, 2)


def _x(*ops, wait=True):
    return Exchange(tuple(P2P(op, c, i) for op, c, i in ops), wait)


def test_1f1b_batches_each_steady_step_as_two_exchanges():
    """pp=2, m=3: rank 0 warms up with one forward; in the steady state the activation it sends and
    the gradient it gets travel in one batch, as do the gradient rank 1 returns and the next
    activation it takes."""
    rank0, rank1 = one_f_one_b(2, 3)
    assert rank0 == [F(0, 0), _x((Op.SEND_NEXT, 0, 0)),
                     F(0, 1), _x((Op.SEND_NEXT, 0, 1), (Op.RECV_NEXT, 0, 0)), B(0, 0),
                     F(0, 2), _x((Op.SEND_NEXT, 0, 2), (Op.RECV_NEXT, 0, 1)), B(0, 1),
                     _x((Op.RECV_NEXT, 0, 2)), B(0, 2)]
    assert rank1 == [_x((Op.RECV_PREV, 0, 0)), F(0, 0), B(0, 0), _x((Op.RECV_PREV, 0, 1), (Op.SEND_PREV, 0, 0)),
                     F(0, 1), B(0, 1), _x((Op.RECV_PREV, 0, 2), (Op.SEND_PREV, 0, 1)),
                     F(0, 2), B(0, 2), _x((Op.SEND_PREV, 0, 2))]


def test_interleaved_posts_receives_and_waits_when_needed():
    """pp=2, v=2, m=2 (all warmup): rank 1's second chunk receives from rank 0's, around the ring,
    and every batch is posted without waiting (Megatron's overlapped p2p)."""
    rank0, rank1 = interleaved_one_f_one_b(2, 2, 2)
    assert all(not a.wait for a in rank0 + rank1 if isinstance(a, Exchange))
    assert rank1[:6] == [_x((Op.RECV_PREV, 0, 0), wait=False), F(0, 0),
                         _x((Op.SEND_NEXT, 0, 0), (Op.RECV_PREV, 0, 1), wait=False), F(0, 1),
                         _x((Op.SEND_NEXT, 0, 1), (Op.RECV_PREV, 1, 0), wait=False), F(1, 0)]
    # Rank 0's chunk 1 gets micro-batch 0 from rank 1's chunk 0 (the wrap), in the same batch as it sends.
    assert rank0[3] == _x((Op.SEND_NEXT, 0, 1), (Op.RECV_PREV, 1, 0), wait=False)


def test_generators_reject_what_they_cannot_run():
    with pytest.raises(ValueError, match="one model chunk per rank"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ValueError, match="one model chunk per rank"):
        gpipe(2, 4, 2)
    with pytest.raises(ValueError, match=r"micro-batches \(6\) divisible by pp \(4\)"):
        interleaved_one_f_one_b(4, 6, 2)
    assert set(GENERATORS) == {"1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "none"}


GPIPE_PP4_M8 = """\
rank 0: F0 F1 F2 F3 F4 F5 F6 F7 .. .. .. .. .. .. B0 B1 B2 B3 B4 B5 B6 B7
rank 1: .. F0 F1 F2 F3 F4 F5 F6 F7 .. .. .. .. B0 B1 B2 B3 B4 B5 B6 B7 ..
rank 2: .. .. F0 F1 F2 F3 F4 F5 F6 F7 .. .. B0 B1 B2 B3 B4 B5 B6 B7 .. ..
rank 3: .. .. .. F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .. .. .."""

ONE_F_ONE_B_PP4_M8 = """\
rank 0: F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7
rank 1: .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 ..
rank 2: .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 .. ..
rank 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. .."""

INTERLEAVED_PP4_M8_V2 = """\
rank 0: F0a F1a F2a F3a F0b F1b F2b F3b F4a F5a ... ... ... F6a B0b F7a B1b F4b B2b F5b B3b F6b B0a F7b B1a \
B2a ... B3a B4b ... ... B5b B6b B7b B4a B5a B6a B7a
rank 1: ... F0a F1a F2a F3a F0b F1b F2b F3b ... ... F4a B0b F5a B1b F6a B2b F7a B3b F4b B0a F5b B1a F6b B2a \
F7b B3a B4b ... B5b B6b ... B7b B4a B5a B6a B7a ...
rank 2: ... ... F0a F1a F2a F3a F0b F1b ... F2b B0b F3b B1b F4a B2b F5a B3b F6a B0a F7a B1a F4b B2a F5b B3a \
F6b B4b F7b B5b B6b ... B7b B4a B5a B6a B7a ... ...
rank 3: ... ... ... F0a F1a F2a F3a F0b B0b F1b B1b F2b B2b F3b B3b F4a B0a F5a B1a F6a B2a F7a B3a F4b B4b \
F5b B5b F6b B6b F7b B7b B4a B5a B6a B7a ... ... ..."""


@pytest.mark.parametrize("gen,v,picture", [(gpipe, 1, GPIPE_PP4_M8), (one_f_one_b, 1, ONE_F_ONE_B_PP4_M8),
                                           (interleaved_one_f_one_b, 2, INTERLEAVED_PP4_M8_V2)],
                         ids=["gpipe", "1f1b", "interleaved"])
def test_rendered_pictures_pp4_m8(gen, v, picture):
    """The pictures in docs/parallelism.md: one unit per (chunk) forward and backward, '.' idle;
    with two chunks a micro-batch's letter says which (a = chunk 0, b = chunk 1)."""
    assert render(gen(4, 8, v)) == picture


def test_docs_show_the_rendered_pictures():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    for picture in (GPIPE_PP4_M8, ONE_F_ONE_B_PP4_M8, INTERLEAVED_PP4_M8_V2):
        assert f"```\n{picture}\n```" in docs


def test_every_schedule_flag_value_has_a_generator_and_back():
    """``--pipeline-schedule``'s choices (config, which cannot import the pipeline package) and the
    generators by name are the same set: a schedule added to one and not the other fails here."""
    from megazero.config import SCHEDULES
    assert set(SCHEDULES) == set(GENERATORS) - {"none"}
