"""tools/fuzz/checker.py: fixed-seed draws equal their serial twin (trained, saved, resumed under a second
layout), and the comparisons name the first iteration and value that differ."""

from dataclasses import replace

import pytest
import torch
from helpers.trainer import fuzz_launcher

from tools.fuzz.checker import TOLERANCES, Difference, Report, check, compare_records, tensor_difference
from tools.fuzz.sampler import draw

QUICK_SEEDS = [24]               # Llama dp2 ZeRO-1 -> cp2 a2a (Ulysses) ZeRO-3 with parameters offloaded, recompute;
                                 # Muon without Nesterov (momentum 0.9, 3 Newton-Schulz steps, original lr scale)
FULL_SEEDS = [                   # what each draws (first layout -> resumed layout) on the current sampler
    3,       # tp2 cp2 allgather ZeRO-3 keep-gathered -> cp2 zb-v pp2 dp2, optimizer on NVMe, full recompute
    30,      # Llama cp4 dp2 ZeRO-2, activation offload + selective mlp -> tp2 SP gpipe pp2 ZeRO-3, NVMe
             # parameters; Muon (plain)
    76,      # tp2 SP cp2 a2a zb-h1 pp2 -> tp2 cp2 a2a ZeRO-3, everything offloaded, selective recompute
    2002,    # Llama MoE top-2 capacity cp2 a2a zb-v pp2 dp2 -> tp2 SP dp2 ZeRO-2, optimizer on NVMe
    2005,    # fp16 tp4 dp2 -> cp2 allgather dp2
    2006,    # Llama MoE zb-v pp2 ZeRO-2 qgZ -> tp4 cp2 allgather ZeRO-3 ep2, optimizer on NVMe
    2009,    # MoE capacity tp2 cp2 allgather dp2 ep2 -> tp2 SP zb-h1 pp2, full-block recompute; Muon (plain)
    2014,    # MoE capacity cp2 ep2 ZeRO-1 offload -> tp2 cp2 a2a dp2 ep4
    2020,    # Llama MoE capacity tp2 interleaved pp2 dp2 ep2 -> tp2 dp2 ZeRO-3 offload
    2024,    # tp2 cp4 allgather -> cp2 dp2 ZeRO-2
]


@pytest.fixture(scope="module")
def serial_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("serial-twins")


@pytest.mark.parametrize("seed", [pytest.param(s) for s in QUICK_SEEDS]
                         + [pytest.param(s, marks=pytest.mark.slow) for s in FULL_SEEDS])
def test_fixed_seed_draw_equals_its_serial_twin(seed, tmp_path, serial_cache):
    report = check(draw(seed, fp8=False, families=False), tmp_path, launch=fuzz_launcher(), cache=serial_cache)
    assert report.ok, report.summary() + "\n" + report.step_table()
    assert [r[0] for r in report.rows] == [1, 2, 3, 4] and report.tensors_compared >= 4 * 3 * 20
    assert not (tmp_path / f"draw-{seed}").exists()                 # a passing draw leaves nothing


def _records(losses, norms):
    return {i + 1: {"iteration": i + 1, "loss": x, "grad_norm": n, "skipped": False}
            for i, (x, n) in enumerate(zip(losses, norms))}


FP8_SEEDS = [                    # FP8 draws (first layout -> resumed layout)
    109,     # e4m3 delayed, cp2 a2a ZeRO-2 FP8 param gather, selective recompute -> interleaved pp2 ZeRO-1
]
FP8_FULL_SEEDS = [
    24,      # Llama hybrid rowwise dp2 ZeRO-1 -> cp2 a2a ZeRO-3 parameters offloaded (gradient norm 4.7e-3 off)
    31,      # e4m3 delayed tp2 zb-v pp2 dp2 ZeRO-3 FP8 param gather -> tp2 SP dp4 hpZ: histories saved at dp 2
]


@pytest.mark.parametrize("seed", [pytest.param(s) for s in FP8_SEEDS]
                         + [pytest.param(s, marks=pytest.mark.slow) for s in FP8_FULL_SEEDS])
def test_fixed_seed_fp8_draw_equals_its_serial_fp8_twin(seed, tmp_path, serial_cache):
    """The serial twin runs the same FP8 flags; the draw passes at the FP8 tolerance, the delayed recipe's
    amax histories compared in the serial run's units."""
    d = draw(seed, families=False)
    assert d.fp8 and "--fp8-format" in d.serial_args
    report = check(d, tmp_path, launch=fuzz_launcher(), cache=serial_cache)
    assert report.ok, report.summary() + "\n" + report.step_table()
    assert "fp8" in report.tolerance.name and [r[0] for r in report.rows] == [1, 2, 3, 4]


def test_the_fp8_tolerance_applies_only_with_fp8_on_and_only_loosens():
    from tools.fuzz.checker import tolerance_for

    fp8 = TOLERANCES["fp8"]
    for seed in range(30):
        d, plain = draw(seed), draw(seed, fp8=False)
        own = tolerance_for(plain)
        assert "fp8" not in own.name and own.name == tolerance_for(replace(d, axes={**d.axes, "fp8": "off"})).name
        if not d.fp8:
            continue
        tol = tolerance_for(d)
        assert tol.name == f"{own.name} + fp8"
        for f in ("loss_rtol", "norm_rtol", "tensor_rtol", "tensor_atol", "param_lr", "moment_atol"):
            assert getattr(tol, f) == max(getattr(own, f), getattr(fp8, f)), f
        assert tol.moment_norm_rtol is None


def test_amax_histories_are_compared_in_the_serial_runs_units():
    """At dp 4 the output-gradient row of a delayed history is 4 times the serial run's (each rank divides
    its loss by its own micro-batch count); the input and weight rows are not. As the loader does, the
    checker rescales that row before comparing, so the same history at dp 4 passes and a wrong one fails."""
    from tools.fuzz.checker import history_at_serial_dp

    serial = torch.tensor([[3.0, 2.5], [0.7, 0.7], [1e-3, 2e-3]], dtype=torch.float64)
    at_dp4 = serial.clone()
    at_dp4[2] *= 4
    name = "fp8.amax_history/layers.0.mlp.fc1"
    assert torch.equal(history_at_serial_dp(at_dp4, 4, 1), serial)
    assert tensor_difference(name, history_at_serial_dp(at_dp4, 4, 1), serial, TOLERANCES["fp8"], LR) is None
    assert tensor_difference(name, at_dp4, serial, TOLERANCES["fp8"], LR)                # not rescaled: fails
    assert history_at_serial_dp(at_dp4, 1, 1) is at_dp4


def test_records_out_of_tolerance_name_their_iteration():
    want = _records([4.0, 3.9, 3.8], [1.0, 0.9, 0.8])
    got = _records([4.0, 3.9, 3.8 * (1 + 3e-5)], [1.0, 0.9 * (1 + 2e-6), 0.8])
    report = Report(draw(9), TOLERANCES["fp32"])
    compare_records(got, want, range(1, 4), TOLERANCES["fp32"], "first", report)
    assert [(d.iteration, d.what) for d in report.differences] == [(3, "loss")]
    assert report.first_difference.iteration == 3 and "rel 3.0e-05 > 1e-05" in str(report.first_difference)
    loose = Report(draw(9), TOLERANCES["bf16"])
    compare_records(got, want, range(1, 4), TOLERANCES["bf16"], "first", loose)
    assert loose.ok


def test_the_summary_of_a_failure_gives_the_seed_and_a_reproducing_line():
    report = Report(draw(12), TOLERANCES["fp32"], reproduce="python -m tools.fuzz_layouts --seed 12 --draws 1")
    report.differences = [Difference(3, "tensor model/final_norm.weight[5]", 1.0, 1.1), Difference(2, "loss", 4.0, 4.1)]
    text = report.summary()
    assert text.startswith("draw 12: NOT EQUAL") and "first difference: iteration 2: loss" in text
    assert "first tensor that differs: iteration 3: tensor model/final_norm.weight[5]" in text
    assert "reproduce: python -m tools.fuzz_layouts --seed 12 --draws 1" in text


@pytest.mark.slow
def test_moe_draw_with_one_large_serial_bucket_equals_its_serial_twin(tmp_path, serial_cache):
    """Draw 11. Under the sampler before context parallelism (MoE with capacity at tp 2 + SP, ZeRO-1 with
    small buckets, resumed at interleaved pp 4) the gradient norm was 1.2e-5 above serial: a float32
    norm over the serial twin's one large range (now optimizer.squared_norm). With cp in the space it draws
    MoE capacity at cp 4 (allgather, ep 4, dp-cp-tp-pp), resumed at tp 2 x cp 2 (p2p): capacity counted per
    cp rank then (7e-5 loss off); the queues are now the whole sequence's in serial token order."""
    report = check(draw(11, fp8=False, families=False), tmp_path, launch=fuzz_launcher(), cache=serial_cache)
    assert report.ok, report.summary()


@pytest.mark.slow
def test_zero_over_dp_x_cp_with_dp_before_cp_equals_serial(tmp_path, capsys):
    """cp 2, dp 2, ZeRO-1, --parallel-order dp-cp-tp-pp on 4 ranks (the smallest reproduction of the
    fuzzer's draws 2004, 2010 and 2013): the gradient norm was 7.7e-3 off at the first step, ZeRO owning
    one shard and reduce-scattering into another (the dp x cp view's rank was not torch's group rank)."""
    from tools import check_layout

    plan = ["--cp", "2", "--dp", "2", "--zero-stage", "1", "--parallel-order", "dp-cp-tp-pp", "--num-layers", "4",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "1",
            "--global-batch-size", "4"]
    status = check_layout.main(["--workdir", str(tmp_path), "--", *plan], launch=fuzz_launcher())
    assert status == 0, capsys.readouterr().out


# The element rule on synthetic tensors: Adam's first step moves each parameter element by ±lr, so a 16-bit
# draw whose rounding flips the sign of a few near-zero gradients differs from serial by 2 lr there.
LR = 5e-3


def _adam_like(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = 0.02 * torch.randn(n, generator=g, dtype=torch.float64)
    grads = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    return weights, grads


@pytest.mark.parametrize("precision", ["bf16", "fp16", "moe16"])
def test_rounding_like_flips_pass_a_16_bit_draw_and_fail_fp32(precision):
    weights, grads = _adam_like()
    flipped = weights.clone()
    flipped[:10] += 2 * LR                                       # 4% of the elements stepped the other way
    flipped[10:] += 1e-3 * LR * torch.sign(grads[10:])           # the rest a rounding's width apart
    tol = TOLERANCES[precision]
    assert tensor_difference("model/layers.0.attention.dense.bias", flipped, weights, tol, LR) is None
    moment = 0.1 * grads
    noisy = moment * (1 + 0.02 * torch.sign(grads))
    noisy[:8] = -moment[:8]                                      # near-zero gradients rounded the other way
    assert tensor_difference("optim.exp_avg/layers.0.attention.dense.bias", noisy, moment, tol, LR) is None
    detail = tensor_difference("model/layers.0.attention.dense.bias", flipped, weights, TOLERANCES["fp32"], LR)
    assert detail and "10 of 256 elements out of tolerance" in detail[3]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_missing_reduction_fails_a_16_bit_draw(precision):
    """Half the ranks' contribution lost: the moments halve (the parameters do not move differently: Adam's
    step does not see a gradient's scale), or a partial sum flips three in four of the parameters' steps."""
    tol = TOLERANCES[precision]
    weights, grads = _adam_like()
    moment = 0.1 * grads
    detail = tensor_difference("optim.exp_avg/final_norm.weight", 0.5 * moment, moment, tol, LR)
    assert detail and "elements out of tolerance" in detail[3]
    detail = tensor_difference("optim.exp_avg_sq/final_norm.weight", 0.25 * grads ** 2, grads ** 2, tol, LR)
    assert detail and ("elements out of tolerance" in detail[3] or "elements within bound differ" in detail[3])
    partial = weights + torch.where(torch.arange(256) % 4 != 0, 2 * LR, 0.0)
    detail = tensor_difference("model/final_norm.weight", partial, weights, tol, LR)
    assert detail and "192 of 256 elements out of tolerance" in detail[3]


def test_draws_get_the_rule_of_their_precision_experts_and_int8():
    from tools.fuzz.checker import tolerance_for

    kinds = {}
    for seed in range(6000, 6060):
        d = draw(seed, fp8=False)
        kind = ("int8" if d.lossy else d.axes["precision"]) + ("-moe" if (d.axes.get("experts") or 0) > 1 else "")
        kinds.setdefault(kind, tolerance_for(d).name)
    assert kinds["fp32"] == kinds["fp32-moe"] == "fp32" and kinds["bf16"] == "bf16" and kinds["fp16"] == "fp16"
    assert kinds["bf16-moe"] == kinds["fp16-moe"] == TOLERANCES["moe16"].name
    assert kinds["int8"].startswith("quantized")


def test_elements_within_bound_must_still_agree_as_a_whole():
    """Every moment element inside its bound, yet all off the same way: the rest's norm catches it."""
    tol = TOLERANCES["bf16"]
    _, grads = _adam_like()
    moment = 0.1 * grads.abs()
    off = (tol.rest_rtol + tol.moment_rtol + tol.moment_atol) / 2      # inside every element's bound
    assert tol.rest_rtol < off <= tol.moment_rtol + tol.moment_atol
    scaled = moment * (1 + off)
    detail = tensor_difference("optim.exp_avg/final_norm.weight", scaled, moment, tol, LR)
    assert detail and "elements within bound differ by" in detail[3]


def test_int8_tensors_are_held_within_adams_reach():
    """ZeRO++ int8 moves elements as far as a broken reduction does (measured), so only what Adam cannot do
    fails: a parameter further from serial than its steps could take it (a wrong shard loaded on resume)."""
    tol = TOLERANCES["quantized"]
    weights, grads = _adam_like()
    assert tensor_difference("model/final_norm.weight", weights + 5.9 * LR, weights, tol, LR) is None
    assert tensor_difference("optim.exp_avg/final_norm.weight", -grads, grads, tol, LR) is None
    detail = tensor_difference("model/final_norm.weight", weights.flip(0), weights, tol, LR)
    assert detail and "elements out of tolerance" in detail[3]


def test_fp32_keeps_its_element_bound():
    tol = TOLERANCES["fp32"]
    weights, _ = _adam_like()
    assert tol.out_fraction == tol.moment_out_fraction == 0 and tol.rest_rtol is None
    assert tensor_difference("model/final_norm.weight", weights + 1e-3 * LR, weights, tol, LR) is None
    one = weights.clone()
    one[3] += 0.01 * LR
    detail = tensor_difference("model/final_norm.weight", one, weights, tol, LR)
    assert detail[0] == "[3]" and "1 of 256 elements out of tolerance;" in detail[3]


def test_fp32_moment_norms_exp_avg_sq_at_twice_the_gradients_rule():
    """exp_avg follows the gradient, exp_avg_sq its square, whose relative difference is twice the
    gradient's: a gradient 2.35e-5 off (draw 11080's key/value weight, rounding) passes both; 4e-5
    fails exp_avg's 3e-5 and exp_avg_sq's 6e-5 (8e-5 off); a lost reduction is far outside either."""
    tol = TOLERANCES["fp32"]
    _, grads = _adam_like()
    for off, ok in ((2.35e-5, True), (4e-5, False)):
        g = grads * (1 + off)
        avg = tensor_difference("optim.exp_avg/layers.2.attention.key_value.weight", 0.1 * g, 0.1 * grads, tol, LR)
        sq = tensor_difference("optim.exp_avg_sq/layers.2.attention.key_value.weight", 1e-3 * g ** 2,
                               1e-3 * grads ** 2, tol, LR)
        assert (avg is None, sq is None) == (ok, ok), (off, avg, sq)
    assert "> 3e-05" in avg[3] and "> 6e-05" in sq[3], (avg, sq)
    half = tensor_difference("optim.exp_avg_sq/layers.2.attention.key_value.weight", 0.25e-3 * grads ** 2,
                             1e-3 * grads ** 2, tol, LR)
    assert half and "norms; relative difference 7.5e-01" in half[3], half


def test_a_deepseek_v3_moe_draw_at_ep4_over_dp2_x_cp2_zero3_equals_its_serial_twin(tmp_path, serial_cache):
    """Draw 6682, a family drawn from the registry: DeepSeek-V3 (latent attention, 4 experts, its spec's tiny
    model) at cp2 (all-gather) x dp2 ZeRO-3 kept gathered, small buckets, the optimizer offloaded, ep 4 carved
    out of dp x cp (the smallest world with ep 4 and dp 2: 4 ranks), resumed at dp4 ZeRO-1 ep2 with full-block
    recompute; its serial twin is the same family on one process."""
    d = draw(6682)
    assert d.axes["family"] == "deepseek_v3" and "--model-family" in d.serial_args
    assert (d.world, d.axes["experts"], d.axes["ep"], d.axes["dp"], d.axes["cp"], d.axes["zero"]) == (4, 4, 4, 2, 2, 3)
    assert not d.lossy and d.axes["precision"] == "fp32" and d.resume_world == 4
    report = check(d, tmp_path, launch=fuzz_launcher(), cache=serial_cache)
    assert report.ok, report.summary() + "\n" + report.step_table()
    assert [r[0] for r in report.rows] == [1, 2, 3, 4] and report.tensors_compared >= 4 * 3 * 20


def test_a_muon_draw_equals_its_serial_twin(tmp_path, serial_cache):
    """Draw 45: Muon (Nesterov, fp32 Newton-Schulz) at dp4 ZeRO-3 with the parameters offloaded, saved and
    resumed at cp2 dp2 ZeRO-1: the momentum crosses the checkpoint and the layout change."""
    d = draw(45, fp8=False)
    assert d.optimizer == "muon" and (d.world, d.axes["zero"], d.resume_axes["cp"]) == (4, 3, 2)
    report = check(d, tmp_path, launch=fuzz_launcher(), cache=serial_cache)
    assert report.ok, report.summary() + "\n" + report.step_table()
    assert [r[0] for r in report.rows] == [1, 2, 3, 4] and report.tensors_compared >= 4 * 3 * 20
