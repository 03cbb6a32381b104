"""Mixed precision: the fp16 dynamic loss scaler, skipped steps on overflow, bf16 with fp32 masters."""
import logging

import pytest
import torch
from helpers import run_on_ranks
from helpers.tinynet import OPT, TinyNet, make_batches, reference_run, train_dp

from megazero.config import PrecisionConfig, ZeroConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine, build_optimizer, wrap_data_parallel
from megazero.precision import DynamicLossScaler


def test_scaler_backoff_hysteresis_growth_and_floor():
    s = DynamicLossScaler(initial_scale=1024, growth_interval=3, hysteresis=2, min_scale=256)
    s.update(found_inf=True)
    assert s.scale == 1024            # hysteresis 2: the first overflow is tolerated (step still skipped)
    s.update(found_inf=True)
    assert s.scale == 512
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 1024            # 3 clean steps: grow, hysteresis refilled
    s.update(found_inf=True)
    assert s.scale == 1024
    for _ in range(4):
        s.update(found_inf=True)
    assert s.scale == 256             # never below min_scale
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_scaler_rejects_bad_settings():
    with pytest.raises(ValueError, match="--hysteresis"):
        DynamicLossScaler(hysteresis=0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _overflow_body(rank, world_size, stage):
    topo = Topology(dp=world_size)
    prec = PrecisionConfig(fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    model = TinyNet(dtype=torch.float16)
    sync = wrap_data_parallel(model, topo, ZeroConfig(zero_stage=stage, bucket_size=300))
    opt = build_optimizer(sync, OPT, prec)
    records = _Records()
    logging.getLogger("megazero.parallel.zero").addHandler(records)
    (tokens, labels), = make_batches(1, 4)

    def step(blow_up: bool):
        opt.zero_grad()
        loss = model(tokens[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]) * opt.loss_scale
        if blow_up and rank == 1:     # only one rank overflows: the skip decision must still be global
            loss = loss * 1e30
        loss.backward()
        sync.finalize_grads()
        return opt.step()

    _, skipped = step(False)
    assert not skipped
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = [(r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone()) for r in opt.ranges]
    scale, count = opt.loss_scale, opt.step_count
    norm, skipped = step(True)
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    state_unchanged = all(torch.equal(a, b) for r, old in zip(opt.ranges, state_before)
                          for a, b in zip((r.master, r.exp_avg, r.exp_avg_sq), old))
    result = dict(skipped=skipped, scale_before=scale, scale_after=opt.loss_scale, unchanged=unchanged,
                  state_unchanged=state_unchanged, count_same=opt.step_count == count,
                  logged=any(m.startswith("optimizer step 2: fp16 gradients overflowed (inf/nan): step skipped")
                             for m in records.messages))
    _, skipped_again = step(False)
    result["next_step_ok"] = not skipped_again
    result["moved_after"] = not all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return result


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_skips_step_halves_scale_changes_nothing(stage):
    for r in run_on_ranks(2, _overflow_body, stage):
        assert r["skipped"] and r["count_same"] and r["logged"]
        assert r["scale_after"] == r["scale_before"] / 2
        assert r["unchanged"] and r["state_unchanged"]
        assert r["next_step_ok"] and r["moved_after"]


def _bf16_body(rank, world_size):
    topo = Topology(dp=world_size)
    losses, _, params, _, opt = train_dp(topo, 1, steps=5, global_batch=8, micro_batches=2, dtype=torch.bfloat16,
                                         precision=PrecisionConfig(bf16=True))
    masters = [r.master.dtype for r in opt.ranges]
    return losses, {n: p.float() for n, p in params.items()}, params["fc1.weight"].dtype, masters, opt.loss_scale


def test_bf16_zero1_tracks_fp32_with_fp32_master_weights():
    ref_losses, _, ref_params = reference_run(5, 8)
    for losses, params, dtype, masters, scale in run_on_ranks(2, _bf16_body):
        assert dtype == torch.bfloat16 and set(masters) == {torch.float32} and scale == 1.0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=2e-2, atol=2e-2, msg=name)


def _accumulation_body(rank, world_size, precision_flags):
    """50 steps of a one-layer GPT at dp2 ZeRO-1 with 128 micro-batches per rank per step (where
    bf16 sums lose the most); the losses and this rank's shard of the fp32 master weights."""
    from megazero.cli.job import parse_job
    from megazero.models.gpt import build_model_chunks
    from megazero.training import train_step

    flags = ["--mock-data", "--vocab-size", "200", "--num-layers", "1", "--hidden-size", "16",
             "--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "1",
             "--global-batch-size", "256", "--lr", "3e-3", "--zero-stage", "1", *precision_flags]
    job, _ = parse_job(flags, world_size)
    topo = Topology(job.parallel.tp, job.parallel.pp, job.parallel.dp)
    dtype = torch.bfloat16 if job.precision.bf16 else torch.float32
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=1, dtype=dtype, device="meta")
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    g = torch.Generator().manual_seed(0)
    per, s = job.num_micro_batches, job.model.seq_length
    losses = []
    for _ in range(50):
        step = [{"tokens": torch.randint(0, 200, (1, s), generator=g),
                 "labels": torch.randint(0, 200, (1, s), generator=g), "loss_mask": torch.ones(1, s)}
                for _ in range(per * world_size)]
        losses.append(train_step(chunks, step[topo.dp_rank * per:(topo.dp_rank + 1) * per], topo, engine, job).loss)
    return losses, torch.cat([r.master.reshape(-1) for r in engine.optimizer.ranges])


@pytest.mark.slow
def test_bf16_with_fp32_gradient_accumulation_tracks_fp32_more_closely():
    """Megatron's main grads: bf16 micro-batch gradients summed (and reduced) in fp32 stay nearer the
    fp32 run than sums kept in bf16. Measured (relative distance of the master weights to fp32's
    after 50 steps): 0.0083 with fp32 accumulation, 0.0150 without."""
    runs = {name: run_on_ranks(2, _accumulation_body, flags, timeout=600) for name, flags in [
        ("fp32", []), ("fp32-acc", ["--bf16"]), ("bf16-acc", ["--bf16", "--no-accumulate-allreduce-grads-in-fp32"])]}
    ref = torch.cat([r[1] for r in runs["fp32"]])

    def distance(name):
        return float((torch.cat([r[1] for r in runs[name]]) - ref).norm() / ref.norm())

    near, far = distance("fp32-acc"), distance("bf16-acc")
    print(f"relative distance to fp32 after 50 steps: fp32 accumulation {near:.4f}, bf16 accumulation {far:.4f}")
    assert near < 0.8 * far and near < 0.02
    assert abs(runs["fp32-acc"][0][0][-1] - runs["fp32"][0][0][-1]) < 1e-3      # and the loss still matches
