"""Pipeline parallelism: stage split, schedules, p2p and tied embeddings, against the serial model.

Parity tests run the same model, seed and batches on 1 process and on tp x pp gloo processes and
compare the loss and every parameter after 3 AdamW steps (fp32, 1e-5 relative).
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from helpers.pipeline_sim import run_on_threads

from megazero.config import ConfigError, JobConfig, ModelConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.models.gpt import GPT, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.params import attribute, split_dim
from megazero.parallel.pipeline import (PipelineStats, get_schedule, gpipe, interleaved_one_f_one_b,
                                        interleaved_warmup, no_pipelining, one_f_one_b, run_schedule, simulate,
                                        stage_layer_ids)
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.parallel.zero import wrap_data_parallel

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


def test_dispatcher_picks_by_config():
    assert get_schedule(ParallelConfig(pp=1)) is no_pipelining
    assert get_schedule(ParallelConfig(pp=2, pipeline_schedule="1f1b")) is one_f_one_b
    assert get_schedule(ParallelConfig(pp=2, pipeline_schedule="gpipe")) is gpipe
    assert get_schedule(ParallelConfig(pp=2, pipeline_schedule="interleaved")) is interleaved_one_f_one_b
    with pytest.raises(ValueError, match="pipeline-schedule"):
        get_schedule(ParallelConfig(pp=2, pipeline_schedule="zigzag"))


def test_config_rejects_fewer_micro_batches_than_stages():
    job = JobConfig(model=ModelConfig(num_layers=8), parallel=ParallelConfig(pp=4),
                    train=TrainConfig(micro_batch_size=2, global_batch_size=4))
    with pytest.raises(ConfigError, match="fewer than 4 pipeline stages"):
        validate(job, world_size=4)
    job.parallel.num_layers_per_virtual_pipeline_stage = 1
    job.train.global_batch_size = 12          # 6 micro-batches: not a multiple of pp=4
    with pytest.raises(ConfigError, match="interleaved schedule needs micro-batches"):
        validate(job, world_size=4)


def test_activation_shape_with_sequence_parallel():
    cfg = ModelConfig(seq_length=16, hidden_size=32)
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

SEED, STEPS, MICRO, LR = 1234, 3, 2, 1e-3


def _model_cfg() -> ModelConfig:
    return ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       make_vocab_size_divisible_by=16)


def _batches(step: int, m: int, cfg: ModelConfig) -> list[dict]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length), generator=g)
        mask = (torch.rand(MICRO, cfg.seq_length, generator=g) < 0.8).float()
        mask[0, 0] = 1.0
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
    return out


@functools.lru_cache(maxsize=None)
def _serial_run(m: int, dtype: torch.dtype = torch.float32):
    """One process, whole model, one forward over the whole global batch per step. Returns the step
    losses, the gradients of step 0 and the parameters after the last step."""
    cfg = _model_cfg()
    model = GPT(cfg, None, seed=SEED, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        mbs = _batches(step, m, cfg)
        per_token = model(torch.cat([b["tokens"] for b in mbs]), torch.cat([b["labels"] for b in mbs]))
        loss = torch.stack([masked_mean(per_token[i * MICRO:(i + 1) * MICRO], b["loss_mask"])
                            for i, b in enumerate(mbs)]).mean()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full_tensor(t, p, topo):
    """The whole tensor ``t`` (a parameter or its gradient): tp shards gathered over the tp group."""
    if topo.tp_size == 1 or not p.tensor_parallel:
        return t.detach().clone()
    return gather_full(t.detach(), split_dim(p), topo.tp_group)


def _tied_copies_equal(chunks, topo) -> bool | None:
    """On first/last stages: is this rank's tied embedding bit-identical to the other end's?"""
    if topo.pp_size == 1 or topo.pipeline().embedding is None:
        return None
    (w,) = [p for c in chunks for p in c.parameters() if attribute(p, "shared_embedding")]
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w.detach(), group=topo.pipeline().embedding.group)
    return torch.equal(both[0], both[1])


def _parallel_body(rank, world, tp, pp, schedule, v, m, sp=False, dtype=torch.float32):
    topo = Topology(tp=tp, pp=pp)
    cfg = _model_cfg()
    par = ParallelConfig(tp=tp, pp=pp, pipeline_schedule=schedule, virtual_stages=v, sequence_parallel=sp)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED, dtype=dtype)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    # The trainer's gradient finalisation (ZeRO-0 grad sync): tied-embedding grads summed over the
    # first and last stage, sequence-parallel grads over tp (and identical dp replicas averaged).
    sync = wrap_data_parallel(chunks, topo, ZeroConfig())
    opt = torch.optim.AdamW([p for _, p in named], lr=LR)
    shape = activation_shape(cfg, MICRO, tp, sp)
    losses, tied, peaks, grads = [], [], [], None
    for step in range(STEPS):
        stats = PipelineStats()
        sync.zero_grad()
        step_losses = run_schedule(chunks, _batches(step, m, cfg), topo.pipeline(), loss_fn=masked_mean,
                                   schedule=get_schedule(par), tensor_shape=shape, stats=stats, grad_sync=sync)
        sync.finalize_grads()
        if step == 0:
            grads = {n: _full_tensor(p.grad, p, topo) for n, p in named}
        opt.step()
        losses.append(torch.stack(step_losses).mean().item() if step_losses else None)
        tied.append(_tied_copies_equal(chunks, topo))
        peaks.append(stats.peak_in_flight)
    return {"pp_rank": topo.pp_rank, "losses": losses, "tied": tied, "peaks": peaks, "grads": grads,
            "params": {n: _full_tensor(p, p, topo) for n, p in named}}


def _close(got, ref, what, rtol, atol):
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda s: f"{what}: {s}")


def _check_parity(results, m, pp, schedule, v, dtype):
    """Loss, step-0 gradients and weights after 3 AdamW steps against the serial run.

    fp32: 1e-5 relative. Gradient entries that cancel to ~0 are judged against 1e-6 of the tensor's
    largest entry. Adam normalises each update, so an entry whose true gradient is ~0 (e.g. the key
    bias: softmax ignores a constant shift) moves by rounding noise of either sign; weights therefore
    get an absolute floor of 1e-5, 1% of one lr=1e-3 step (a lost micro-batch, a wrong chunk or a
    missing tied-embedding sync moves weights by ~lr). The float64 cases remove rounding and must
    agree to 1e-10 (the same floor the tensor-parallel tests use).
    """
    ref_losses, ref_grads, ref_params = _serial_run(m, dtype)
    fp64 = dtype == torch.float64
    for r in results:
        if r["pp_rank"] == pp - 1:
            _close(torch.tensor(r["losses"]), torch.tensor(ref_losses), "losses", rtol=1e-5, atol=0)
    seen = set()
    for r in results:
        for name, full in r["params"].items():
            g = ref_grads[name]
            _close(r["grads"][name], g, f"step-0 grad of {name}", rtol=1e-10 if fp64 else 1e-5,
                   atol=(1e-12 if fp64 else 1e-6) * g.abs().max().item())
            _close(full, ref_params[name], f"{name} after {STEPS} AdamW steps", rtol=1e-10 if fp64 else 1e-5,
                   atol=1e-10 if fp64 else 1e-5)
            seen.add(name)
        if r["pp_rank"] in (0, pp - 1) and pp > 1:
            assert r["tied"] == [True] * STEPS, f"tied embedding copies differ on pp rank {r['pp_rank']}"
        _check_in_flight(r["peaks"], m, pp, r["pp_rank"], schedule, v)
    assert seen == set(ref_params), f"parameters held by no rank: {set(ref_params) - seen}"


def _check_in_flight(peaks, m, pp, r, schedule, v):
    """Activation sets held at once: 1F1B <= pp - pp_rank; GPipe all m; interleaved warmup + 1."""
    if schedule == "1f1b":
        assert max(peaks) <= pp - r, f"1F1B held {max(peaks)} micro-batches on pp rank {r} (> {pp - r})"
        assert peaks == [min(pp - r, m)] * STEPS
    elif schedule == "gpipe":
        assert peaks == [m] * STEPS
    elif schedule == "zb-h1":                  # held from F to W, at most 1F1B's peak (rank 0's)
        assert max(peaks) <= min(pp, m)
    else:
        assert peaks == [min(interleaved_warmup(m, pp, r, v) + 1, m * v)] * STEPS


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
    results = run_on_ranks(tp * pp, _parallel_body, tp, pp, schedule, v, m, sp, dtype, timeout=120)
    _check_parity(results, m, pp, schedule, v, dtype)


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
    cfg = _model_cfg()
    par = ParallelConfig(pp=pp, pipeline_schedule=schedule, virtual_stages=v)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED)
    mbs = _batches(0, m, cfg)
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
    cfg = _model_cfg()
    mbs = _batches(0, m, cfg)
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


def test_pipeline_inside_a_data_parallel_grid():
    """pp=2 x dp=2 (4 ranks, pipelines [0, 2] and [1, 3]): each replica, fed the same batches, trains
    exactly like the serial model (the data-parallel gradient reduction is not part of this module)."""
    results = run_on_ranks(4, _parallel_body, 1, 2, "interleaved", 2, 4, False, F32, timeout=120)
    _check_parity(results, 4, 2, "interleaved", 2, F32)
