"""Mixed precision: the fp16 dynamic loss scaler, skipped steps on overflow, bf16 with fp32 masters."""
import logging

import pytest
import torch
from helpers import run_on_ranks
from helpers.tinynet import OPT, TinyNet, make_batches, reference_run, train_dp

from megazero.config import PrecisionConfig, ZeroConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_optimizer, wrap_data_parallel
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
                  logged=any("skipping step" in m for m in records.messages))
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
