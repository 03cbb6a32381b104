"""Pipeline parallelism: stage split, schedules, p2p and tied embeddings, against the serial model.

Parity tests run the same model, seed and batches on 1 process and on tp x pp gloo processes and
compare the loss and every parameter after 3 AdamW steps (fp32, 1e-5 relative). The trainer grid runs
pretrain_gpt.main with every ``--pipeline-schedule`` at pp 2 and 4, with tp 2, with dp 2 and ZeRO 1, 2 and 3,
and with expert parallelism 2, and compares losses, gradient norms and every checkpointed tensor after 5
iterations with the serial run's.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from helpers import run_on_ranks
from helpers.pipeline_parity import MICRO, SEED, batches, check_parity, model_cfg, parallel_body
from helpers.pipeline_sim import run_on_threads

from megazero.config import JobConfig, ParallelConfig, TrainConfig, validate
from megazero.errors import ConfigError
from megazero.models.gpt import GPT, GPTConfig, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.pipeline import (
    PipelineStats,
    get_schedule,
    gpipe,
    interleaved_one_f_one_b,
    interleaved_warmup,
    no_pipelining,
    one_f_one_b,
    run_schedule,
    simulate,
    stage_layer_ids,
)
from megazero.parallel.pipeline.partition import V, placements
from megazero.parallel.topology import Topology

# --------------------------------------------------------------------------------------------------
# Pure pieces: layer split, dispatcher, config validation
# --------------------------------------------------------------------------------------------------


def test_stage_layer_ids():
    assert stage_layer_ids(8, 2, 0) == [0, 1, 2, 3]
    assert stage_layer_ids(8, 4, 3) == [6, 7]
    # Interleaved: chunk c of rank r is virtual stage c * pp + r.
    assert [stage_layer_ids(8, 2, r, 2, c) for c in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layer_ids(8, 4, 1, 2, 1) == [5]
    covered = sorted(i for r in range(4) for c in range(2) for i in stage_layer_ids(16, 4, r, 2, c))
    assert covered == list(range(16))
    with pytest.raises(ValueError, match="not divisible"):
        stage_layer_ids(6, 4, 0)


def test_v_placement_puts_both_ends_on_rank_0():
    """L = 8, pp = 2: stages 0 1 | 2 3 on ranks 0 1 | 1 0; embedding on rank 0 chunk 0, loss on rank 0 chunk 1."""
    got = [[(p.layer_ids, p.pre_process, p.post_process) for p in placements(8, 2, r, 2, V)] for r in range(2)]
    assert got == [[((0, 1), True, False), ((6, 7), False, True)],
                   [((2, 3), False, False), ((4, 5), False, False)]]
    layers = sorted(i for r in range(4) for p in placements(16, 4, r, 2, V) for i in p.layer_ids)
    assert layers == list(range(16))


def test_dispatcher_picks_by_config():
    assert get_schedule(ParallelConfig(pp=1)) is no_pipelining
    assert get_schedule(ParallelConfig(pp=2, pipeline_schedule="1f1b")) is one_f_one_b
    assert get_schedule(ParallelConfig(pp=2, pipeline_schedule="gpipe")) is gpipe
    assert get_schedule(ParallelConfig(pp=2, pipeline_schedule="interleaved")) is interleaved_one_f_one_b
    with pytest.raises(ValueError, match="pipeline-schedule"):
        get_schedule(ParallelConfig(pp=2, pipeline_schedule="zigzag"))


def test_config_rejects_fewer_micro_batches_than_stages():
    job = JobConfig(model=GPTConfig(num_layers=8), parallel=ParallelConfig(pp=4),
                    train=TrainConfig(micro_batch_size=2, global_batch_size=4))
    with pytest.raises(ConfigError, match="fewer than 4 pipeline stages"):
        validate(job, world_size=4)
    job.parallel.num_layers_per_virtual_pipeline_stage = 1
    job.train.global_batch_size = 12          # 6 micro-batches: not a multiple of pp=4
    with pytest.raises(ConfigError, match="interleaved schedule needs micro-batches"):
        validate(job, world_size=4)


def test_activation_shape_with_sequence_parallel():
    cfg = GPTConfig(seq_length=16, hidden_size=32)
    assert activation_shape(cfg, 2) == (16, 2, 32)
    assert activation_shape(cfg, 2, tp=2, sequence_parallel=True) == (8, 2, 32)
    assert activation_shape(cfg, 2, tp=2, sequence_parallel=False) == (16, 2, 32)


# --------------------------------------------------------------------------------------------------
# The executor running each schedule on threads (rendezvous p2p; every tensor checked)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,m", list(itertools.product([2, 3, 4, 8], [1, 2, 3, 4, 7, 16])))
def test_1f1b_and_gpipe_simulated(pp, m):
    for fo in (False, True):
        runs = run_on_threads(one_f_one_b, pp, m, forward_only=fo)
        predicted = simulate(one_f_one_b(pp, m, 1, fo), m, 1, fo).peak_in_flight
        for r, run in enumerate(runs):
            order = run.stats.order
            # Warmup is pp - r - 1 forwards, then strict alternation until the forwards run out.
            warm = min(pp - r - 1, m)
            assert [k for k, _, _ in order[:warm]] == ["F"] * warm
            if not fo:
                assert run.stats.peak_in_flight == min(pp - r, m) <= pp - r
            assert run.stats.peak_in_flight == predicted[r]
        runs = run_on_threads(gpipe, pp, m, forward_only=fo)
        for run in runs:
            assert [k for k, _, _ in run.stats.order] == ["F"] * m + ([] if fo else ["B"] * m)


@pytest.mark.parametrize("pp,v,mult", list(itertools.product([2, 3, 4, 8], [2, 3, 4], [1, 2, 3])))
def test_interleaved_simulated(pp, v, mult):
    m = pp * mult
    for fo in (False, True):
        runs = run_on_threads(interleaved_one_f_one_b, pp, m, v=v, forward_only=fo)
        predicted = simulate(interleaved_one_f_one_b(pp, m, v, fo), m, v, fo).peak_in_flight
        for r, run in enumerate(runs):
            assert run.stats.peak_in_flight == predicted[r]
            order = run.stats.order
            warm = interleaved_warmup(m, pp, r, v, fo)
            assert [k for k, _, _ in order[:warm]] == ["F"] * warm
            # Forwards visit chunks in groups of pp micro-batches: 0 0 1 1 0 0 1 1 ... (pp=2, v=2)
            fwd_chunks = [c for k, c, _ in order if k == "F"]
            assert fwd_chunks == [(k % (pp * v)) // pp for k in range(m * v)]
            if not fo:
                bwd_chunks = [c for k, c, _ in order if k == "B"]
                assert bwd_chunks == [v - 1 - (k % (pp * v)) // pp for k in range(m * v)]
                assert run.stats.peak_in_flight == min(warm + 1, m * v)


# --------------------------------------------------------------------------------------------------
# Parity with the serial model on gloo processes
# --------------------------------------------------------------------------------------------------

F32, F64 = torch.float32, torch.float64
PARITY_CASES = [  # (tp, pp, schedule, v, m, sequence_parallel, dtype)
    (1, 2, "1f1b", 1, 4, False, F32), (1, 2, "gpipe", 1, 4, False, F32), (1, 2, "interleaved", 2, 4, False, F32),
    (1, 4, "1f1b", 1, 8, False, F32), (1, 4, "gpipe", 1, 4, False, F32), (1, 4, "interleaved", 2, 8, False, F32),
    (1, 4, "interleaved", 2, 4, False, F32),             # m == pp: all forwards, then all backwards
    (2, 2, "1f1b", 1, 4, False, F32), (2, 2, "gpipe", 1, 4, False, F32), (2, 2, "interleaved", 2, 4, False, F32),
    (2, 2, "1f1b", 1, 4, True, F32),                     # [s/tp, b, h] crosses the stage boundary
    (1, 4, "interleaved", 2, 8, False, F64), (2, 2, "1f1b", 1, 4, True, F64),
]


def _case_id(case) -> str:
    tp, pp, schedule, v, m, sp, dtype = case
    return f"tp{tp}-pp{pp}-{schedule}-v{v}-m{m}{'-sp' if sp else ''}-{'fp64' if dtype == F64 else 'fp32'}"


QUICK_CASES = {(1, 2, "1f1b", 1, 4, False, F32), (1, 4, "interleaved", 2, 8, False, F32),
               (1, 4, "interleaved", 2, 4, False, F32), (2, 2, "1f1b", 1, 4, True, F32)}   # the quick tier's share


@pytest.mark.parametrize("tp,pp,schedule,v,m,sp,dtype", [
    c if c in QUICK_CASES else pytest.param(*c, marks=pytest.mark.slow) for c in PARITY_CASES],
    ids=[_case_id(c) for c in PARITY_CASES])
def test_pipeline_matches_serial(tp, pp, schedule, v, m, sp, dtype):
    results = run_on_ranks(tp * pp, parallel_body, tp, pp, schedule, v, m, sp, dtype, timeout=120)
    check_parity(results, m, pp, schedule, v, dtype)


# --------------------------------------------------------------------------------------------------
# Evaluation (forward only), the data-parallel hook, stages given no data, p2p shape errors
# --------------------------------------------------------------------------------------------------


class _HookRecorder:
    def __init__(self, stats: PipelineStats):
        self.calls, self.stats = [], stats

    def before_backward(self, chunk_id, is_last_microbatch):
        self.calls.append((chunk_id, is_last_microbatch, self.stats.num_backward))


def _eval_and_hook_body(rank, world, pp, schedule, v, m):
    topo = Topology(pp=pp)
    cfg = model_cfg()
    par = ParallelConfig(pp=pp, pipeline_schedule=schedule, virtual_stages=v)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED)
    mbs = batches(0, m, cfg)
    if not (topo.is_first_stage or topo.is_last_stage):
        mbs = [None] * m                     # middle stages read no data
    elif topo.is_last_stage and v == 1:
        mbs = [{"labels": b["labels"], "loss_mask": b["loss_mask"]} for b in mbs]
    shape = activation_shape(cfg, MICRO)
    stats = PipelineStats()
    eval_losses = run_schedule(chunks, mbs, topo.pipeline(), loss_fn=masked_mean, forward_only=True, schedule=schedule,
                               tensor_shape=shape, stats=stats)
    no_grads = all(p.grad is None for c in chunks for p in c.parameters())
    eval_peak = stats.peak_in_flight
    hook = _HookRecorder(stats)
    train_losses = run_schedule(chunks, mbs, topo.pipeline(), loss_fn=masked_mean, schedule=schedule,
                                tensor_shape=shape, stats=stats, grad_sync=hook)
    return {"pp_rank": topo.pp_rank, "eval": [x.item() for x in eval_losses],
            "train": [x.item() for x in train_losses], "no_grads": no_grads, "eval_peak": eval_peak,
            "calls": hook.calls}


@pytest.mark.parametrize("pp,schedule,v,m", [(4, "1f1b", 1, 4), (2, "interleaved", 2, 4)])
def test_forward_only_and_grad_sync_hook(pp, schedule, v, m):
    results = run_on_ranks(pp, _eval_and_hook_body, pp, schedule, v, m, timeout=120)
    cfg = model_cfg()
    mbs = batches(0, m, cfg)
    with torch.no_grad():
        model = GPT(cfg, None, seed=SEED)
        ref = [masked_mean(model(b["tokens"], b["labels"]), b["loss_mask"]).item() for b in mbs]
    for r in results:
        last = r["pp_rank"] == pp - 1
        assert r["eval"] == (pytest.approx(ref, rel=1e-5) if last else [])
        assert r["train"] == (pytest.approx(ref, rel=1e-5) if last else [])
        assert r["no_grads"] and r["eval_peak"] == 0
        # The hook fires right before each backward; is_last_microbatch only on a chunk's m-th one.
        assert [n for _, _, n in r["calls"]] == list(range(m * v))
        for c in range(v):
            flags = [last_mb for chunk, last_mb, _ in r["calls"] if chunk == c]
            assert flags == [False] * (m - 1) + [True]


def test_p2p_rejects_wrong_shape_before_communicating():
    from megazero.parallel.groups import PipelineLayout
    from megazero.parallel.pipeline import StageComm

    comm = StageComm(PipelineLayout(None, (0, 1), 0, 2), (16, 2, 32), torch.float32)
    with pytest.raises(RuntimeError, match="--micro-batch-size"):
        comm.send_forward(torch.zeros(16, 4, 32))
    with pytest.raises(RuntimeError, match="does not match"):
        comm.send_forward(torch.zeros(16, 2, 32, dtype=torch.float64))
    assert comm.num_batches == 0
    # The first stage has no previous rank: nothing is received and nothing is posted.
    assert comm.recv_forward() is None and comm.num_batches == 0


def test_run_schedule_needs_the_boundary_shape_with_pipelining():
    from megazero.parallel.groups import PipelineLayout

    chunk = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs tensor_shape: the model spec's boundary_shape"):
        run_schedule([chunk], [None, None], PipelineLayout(None, (0, 1), 1, 2), loss_fn=masked_mean, schedule="1f1b")


def _timed_waits_body(rank, world):
    """pp 2, 1F1B: a step with the clocks off (it must read none), then one where the last stage starts
    0.3 s late, which the first stage spends waiting for it, with its computes timed per kind."""
    import time
    import types

    from megazero.parallel.pipeline import executor, p2p

    topo, cfg = Topology(pp=2), model_cfg()
    chunks = build_model_chunks(cfg, ParallelConfig(pp=2), topo, seed=SEED)
    shape, mbs = activation_shape(cfg, MICRO), batches(0, 4, cfg)
    real, off = p2p.time, PipelineStats()
    p2p.time = executor.time = types.SimpleNamespace(perf_counter=lambda: pytest.fail("a clock was read while off"))
    try:
        run_schedule(chunks, mbs, topo.pipeline(), loss_fn=masked_mean, schedule="1f1b", tensor_shape=shape, stats=off)
    finally:
        p2p.time = executor.time = real
    assert off.compute_s == off.computes == {}
    on = PipelineStats(time_waits=True, time_computes=True)
    if rank == 1:
        time.sleep(0.3)
    t0 = time.perf_counter()
    run_schedule(chunks, mbs, topo.pipeline(), loss_fn=masked_mean, schedule="1f1b", tensor_shape=shape, stats=on)
    return off.wait_s, on.wait_s, time.perf_counter() - t0, on.computes, on.compute_s


def test_wait_clock_measures_idle_time_and_costs_nothing_when_off():
    """The wait clock sees the late stage; the compute clock counts every F and B, and its seconds plus
    the waits fit in the step (a receive's wait is not counted as compute)."""
    (off0, wait0, step0, n0, c0), (off1, wait1, step1, n1, c1) = run_on_ranks(2, _timed_waits_body, timeout=120)
    assert off0 == off1 == 0.0
    assert 0.25 < wait0 < step0 and 0.0 < wait1 < step1 and wait1 < wait0
    assert n0 == n1 == {"F": 4, "B": 4}
    for wait, step, c in ((wait0, step0, c0), (wait1, step1, c1)):
        assert all(t > 0 for t in c.values()) and wait + sum(c.values()) <= step, (wait, step, c)


def test_pipeline_inside_a_data_parallel_grid():
    """pp=2 x dp=2 (4 ranks, pipelines [0, 2] and [1, 3]): each replica, fed the same batches, trains
    exactly like the serial model (the data-parallel gradient reduction is not part of this module)."""
    results = run_on_ranks(4, parallel_body, 1, 2, "interleaved", 2, 4, False, F32, timeout=120)
    check_parity(results, 4, 2, "interleaved", 2, F32)


# --------------------------------------------------------------------------------------------------
# The trainer with every schedule: pretrain_gpt.main against its serial run, loss and parameters
# --------------------------------------------------------------------------------------------------

# The flags that pick each --pipeline-schedule (a new schedule adds its entry here; the test below fails
# until it does). Interleaved runs two chunks per rank: one layer per virtual stage at pp 2 (4 layers) and
# at pp 4 (the pp 4 rows use 8 layers).
SCHEDULE_FLAGS = {
    "gpipe": ["--pipeline-schedule", "gpipe"],
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "interleaved": ["--pipeline-schedule", "interleaved", "--num-layers-per-virtual-pipeline-stage", "1"],
    "zb-h1": ["--pipeline-schedule", "zb-h1"],
    "zb-v": ["--pipeline-schedule", "zb-v"],
}
_MOE = ("--num-experts", "4", "--moe-router-topk", "2")
# (id, world size, model shape flags (the serial run's too), layout flags)
TRAINER_LAYOUTS = [
    ("pp2", 2, (), ["--pp", "2"]),
    ("pp4", 4, ("--num-layers", "8"), ["--pp", "4"]),
    ("tp2pp2", 4, (), ["--tp", "2", "--pp", "2"]),
    ("dp2pp2-zero1", 4, (), ["--dp", "2", "--pp", "2", "--zero-stage", "1"]),
    ("dp2pp2-zero2", 4, (), ["--dp", "2", "--pp", "2", "--zero-stage", "2"]),
    ("dp2pp2-zero3", 4, (), ["--dp", "2", "--pp", "2", "--zero-stage", "3"]),
    ("ep2dp2pp2-moe-zero1", 4, _MOE, ["--dp", "2", "--pp", "2", "--expert-model-parallel-size", "2",
                                      "--zero-stage", "1"]),
]
_GRID = [(lay, sched) for lay in TRAINER_LAYOUTS for sched in SCHEDULE_FLAGS]


def test_every_schedule_has_trainer_rows():
    from megazero.config import SCHEDULES
    assert set(SCHEDULE_FLAGS) == set(SCHEDULES)


@pytest.fixture(scope="module")
def serial_parity(tmp_path_factory):
    from helpers.trainer import serial_parity_runs
    return serial_parity_runs(tmp_path_factory)


@pytest.mark.parametrize("layout,schedule", [
    (lay, sched) if lay[0] == "pp2" else pytest.param(lay, sched, marks=pytest.mark.slow) for lay, sched in _GRID],
    ids=[f"{lay[0]}-{sched}" for lay, sched in _GRID])
def test_trainer_schedule_matches_serial(layout, schedule, serial_parity, tmp_path):
    """The quick tier runs pp 2 with every schedule (the workers of a world size are reused: ~1 s a run)."""
    from helpers.trainer import assert_matches_serial
    _, world, shape, flags = layout
    assert_matches_serial(world, [*shape, *flags, *SCHEDULE_FLAGS[schedule]], tmp_path, serial_parity(shape))
