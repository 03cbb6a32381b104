"""The zero-bubble generator (zero_bubble.py): deadlock-free for pp 2-8, m 1-16 by the simulator, the
paper's ZB-H1 bubble (pp-1)/(3m+pp-1) for m >= pp at 1F1B's memory, run by the real executor on
threads, its pictures in the docs, on gloo processes the same loss and parameters as the serial model
(through the ZeRO grad sync), and ``--pipeline-schedule zb-h1`` through pretrain_gpt.main with sequence
parallelism and recompute, ZeRO-2 per micro-batch, ZeRO-3 kept gathered and activation offload, with the
serial run's losses and parameters (pp 2 and 4, tp 2, dp 2 with ZeRO 1-3 and EP 2 are rows of the schedule
grid in tests/test_pipeline.py)."""
from __future__ import annotations

import itertools

import pytest
from helpers.pipeline_sim import run_on_threads

from megazero.parallel.pipeline import one_f_one_b, simulate
from megazero.parallel.pipeline.actions import Kind
from megazero.parallel.pipeline.zero_bubble import theory, zb_h1


def _held_until(tl, kind, rank: int) -> int:
    """Most micro-batches rank ``rank`` of timeline ``tl`` holds at once, counted from a forward to its
    compute of ``kind`` (I: the whole activation set a backward needs; W: what the weight gradients need)."""
    held = peak = 0
    for _, _, a in sorted(tl.computes[rank], key=lambda c: c[0]):
        if a.kind is Kind.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.kind is kind:
            held -= 1
    return peak


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_list_is_deadlock_free_and_beats_1f1b_at_its_memory(pp):
    for m in range(1, 17):
        for fo in (False, True):
            simulate(zb_h1(pp, m, 1, fo), m, 1, fo)            # raises ScheduleError otherwise
        bubble, peaks = theory(zb_h1, pp, m)
        bubble_1f1b, peaks_1f1b = theory(one_f_one_b, pp, m)
        tl = simulate(zb_h1(pp, m), m, 1, False)
        for r in range(pp):                                    # 1F1B's per-rank peak up to I, its rank-0 peak up to W
            assert _held_until(tl, Kind.BACKWARD_INPUT, r) <= peaks_1f1b[r] == min(pp - r, m)
            assert peaks[r] == _held_until(tl, Kind.BACKWARD_WEIGHT, r) <= max(peaks_1f1b)
        assert bubble < bubble_1f1b
        if m >= pp:                                            # the paper's ZB-H1: (p-1)/(3m+p-1)
            assert bubble == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)


def test_pp4_m8_reaches_the_papers_bubble():
    assert theory(zb_h1, 4, 8)[0] == pytest.approx(3 / 27) and theory(one_f_one_b, 4, 8)[0] == pytest.approx(9 / 33)


@pytest.mark.parametrize("pp,m", list(itertools.product([2, 4], [1, 4, 7])))
def test_executor_runs_i_before_w_per_micro_batch(pp, m):
    for run in run_on_threads(zb_h1, pp, m):
        order = run.stats.order
        for i in range(m):
            assert order.index(("F", 0, i)) < order.index(("I", 0, i)) < order.index(("W", 0, i))
        assert run.stats.in_flight == 0


ONE_F_ONE_B_SPLIT_UNITS = """\
rank 0: F0 F1 F2 F3 .. .. .. .. .. .. B0 B0 F4 B1 B1 F5 B2 B2 F6 B3 B3 F7 B4 B4 .. B5 B5 .. B6 B6 .. B7 B7
rank 1: .. F0 F1 F2 .. .. .. .. B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3 F6 B4 B4 F7 B5 B5 .. B6 B6 .. B7 B7 .. ..
rank 2: .. .. F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4 F6 B5 B5 F7 B6 B6 .. B7 B7 .. .. .. ..
rank 3: .. .. .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5 F6 B6 B6 F7 B7 B7 .. .. .. .. .. .."""

ZB_H1_PP4_M8 = """\
rank 0: F0 F1 F2 F3 .. .. .. I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
rank 1: .. F0 F1 F2 .. .. I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7
rank 2: .. .. F0 F1 .. I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7
rank 3: .. .. .. F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"""


def test_rendered_pictures_are_the_docs():
    """docs/parallelism.md's ZB-H1 picture beside 1F1B's, one unit per F, I and W (B = 2)."""
    from pathlib import Path

    from megazero.parallel.pipeline.simulate import render
    units = {Kind.BACKWARD: 2.0}
    assert render(one_f_one_b(4, 8), durations=units) == ONE_F_ONE_B_SPLIT_UNITS
    assert render(zb_h1(4, 8)) == ZB_H1_PP4_M8
    docs = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    for picture in (ONE_F_ONE_B_SPLIT_UNITS, ZB_H1_PP4_M8):
        assert f"```\n{picture}\n```" in docs


def test_v_other_than_one_is_refused():
    with pytest.raises(ValueError, match="one model chunk per rank"):
        zb_h1(2, 4, 2)


def test_w_fills_the_cooldown():
    lists = zb_h1(4, 8)
    kinds = [a.kind for a in lists[0] if hasattr(a, "kind")]
    assert Kind.BACKWARD not in kinds and kinds.count(Kind.BACKWARD_WEIGHT) == 8


@pytest.mark.parametrize("tp,pp,m", [(1, 2, 4), pytest.param(1, 4, 8, marks=pytest.mark.slow),
                                     pytest.param(2, 2, 4, marks=pytest.mark.slow)])
def test_zero_bubble_matches_serial(tp, pp, m):
    import torch
    from helpers import run_on_ranks
    from helpers.pipeline_parity import check_parity, parallel_body
    # I and W through the ZeRO-0 grad sync: bucket countdown from W, tied-embedding and sequence-parallel sums
    results = run_on_ranks(tp * pp, parallel_body, tp, pp, "zb-h1", 1, m, False, torch.float32, True, timeout=180)
    check_parity(results, m, pp, "zb-h1", 1, torch.float32)
    for r in results:
        assert max(r["peaks"]) <= pp                           # held from F to W: 1F1B's peak


# --pipeline-schedule zb-h1 through pretrain_gpt.main with what the split backward touches beyond the schedule
# grid (tests/test_pipeline.py: every schedule at pp 2 and 4, tp 2, dp 2 with ZeRO 1-3, EP 2): sequence
# parallelism with recompute, ZeRO-2's reduce per micro-batch, ZeRO-3 kept gathered, activation offload.
# Each against the serial run of the same model (fp32): losses, gradient norms and every checkpointed tensor.
ZB = ["--pipeline-schedule", "zb-h1"]
TRAINER_LAYOUTS = [
    ("tp2pp2-sp-recompute", 4, ["--tp", "2", "--pp", "2", "--sequence-parallel", "--recompute-activations"]),
    ("dp2pp2-zero2-each-mb", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "2", "--zero2-reduce-each-microbatch"]),
    ("dp2pp2-zero3-keep-gathered", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "3",
                                       "--zero3-keep-params-gathered"]),
    ("pp2-cpu-offloading", 2, ["--pp", "2", "--cpu-offloading", "--cpu-offloading-num-layers", "1"]),
]


@pytest.fixture(scope="module")
def serial_parity(tmp_path_factory):
    from helpers.trainer import serial_parity_runs
    return serial_parity_runs(tmp_path_factory)


@pytest.mark.parametrize("world,flags", [pytest.param(*c[1:], marks=() if c[0] == "pp2-cpu-offloading" else
                                                      pytest.mark.slow) for c in TRAINER_LAYOUTS],
                         ids=[c[0] for c in TRAINER_LAYOUTS])
def test_trainer_with_zb_h1_matches_serial(world, flags, serial_parity, tmp_path):
    from helpers.trainer import assert_matches_serial
    assert_matches_serial(world, ZB + flags, tmp_path, serial_parity())


def test_start_line_predicts_bubble_and_peak():
    """The line a run prints at start: the schedule's bubble and peak from the simulator (pp 4, m 8)."""
    from megazero.config import JobConfig, ParallelConfig, TrainConfig, validate
    from megazero.models.gpt import GPTConfig
    from megazero.reporting import predicted_pipeline

    def line(schedule):
        job = JobConfig(parallel=ParallelConfig(pp=4, pipeline_schedule=schedule), model=GPTConfig(num_layers=4),
                        train=TrainConfig(micro_batch_size=1, global_batch_size=8))
        return predicted_pipeline(validate(job, world_size=4))

    assert "pipeline zb-h1: predicted bubble 0.111 of the step, peak activations 4 micro-batches" in line("zb-h1")
    assert "pipeline 1f1b: predicted bubble 0.273 of the step, peak activations 4 micro-batches" in line("1f1b")
    assert line("zb-h1").count("\n") == 1                       # one line of its own under the layout line
