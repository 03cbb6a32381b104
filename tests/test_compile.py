"""--compile (megazero/compile.py): regional torch.compile through the model spec. Compiled runs equal
the single-process eager run (fp32, 1e-5 relative) at serial, tp 2 + SP, pp 2 (1F1B and interleaved),
dp 2 under ZeRO 1 and 3, ep 2, and with full recompute; a GPT-2 and a Llama layer compile without a
graph break, and repeated layers share one graph."""
import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_CFG, LLAMA_KW, SEED, check_against_reference, trainer_steps

from megazero.compile import CompileLog, CompileStats, compile_model, compile_unavailable
from megazero.config import CompileConfig, JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from megazero.models.gpt import GPT, GPTConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import ModelSpec, build_model_chunks, get_model_spec, register_model_spec

COMPILE = CompileConfig(compile=True)
STEPS = 5


def test_flags_the_accelerate_key_and_refusals(tmp_path, monkeypatch):
    from megazero import compile as compile_module
    from megazero.cli.preflight import preflight
    from megazero.errors import PreflightError
    from megazero.foreign_config import from_accelerate

    assert compile_unavailable("cpu") is None                      # this machine compiles (a C++ compiler)
    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    assert "C++ compiler" in compile_unavailable("cpu")
    with pytest.raises(PreflightError, match="^--compile: inductor compiles CPU kernels with a C\\+\\+ compiler"):
        preflight(validate(JobConfig(compilation=COMPILE), 1), "gloo", 0)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="--compile-mode max-autotune applies with --compile"):
        validate(JobConfig(compilation=CompileConfig(compile_mode="max-autotune")), 1)
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text("dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n")
    assert from_accelerate(yaml) == {"compilation.compile": True, "compilation.compile_mode": "max-autotune"}
    yaml.write_text("dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_fullgraph: true\n")
    with pytest.raises(ConfigError, match="dynamo_use_fullgraph: is not supported"):
        from_accelerate(yaml)
    spec = get_model_spec("gpt")
    bare = ModelSpec("no-regions-test", spec.config, spec.build_chunk, spec.boundary_shape, spec.loss,
                     spec.flops_per_token)
    register_model_spec(bare)
    with pytest.raises(ConfigError, match="names no regions to compile"):
        validate(JobConfig(model=GPTConfig(model_family="no-regions-test"), compilation=COMPILE), 1)


@pytest.mark.parametrize("model_kw", [pytest.param({}, marks=pytest.mark.slow), LLAMA_KW], ids=["gpt2", "llama"])
def test_a_layer_compiles_without_graph_breaks_into_one_graph_for_all_layers(model_kw):
    """Forward and backward of the whole chunk: the compiled layers give the eager losses and gradients,
    dynamo breaks no graph, and every layer runs the one graph compiled for the first."""
    cfg = GPTConfig(**{**GPT_CFG, **model_kw})
    eager, compiled = GPT(cfg, seed=SEED), GPT(cfg, seed=SEED)
    before = CompileStats.now()
    regions = compile_model([compiled], get_model_spec("gpt").compile_regions, COMPILE)
    assert len(regions) == cfg.num_layers and all(r.compiled_region for r in regions)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    for _ in range(2):                                              # the second pass compiles nothing new
        losses = [m(tokens, labels).mean() for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    after = CompileStats.now()
    assert after.graph_breaks == before.graph_breaks, after.break_reasons
    assert after.graphs - before.graphs == 1, "repeated layers share one compiled graph"


def _parity_body(rank, world_size, cases):
    """Each case (tp, pp, v, sp, ZeRO stage, model keywords) compiled, through the trainer's step, STEPS
    steps on these ranks: what check_against_reference compares with the eager single process."""
    out = []
    for tp, pp, v, sp, stage, model_kw, *zero_kw in cases:
        topo = Topology(tp=tp, pp=pp)
        cfg = GPTConfig(**{**GPT_CFG, **model_kw})
        par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, virtual_stages=v,
                             pipeline_schedule="interleaved" if v > 1 else "1f1b")
        job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=2, seed=SEED), compilation=COMPILE)
        from helpers.gpt_parity import GPT_OPT

        spec = get_model_spec("gpt")
        chunks = build_model_chunks(spec, job, topo, device="meta")
        log = CompileLog(len(compile_model(chunks, spec.compile_regions, COMPILE)))
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage, **(zero_kw[0] if zero_kw else {})), GPT_OPT)
        losses, norms, params = trainer_steps(chunks, topo, engine, job, STEPS)
        out.append((topo.tp_rank, tp, losses, norms, params, log.metrics()))
    return out


def _check(results, cases, dp):
    """Each case equals the eager single process, and dynamo broke no graph on any rank (the tensor- and
    sequence-parallel collectives inside a layer are traced into its graph)."""
    for i, case in enumerate(cases):
        check_against_reference([r[i][:5] for r in results], STEPS, dp, case[5], param_atol=1e-5)
        assert all(r[i][5]["compile_graph_breaks"] == 0 for r in results), [r[i][5] for r in results]


def test_compiled_serial_run_equals_the_eager_reference():
    cases = [(1, 1, 1, False, 0, {})]
    _check(run_on_ranks(1, _parity_body, cases, timeout=600), cases, 1)


@pytest.mark.slow
def test_compiled_layouts_equal_the_eager_reference():
    """4 ranks: tp 2 + SP at dp 2 (ZeRO-1), pp 2 1F1B at dp 2 (ZeRO-3), pp 2 interleaved with full
    recompute at dp 2 (ZeRO-1); 2 ranks: dp 2 (ZeRO-3; ZeRO-1 with --overlap-param-gather, whose waits
    move from the modules inside a compiled layer to the layer; ZeRO-3 with optimizer and parameters
    offloaded to the CPU), Llama layers at tp 2 + SP."""
    four = [(2, 1, 1, True, 1, {}), (1, 2, 1, False, 3, {}), (1, 2, 2, False, 1, dict(recompute_activations=True))]
    _check(run_on_ranks(4, _parity_body, four, timeout=900), four, 2)
    two = [(1, 1, 1, False, 3, {}), (1, 1, 1, False, 1, {}, dict(overlap_param_gather=True)),
           (1, 1, 1, False, 3, {}, dict(offload_optimizer="cpu", offload_params="cpu"))]
    _check(run_on_ranks(2, _parity_body, two, timeout=900), two, 2)
    llama = [(2, 1, 1, True, 0, LLAMA_KW)]
    _check(run_on_ranks(2, _parity_body, llama, timeout=900), llama, 1)


def _moe_body(rank, world_size):
    """ep 2 at dp 2, ZeRO-1: the compiled run (each MoE layer's attention compiled, its experts eager)
    against the eager run of the same layout, losses and parameters after STEPS steps."""
    from helpers.gpt_parity import GPT_OPT

    out = {}
    for compiled in (False, True):
        topo = Topology(ep=2)
        cfg = GPTConfig(**GPT_CFG, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
        par = ParallelConfig(dp=topo.dp_size, expert_model_parallel_size=2)
        job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=2, seed=SEED),
                        compilation=CompileConfig(compile=compiled))
        spec = get_model_spec("gpt")
        chunks = build_model_chunks(spec, job, topo, device="meta")
        regions = compile_model(chunks, spec.compile_regions, job.compilation)
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=1), GPT_OPT)
        out[compiled] = trainer_steps(chunks, topo, engine, job, STEPS) + (len(regions),)
    return out


@pytest.mark.slow
def test_compiled_experts_equal_the_eager_run():
    for out in run_on_ranks(2, _moe_body, timeout=900):
        (losses, norms, params, _), (c_losses, c_norms, c_params, regions) = out[False], out[True]
        assert regions == GPT_CFG["num_layers"]                       # every layer's attention
        torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(c_norms), torch.tensor(norms), rtol=1e-5, atol=0)
        for name, (value, _) in params.items():
            torch.testing.assert_close(c_params[name][0], value, rtol=1e-5, atol=1e-5, msg=name)


def _bf16_body(rank, world_size):
    """The serial bf16 run (fp32 masters), eager and compiled, STEPS steps each."""
    from helpers.gpt_parity import GPT_OPT

    from megazero.config import PrecisionConfig

    out = {}
    for compiled in (False, True):
        topo = Topology()
        job = JobConfig(model=GPTConfig(**GPT_CFG), parallel=ParallelConfig(dp=1),
                        train=TrainConfig(micro_batch_size=2, seed=SEED), compilation=CompileConfig(compile=compiled))
        spec = get_model_spec("gpt")
        chunks = build_model_chunks(spec, job, topo, dtype=torch.bfloat16, device="meta")
        compile_model(chunks, spec.compile_regions, job.compilation)
        engine = build_engine(chunks, topo, ZeroConfig(), GPT_OPT, PrecisionConfig(bf16=True))
        out[compiled] = trainer_steps(chunks, topo, engine, job, STEPS)[0]
    return out


@pytest.mark.slow
def test_compiled_bf16_run_stays_within_bf16_of_eager():
    out = run_on_ranks(1, _bf16_body, timeout=900)[0]
    torch.testing.assert_close(torch.tensor(out[True]), torch.tensor(out[False]), rtol=2e-2, atol=0)


def _main(rank, world_size, argv):
    from helpers.trainer import main_body

    return main_body(rank, world_size, argv)


@pytest.mark.slow
def test_the_trainer_compiles_and_logs_what_it_did(tmp_path):
    """pretrain_gpt.py --compile at dp 2 under ZeRO-3 gives the eager run's losses; its metrics record
    the graphs, no graph break, and at most the one recompile of the first evaluation."""
    from helpers.trainer import TINY, assert_same_losses, read_metrics

    runs = {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        path = tmp_path / f"{name}.jsonl"
        argv = TINY + ["--zero-stage", "3", "--train-iters", "6", "--metrics-file", str(path)] + flags
        assert run_on_ranks(2, _main, argv, timeout=600) == [0, 0]
        runs[name] = read_metrics(path)[0]
    assert_same_losses(runs["compiled"], runs["eager"], "loss")
    assert all(r["compile_graph_breaks"] == 0 for r in runs["compiled"])
    assert sum(r["recompiles"] for r in runs["compiled"]) <= 1     # once for evaluation's no-grad forward
    assert "compile_graphs" not in runs["eager"][0] and "compile_seconds" in runs["compiled"][0]


@pytest.mark.gpu
def test_compiled_layer_on_cuda_equals_eager():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = GPTConfig(**GPT_CFG)
    eager = GPT(cfg, seed=SEED, device="cuda")
    compiled = GPT(cfg, seed=SEED, device="cuda")
    compile_model([compiled], get_model_spec("gpt").compile_regions, COMPILE)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
    torch.testing.assert_close(compiled(tokens, tokens), eager(tokens, tokens), rtol=1e-4, atol=1e-5)


def test_apex_is_only_the_real_one_and_compiled_layers_get_torch_norms(monkeypatch):
    """PyPI's unrelated ``apex`` is not NVIDIA's; with NVIDIA's (faked here by a plain Module holding
    ``weight`` and ``bias``, as apex's is), the layers' norms are apex's where apex is used, start at scale 1,
    and compiling swaps them for torch's, keeping the very same parameters (so the engine, checkpoints and
    names see no change). Zero-centred norms (--apply-layernorm-1p) are torch's, and the kernel line says so."""
    import sys
    import types

    from megazero import kernels
    from megazero.models.gpt import spec as gpt_spec
    from megazero.models.gpt import transformer

    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))           # PyPI's apex
    assert kernels.apex_norms() is None
    assert "apex not installed" in kernels.describe_kernels(torch.device("cpu"), compiling=False)

    class FusedLayerNorm(torch.nn.Module):
        def __init__(self, hidden, eps):
            super().__init__()
            self.eps, self.weight = eps, torch.nn.Parameter(torch.ones(hidden))
            self.bias = torch.nn.Parameter(torch.zeros(hidden))

        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

    fake = types.ModuleType("apex.normalization")
    fake.FusedLayerNorm, fake.FusedRMSNorm = FusedLayerNorm, FusedLayerNorm
    monkeypatch.setitem(sys.modules, "apex.normalization", fake)
    assert kernels.apex_norms() == (FusedLayerNorm, FusedLayerNorm)
    assert "apex fused" in kernels.describe_kernels(torch.device("cuda"), compiling=False)
    assert not kernels.use_apex_norms(torch.device("cpu"))                  # CUDA only
    monkeypatch.setattr(transformer, "use_apex_norms", lambda device: True)
    monkeypatch.setattr(gpt_spec, "use_apex_norms", lambda device: True)
    chunk = GPT(GPTConfig(**GPT_CFG), seed=SEED)
    before = dict(chunk.named_parameters())
    assert isinstance(chunk.layers["0"].input_layernorm, FusedLayerNorm)
    assert all(torch.all(before[n] == 1) for n in before if n.endswith("norm.weight"))
    centred = GPT(GPTConfig(**GPT_CFG, apply_layernorm_1p=True), seed=SEED)
    assert isinstance(centred.layers["0"].input_layernorm, transformer.ZeroCentredLayerNorm)
    assert torch.all(centred.final_norm.weight == 0)
    assert "normalisation torch (zero-centred" in kernels.describe_kernels(torch.device("cuda"), False, True)
    compile_model([chunk], gpt_spec.compile_regions, COMPILE)
    norm = chunk.layers["0"].input_layernorm
    assert type(norm) is torch.nn.LayerNorm and norm.weight is before["layers.0.input_layernorm.weight"]
    assert dict(chunk.named_parameters()).keys() == before.keys()
    assert all(p is before[n] for n, p in chunk.named_parameters())


@pytest.mark.gpu
def test_the_trainer_compiles_on_cuda_and_equals_eager(tmp_path):
    """pretrain_gpt.py --compile on one GPU (NCCL, the backend picked from the hardware) under ZeRO-3:
    the eager run's losses within 1e-4, no graph break."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import math

    from helpers.trainer import TINY, read_metrics

    runs = {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        path = tmp_path / f"{name}.jsonl"
        argv = TINY + ["--zero-stage", "3", "--train-iters", "5", "--metrics-file", str(path)] + flags
        assert run_on_ranks(1, _main, argv, timeout=600) == [0]
        runs[name] = read_metrics(path)[0]
    for got, want in zip(runs["compiled"], runs["eager"], strict=True):
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-4), (got, want)
    assert all(r["compile_graph_breaks"] == 0 for r in runs["compiled"])
