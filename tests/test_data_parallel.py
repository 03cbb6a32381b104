"""Data parallelism and ZeRO 0/1/2 (megazero/parallel/zero/grad_sync.py) against the single-process run
with the same global batch (the tiny model lives in tests/helpers/tinynet.py)."""
import math

import pytest
import torch
from helpers import run_on_ranks
from helpers.tinynet import OPT, TinyNet, make_batches, reference_run, train_dp

from megazero.config import PrecisionConfig, ZeroConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import (
    AllReduceGradSync,
    build_optimizer,
    plan_buckets,
    reductions_in_flight,
    wrap_data_parallel,
)
from megazero.parallel.zero.adamw import weight_decay_groups


def _parity_body(rank, world_size, stage, micro_batches):
    topo = Topology(dp=world_size)
    losses, norms, params, _, _ = train_dp(topo, stage, steps=5, global_batch=8, micro_batches=micro_batches)
    return losses, norms, params


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_dp_matches_single_process(world, stage):
    ref_losses, ref_norms, ref_params = reference_run(5, 8)
    results = run_on_ranks(world, _parity_body, stage, 2)  # 2 micro-batches: accumulation too
    for losses, norms, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert params.keys() == ref_params.keys()
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # the parameters really moved (the comparison is not of an untouched init)
    assert not torch.allclose(ref_params["fc1.weight"], TinyNet().fc1.weight)


def _allreduce_zero1_body(rank, world_size):
    topo = Topology(dp=world_size)
    losses, norms, params, _, _ = train_dp(topo, 1, steps=5, global_batch=8, micro_batches=2,
                                           grad_sync_cls=AllReduceGradSync)
    return losses, norms, params


def test_zero1_over_all_reduced_grads_matches_single_process():
    ref_losses, ref_norms, ref_params = reference_run(5, 8)
    for losses, norms, params in run_on_ranks(2, _allreduce_zero1_body):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def _accumulation_body(rank, world_size):
    topo = Topology(dp=world_size)
    out = {}
    for micro, overlap in ((1, True), (4, True), (4, False)):
        losses, norms, params, _, _ = train_dp(topo, 2, steps=3, global_batch=16, micro_batches=micro,
                                               overlap=overlap)
        out[micro, overlap] = (losses, params)
    return out


def test_accumulation_over_four_micro_batches_and_no_overlap_equal_one_process():
    ref_losses, _, ref_params = reference_run(3, 16)
    for out in run_on_ranks(2, _accumulation_body):
        for micro in out:
            losses, params = out[micro]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def _comm_body(rank, world_size, stage, dtype, grad_sync_cls=None, each_microbatch=False):
    topo = Topology(dp=world_size)
    _, _, _, sync, _ = train_dp(topo, stage, steps=2, global_batch=8, micro_batches=2, dtype=dtype,
                                bucket_size=8000, hidden=64, grad_sync_cls=grad_sync_cls,
                                each_microbatch=each_microbatch,
                                precision=PrecisionConfig(bf16=True) if dtype == torch.bfloat16 else None)
    padded = sum(b.numel for b in sync.buckets)
    psi = sum(p.numel() for p in sync.parameters())
    return sync.comm_log.bytes(), sync.comm_log.calls(), padded, psi, len(sync.buckets)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_bytes_per_step_equal_plain_data_parallel(world):
    """Per rank per step on the dp group: 2 Psi (N-1)/N bytes for stages 0, 1 and 2."""
    for dtype, elem in ((torch.float32, 4), (torch.bfloat16, 2)):
        per_stage = {}
        for stage in (0, 1, 2):
            dp_bytes, calls, padded, psi, nbuckets = run_on_ranks(world, _comm_body, stage, dtype)[0]
            expected = 2 * padded * elem * (world - 1) / world
            assert dp_bytes["dp"] == pytest.approx(expected), (stage, dtype)
            assert dp_bytes["dp"] == pytest.approx(2 * psi * elem * (world - 1) / world, rel=0.05)
            assert calls["dp"] == (nbuckets if stage == 0 else 2 * nbuckets)  # one per bucket / two
            per_stage[stage] = dp_bytes["dp"]
        assert per_stage[0] == per_stage[1] == per_stage[2]
        # the opt-in ZeRO-1 over all-reduced gradients (cheaper on gloo) sends 3 Psi (N-1)/N: say so
        dp_bytes, _, padded, _, _ = run_on_ranks(world, _comm_body, 1, dtype, AllReduceGradSync)[0]
        assert dp_bytes["dp"] == pytest.approx(3 * padded * elem * (world - 1) / world)
        # stage 2 reducing every micro-batch (m = 2 here): m reduce-scatters + one all-gather per bucket
        dp_bytes, calls, padded, _, nbuckets = run_on_ranks(world, _comm_body, 2, dtype, None, True)[0]
        assert dp_bytes["dp"] == pytest.approx(3 * padded * elem * (world - 1) / world)
        assert calls["dp"] == 3 * nbuckets


def _each_microbatch_body(rank, world_size):
    topo = Topology(dp=world_size)
    out = {}
    for micro, overlap in ((2, True), (4, True), (4, False)):
        losses, norms, params, _, _ = train_dp(topo, 2, steps=5, global_batch=16, micro_batches=micro,
                                               overlap=overlap, each_microbatch=True)
        out[micro, overlap] = (losses, norms, params)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_zero2_reducing_each_micro_batch_matches_single_process(world):
    ref_losses, ref_norms, ref_params = reference_run(5, 16)
    for out in run_on_ranks(world, _each_microbatch_body):
        for losses, norms, params in out.values():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def _grad_peak_body(rank, world_size, each_microbatch, overlap=False, micro_batches=4):
    topo = Topology(dp=world_size)
    _, _, _, sync, _ = train_dp(topo, 2, steps=2, global_batch=16, micro_batches=micro_batches, overlap=overlap,
                                each_microbatch=each_microbatch)
    full = [b.numel * 4 for b in sync.buckets]
    return sync.peak_grad_bytes, sum(full), max(full), sum(b.shard_size for b in sync.buckets) * 4


def test_zero2_reducing_each_micro_batch_holds_one_bucket_not_all_gradients():
    """4 micro-batches: the default stage 2 holds every bucket's full gradients from the first
    backward to the last; reducing each micro-batch holds the shards, one scratch shard and the one
    bucket being reduced (no overlap, so nothing else is in flight)."""
    peak_default, full, _, shards = run_on_ranks(2, _grad_peak_body, False)[0]
    peak_each, full_, biggest, shards_ = run_on_ranks(2, _grad_peak_body, True)[0]
    assert (full, shards) == (full_, shards_) and len({full, biggest}) == 2    # several buckets
    assert peak_default >= full
    assert peak_each <= shards + biggest + biggest // 2
    assert peak_each < full
    # overlapped: the bucket being filled and reductions_in_flight(2) in flight, each with a scratch shard,
    # whatever the number of micro-batches (the default's peak is the full gradient size for any m)
    peak_overlap = run_on_ranks(2, _grad_peak_body, True, True)[0][0]
    assert peak_overlap <= shards + (1 + reductions_in_flight(2, True)) * (biggest + biggest // 2)
    assert run_on_ranks(2, _grad_peak_body, True, True, 8)[0][0] == peak_overlap


def test_plan_buckets_worked_example():
    # the module docstring's example: w(6), b(3), ln(2) filled in reverse order: ln, b, w
    plan = plan_buckets([2, 3, 6], [False, False, False], bucket_size=5, dp=2, pad_multiple=1)
    assert plan == [([(0, 0, 2), (1, 2, 5)], 6), ([(2, 0, 6)], 6)]
    # a tied embedding gets a bucket of its own; padding to dp * pad_multiple
    plan = plan_buckets([4, 10, 4], [False, True, False], bucket_size=100, dp=4, pad_multiple=2)
    assert plan == [([(0, 0, 4)], 8), ([(1, 0, 10)], 16), ([(2, 0, 4)], 8)]


def _overlap_body(rank, world_size):
    """Buckets are reduced during backward; stage 2 releases full-size grads once reduced."""
    topo = Topology(dp=world_size)
    model = TinyNet()
    sync = wrap_data_parallel(model, topo, ZeroConfig(zero_stage=2, bucket_size=300))
    (tokens, labels), = make_batches(1, 4)
    launched_in_backward = []
    # the embedding's gradient comes last in backward and lives in the last bucket
    assert sync.buckets[-1].slots[-1].param is model.emb.weight
    model.emb.weight.register_hook(lambda g: launched_in_backward.append([b.launched for b in sync.buckets]))
    sync.before_backward(0, True)
    model(tokens, labels).backward()
    sync.finish_grad_sync()
    full = sum(b.numel for b in sync.buckets) * 4
    shards = sum(b.shard_size for b in sync.buckets) * 4
    held_after = sum(b.grad_data is not None for b in sync.buckets)
    return (launched_in_backward[0], held_after, all(p.grad is None for p in model.parameters()),
            sync.peak_grad_bytes, full, shards)


def test_buckets_reduce_during_backward_and_stage2_frees_full_grads():
    launched, held_after, grads_none, peak, full, shards = run_on_ranks(2, _overlap_body)[0]
    # when the last bucket's first gradient arrives, the earlier buckets are already in flight
    assert len(launched) >= 3 and all(launched[:-1]) and not launched[-1]
    assert held_after == 0 and grads_none
    assert shards < peak <= full + shards


def test_finalize_is_required_before_step():
    assert run_on_ranks(2, _finalize_body) == [True, True]


def _finalize_body(rank, world_size):
    topo = Topology(dp=world_size)
    model = TinyNet()
    sync = wrap_data_parallel(model, topo, ZeroConfig(zero_stage=1))
    opt = build_optimizer(sync, OPT)
    tokens, labels = make_batches(1, 4)[0]
    model(tokens, labels).backward()
    try:
        opt.step()
        raise AssertionError("step() accepted unsynchronised gradients")
    except RuntimeError as e:
        assert "finalize_grads" in str(e)
    sync.finalize_grads()
    return math.isfinite(opt.step()[0])


class _WithUnused(TinyNet):
    """TinyNet with a layer forward never uses, laid out between the head and fc2 (so it shares a
    bucket with parameters that do get gradients): its gradient is zero, as in Megatron and DeepSpeed."""

    def __init__(self):
        super().__init__()
        head = self.head
        del self.head
        self.unused = torch.nn.Linear(16, 16)
        self.head = head
        with torch.no_grad():
            for p in self.unused.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.3)


def _unused_reference(steps, global_batch):
    model = _WithUnused()
    opt = torch.optim.AdamW(weight_decay_groups(model.named_parameters(), OPT.weight_decay), lr=OPT.lr,
                            betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps)
    losses = []
    for tokens, labels in make_batches(steps, global_batch):
        loss = model(tokens, labels)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _unused_body(rank, world_size):
    topo = Topology(dp=world_size)
    out = {}
    for each in (False, True):
        losses, _, params, _, _ = train_dp(topo, 2, steps=3, global_batch=8, micro_batches=2, model=_WithUnused(),
                                           each_microbatch=each)
        out[each] = (losses, params)
    return out


def test_zero2_parameter_without_gradient_is_updated_as_zero_gradient():
    """ZeRO-2's gradient storage is not zeroed when made: a parameter that got no gradient must be
    reduced as zeros (weight decay and Adam's moments still move it), not as what the memory held."""
    ref_losses, ref_params = _unused_reference(3, 8)
    assert not torch.equal(ref_params["unused.weight"], _WithUnused().unused.weight)
    for out in run_on_ranks(2, _unused_body):
        for losses, params in out.values():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)
