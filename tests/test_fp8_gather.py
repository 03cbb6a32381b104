"""--fp8-param-gather (megazero/parallel/zero/fp8_gather.py): ZeRO's parameter all-gathers send the FP8
linears' weights in FP8. A dp 2 run (ZeRO-1, 2 and 3, tensorwise and delayed scaling; tp 2 x dp 2; hpZ at
dp 4) equals the same layout without the flag bit for bit and the serial FP8 run of the same model, init
and data; the bytes counted are the wire format's; the wire layout; the FP8 round trip of a dequantized
weight; the refusal next to ZeRO++'s int8 gather."""
import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_CFG, GPT_OPT, MB_SIZE, MICRO, SEED, gpt_batches

from megazero.config import FP8Config, JobConfig, ParallelConfig, PrecisionConfig, TrainConfig, ZeroConfig
from megazero.errors import ConfigError
from megazero.models.gpt import GPTConfig, build_model_chunks
from megazero.parallel.fp8 import LinearFP8, Recipe, Splits
from megazero.parallel.params import split_dim
from megazero.parallel.tensor import shard
from megazero.parallel.topology import Topology
from megazero.parallel.zero import Bucket, ParamSlot, build_engine
from megazero.parallel.zero.fp8_gather import WIRE_ALIGN, gathers_in_fp8, plan_wire
from megazero.training import train_step

STEPS = 5
RECIPES = ("tensorwise", "delayed")


def _fp8(recipe: str, gather: bool) -> FP8Config:
    return FP8Config(fp8_format="e4m3", fp8_recipe=recipe, fp8_param_gather=gather)


def _train(tp: int, stage: int, fp8: FP8Config, steps: int = STEPS, dtype=torch.float32, precision=None, **zero_kw):
    """Train the test GPT with ``fp8`` and ZeRO ``stage`` (and ``zero_kw``) on the 2 * MICRO micro-batches of
    each step, split over dp; returns (topo, losses, {name: (tp-local exact value, split dim)}, dp bytes per
    step, engine)."""
    topo = Topology(tp=tp, pp=1)
    cfg = GPTConfig(**GPT_CFG)
    par = ParallelConfig(tp=tp, pp=1, dp=topo.dp_size)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED, dtype=dtype, fp8=fp8)
    job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=MB_SIZE), fp8=fp8)
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage, **zero_kw), GPT_OPT, precision)
    micro = 2 * MICRO // topo.dp_size
    losses, sent = [], []
    for batches in gpt_batches(steps, 2 * MICRO):
        engine.comm_log.reset()
        result = train_step(chunks, batches[topo.dp_rank * micro:(topo.dp_rank + 1) * micro], topo, engine, job)
        losses.append(result.loss)
        sent.append(engine.comm_log.bytes().get("dp", 0.0))
    with engine.gathered_parameters():
        params = {n: (p.detach().float().clone(), split_dim(p)) for c in chunks for n, p in c.named_parameters()}
    return topo, losses, params, sent, engine


def _reference_body(rank, world_size, recipes):
    """Per recipe: the losses of 2 steps and the parameters after 1 step."""
    return {recipe: (_train(1, 0, _fp8(recipe, False), steps=2)[1], _train(1, 0, _fp8(recipe, False), steps=1)[2])
            for recipe in recipes}


def _gathered_body(rank, world_size, tp, runs, zero_kw=None):
    out, zero_kw = [], zero_kw or {}
    for stage, recipe in runs:
        topo, losses, params, _, engine = _train(tp, stage, _fp8(recipe, True), **zero_kw)
        weights = [s.param for b in engine.bucket_groups[0].buckets for s in b.slots if gathers_in_fp8(s.param)]
        used = bool(weights) and all(p.fp8_linear.weight_amax is not None for p in weights)
        _, plain_losses, plain_params, _, _ = _train(tp, stage, _fp8(recipe, False), **zero_kw)
        first_params = _train(tp, stage, _fp8(recipe, True), steps=1, **zero_kw)[2]
        out.append((stage, recipe, topo.tp_rank, topo.tp_size, used, (losses, params), (plain_losses, plain_params),
                    first_params))
    return out


def _check(results, reference):
    """Over 5 steps the run equals, bit for bit, the same layout gathering in the parameters' dtype (the
    products see the same FP8 values); against the serial FP8 run, the losses of the first 2 steps (the
    second's forward takes gathered weights at every stage) and every parameter after the first step
    at 1e-5 (absolute floor 1e-5: Adam moves an element of ~0 gradient by rounding noise, as
    tests/test_llama.py allows). Not later steps: the serial and the dp 2 FP8 runs, with or without this flag, part after a
    few steps, when an fp32 rounding difference in a gradient sum moves a value across an FP8 rounding
    boundary."""
    for stage, recipe, tp_rank, tp, used, (losses, params), (plain_losses, plain_params), first_params in results:
        assert used, f"ZeRO-{stage} {recipe}: no weight travelled in FP8"
        assert losses == plain_losses, f"ZeRO-{stage} {recipe}: {losses} != {plain_losses}"
        assert set(params) == set(plain_params)
        for name, (value, _) in params.items():
            torch.testing.assert_close(value, plain_params[name][0], rtol=0, atol=0,
                                       msg=lambda m: f"ZeRO-{stage} {recipe} {name}: {m}")
        ref_losses, ref_params = reference[recipe]
        torch.testing.assert_close(torch.tensor(losses[:2]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert set(first_params) == set(ref_params)
        for name, (value, dim) in first_params.items():
            torch.testing.assert_close(value, shard(ref_params[name][0], dim, tp_rank, tp), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"ZeRO-{stage} {recipe} {name} after one step: {m}")


@pytest.fixture(scope="module")
def reference():
    """The serial FP8 runs (one process, no ZeRO, the same FP8 settings without the FP8 gather)."""
    return run_on_ranks(1, _reference_body, RECIPES)[0]


@pytest.mark.parametrize("runs", [
    [(3, "delayed"), (1, "tensorwise")],
    pytest.param([(3, "tensorwise"), (2, "delayed")], marks=pytest.mark.slow),
], ids=["zero3-delayed,zero1-tensorwise", "zero3-tensorwise,zero2-delayed"])
def test_dp2_fp8_param_gather_matches_serial_fp8_run(reference, runs):
    """ZeRO-3 (per-unit gathers in forward and backward) and ZeRO-1 / 2 (the updated shards' gather after
    the step), tensorwise and delayed scaling, fp32 parameters."""
    for rank_out in run_on_ranks(2, _gathered_body, 1, runs):
        _check(rank_out, reference)


@pytest.mark.slow
def test_tp2_dp2_fp8_param_gather_matches_serial_fp8_run(reference):
    """Each weight's amax agreed over dp and then over tp (column- and row-parallel layers)."""
    for rank_out in run_on_ranks(4, _gathered_body, 2, [(3, "delayed"), (1, "tensorwise")], timeout=400):
        _check(rank_out, reference)


@pytest.mark.slow
def test_dp4_fp8_param_gather_with_hpz_matches_serial_fp8_run(reference):
    """ZeRO++ hpZ: the forward gathers in FP8 over dp 4, the backward gathers the secondary shards (the
    forward's dequantized values) over blocks of 2 ranks."""
    for rank_out in run_on_ranks(4, _gathered_body, 1, [(3, "delayed")], dict(hpz_partition_size=2), timeout=400):
        _check(rank_out, reference)


# --------------------------------------------------------------------------- bytes

def _expected_gather_bytes(bucket, n: int) -> float:
    """The wire format's all-gather bytes per rank for one bucket (module docstring of fp8_gather)."""
    e = bucket.param_data.element_size()
    spans = [(s.start, s.end) for s in bucket.slots if gathers_in_fp8(s.param)]
    if not spans:
        return e * bucket.numel * (n - 1) / n
    payloads = []
    for r in range(n):
        lo, hi = bucket.shard_range(r)
        fp8 = sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)
        payloads.append(e * (hi - lo - fp8) + fp8)
    piece = -(-max(payloads) // WIRE_ALIGN) * WIRE_ALIGN
    return n * piece * (n - 1) / n


def _bytes_body(rank, world_size):
    _, _, _, plain, _ = _train(1, 1, _fp8("tensorwise", False), steps=2)
    _, _, _, fp8, engine = _train(1, 1, _fp8("tensorwise", True), steps=2)
    buckets = engine.bucket_groups[0].buckets
    weights = sum(s.end - s.start for b in buckets for s in b.slots if gathers_in_fp8(s.param))
    others = sum(b.numel for b in buckets) - weights
    expected = sum(_expected_gather_bytes(b, world_size) for b in buckets)
    amaxes = 2 * (world_size - 1) / world_size * 4 * sum(gathers_in_fp8(s.param) for b in buckets for s in b.slots)
    return plain, fp8, weights, others, expected, amaxes


def test_fp8_gather_sends_one_byte_per_weight_element():
    """ZeRO-1, fp32 parameters, dp 2: per step the all-gather of the updated parameters sends exactly the
    wire format's bytes plus one fp32 amax per FP8 weight all-reduced; the FP8 weights' part is one byte
    per element (half of bf16's two, a quarter of fp32's four), plus the padding of the smaller payload
    to the larger's (here under 3%)."""
    for plain, fp8, weights, others, expected, amaxes in run_on_ranks(2, _bytes_body):
        n = 2
        fp32_gather = 4 * (weights + others) * (n - 1) / n
        for p, f in zip(plain, fp8):
            fp8_gather = fp32_gather - (p - f) - amaxes
            assert fp8_gather == pytest.approx(expected, rel=1e-12)
            weights_part = fp8_gather - 4 * others * (n - 1) / n
            one_byte = 1 * weights * (n - 1) / n
            assert one_byte <= weights_part < 1.05 * one_byte      # equal pieces: the larger payload's padding


# --------------------------------------------------------------------------- wire layout, refusal

def _param(numel: int, fp8: bool):
    p = torch.nn.Parameter(torch.zeros(numel))
    if fp8:
        recipe = Recipe(torch.float8_e4m3fn, torch.float8_e4m3fn, False, False, 1, False, 0, param_gather=True)
        p.fp8_linear = LinearFP8(recipe, Splits())
    return p


def test_wire_layout_worked_example():
    """The module docstring's example: fp32, dp 2, a bias of 32 then an FP8 weight of 96 elements."""
    bucket = Bucket(0, 0, 0, 128, 64)
    bucket.param_data = torch.zeros(128)
    bucket.slots = [ParamSlot("b", _param(32, False), bucket, 0, 32), ParamSlot("w", _param(96, True), bucket, 32, 128)]
    plan = plan_wire(bucket, 2)
    assert plan.piece == 160 and plan.spans == [(32, 128)]
    assert [(s.lo, s.hi, s.weight, s.offset) for s in plan.segments[0]] == [(0, 32, -1, 0), (32, 64, 0, 128)]
    assert [(s.lo, s.hi, s.weight, s.offset) for s in plan.segments[1]] == [(64, 128, 0, 0)]
    assert plan_wire(bucket, 1) is None                      # one rank: nothing travels


def test_refused_beside_zero_quantized_weights():
    with pytest.raises(ConfigError, match="--fp8-param-gather and --zero-quantized-weights"):
        _fp8("delayed", True).check(3, quantized_weights=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_weight_casts_back_to_the_same_fp8_values(dtype):
    """The ground of the exactness: a weight cast to e4m3 with a scale, dequantized in the parameters' dtype
    and cast again with the same scale gives the same FP8 bytes, for values across e4m3's range (subnormal,
    normal, saturating above 448 / scale) and with a scale from a stale (delayed) amax."""
    state = _param(1, True).fp8_linear
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, generator=g) * torch.logspace(-6, 0, 4096)
    for amax in (w.abs().max(), w.abs().max() / 3):             # the second: values saturate
        scale = state.weight_scale(amax)
        q = state.cast(w.to(dtype), scale, torch.float8_e4m3fn)
        back = (q.float() / scale).to(dtype)
        again = state.cast(back, scale, torch.float8_e4m3fn)
        assert torch.equal(again.view(torch.uint8), q.view(torch.uint8))
        assert (q.view(torch.uint8) != 0).sum() > 1000           # not all flushed to zero
