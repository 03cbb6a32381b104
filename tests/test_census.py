"""The op census: one trainer step's kernels besides the GEMMs, split per layer and micro-batch, pinned for the
GPT-2 and Llama shapes so that a change adding glue (copies, casts, per-parameter kernels) fails on CPU."""
import dataclasses

import pytest
import torch
from helpers import run_on_ranks

from megazero.census import (
    Census,
    OpCensus,
    TimeModel,
    layer_census,
    shape_census,
    step_census,
)
from megazero.config import JobConfig, PrecisionConfig, TrainConfig, ZeroConfig
from megazero.kernels import one_kernel, rms_norm_forward
from megazero.models.gpt import GPTConfig

HIDDEN, FFN, TOKENS = 64, 128, 2 * 32
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=FFN,
             group_query_attention=True, num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
# Non-GEMM kernels each transformer layer runs per micro-batch (forward + backward, bf16 with fp32 masters) and
# once per step (gradient sync + optimizer), at torch 2.13 on CPU, counting each region megazero/kernels.py runs as
# one fused kernel on CUDA (RMSNorm, SwiGLU and RoPE, each way) as that kernel. Lower them when a change removes
# glue; a change that raises them adds kernels to every layer of every step on a GPU. Llama's layer was 95 (20 casts)
# before its norms and SwiGLU were counted as the kernels CUDA runs, 45 before RoPE was (its 20 torch ops, mul, add,
# neg and cat each way for q and k, now 4) and before the attention's q/k/v and SwiGLU's gate/up rows were taken
# apart by unbind (backward: one stack) rather than by indexing (one zero-filled select_backward or slice_backward
# each, and their sum): GPT-2's layer was 31 then.
# "llama_buckets" puts each of a layer's parameters in a bucket of its own (as the 1.5B shape's large matrices
# are): its step ops are the per-bucket glue of the gradient norm, clipping, weight decay, the finite checks and
# the bf16 copy (81 at fcda14e, 26 since clipping, decay and the parameters' finite check are one foreach
# kernel each for all buckets).
# Gradient-accumulation fusion (megazero/parallel/wgrad_fusion.py) makes each linear's weight gradient in its fp32
# main gradient inside the GEMM: the fold of a fresh bf16 gradient (add_) is gone for GPT-2's four weights and
# Llama's five; RoPE is one kernel each way, and fused rows are split by unbind (their gradients one stack, not
# zero-filled slices and a sum). What still folds: the norms' and the biases' gradients. Before: GPT-2 31,
# Llama 45 (95 before its norms and SwiGLU were counted as the kernels CUDA runs).
PINNED = {"gpt2": {"micro_ops": 23, "micro_casts": 0, "step_ops": 0},
          "llama": {"micro_ops": 19, "micro_casts": 0, "step_ops": 0},
          "llama_buckets": {"micro_ops": 19, "micro_casts": 0, "step_ops": 26}}


def _job(bucket_size: int = 4_000_000, **model_kw):
    return JobConfig(model=GPTConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=32,
                                     vocab_size=256, **model_kw),
                     train=TrainConfig(micro_batch_size=2, global_batch_size=2, train_iters=10),
                     precision=PrecisionConfig(bf16=True), zero=ZeroConfig(bucket_size=bucket_size))


def _census_body(rank, world_size):
    return {"gpt2": layer_census(_job()), "llama": layer_census(_job(**LLAMA)),
            "llama_buckets": layer_census(_job(bucket_size=1000, **LLAMA))}


def test_the_census_of_a_layer_is_pinned_and_its_gemms_are_six_n_t():
    """Per layer and micro-batch: whole numbers (the split by depth and micro-batch count is exact), 6 N T GEMM
    FLOPs for the layer's N matrix parameters and T tokens (forward, input and weight gradients), three GEMMs a
    product, one attention kernel forward and one backward; the non-GEMM kernels at most the pinned counts."""
    censuses = run_on_ranks(1, _census_body, timeout=300)[0]
    matrices = {"gpt2": 12 * HIDDEN * HIDDEN, "llama": HIDDEN * (HIDDEN + 2 * 32) + HIDDEN * HIDDEN + 3 * HIDDEN * FFN}
    matrices["llama_buckets"] = matrices["llama"]
    # GPT-2: qkv, dense, fc1, fc2; Llama: query, key_value, dense, fc2 and SwiGLU's fused gate/up weight, whose
    # halves run as two products (forward and each gradient)
    products = {"gpt2": 4, "llama": 6, "llama_buckets": 6}
    for name, lc in censuses.items():
        micro, step = lc.per_layer_micro, lc.per_layer_step
        for figure in (micro.ops, micro.copies, micro.casts, micro.gemms, micro.attention, step.ops):
            assert figure == int(figure), (name, micro.line(), step.line())
        assert micro.gemm_flops == 6 * matrices[name] * TOKENS, (name, micro.gemm_flops)
        assert micro.gemms == 3 * products[name] and micro.attention == 2 and micro.syncs == 0, (name, micro.line())
        pinned = PINNED[name]
        assert micro.ops <= pinned["micro_ops"], (name, micro.line(), dict(micro.by_op))
        assert micro.casts <= pinned["micro_casts"], (name, micro.line(), dict(micro.by_op))
        assert step.ops <= pinned["step_ops"], (name, step.line(), dict(step.by_op))
        assert step.gemms == 0 and lc.rest.syncs >= 1


def test_the_census_sorts_gemms_views_copies_and_casts():
    """One of each: a matrix product (2 M N K), a view (no kernel), a copy, a cast and an elementwise kernel with
    its bytes read and written."""
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with OpCensus() as counted:
        c = a @ b
        c.t()
        c.clone()
        c.to(torch.bfloat16)
        c.add(1.0)
    got = counted.census
    assert (got.gemms, got.gemm_flops) == (1, 2 * 4 * 3 * 8)
    assert (got.ops, got.copies, got.casts) == (3, 2, 1)
    assert got.cast_bytes == 12 * 4 + 12 * 2 and got.bytes == 3 * 12 * 4 + 12 * 2 + 2 * 12 * 4
    assert isinstance(got - got, Census) and (got - got).ops == 0


def test_a_region_marked_as_one_kernel_is_counted_as_one():
    """RMSNorm's several CPU ops count as the one kernel CUDA runs, reading x and the weight and writing y and
    rstd; a GEMM inside a region stays a GEMM; outside a census the region is the plain call."""
    x, w = torch.randn(4, 8), torch.randn(8)
    with OpCensus() as counted:
        y, rstd = one_kernel("rms_norm", rms_norm_forward, x, w, 1e-5)
        one_kernel("epilogue", lambda a: (a @ a.T).relu(), x)
    got = counted.census
    assert (got.ops, got.by_op["rms_norm"], got.gemms, got.casts) == (1, 1, 1, 0), got.line()
    assert got.bytes == (32 + 8 + 32 + 4) * 4
    assert torch.equal(one_kernel("rms_norm", rms_norm_forward, x, w, 1e-5)[0], y)


def _shape_body(rank, world_size):
    job = _job(**LLAMA)
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, num_layers=3, seq_length=48, vocab_size=1536,
                                                                max_position_embeddings=48),
                              train=dataclasses.replace(job.train, micro_batch_size=2, global_batch_size=4))
    return step_census(job, 2), shape_census(job)


def test_a_shape_census_extrapolated_from_small_runs_equals_the_step_run_at_that_shape():
    """The census of a 3-layer step of two micro-batches of 2 x 48 tokens at vocabulary 1536, read off the
    bilinear function through four probes (16 and 32 tokens, vocabularies 512 and 1024, one micro-batch of one
    sequence, one and two layers), equals the census of that step run whole: kernels, copies, casts and FLOPs
    exactly, bytes within 0.5%; the time model adds its four parts."""
    direct, parts = run_on_ranks(1, _shape_body, timeout=300)[0]
    got = parts.step(parts.layers, parts.micro)
    for figure in ("ops", "copies", "casts", "gemms", "gemm_flops", "attention", "attention_flops", "syncs"):
        assert round(getattr(got, figure)) == getattr(direct, figure), (figure, got.line(), direct.line())
    assert abs(got.bytes / direct.bytes - 1) < 5e-3, (got.bytes, direct.bytes)
    times = TimeModel(gemm_flops_per_s=1e12, attention_flops_per_s=1e11, bytes_per_s=1e10, seconds_per_kernel=1e-5)
    t = times.seconds(got)
    assert t["total"] == pytest.approx(got.gemm_flops / 1e12 + got.attention_flops / 1e11 + got.bytes / 1e10
                                       + got.ops * 1e-5)
