"""Gradient-accumulation fusion (megazero/parallel/wgrad_fusion.py): a linear's weight gradient added straight
into its fp32 main gradient. On a CPU it runs the same product and add as autograd's gradient folded by the grad
sync's hook, so a bf16 run with it equals the run without it bitwise; where it applies is a config rule."""
import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from helpers import run_on_ranks

from megazero.config import (
    CompileConfig,
    FP8Config,
    JobConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    ZeroConfig,
    validate,
)
from megazero.errors import ConfigError
from megazero.models.gpt import GPTConfig
from megazero.parallel import wgrad_fusion
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train_step

LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 128,
         "group_query_attention": True, "num_query_groups": 2, "add_bias_linear": False,
         "untie_embeddings_and_output_weights": True}
LINEARS = ("attention.query", "attention.key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
MICRO = 2                               # micro-batches per rank and step


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _reference_and_fused(w, b):
    """Two copies of weight ``w`` and bias ``b`` (None: no bias) as leaves: the reference's, and the fused one's
    with an fp32 main gradient installed and a hook recording what ``take_fused`` says each backward; the fold's
    fp32 target for the reference; the main gradient; the hook's record."""
    ref = (w.clone().requires_grad_(), None if b is None else b.clone().requires_grad_())
    fused = (w.clone().requires_grad_(), None if b is None else b.clone().requires_grad_())
    folded, main = torch.zeros(w.numel()), torch.zeros(w.numel())
    wgrad_fusion.install_main_grad(fused[0], main)
    hooked = []
    fused[0].register_post_accumulate_grad_hook(lambda p: hooked.append(wgrad_fusion.take_fused(p)))
    return ref, fused, folded, main, hooked


@pytest.mark.parametrize("shape", [(6, 8), (3, 2, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_linear_is_bitwise_autograd_and_the_fold(shape, with_bias):
    """Output, input and bias gradients bitwise F.linear's under autograd; the weight's gradient added into an fp32
    target bitwise autograd's bf16 gradient folded into it (twice: two micro-batches), and a dummy gradient stored
    (the post-accumulate-grad hook still runs) with the weight marked."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).bfloat16()
    w = torch.randn(5, 8, generator=g).bfloat16()
    b = torch.randn(5, generator=g).bfloat16() if with_bias else None
    dys = [torch.randn(*shape[:-1], 5, generator=g).bfloat16() for _ in range(2)]

    (ref_w, ref_b), (fused_w, fused_b), folded, main, hooked = _reference_and_fused(w, b)
    for dy in dys:
        x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref = F.linear(x_ref, ref_w, ref_b)
        y_ref.backward(dy)
        folded.add_(ref_w.grad.reshape(-1))
        ref_w.grad = None
        y = wgrad_fusion.linear(x_fused, fused_w, fused_b)
        y.backward(dy)
        assert torch.equal(_bits(y), _bits(y_ref)) and torch.equal(_bits(x_fused.grad), _bits(x_ref.grad))
        if with_bias:
            assert torch.equal(_bits(fused_b.grad), _bits(ref_b.grad))
    assert hooked == [True, True] and fused_w.grad is None
    assert torch.equal(_bits(main), _bits(folded))


@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglus_two_halves_add_into_their_rows_bitwise_autograd_and_the_fold(with_bias):
    """gate_up: the products of rows 0::2 and 1::2 of one weight, each half's weight gradient added into its rows
    of the fp32 target (autograd: ``(X^T dY)^T`` for a strided weight, scattered, summed, folded), one dummy
    gradient for the hook; outputs, input and bias gradients bitwise autograd's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 8, generator=g).bfloat16()
    w = torch.randn(10, 8, generator=g).bfloat16()
    b = torch.randn(10, generator=g).bfloat16() if with_bias else None
    (ref_w, ref_b), (fused_w, fused_b), folded, main, hooked = _reference_and_fused(w, b)
    for _ in range(2):
        dys = [torch.randn(3, 2, 5, generator=g).bfloat16() for _ in range(2)]
        x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref = (F.linear(x_ref, ref_w[0::2], ref_b[0::2] if with_bias else None),
               F.linear(x_ref, ref_w[1::2], ref_b[1::2] if with_bias else None))
        torch.autograd.backward(ref, dys)
        folded.add_(ref_w.grad.reshape(-1))
        ref_w.grad = None
        out = wgrad_fusion.gate_up(x_fused, fused_w, fused_b)
        torch.autograd.backward(out, dys)
        assert all(torch.equal(_bits(a), _bits(r)) for a, r in zip(out, ref))
        assert torch.equal(_bits(x_fused.grad), _bits(x_ref.grad))
        if with_bias:
            assert torch.equal(_bits(fused_b.grad), _bits(ref_b.grad))
    assert hooked == [True, True] and fused_w.grad is None
    assert torch.equal(_bits(main), _bits(folded))


def test_without_a_target_or_gradients_the_linear_is_f_linear():
    w = torch.randn(5, 8).bfloat16().requires_grad_()
    x = torch.randn(3, 8).bfloat16()
    assert not wgrad_fusion.fuses(x, w)
    wgrad_fusion.install_main_grad(w, torch.zeros(w.numel()))
    assert wgrad_fusion.fuses(x, w) and not wgrad_fusion.fuses(x.t().contiguous().t(), w)
    with torch.no_grad():
        assert not wgrad_fusion.fuses(x, w)


def _job(stage: int = 0, **kw) -> JobConfig:
    return JobConfig(model=GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                                     vocab_size=128, **LLAMA),
                     train=TrainConfig(micro_batch_size=2, global_batch_size=2 * MICRO, train_iters=10),
                     precision=PrecisionConfig(bf16=True), zero=ZeroConfig(zero_stage=stage), **kw)


def test_it_is_on_where_it_applies_and_refused_where_asked_and_not():
    assert validate(_job(0), 1).zero.wgrad_into_main_grad
    assert validate(_job(1), 1).zero.wgrad_into_main_grad
    assert not validate(_job(2), 1).zero.wgrad_into_main_grad
    off = _job(0)
    off.zero.gradient_accumulation_fusion = False
    assert not validate(off, 1).zero.wgrad_into_main_grad
    fp32 = dataclasses.replace(_job(0), precision=PrecisionConfig())
    assert not validate(fp32, 1).zero.wgrad_into_main_grad
    bf16_grads = _job(0)
    bf16_grads.zero.accumulate_allreduce_grads_in_fp32 = False
    assert not validate(bf16_grads, 1).zero.wgrad_into_main_grad
    assert not validate(_job(0, compilation=CompileConfig(compile=True)), 1).zero.wgrad_into_main_grad
    assert not validate(_job(0, fp8=FP8Config(fp8_format="e4m3")), 1).zero.wgrad_into_main_grad
    validated = validate(_job(0), 1)
    again = validate(dataclasses.replace(validated, zero=dataclasses.replace(validated.zero, zero_stage=2)), 1)
    assert not again.zero.wgrad_into_main_grad      # settled afresh (the memory planner tries other stages)
    asked = _job(2)
    asked.zero.gradient_accumulation_fusion = True
    with pytest.raises(ConfigError, match="--gradient-accumulation-fusion needs --zero-stage 0 or 1"):
        validate(asked, 1)


def _steps(job: JobConfig, fuse: bool, rank: int):
    """Two trainer steps of ``job`` with the fusion on or off: the parameters whose gradient a linear added to its
    main gradient, each step's held fp32 gradients and the updated parameters (as bytes), and which code launched
    each bucket's reduction."""
    job = dataclasses.replace(job, zero=dataclasses.replace(job.zero, gradient_accumulation_fusion=fuse))
    job = validate(job, torch.distributed.get_world_size())
    assert job.zero.wgrad_into_main_grad is fuse
    par = job.parallel
    topo = Topology(par.tp, par.pp, par.dp, order=par.order, cp=par.cp, ep=par.expert_model_parallel_size)
    torch.manual_seed(0)
    chunks = build_model_chunks(get_model_spec(job.model.model_family), job, topo, dtype=torch.bfloat16)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    added = set()                       # the parameters whose gradient a linear's backward added to main_grad
    take_fused = wgrad_fusion.take_fused

    def spy(param):
        if take_fused(param):
            added.add(id(param))
            return True
        return False
    wgrad_fusion.take_fused = spy
    launched_by = []                    # who launched each bucket's reduction: the countdown, or the end of backward
    for sync in engine.bucket_groups:
        start = sync._start

        def recording(bucket, start=start):
            launched_by.append((bucket.index, inspect.stack()[1].function))
            start(bucket)
        sync._start = recording
    g = torch.Generator().manual_seed(1 + rank)
    b, s, v = job.train.micro_batch_size, job.model.seq_length, job.model.vocab_size
    seen = []
    try:
        for _ in range(2):
            batches = [{"tokens": torch.randint(0, v, (b, s), generator=g), "loss_mask": torch.ones(b, s),
                        "labels": torch.randint(0, v, (b, s), generator=g)} for _ in range(MICRO)]
            train_step(chunks, batches, topo, engine, job)
            seen.append([_bits(seg) for sync in engine.bucket_groups for slot in sync.slots
                         for seg in sync.local_grad_segments(slot)])
            seen.append([_bits(p) for c in chunks for p in c.parameters()])
    finally:
        engine.close()
        wgrad_fusion.take_fused = take_fused
    return [n for c in chunks for n, p in c.named_parameters() if id(p) in added], seen, launched_by


def _parity_body(rank, world_size, stage, model_kw, parallel_kw=None):
    parallel = ParallelConfig(**(parallel_kw or {}))
    dp = world_size // (parallel.tp * parallel.pp)
    job = _job(stage, parallel=parallel)
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, **model_kw),
                              train=dataclasses.replace(job.train, global_batch_size=2 * MICRO * dp))
    off_names, off, off_launches = _steps(job, False, rank)
    on_names, on, on_launches = _steps(job, True, rank)
    same = len(off) == len(on) == 4 and all(len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
                                            for a, b in zip(off, on))
    assert on_launches == off_launches and {by for _, by in on_launches} == {"on_grad_ready"}, on_launches
    return off_names, on_names, same


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_bf16_llama_trains_bitwise_the_same_with_and_without_the_fusion(world, stage):
    """Two steps of two micro-batches, ZeRO 0 and 1 at dp 1 and 2: every held fp32 main gradient and every updated
    parameter bitwise equal, and every bucket's reduction launched by the countdown of the parameters' hooks, as
    without the fusion. The weights fused are the linears' and the untied head's (not the norms', not
    SwiGLU's interleaved gate/up weight, whose halves are two products of slices)."""
    for off_names, on_names, same in run_on_ranks(world, _parity_body, stage, {}, timeout=300):
        assert off_names == [] and same
        assert on_names == [f"layers.{i}.{name}.weight" for i in (0, 1) for name in LINEARS] + ["output_layer.weight"]


def test_gpt2_with_biases_and_a_tied_embedding_trains_bitwise_the_same():
    """GPT-2's shape (biases, LayerNorm, the head tied to the word embedding) at ZeRO 1, dp 2: bitwise the same;
    the tied embedding, used twice in one backward, keeps the fold."""
    gpt2 = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
            "ffn_hidden_size": 256, "group_query_attention": False, "num_query_groups": None,
            "add_bias_linear": True, "untie_embeddings_and_output_weights": False}
    for off_names, on_names, same in run_on_ranks(2, _parity_body, 1, gpt2, timeout=300):
        assert same and on_names == [f"layers.{i}.{name}.weight" for i in (0, 1) for name in (
            "attention.qkv", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")], on_names


@pytest.mark.parametrize("layout", ["tp2-sequence-parallel-recompute", "pp2-tied", "ep2-moe"])
def test_tensor_and_pipeline_layouts_train_bitwise_the_same(layout):
    """Tensor parallelism with sequence parallelism and full recompute (Llama), two pipeline stages whose last
    holds the tied embedding's copy (GPT-2), and MoE layers (experts and a shared expert) over two expert-parallel
    ranks (Llama), at ZeRO 1: bitwise the same with the fusion as without."""
    if layout == "ep2-moe":
        model_kw, parallel_kw = {"num_experts": 4, "moe_router_topk": 2,
                                 "moe_shared_expert_intermediate_size": 64}, {"expert_model_parallel_size": 2}
    elif layout.startswith("tp2"):
        model_kw, parallel_kw = {"recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": 1}, {"tp": 2, "sequence_parallel": True}
    else:
        model_kw, parallel_kw = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
                                 "swiglu": False, "ffn_hidden_size": 256, "group_query_attention": False,
                                 "num_query_groups": None, "add_bias_linear": True,
                                 "untie_embeddings_and_output_weights": False}, {"pp": 2}
    results = run_on_ranks(2, _parity_body, 1, model_kw, parallel_kw, timeout=300)
    assert all(same and on_names for _, on_names, same in results), results
    if layout == "ep2-moe":                     # each rank's own experts' and the shared expert's linears too
        assert {"layers.0.mlp.experts.0.fc1.weight", "layers.0.mlp.shared_experts.fc2.weight"} <= set(results[0][1])
