"""ZB-V (zero_bubble_v.py; the V placement is tested with partition's in test_pipeline.py): deadlock-free
for pp 2-8, m 1-16 by the simulator, a bubble below ZB-H1's (and 1F1B's) for m >= pp at 1F1B's memory,
run by the real executor on threads (the turn of the V handed over locally), its picture in the docs, on gloo processes the same loss, gradients and
parameters as the serial model, and ``--pipeline-schedule zb-v`` through pretrain_gpt.main against the
serial run (losses and the saved parameters; the checkpoint loads at pp 1) at pp 2 and 4, tp 2, dp 2 with
ZeRO 1-3, EP 2, and with sequence parallelism + recompute, per-micro-batch reduction, kept ZeRO-3
gathers and CPU activation offloading."""
from __future__ import annotations

import itertools

import pytest
from helpers.pipeline_sim import run_on_threads

from megazero.parallel.pipeline import one_f_one_b, simulate
from megazero.parallel.pipeline.actions import P2P, Compute, Exchange, Kind, Op
from megazero.parallel.pipeline.partition import V
from megazero.parallel.pipeline.simulate import ScheduleError
from megazero.parallel.pipeline.zero_bubble import theory, zb_h1
from megazero.parallel.pipeline.zero_bubble_v import zb_v


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_list_is_deadlock_free_and_beats_zb_h1_at_1f1b_memory(pp):
    for m in range(1, 17):
        for fo in (False, True):
            simulate(zb_v(pp, m, 2, fo), m, 2, fo, shape=V)            # raises ScheduleError otherwise
        bubble, peaks = theory(zb_v, pp, m, 2)
        assert max(peaks) <= 2 * pp        # chunk sets of half a rank's layers: 1F1B's rank-0 peak of pp
        if m >= pp:
            assert bubble < theory(zb_h1, pp, m)[0] < theory(one_f_one_b, pp, m)[0]
            paper = (pp - 1) / (6 * m + pp - 1)                           # the paper's ZB-V
            assert bubble >= paper - 1e-12
            if m == pp or 2 * m >= 3 * pp:
                assert bubble == pytest.approx(paper, abs=1e-12)


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


@pytest.mark.parametrize("tp,pp,m", [(1, 2, 4), pytest.param(1, 4, 8, marks=pytest.mark.slow),
                                     pytest.param(2, 2, 4, marks=pytest.mark.slow)])
def test_zb_v_matches_serial(tp, pp, m):
    import torch
    from helpers import run_on_ranks
    from helpers.pipeline_parity import check_parity, parallel_body
    # the V placement and the zb-v lists, I and W through the ZeRO-0 grad sync; both tied copies on rank 0
    results = run_on_ranks(tp * pp, parallel_body, tp, pp, "zb-v", 2, m, False, torch.float32, True, timeout=180)
    check_parity(results, m, pp, "zb-v", 2, torch.float32)


# --pipeline-schedule zb-v through pretrain_gpt.main against the serial run of the same model (fp32): the
# losses of 7 steps and the parameters saved after 5; the pp2 case also loads each side's checkpoint in
# the other's layout and continues with the serial run's losses. Parameters: 1e-5 relative with an
# absolute floor of 1e-5, 1% of one lr = 1e-3 step (helpers.pipeline_parity.check_parity's reasoning:
# Adam moves an entry whose true gradient is ~0, like the key bias, by rounding noise of either sign).
ZBV = ["--pipeline-schedule", "zb-v", "--train-iters", "7", "--save-interval", "5", "--lr", "1e-3"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
EIGHT = ["--num-layers", "8"]                   # pp 4 needs 2 * 4 layers
TRAINER_LAYOUTS = [
    # pp 4, tp2 x pp2, dp2 x pp2 with ZeRO 1-3 and EP2 are rows of the every-schedule grid
    # (tests/test_pipeline.py::test_trainer_schedule_matches_serial); here the pp2 case with the
    # checkpoints loaded across layouts, and the switches the grid does not draw.
    ("pp2", 2, ["--pp", "2"]),
    ("tp2pp2-sp-recompute", 4, ["--tp", "2", "--pp", "2", "--sequence-parallel", "--recompute-activations"]),
    ("dp2pp2-zero2-each-mb", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "2", "--zero2-reduce-each-microbatch"]),
    ("dp2pp2-zero3-keep-gathered", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "3",
                                       "--zero3-keep-params-gathered"]),
    ("pp2-cpu-offloading", 2, ["--pp", "2", "--cpu-offloading", "--cpu-offloading-num-layers", "1"]),
]


def _model_params(directory):
    """The model's whole tensors in a checkpoint directory (layout-free: by name)."""
    from megazero.checkpoint import CheckpointReader
    reader = CheckpointReader(directory)
    return {n: reader.read_full(n) for n in reader.tensors if n.startswith("model/")}


def _run(world, flags, tmp_path, name):
    from helpers import run_on_ranks
    from helpers.trainer import TINY, main_body, read_metrics
    path, save = tmp_path / f"{name}.jsonl", tmp_path / name
    argv = [str(a) for a in TINY + ZBV[2:] + flags + ["--save", save, "--metrics-file", path]]
    assert run_on_ranks(world, main_body, argv, timeout=300) == [0] * world
    return read_metrics(path), save


def _at_iteration_5(save, tmp_path):
    """A directory whose latest checkpoint is ``save``'s iteration 5 (what --load resumes from)."""
    import shutil

    from megazero.checkpoint.format import TRACKER
    out = tmp_path / f"at5-{save.name}"
    shutil.copytree(save / "iter_0000005", out / "iter_0000005")
    (out / TRACKER).write_text("5")
    return out


@pytest.fixture(scope="module")
def serial_runs(tmp_path_factory):
    """The single-process metrics and checkpoints of the dense (4 or 8 layers) and the MoE model."""
    cache = {}

    def get(flags):
        key = ("--num-experts" in flags, "--num-layers" in flags)
        if key not in cache:
            extra = (MOE if key[0] else []) + (EIGHT if key[1] else [])
            cache[key] = _run(1, extra, tmp_path_factory.mktemp("serial"), "serial")
        return cache[key]
    return get


@pytest.mark.slow          # the quick tier has zb-v against serial in test_pipeline's schedule grid
@pytest.mark.parametrize("world,flags", [c[1:] for c in TRAINER_LAYOUTS], ids=[c[0] for c in TRAINER_LAYOUTS])
def test_trainer_with_zb_v_matches_serial(world, flags, serial_runs, tmp_path):
    import torch
    from helpers.trainer import assert_same_losses
    (train, valid), save = _run(world, ZBV[:2] + flags, tmp_path, "zbv")
    (want_train, want_valid), want_save = serial_runs(flags)
    assert_same_losses(train, want_train, "loss")
    assert_same_losses(valid, want_valid, "valid_loss")
    got, want = _model_params(save / "iter_0000005"), _model_params(want_save / "iter_0000005")
    assert want and set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda s, n=name: f"{n}: {s}")
    if flags == ["--pp", "2"]:                  # layout-free checkpoints: zb-v -> pp 1 and pp 1 -> zb-v
        for world_b, flags_b, ckpt in [(1, [], save), (2, ZBV[:2] + flags, want_save)]:
            (train_b, _), _ = _run(world_b, flags_b + ["--load", _at_iteration_5(ckpt, tmp_path)], tmp_path,
                                   f"resumed-at-world-{world_b}")
            assert_same_losses(train_b, want_train[5:], "loss")


def test_start_line_predicts_bubble_and_peak():
    """The line a run prints at start (pp 4, m 8): ZB-V's bubble, and its peak in chunk sets and in 1F1B's units."""
    from megazero.config import JobConfig, ParallelConfig, TrainConfig, validate
    from megazero.models.gpt import GPTConfig
    from megazero.reporting import predicted_pipeline
    job = JobConfig(parallel=ParallelConfig(pp=4, pipeline_schedule="zb-v"), model=GPTConfig(num_layers=8),
                    train=TrainConfig(micro_batch_size=1, global_batch_size=8))
    line = predicted_pipeline(validate(job, world_size=4))
    assert ("pipeline zb-v: predicted bubble 0.059 of the step, peak activations 8 chunk sets per rank "
            "(= 4 micro-batches of a rank's layers)") in line
