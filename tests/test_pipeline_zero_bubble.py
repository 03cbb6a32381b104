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


def test_v_other_than_one_is_refused():
    with pytest.raises(ValueError, match="one model chunk per rank"):
        zb_h1(2, 4, 2)


def test_w_fills_the_cooldown():
    lists = zb_h1(4, 8)
    kinds = [a.kind for a in lists[0] if hasattr(a, "kind")]
    assert Kind.BACKWARD not in kinds and kinds.count(Kind.BACKWARD_WEIGHT) == 8


def _zb_body(rank, world, tp, pp, m):
    """test_pipeline's parity run with the zero-bubble lists (I and W through the ZeRO-0 grad sync:
    bucket countdown from W, tied-embedding and sequence-parallel sums)."""
    import torch

    from megazero.config import ModelConfig, ParallelConfig, ZeroConfig
    from megazero.models.gpt import activation_shape, build_model_chunks, masked_mean
    from megazero.parallel.pipeline import PipelineStats, run_schedule
    from megazero.parallel.topology import Topology
    from megazero.parallel.zero import wrap_data_parallel
    from test_pipeline import LR, MICRO, SEED, STEPS, _batches, _full_tensor, _model_cfg, _tied_copies_equal

    topo, cfg = Topology(tp=tp, pp=pp), _model_cfg()
    assert isinstance(cfg, ModelConfig)
    chunks = build_model_chunks(cfg, ParallelConfig(tp=tp, pp=pp), topo, seed=SEED)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    sync = wrap_data_parallel(chunks, topo, ZeroConfig(overlap_grad_reduce=True))
    opt = torch.optim.AdamW([p for _, p in named], lr=LR)
    losses, tied, peaks, grads = [], [], [], None
    for step in range(STEPS):
        stats = PipelineStats()
        sync.zero_grad()
        out = run_schedule(chunks, _batches(step, m, cfg), topo.pipeline(), loss_fn=masked_mean, schedule=zb_h1,
                           tensor_shape=activation_shape(cfg, MICRO, tp, False), stats=stats, grad_sync=sync)
        sync.finalize_grads()
        if step == 0:
            grads = {n: _full_tensor(p.grad, p, topo) for n, p in named}
        opt.step()
        losses.append(torch.stack(out).mean().item() if out else None)
        tied.append(_tied_copies_equal(chunks, topo))
        peaks.append(stats.peak_in_flight)
    return {"pp_rank": topo.pp_rank, "losses": losses, "tied": tied, "peaks": peaks, "grads": grads,
            "params": {n: _full_tensor(p, p, topo) for n, p in named}}


@pytest.mark.parametrize("tp,pp,m", [(1, 2, 4), pytest.param(1, 4, 8, marks=pytest.mark.slow),
                                     pytest.param(2, 2, 4, marks=pytest.mark.slow)])
def test_zero_bubble_matches_serial(tp, pp, m):
    from helpers import run_on_ranks
    from test_pipeline import _check_parity
    import torch
    results = run_on_ranks(tp * pp, _zb_body, tp, pp, m, timeout=180)
    _check_parity(results, m, pp, "zb-h1", 1, torch.float32)
    for r in results:
        assert max(r["peaks"]) <= pp                           # held from F to W: 1F1B's peak


# --pipeline-schedule zb-h1 through pretrain_gpt.main, against the serial run of the same model (fp32).
ZB = ["--pipeline-schedule", "zb-h1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
TRAINER_LAYOUTS = [
    ("pp2", 2, ["--pp", "2"]),
    ("pp4", 4, ["--pp", "4"]),
    ("tp2pp2", 4, ["--tp", "2", "--pp", "2"]),
    ("dp2pp2-zero1", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "1"]),
    ("dp2pp2-zero2", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "2"]),
    ("dp2pp2-zero3", 4, ["--dp", "2", "--pp", "2", "--zero-stage", "3"]),
    ("ep2dp2pp2-moe-zero1", 4, MOE + ["--dp", "2", "--pp", "2", "--expert-model-parallel-size", "2",
                                      "--zero-stage", "1"]),
]


@pytest.fixture(scope="module")
def serial_runs(tmp_path_factory):
    """The single-process metrics of the dense and the MoE model, computed when first asked for."""
    from helpers import run_on_ranks
    from helpers.trainer import TINY, main_body, read_metrics
    cache = {}

    def get(moe: bool):
        if moe not in cache:
            path = tmp_path_factory.mktemp("serial") / "metrics.jsonl"
            flags = TINY + (MOE if moe else []) + ["--metrics-file", str(path)]
            assert run_on_ranks(1, main_body, flags, timeout=120) == [0]
            cache[moe] = read_metrics(path)
        return cache[moe]
    return get


@pytest.mark.parametrize("world,flags", [pytest.param(*c[1:], marks=() if c[0] == "pp2" else pytest.mark.slow)
                                         for c in TRAINER_LAYOUTS], ids=[c[0] for c in TRAINER_LAYOUTS])
def test_trainer_with_zb_h1_matches_serial(world, flags, serial_runs, tmp_path):
    from helpers import run_on_ranks
    from helpers.trainer import TINY, assert_same_losses, main_body, read_metrics
    path = tmp_path / "metrics.jsonl"
    assert run_on_ranks(world, main_body, TINY + ZB + flags + ["--metrics-file", str(path)],
                        timeout=300) == [0] * world
    train, valid = read_metrics(path)
    want_train, want_valid = serial_runs("--num-experts" in flags)
    assert_same_losses(train, want_train, "loss")
    assert_same_losses(valid, want_valid, "valid_loss")
