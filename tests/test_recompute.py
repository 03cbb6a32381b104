"""Activation recompute and offload (megazero/spec/recompute.py, megazero/memory/activation_offload.py):
every choice trains exactly as the run that keeps everything, at tp 2 + SP, pp 2 (1F1B, interleaved,
GPipe), dp 2 under ZeRO 1, 2 (optimizer offloaded) and 3, dp 4 under ZeRO++ (hpZ, qwZ) and ep 2,
with dropout on (the backward's recomputation replays
the forward's masks); the no-recompute run itself equals the single process; the groups and the
offloaded bytes are what the docs say."""
import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_CFG, GPT_OPT, LLAMA_KW, SEED, check_against_reference, trainer_steps

from megazero.config import CompileConfig, JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from megazero.models.gpt import GPT, GPTConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.spec.recompute import full_recompute_groups

STEPS = 5
DROPOUT = dict(attention_dropout=0.1, hidden_dropout=0.1)
FULL = dict(recompute_granularity="full")
CHOICES = {                                            # name: model keywords
    "none": {},
    "full-uniform-1": dict(recompute_activations=True),
    "full-uniform-2": dict(FULL, recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(FULL, recompute_method="block", recompute_num_layers=1),
    "core_attn": dict(recompute_granularity="selective"),
    "mlp+layernorm": dict(recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]),
    "all-modules": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
    "offload": dict(cpu_offloading=True),
    "offload-1+core_attn": dict(cpu_offloading=True, cpu_offloading_num_layers=1, recompute_granularity="selective"),
    "moe_act": dict(recompute_granularity="selective", recompute_modules=["moe_act", "core_attn"]),   # MoE only
}


def _choices_body(rank, world_size, layout, base_kw, names):
    """Every choice of ``names`` at ``layout`` (tp, pp, v, sp, ZeRO stage, ep), STEPS trainer steps each:
    {name: (tp rank, tp, losses, norms, params, offloaded bytes)}."""
    tp, pp, v, sp, stage, ep, *more = layout
    more = more[0] if more else {}                       # "schedule", "zero" (ZeroConfig keywords), "ranks_per_node"
    out = {}
    for name in names:
        topo = Topology(tp=tp, pp=pp, ep=ep, ranks_per_node=more.get("ranks_per_node"))
        cfg = GPTConfig(**{**GPT_CFG, **base_kw, **CHOICES[name]})
        layers_per_chunk = cfg.num_layers // (pp * v) if v > 1 else None
        par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, expert_model_parallel_size=ep,
                             num_layers_per_virtual_pipeline_stage=layers_per_chunk,
                             pipeline_schedule=more.get("schedule", "interleaved" if v > 1 else "1f1b"))
        job = validate(JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=2, seed=SEED)),
                       world_size)
        chunks = build_model_chunks(get_model_spec("gpt"), job, topo, device="meta")
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage, **more.get("zero", {})), GPT_OPT)
        losses, norms, params = trainer_steps(chunks, topo, engine, job, STEPS)
        offloaded = sum(c.activation_offload.bytes_offloaded for c in chunks if c.activation_offload is not None)
        out[name] = (topo.tp_rank, tp, losses, norms, params, offloaded)
    return out


def _check_choices(results, names):
    """Each choice's losses, norms and parameters equal the run that keeps everything (1e-6 relative)."""
    for out in results:
        _, _, losses, norms, params, _ = out["none"]
        for name in names:
            _, _, c_losses, c_norms, c_params, offloaded = out[name]
            torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(losses), rtol=1e-6, atol=0, msg=name)
            torch.testing.assert_close(torch.tensor(c_norms), torch.tensor(norms), rtol=1e-6, atol=0, msg=name)
            for p, (value, _) in params.items():
                torch.testing.assert_close(c_params[p][0], value, rtol=1e-6, atol=1e-8, msg=f"{name} {p}")
            assert (offloaded > 0) == ("offload" in name), (name, offloaded)


LAYOUTS = {   # (tp, pp, v, sp, ZeRO stage, ep[, more]) on 4 ranks
    "tp2-sp-dp2-zero1": (2, 1, 1, True, 1, 1),
    "pp2-1f1b-dp2-zero3": (1, 2, 1, False, 3, 1),
    "pp2-interleaved-dp2-zero1": (1, 2, 2, False, 1, 1),
    "pp2-gpipe-dp2-zero2-offload-optimizer": (1, 2, 1, False, 2, 1, dict(schedule="gpipe",
                                                                         zero=dict(offload_optimizer="cpu"))),
    "dp4-zero3-hpz2-qwz": (1, 1, 1, False, 3, 1, dict(ranks_per_node=2, zero=dict(
        hpz_partition_size=2, quantized_weights=True, quantization_block_size=32))),
}


@pytest.mark.parametrize("layout", [pytest.param(v, id=k, marks=pytest.mark.slow)
                                    for k, v in LAYOUTS.items()])
def test_every_choice_trains_as_keeping_everything(layout):
    """With dropout: each choice against keeping everything at the same layout (a layer count above a
    model chunk's layers is refused, so such a choice is left out where chunks are smaller)."""
    _, pp, v, *_ = layout
    chunk_layers = GPT_CFG["num_layers"] // (pp * v)
    names = [name for name in CHOICES
             if name != "moe_act" and CHOICES[name].get("recompute_num_layers", 1) <= chunk_layers]
    _check_choices(run_on_ranks(4, _choices_body, layout, DROPOUT, names, timeout=900), names)


@pytest.mark.slow
def test_llama_and_experts_choices_train_as_keeping_everything():
    """Llama layers (RoPE inside the recomputed core attention, RMSNorm, SwiGLU) at tp 2 + SP, pp 2;
    MoE at ep 2, dp 2 under ZeRO-3, with the experts' activation recomputed."""
    names = ["none", "full-uniform-2", "all-modules", "offload"]
    _check_choices(run_on_ranks(4, _choices_body, (2, 2, 1, True, 1, 1), LLAMA_KW, names, timeout=900), names)
    names = ["none", "moe_act", "full-block-1", "offload"]
    moe = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
    _check_choices(run_on_ranks(2, _choices_body, (1, 1, 1, False, 3, 2), moe, names, timeout=900), names)


def test_keeping_everything_and_recomputing_equal_the_single_process():
    """Without dropout the layouts equal the single process (1e-5), recomputing or not: dp 2 under ZeRO-1."""
    names = ["none", "full-uniform-2", "all-modules", "offload-1+core_attn"]
    for name, result in run_on_ranks(2, _choices_body, (1, 1, 1, False, 1, 1), {}, names)[0].items():
        check_against_reference([result[:5]], STEPS, 2)


def test_groups_follow_megatrons_methods():
    cfg = GPTConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert full_recompute_groups(cfg, 5) == [([0, 1], True), ([2, 3], True), ([4], True)]
    cfg = GPTConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert full_recompute_groups(cfg, 5) == [([0], True), ([1], True), ([2], False), ([3], False), ([4], False)]
    assert full_recompute_groups(GPTConfig(recompute_activations=True), 2) == [([0], True), ([1], True)]
    assert full_recompute_groups(GPTConfig(), 2) == [([0], False), ([1], False)]


@pytest.mark.parametrize("kw,message", [
    (dict(recompute_granularity="full"), "--recompute-granularity full needs --recompute-method"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9),
     "--recompute-num-layers 9 counts layers of each model chunk, which holds 4"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "apply with --recompute-granularity full"),
    (dict(recompute_modules=["mlp"]), "apply with --recompute-granularity: add it"),
    (dict(recompute_activations=True, recompute_granularity="selective"), "--recompute-activations is full"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "it needs --num-experts"),
    (dict(cpu_offloading_num_layers=1), "applies with --cpu-offloading"),
    (dict(cpu_offloading=True, recompute_activations=True), "nothing to offload; choose one"),
    (dict(cpu_offloading=True, compile=True), "--compile compiles whole layers"),
    (dict(recompute_granularity="selective", compile=True), "--compile compiles whole layers"),
])
def test_contradictory_choices_are_refused(kw, message):
    compiled = CompileConfig(compile=kw.pop("compile", False))
    with pytest.raises(ConfigError, match=message):
        validate(JobConfig(model=GPTConfig(**{**GPT_CFG, **kw}), compilation=compiled), 1)


def test_offloaded_bytes_are_what_the_layers_save():
    """One process, no dropout: the bytes sent to the host are the storages of every tensor the
    offloaded layers save (counted here with torch's own saved-tensor hooks, parameters left out), and
    the gradients equal keeping everything bitwise."""
    cfg = GPTConfig(**GPT_CFG, cpu_offloading=True, cpu_offloading_num_layers=2)
    model, plain = GPT(cfg, seed=SEED), GPT(GPTConfig(**GPT_CFG), seed=SEED)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    params = {p.untyped_storage().data_ptr() for p in plain.parameters()}
    saved = {}                                           # distinct storages: views of one are sent once

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    h = plain.embedding(tokens)
    for i, layer in enumerate(plain.layers.values()):
        if i < 2:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h = layer(h)
        else:
            h = layer(h)
    model(tokens, tokens).mean().backward()
    plain(tokens, tokens).mean().backward()
    assert model.activation_offload.bytes_offloaded == sum(saved.values()) > 0
    assert model.activation_offload.bytes_reloaded == sum(saved.values())
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("modules,moe", [(["layernorm"], {}), (["moe_act"], dict(num_experts=2, moe_router_topk=1))])
def test_offload_with_a_recomputed_output_keeps_every_saved_tensor(modules, moe):
    """Found by the layout fuzzer (draw 2003): selective recompute frees a norm's or an expert
    activation's output in the forward, and the allocator hands its address to the next tensor the
    layer saves; offload took that tensor for another view of the freed one and read back the wrong
    bytes (gradient norm 580 instead of 1.24 with layernorm). One process: bitwise the resident run."""
    kw = dict(GPT_CFG, **moe, recompute_granularity="selective", recompute_modules=modules)
    model, plain = GPT(GPTConfig(**kw, cpu_offloading=True), seed=SEED), GPT(GPTConfig(**kw), seed=SEED)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_length),
                           generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).mean().backward()
    plain(tokens, tokens).mean().backward()
    assert model.activation_offload.bytes_offloaded > 0
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_the_flops_count_what_the_backward_runs_again():
    """The share of the layers' forward recomputed: every layer (uniform), the first of each of pp 2's
    chunks (block 1: half of 4 layers), the attention core and MLP matmuls (selective), none."""
    from megazero.models.gpt.spec import flops_per_token, recomputed_share

    par = ParallelConfig(pp=2)
    cfg = GPTConfig(**GPT_CFG)
    h, s, f = cfg.hidden_size, cfg.seq_length, cfg.ffn_hidden_size
    layer = 2 * (4 * h * h + 2 * h * f) + 4 * s * h
    assert recomputed_share(GPTConfig(**GPT_CFG, recompute_activations=True), par) == 1.0
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert recomputed_share(GPTConfig(**GPT_CFG, **block), par) == 0.5
    selective = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    assert recomputed_share(GPTConfig(**GPT_CFG, **selective), par) == pytest.approx((4 * s * h + 4 * h * f) / layer)
    assert recomputed_share(cfg, par) == 0.0
    assert flops_per_token(cfg, 256, 1.0) - flops_per_token(cfg, 256) == cfg.num_layers * layer


def _main(rank, world_size, argv):
    from helpers.trainer import main_body

    return main_body(rank, world_size, argv)


def test_the_trainer_logs_the_bytes_it_offloads(tmp_path):
    """pretrain_gpt.py --cpu-offloading at dp 2: the same losses as without, and the bytes sent to the host
    per iteration are the estimator's host activations per micro-batch times the micro-batches (10%)."""
    from helpers.trainer import TINY, assert_same_losses, read_metrics

    from megazero.cli.job import parse_job
    from megazero.models.gpt.memory import chunk_offloaded_bytes
    from megazero.parallel.pipeline.partition import placements

    runs = {}
    for name, flags in (("kept", []), ("offloaded", ["--cpu-offloading", "--cpu-offloading-num-layers", "3"])):
        path = tmp_path / f"{name}.jsonl"
        argv = TINY + ["--train-iters", "4", "--metrics-file", str(path)] + flags
        assert run_on_ranks(2, _main, argv) == [0, 0]
        runs[name] = read_metrics(path)[0]
    assert_same_losses(runs["offloaded"], runs["kept"], "loss")
    job, _ = parse_job(argv, 2)
    [place] = placements(job.model.num_layers, 1, 0)
    want = chunk_offloaded_bytes(job, place, 4, 4) * job.num_micro_batches
    assert [r["activation_offload_bytes"] for r in runs["offloaded"]] == pytest.approx([want] * 4, rel=0.10)
    assert "activation_offload_bytes" not in runs["kept"][0]


@pytest.mark.gpu
def test_offload_on_cuda_moves_the_saved_tensors_to_pinned_host_memory_and_back():
    """On a GPU: the side stream's copies give the gradients of keeping everything, bitwise, and the
    offloaded bytes leave the device between forward and backward."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = GPTConfig(**GPT_CFG, cpu_offloading=True)
    model, plain = GPT(cfg, seed=SEED, device="cuda"), GPT(GPTConfig(**GPT_CFG), seed=SEED, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(tokens, tokens).mean()
    held_offloaded = torch.cuda.memory_allocated() - before
    loss.backward()
    del loss
    before = torch.cuda.memory_allocated()
    loss = plain(tokens, tokens).mean()
    held_plain = torch.cuda.memory_allocated() - before
    loss.backward()
    assert model.activation_offload.bytes_offloaded > 0
    assert held_offloaded < held_plain - model.activation_offload.bytes_offloaded // 2
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
