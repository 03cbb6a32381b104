"""Mixture of Experts (megazero/models/gpt/moe.py; the experts' bucket group: megazero/parallel/zero/engine.py):
routing, capacity and losses against hand-computed cases, and 5 training steps of a top-2, 4-expert,
dropless GPT at expert parallelism 1, 2 and 4 (dp 4), with tp 2 and with pp 2, under ZeRO 0-3, each
equal to the single-process run (fp32, 1e-5 relative); fp16 and nvme offload through the one engine."""
import functools
import math

import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_CFG, GPT_OPT, MB_SIZE, MICRO, SEED, gpt_batches, trainer_steps

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.config import JobConfig, ParallelConfig, TrainConfig, ZeroConfig
from megazero.memory.estimate import estimate_stage
from megazero.models.gpt import GPT, GPTConfig, build_model_chunks, masked_mean
from megazero.models.gpt.moe import (
    capacity_keep,
    collect_moe_metrics,
    expert_bias_step,
    load_balancing_loss,
    moe_alltoall_bytes,
    moe_alltoall_bytes_per_step,
    moe_layers,
    route,
    set_aux_loss_scale,
    stack_experts,
    z_loss,
)
from megazero.parallel.params import split_dim
from megazero.parallel.tensor import shard
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.parallel.zero.adamw import weight_decay_groups
from megazero.state import TrainState
from megazero.training import train_step

STEPS = 5
MOE_KW = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**GPT_CFG, **MOE_KW, **kw})


# --------------------------------------------------------------------------- routing and losses by hand

def test_top2_gates_renormalised_and_top1_keeps_the_probability():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs, gates, experts = route(logits, 2)
    p = torch.softmax(logits, -1)[0]
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(gates[0], torch.stack([p[0], p[1]]) / (p[0] + p[1]))
    _, gates1, experts1 = route(logits, 1)
    assert experts1.tolist() == [[0]] and gates1[0, 0] == p[0]


def test_capacity_drops_later_tokens_of_a_full_expert():
    """6 tokens, top-1, 3 experts, capacity factor 1: C = ceil(1 * 6 * 1 / 3) = 2 per expert. Expert 0 is
    chosen by tokens 0, 1, 2, 4 -> tokens 2 and 4 dropped; expert 1 by 3, 5 -> kept; dropped 2/6."""
    experts = torch.tensor([[0], [0], [0], [1], [0], [1]])
    keep = capacity_keep(experts, 3, 1.0)
    assert keep.reshape(-1).tolist() == [True, True, False, True, False, True]
    assert capacity_keep(experts, 3, None).all()


def test_dropped_fraction_and_gradients_only_through_kept_tokens():
    """A one-layer MoE GPT whose router sends every token to expert 0 (top-1, 4 experts, factor 1):
    C = ceil(T / 4), so exactly T - C of the T tokens are dropped, as the layer reports, and the dropped
    tokens' inputs get no gradient through the MoE layer (only through the residual path)."""
    cfg = _cfg(num_layers=1, moe_router_topk=1, moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=0.0,
               moe_z_loss_coeff=0.0)
    model = GPT(cfg, seed=SEED)
    layer = model.layers["0"].mlp
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0                   # logit of expert 0 = sum of features, large
    t = 16
    x = torch.randn(t, 1, cfg.hidden_size) + 3.0         # sum of features >> 0: everyone picks expert 0
    x.requires_grad_(True)
    out = layer(x)
    st = layer.stats
    capacity = math.ceil(1.0 * t / 4)
    assert st.dropped == t - capacity and st.assignments == t
    out.sum().backward()
    got = x.grad.reshape(t, -1).abs().sum(-1)
    assert (got[:capacity] > 0).all()
    # dropped tokens: output zero, gradient only through the router's gate of ... none: they have no gate
    assert (out.detach().reshape(t, -1)[capacity:] == 0).all()
    assert (got[capacity:] == 0).all()


def test_aux_loss_value_and_gradient_match_the_formula():
    """On a fixed routing, the layer's load-balancing + z-loss equals a * E * sum f_e P_e + z * mean lse^2,
    and the router weight's gradient from it equals autograd of that direct formula."""
    torch.manual_seed(0)
    cfg = _cfg(num_layers=1, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = GPT(cfg, seed=SEED)
    layer = model.layers["0"].mlp
    layer.keep_aux_graph = True
    x = torch.randn(8, 2, cfg.hidden_size)
    layer(x)
    w = layer.router.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, cfg.hidden_size) @ w.t()
    probs = torch.softmax(logits, -1)
    chosen = probs.topk(2, -1).indices
    t, e = logits.shape
    f = torch.stack([(chosen == i).sum() for i in range(e)]).float() / (t * 2)
    direct = 0.1 * e * (f * probs.mean(0)).sum() + 0.01 * (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(layer.last_aux_loss, direct)
    assert layer.stats.aux_loss == pytest.approx(direct.item(), rel=1e-6)
    counts = torch.bincount(chosen.reshape(-1), minlength=e)
    torch.testing.assert_close(load_balancing_loss(probs, counts, t, 2, 0.1) + z_loss(logits, 0.01, t), direct)
    (g_direct,) = torch.autograd.grad(direct, w)
    layer.router.weight.grad = None
    layer.last_aux_loss.backward()
    torch.testing.assert_close(layer.router.weight.grad, g_direct)


def test_aux_loss_reaches_backward_through_the_output_scaled():
    """The attached loss gets gradient ``aux_loss_scale`` in the layer's backward: output.sum() backward
    with scale s gives the router grad of (output.sum() + s * aux)."""
    cfg = _cfg(num_layers=1, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = GPT(cfg, seed=SEED)
    layer = model.layers["0"].mlp
    layer.keep_aux_graph = True
    x = torch.randn(8, 2, cfg.hidden_size)
    set_aux_loss_scale(model, 0.25)
    layer(x).sum().backward()
    injected = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    set_aux_loss_scale(model, 0.0)
    out = layer(x)
    (out.sum() + 0.25 * layer.last_aux_loss).backward()
    torch.testing.assert_close(injected, layer.router.weight.grad)


def test_init_does_not_depend_on_expert_parallelism():
    """Expert e's tensors are drawn from (seed, global name): the same whoever holds it."""
    full = GPT(_cfg(), seed=SEED)
    names = [n for n, _ in full.named_parameters()]
    assert "layers.1.mlp.experts.3.fc2.weight" in names and "layers.1.mlp.router.weight" in names
    swiglu = GPT(_cfg(swiglu=True, add_bias_linear=False, ffn_hidden_size=48), seed=SEED)
    assert swiglu.get_parameter("layers.0.mlp.experts.2.fc1.weight").shape == (96, 32)


# --------------------------------------------------------------------------- grouped GEMM == the loop

def _experts_forward_backward(experts, x, counts, grouped: bool):
    """Output, input gradient and every parameter gradient of ``experts`` on ``x`` (rows grouped by
    ``counts``), through the grouped GEMMs or the per-expert loop."""
    experts.grouped_gemm = grouped
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = experts(x, counts)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute-moe_act"])
def test_grouped_gemm_equals_the_expert_loop_bitwise(swiglu, bias, recompute):
    """--moe-grouped-gemm: the local experts' output, input gradient and every weight and bias gradient
    equal the per-expert loop's bitwise (fp32, CPU), with empty experts (first, middle, last), odd row
    counts and no rows at all. The expert ffn width is a multiple of 32 floats: torch's vectorised CPU
    activations then take the same path per expert as over all rows (see the next test)."""
    kw = dict(num_layers=1, num_experts=6, swiglu=swiglu, ffn_hidden_size=64, add_bias_linear=bias,
              moe_grouped_gemm=True)
    if recompute:
        kw.update(recompute_granularity="selective", recompute_modules=["moe_act"])
    experts = GPT(_cfg(**kw), seed=SEED).layers["0"].mlp.experts
    assert experts.grouped_gemm and experts._grouped_runs(torch.empty(0, 32))
    for counts in ([0, 5, 0, 9, 1, 0], [3, 4, 2, 7, 1, 6], [9, 11, 0, 5, 7, 3], [0] * 6):
        x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(sum(counts)))
        grouped = _experts_forward_backward(experts, x, counts, True)
        loop = _experts_forward_backward(experts, x, counts, False)
        assert torch.equal(grouped[0], loop[0]) and torch.equal(grouped[1], loop[1]), counts
        assert grouped[2].keys() == loop[2].keys() and len(loop[2]) == 6 * (4 if bias else 2)
        for name, grad in loop[2].items():
            assert torch.equal(grouped[2][name], grad), (counts, name)


def _stacks_without_copy(experts) -> bool:
    """Do the experts' fc1 and fc2 weights lie at one stride in one buffer (the grouped path's operand
    then a view of it, no copy)?"""
    weights = [[e.fc1.weight for e in experts.values()], [e.fc2.weight for e in experts.values()]]
    return all(stack_experts(w).data_ptr() == w[0].data_ptr() for w in weights)


def test_grouped_gemm_takes_the_weights_in_place_and_copies_them_where_moved():
    """Built with --moe-grouped-gemm, each of the experts' weights is a view of one buffer and the grouped
    GEMMs read it in place; once a weight has storage of its own (moved, reloaded) the path stacks
    copies instead. Both equal the loop bitwise, gradients included, each expert's gradient its own."""
    experts = GPT(_cfg(num_layers=1, num_experts=6, swiglu=True, ffn_hidden_size=64, add_bias_linear=True,
                       moe_grouped_gemm=True), seed=SEED).layers["0"].mlp.experts
    assert list(experts) == [str(e) for e in range(6)] and _stacks_without_copy(experts)
    counts = [4, 0, 6, 3, 1, 5]
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(1))
    for moved in (False, True):
        if moved:
            expert = experts["2"]
            expert.fc1.weight.data = expert.fc1.weight.data.clone()
            expert.fc2.bias.data = expert.fc2.bias.data.clone()
            assert not _stacks_without_copy(experts)
        grouped = _experts_forward_backward(experts, x, counts, True)
        loop = _experts_forward_backward(experts, x, counts, False)
        assert torch.equal(grouped[0], loop[0]) and torch.equal(grouped[1], loop[1]), moved
        for name, grad in loop[2].items():
            assert torch.equal(grouped[2][name], grad), (moved, name)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_grouped_gemm_at_an_ffn_width_off_the_vector_width_equals_the_loop_to_rounding(swiglu):
    """At an ffn width of 48 floats the activation's last elements of an expert's rows go through torch's
    scalar tail on one path and its vector loop on the other: the two then differ in the last bits of
    the activation (the GEMMs are still the same), so only to fp32 rounding."""
    experts = GPT(_cfg(num_layers=1, num_experts=8, swiglu=swiglu, ffn_hidden_size=48, moe_grouped_gemm=True),
                  seed=SEED).layers["0"].mlp.experts
    counts = [5, 0, 7, 3, 9, 0, 4, 4]
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(0))
    grouped = _experts_forward_backward(experts, x, counts, True)
    loop = _experts_forward_backward(experts, x, counts, False)
    torch.testing.assert_close(grouped[:2], loop[:2], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grouped[2], loop[2], rtol=1e-5, atol=1e-8)


def test_grouped_gemm_runs_the_loop_where_grouped_mm_refuses():
    """fp64 (refused by torch._grouped_mm on CPU) and rows not a multiple of 16 bytes run the loop."""
    from megazero.models.gpt.moe import grouped_mm_supported

    cpu = torch.device("cpu")
    assert grouped_mm_supported(torch.float32, cpu, (32, 96, 48))
    assert grouped_mm_supported(torch.bfloat16, cpu, (32, 96, 48))
    assert not grouped_mm_supported(torch.float64, cpu, (32, 96, 48))
    assert not grouped_mm_supported(torch.float32, cpu, (32, 6, 3))
    experts = GPT(_cfg(num_layers=1, moe_grouped_gemm=True), seed=SEED, dtype=torch.float64).layers["0"].mlp.experts
    counts = [2, 0, 3, 1]
    x = torch.randn(6, 32, dtype=torch.float64)
    out = experts(x, counts)
    assert torch.equal(out, torch.cat([e(p) for e, p in zip(experts.values(), torch.split(x, counts))]))


# --------------------------------------------------------------------------- parallel == serial

@functools.lru_cache(maxsize=8)
def _reference(dp: int, model_kw: tuple):
    """The serial run: torch AdamW + clip_grad_norm_, the MoE losses added to each micro-batch's loss
    explicitly (the layers' in-backward injection switched off)."""
    model = GPT(_cfg(**dict(model_kw)), seed=SEED)
    set_aux_loss_scale(model, 0.0)
    layers = [layer for _, layer in moe_layers(model)]
    for layer in layers:
        layer.keep_aux_graph = True
    opt = torch.optim.AdamW(weight_decay_groups(model.named_parameters(), GPT_OPT.weight_decay),
                            lr=GPT_OPT.lr, eps=GPT_OPT.adam_eps)
    losses, norms = [], []
    for batches in gpt_batches(STEPS, dp * MICRO):
        total = 0.0
        for mb in batches:
            loss = masked_mean(model(mb["tokens"], mb["labels"]), mb["loss_mask"])
            aux = sum(layer.last_aux_loss for layer in layers)
            ((loss + aux) / len(batches)).backward()
            total += loss.item() / len(batches)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GPT_OPT.clip_grad)))
        opt.step()
        opt.zero_grad()
        for layer in layers:                     # the expert biases' step on the step's loads
            if layer.expert_bias is not None:
                expert_bias_step(layer.expert_bias, layer.step_load, model.cfg.moe_router_bias_update_rate)
            layer.step_load = None
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        {n: b.clone() for n, b in model.named_buffers()}


def _expect_weights_taken_in_place(chunks) -> None:
    """Check, at each forward of every MoE layer's experts (after ZeRO-3 has gathered them), that the
    engine's layout keeps their weights at one stride: the grouped GEMMs read them without a copy."""
    def check(experts, args):
        assert _stacks_without_copy(experts), "the engine's layout made the grouped path copy the weights"

    for _, layer in moe_layers(chunks):
        layer.experts.register_forward_pre_hook(check)


def _parity_body(rank, world_size, cases, cp: int = 1):
    """Train each case (tp, pp, ep, sp, ZeRO stage, model flags) STEPS steps with the trainer's step on
    these ranks (at context parallelism ``cp``, ring attention); chunks built on the meta device, as the
    trainer does."""
    out = []
    for tp, pp, ep, sp, stage, model_kw in cases:
        topo = Topology(tp=tp, pp=pp, ep=ep, cp=cp)
        cfg = _cfg(**model_kw)
        par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, expert_model_parallel_size=ep,
                             cp=cp, cp_comm_type="p2p")
        chunks = build_model_chunks(cfg, par, topo, seed=SEED, device="meta")
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage), GPT_OPT)
        job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=MB_SIZE))
        if cfg.moe_grouped_gemm:
            _expect_weights_taken_in_place(chunks)
        losses, norms, params = trainer_steps(chunks, topo, engine, job, STEPS)
        params.update({n: (b.clone(), None) for c in chunks for n, b in c.named_buffers()})   # expert biases
        metrics = collect_moe_metrics(chunks, cfg.num_layers, cfg.num_experts, topo.tp_rank, sp, STEPS, topo.device)
        sized = JobConfig(model=cfg, parallel=par, zero=ZeroConfig(zero_stage=stage),
                          train=TrainConfig(micro_batch_size=MB_SIZE, global_batch_size=MB_SIZE * MICRO * topo.dp_size))
        estimated, measured = estimate_stage(sized, topo.pp_rank).parts, engine.model_state_bytes()
        for key in ("params", "master_weights", "optimizer_state"):
            assert estimated[key] == measured[key], (key, estimated[key], measured[key])
        out.append((topo.tp_rank, tp, topo.dp_size, losses, norms, params, metrics))
    return out


def _check_metrics(metrics: dict, dp: int, model_kw: dict) -> None:
    """The logged figures, gathered over every rank: each MoE layer routes the global batch's tokens
    k times a step (mean per expert = tokens * k / E), nothing is dropped (dropless) or some are (a
    capacity factor), the losses are positive."""
    cfg = _cfg(**model_kw)
    tokens = dp * MICRO * MB_SIZE * cfg.seq_length
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    for i in layers:
        assert metrics[f"moe_layer{i}_tokens_mean"] == pytest.approx(tokens * cfg.moe_router_topk / cfg.num_experts)
        assert metrics[f"moe_layer{i}_tokens_min"] <= metrics[f"moe_layer{i}_tokens_mean"] <= \
            metrics[f"moe_layer{i}_tokens_max"]
    assert not any(k.startswith(f"moe_layer{i}_") for i in set(range(cfg.num_layers)) - set(layers) for k in metrics)
    assert (metrics["moe_dropped_fraction"] > 0) == (cfg.moe_expert_capacity_factor is not None)
    assert metrics["moe_aux_loss"] > 0


def _check(results, cases, cp: int = 1):
    for i, (tp, pp, ep, sp, stage, model_kw) in enumerate(cases):
        seen = set()
        for rank_results in results:
            tp_rank, tp, dp, losses, norms, params, metrics = rank_results[i]
            _check_metrics(metrics, dp, model_kw)
            serial_kw = {k: v for k, v in model_kw.items() if k != "moe_grouped_gemm"}   # the per-expert loop
            ref_losses, ref_norms, ref_params, ref_buffers = _reference(dp, tuple(sorted(serial_kw.items())))
            assert max(ref_norms) > GPT_OPT.clip_grad, "clipping should be active in this test"
            what = f"case tp{tp} pp{pp} ep{ep} sp{sp} zero{stage} cp{cp}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=what)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=what)
            for name, (value, pdim) in params.items():
                if pdim is None:                      # a buffer (expert bias): bitwise the serial run's
                    assert torch.equal(value, ref_buffers[name]), (what, name, value, ref_buffers[name])
                else:
                    torch.testing.assert_close(value, shard(ref_params[name], pdim, tp_rank, tp), rtol=1e-5,
                                               atol=1e-5, msg=lambda m: f"{what} {name}: {m}")
                seen.add(name)
        assert seen == set(ref_params) | set(ref_buffers), \
            f"{what}: never compared: {set(ref_params) | set(ref_buffers) - seen}"


GROUPED = dict(moe_grouped_gemm=True)
DP4_CASES = [(1, 1, ep, False, stage, {}) for ep in (1, 2, 4) for stage in (0, 1, 2, 3)] + \
            [(1, 1, 2, False, 3, GROUPED)]
MIXED_CASES = [(2, 1, 2, False, stage, {}) for stage in (0, 3)] + [(2, 1, 2, True, 1, {}), (2, 1, 2, True, 2, {})] + \
              [(1, 2, 2, False, stage, {}) for stage in (0, 2, 3)] + \
              [(1, 2, 2, False, 1, dict(recompute_activations=True, moe_layer_freq=2))]


@pytest.mark.parametrize("ep", [2, pytest.param(1, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_expert_parallel_dp4_matches_serial(ep):
    """dp 4 at expert parallelism ep, ZeRO 0, 1, 2 and 3, dropless top-2 over 4 experts; at ep 2 also with
    --moe-grouped-gemm (ZeRO-3) against the serial per-expert loop."""
    cases = [c for c in DP4_CASES if c[2] == ep]
    _check(run_on_ranks(4, _parity_body, cases, timeout=600), cases)


@pytest.mark.slow
def test_expert_parallel_with_tp_and_pp_matches_serial():
    """ep 2 with tp 2 (with and without sequence parallelism) and with pp 2, dp 2, ZeRO 0-3 (and one
    with activation recomputation and MoE every other layer)."""
    _check(run_on_ranks(4, _parity_body, MIXED_CASES, timeout=600), MIXED_CASES)


def test_llama_experts_match_serial():
    """SwiGLU experts (the Llama MLP form), ep 2 dp 2 with pp 2 and ZeRO 1... at world 4: tp 1, pp 2; and
    the same with --moe-grouped-gemm against the serial per-expert loop."""
    llama = dict(swiglu=True, ffn_hidden_size=64, add_bias_linear=False, normalization="RMSNorm",
                 position_embedding_type="rope", untie_embeddings_and_output_weights=True, moe_layer_freq=2)
    cases = [(1, 2, 2, False, 1, llama), (1, 2, 2, False, 1, {**llama, **GROUPED})]
    _check(run_on_ranks(4, _parity_body, cases, timeout=600), cases)


def test_grouped_gemm_dp2_zero3_matches_serial():
    """--moe-grouped-gemm at dp 2 under ZeRO-3 (the experts' weights gathered, stacked, released), GELU
    with biases, against the serial per-expert loop."""
    cases = [(1, 1, 1, False, 3, GROUPED)]
    _check(run_on_ranks(2, _parity_body, cases, timeout=600), cases)


@pytest.mark.slow
def test_capacity_under_sequence_parallelism_drops_what_serial_drops():
    """Found by the layout fuzzer (draw 11): at tp 2 with sequence parallelism each rank counted the
    capacity over its half of the sequence, so other tokens dropped than at tp 1 (loss 2e-4 off at the
    first step). The queues are now the whole sequence's: ep 2 and ep 1, ZeRO 1 and 2."""
    cases = [(2, 1, ep, True, stage, dict(moe_expert_capacity_factor=1.0)) for ep, stage in ((2, 1), (1, 2))]
    _check(run_on_ranks(4, _parity_body, cases, timeout=600), cases)


CP_CAPACITY_CASES = [(1, 1, 1, False, 1, dict(moe_expert_capacity_factor=1.0)),
                     (1, 1, 2, False, 2, dict(moe_expert_capacity_factor=1.0))]


@pytest.mark.parametrize("world,cases", [(2, CP_CAPACITY_CASES),
                                         pytest.param(4, [(2, 1, 2, True, 1, dict(moe_expert_capacity_factor=1.0))],
                                                      marks=pytest.mark.slow)],
                         ids=["cp2-ep1-ep2", "cp2-tp2-sp-ep2"])
def test_capacity_under_context_parallelism_drops_what_serial_drops(world, cases):
    """cp 2 (ring attention): each cp rank routes chunks r and 2cp-1-r of every sequence, so the queues are
    counted over the cp ranks' gathered choices put back in serial token order (over tp x cp with
    sequence parallelism). Capacity factor 1 drops tokens (the metrics say so, _check_metrics); losses,
    gradient norms and parameters after 5 steps equal the serial run's: ep 1 (ZeRO 1) and ep 2 over the
    cp ranks (ZeRO 2); slow tier, tp 2 + SP with ep 2. Counting each rank's slice alone, or the gathered
    choices in rank order, drops other tokens (loss off at the first step)."""
    _check(run_on_ranks(world, _parity_body, cases, 2, timeout=600), cases, cp=2)


# --------------------------------------------------------------------------- one engine for dense and experts

def _global_steps(chunks, topo, engine, job, steps: int, per_step: int, before=None, after=None):
    """``steps`` trainer steps on this dp rank's share of ``per_step`` micro-batches of
    :func:`gpt_batches` a step (the same global batch at any dp); ``before(i)`` runs first at step i,
    ``after(i, result)`` right after it."""
    results = []
    per = per_step // topo.dp_size
    for i, batches in enumerate(gpt_batches(steps, per_step)):
        if before is not None:
            before(i)
        results.append(train_step(chunks, batches[topo.dp_rank * per:(topo.dp_rank + 1) * per], topo, engine, job))
        if after is not None:
            after(i, results[-1])
    return results


def _engine_body(rank, world_size, runs, nvme_root=None):
    """Each run (name, ZeRO stage, ZeroConfig extras, PrecisionConfig extras, expert to poison, step) on
    these ranks at ep = min(2, world): losses, norms, loss scales and skips per step, every (tp-local)
    parameter, and, when a gradient was poisoned, every rank's stop message."""
    from megazero.config import PrecisionConfig
    from megazero.training import stop_reason

    out = {}
    for name, stage, zero_kw, precision_kw, poison, poison_step in runs:
        ep = min(2, world_size)
        topo = Topology(ep=ep)
        cfg = _cfg()
        par = ParallelConfig(dp=topo.dp_size, expert_model_parallel_size=ep)
        precision = PrecisionConfig(**precision_kw)
        dtype = torch.float16 if precision.fp16 else torch.float32
        if zero_kw.get("nvme_path") == "":
            zero_kw = {**zero_kw, "nvme_path": nvme_root}
        zero = ZeroConfig(zero_stage=stage, **zero_kw)
        chunks = build_model_chunks(cfg, par, topo, seed=SEED, dtype=dtype, device="meta")
        engine = build_engine(chunks, topo, zero, GPT_OPT, precision)
        job = JobConfig(model=cfg, parallel=par, zero=zero, precision=precision, optimizer=GPT_OPT,
                        train=TrainConfig(micro_batch_size=MB_SIZE))
        hooks = []
        params = dict(n_p for c in chunks for n_p in c.named_parameters())

        def before(i, poison=poison, poison_step=poison_step, params=params):
            for h in hooks:
                h.remove()
            hooks.clear()
            if poison in params and i == poison_step:         # only the ranks holding that expert
                hooks.append(params[poison].register_hook(lambda g: g * float("nan" if not precision.fp16 else "inf")))

        stops = []

        def after(i, result, job=job, engine=engine, poison=poison, poison_step=poison_step):
            if poison and i == poison_step:                   # as the trainer asks, right after the step
                stops.append(stop_reason(job, engine, result, i + 1, 0))

        results = _global_steps(chunks, topo, engine, job, STEPS, 4 * MICRO, before, after)
        stop = stops[0] if stops else None
        with engine.gathered_parameters():
            weights = {n: p.detach().float().clone() for c in chunks for n, p in c.named_parameters()}
        engine.close()
        out[name] = ([r.loss for r in results], [r.grad_norm for r in results], [r.loss_scale for r in results],
                     [r.skipped for r in results], weights, stop)
    return out


EXPERT = "layers.1.mlp.experts.3.fc1.weight"             # held by ep rank 1 only (dp ranks 1 and 3)


@pytest.mark.slow
def test_one_engine_offloads_experts_to_nvme_like_resident(tmp_path):
    """ep 2 at dp 4: the experts' optimizer state (and at ZeRO-3 their parameter shards) in the same
    swap files as the dense parameters', bitwise the resident run (fp32; losses, norms, parameters)."""
    runs = [("resident1", 1, {}, {}, None, 0), ("nvme1", 1, dict(offload_optimizer="nvme", nvme_path=""), {}, None, 0),
            ("resident3", 3, {}, {}, None, 0),
            ("nvme3", 3, dict(offload_optimizer="nvme", offload_params="nvme", nvme_path=""), {}, None, 0)]
    for out in run_on_ranks(4, _engine_body, runs, str(tmp_path), timeout=600):
        for resident, offloaded in (("resident1", "nvme1"), ("resident3", "nvme3")):
            assert out[offloaded][:4] == out[resident][:4], offloaded
            for name, value in out[resident][4].items():
                assert torch.equal(out[offloaded][4][name], value), (offloaded, name)
    assert not list(tmp_path.iterdir()), "the swap files are removed when the engine closes"


@pytest.mark.slow
def test_one_engine_fp16_with_experts_one_loss_scaler_and_a_named_nonfinite_expert():
    """fp16 at ep 2, dp 4, ZeRO-1 and 3, against the single-process fp16 run of the same global batch: the
    same losses to fp16's precision, one loss scale. An overflow in one expert's gradient on the two ranks
    holding it skips the step on every rank and lowers the one scale. In fp32 a NaN there stops the run
    with a message naming that expert on every rank (rank 0 holds other experts)."""
    fp16 = dict(fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    runs = [("fp16-1", 1, {}, fp16, None, 0), ("fp16-3", 3, {}, fp16, None, 0),
            ("overflow", 1, {}, fp16, EXPERT, 2), ("nan", 1, {}, {}, EXPERT, 1)]
    serial = run_on_ranks(1, _engine_body, runs[:1], timeout=600)[0]["fp16-1"]
    for rank, out in enumerate(run_on_ranks(4, _engine_body, runs, timeout=600)):
        for name in ("fp16-1", "fp16-3"):
            losses, norms, scales, skipped, _, _ = out[name]
            assert not any(skipped) and scales == serial[2] == [1024.0] * STEPS
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(serial[0]), rtol=2e-3, atol=0, msg=name)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(serial[1]), rtol=2e-2, atol=0, msg=name)
        losses, norms, scales, skipped, _, _ = out["overflow"]
        assert skipped == [False, False, True, False, False] and scales[2] == 512.0, (skipped, scales)
        assert losses[:2] == out["fp16-1"][0][:2]                  # the same run until the overflow
        stop = out["nan"][5]
        assert out["nan"][3][1] and "iteration 2" in stop and EXPERT in stop, (rank, stop)


# --------------------------------------------------------------------------- checkpoints

def _resume_body(rank, world_size, tp, ep, stage, first, last, save_dir, load, model_kw=None):
    """Steps ``first``..``last`` - 1 of the 8-micro-batch run at (tp, ep, ZeRO stage) on these ranks,
    after loading ``save_dir`` when ``load``; saves after the last step otherwise. With ``model_kw`` also
    the expert biases (after the load, or at the save; and at the end)."""
    topo = Topology(tp=tp, ep=ep)
    cfg = _cfg(**(model_kw or {}))
    par = ParallelConfig(tp=tp, dp=topo.dp_size, expert_model_parallel_size=ep)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED, device="meta")
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage), GPT_OPT)
    job = JobConfig(model=cfg, parallel=par, optimizer=GPT_OPT, train=TrainConfig(micro_batch_size=MB_SIZE))
    state = TrainState()
    biases = None
    if load:
        state = load_checkpoint(save_dir, chunks=chunks, engine=engine, topo=topo, job=job)
        assert state.iteration == first
    biases = {n: b.clone() for c in chunks for n, b in c.named_buffers()} if load else None
    per = 2 * MICRO // topo.dp_size
    losses = []
    for batches in gpt_batches(STEPS, 2 * MICRO)[first:last]:
        losses.append(train_step(chunks, batches[topo.dp_rank * per:(topo.dp_rank + 1) * per], topo, engine, job).loss)
        state.iteration += 1
    if not load:
        save_checkpoint(save_dir, state, chunks=chunks, engine=engine, topo=topo, job=job)
        biases = {n: b.clone() for c in chunks for n, b in c.named_buffers()}
    with engine.gathered_parameters():
        params = {n: (p.detach().clone(), split_dim(p)) for c in chunks for n, p in c.named_parameters()}
    if model_kw is None:
        return topo.tp_rank, tp, losses, params
    return topo.tp_rank, tp, losses, params, biases, {n: b.clone() for c in chunks for n, b in c.named_buffers()}


@pytest.mark.slow
def test_save_at_ep2_resume_at_ep4_gives_the_uninterrupted_run(tmp_path):
    """3 steps at tp 2, dp 2, ep 2 (ZeRO-1), saved; 2 more at dp 4, ep 4 (ZeRO-2) from the checkpoint:
    the 5 losses and the final parameters are the serial run's (8 micro-batches a step throughout)."""
    saved = run_on_ranks(4, _resume_body, 2, 2, 1, 0, 3, str(tmp_path), False, timeout=600)
    resumed = run_on_ranks(4, _resume_body, 1, 4, 2, 3, STEPS, str(tmp_path), True, timeout=600)
    ref_losses, _, ref_params, _ = _reference(2, ())
    torch.testing.assert_close(torch.tensor(saved[0][2] + resumed[0][2]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    seen = set()
    for tp_rank, tp, _, params in resumed:
        for name, (value, pdim) in params.items():
            torch.testing.assert_close(value, shard(ref_params[name], pdim, tp_rank, tp), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert seen == set(ref_params)


# --------------------------------------------------------------------------- bytes and memory

def _bytes_body(rank, world_size):
    """One MoE layer at ep 2 on crafted tokens: token t routes to experts t % 4 and (t + 1) % 4 (balanced),
    forward and backward; the all-to-all bytes the layer counted, and the formula's."""
    topo = Topology(ep=2)
    cfg = _cfg(num_layers=1)
    model = GPT(cfg, topo.model_groups(), seed=SEED)
    layer = model.layers["0"].mlp
    s, b, h = 12, 2, cfg.hidden_size
    t = torch.arange(s * b)
    x = torch.zeros(s * b, h)
    x[t, t % 4] = 10.0
    x[t, (t + 1) % 4] = 5.0
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :4] = torch.eye(4)
    x = (x + 0.01 * torch.randn(s * b, h, generator=torch.Generator().manual_seed(rank))).view(s, b, h)
    x.requires_grad_(True)
    model.ctx.comm_log.reset()
    layer(x).sum().backward()
    assert layer.stats.tokens_per_expert.tolist() == [s * b // 2] * 4
    return model.ctx.comm_log.bytes()["ep"], moe_alltoall_bytes(s * b, 2, h, 4, 2, 4)


def _one_sided_body(rank, world_size):
    """ep 2 with every token routed to experts 0 and 1 (ep rank 0's): rank 1's experts get no rows.
    The layer's output and input gradient equal the single-process layer's on the same tokens."""
    topo = Topology(ep=2)
    cfg = _cfg(num_layers=1)
    layer = GPT(cfg, topo.model_groups(), seed=SEED).layers["0"].mlp
    whole = GPT(cfg, seed=SEED).layers["0"].mlp
    x = torch.randn(8, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(rank)) + 3.0
    for m in (layer, whole):
        with torch.no_grad():
            m.router.weight.zero_()
            m.router.weight[0, :] = 1.0
            m.router.weight[1, :] = 0.5
    outs = []
    for m in (layer, whole):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.square().sum().backward()
        outs.append((out.detach(), xi.grad))
    torch.testing.assert_close(outs[0], outs[1])
    return layer.stats.tokens_per_expert.tolist()


def test_dispatch_when_one_ep_rank_gets_no_tokens():
    for counts in run_on_ranks(2, _one_sided_body):
        assert counts == [16, 16, 0, 0]


def test_alltoall_bytes_equal_the_formula():
    for counted, formula in run_on_ranks(2, _bytes_body):
        assert counted == formula


def test_estimate_counts_experts_per_ep_rank():
    """Parameters per rank: the dense ones plus E/ep experts per MoE layer; the model states shard
    the experts over dp/ep."""
    job = JobConfig(model=_cfg(), parallel=ParallelConfig(dp=4, expert_model_parallel_size=2),
                    zero=ZeroConfig(zero_stage=1), train=TrainConfig(micro_batch_size=MB_SIZE, global_batch_size=32))
    full = GPT(_cfg(), device="meta")
    expert = sum(p.numel() for n, p in full.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in full.parameters()) - expert
    est = estimate_stage(job, 0)
    assert est.params == dense + expert // 2
    one = estimate_stage(JobConfig(**{**vars(job), "parallel": ParallelConfig(dp=4)}), 0)
    assert one.params == dense + expert and one.parts["params"] > est.parts["params"]
    # ZeRO-1's sharded state is the same: E/ep experts over dp/ep ranks is E experts over dp
    assert one.parts["optimizer_state"] == est.parts["optimizer_state"]
    assert moe_alltoall_bytes_per_step(job) == 4 * moe_alltoall_bytes(16 * MB_SIZE, 2, 32, 4, 2, 4, 4, 1)
    per_layer = moe_alltoall_bytes(16 * MB_SIZE, 2, 32, 4, 2, 4, 1, 4)       # a recomputed layer: its forward again
    block = _cfg(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert moe_alltoall_bytes_per_step(JobConfig(**{**vars(job), "model": block})) == 4 * per_layer + per_layer // 2
    every = _cfg(recompute_activations=True)
    assert moe_alltoall_bytes_per_step(JobConfig(**{**vars(job), "model": every})) == 4 * per_layer * 3 // 2


def test_estimate_counts_the_grouped_gemm_stacked_weights():
    """--moe-grouped-gemm keeps one copy of an MoE layer's local experts' weights from forward to backward:
    the estimate's MoE layer keeps that much more per micro-batch (E/ep experts, SwiGLU fc1 2 ffn wide,
    biases), a dense layer nothing more."""
    from megazero.models.gpt.memory import layer_activation_bytes

    def job(**kw):
        return JobConfig(model=_cfg(swiglu=True, ffn_hidden_size=48, moe_layer_freq=2, **kw),
                         parallel=ParallelConfig(dp=4, expert_model_parallel_size=2),
                         train=TrainConfig(micro_batch_size=MB_SIZE, global_batch_size=32))

    grouped, loop = job(moe_grouped_gemm=True), job()
    stacked = 4 * (4 // 2) * (96 * 32 + 32 * 48 + 96 + 32)
    assert layer_activation_bytes(grouped, 4, 4, 0)[0] - layer_activation_bytes(loop, 4, 4, 0)[0] == stacked
    assert layer_activation_bytes(grouped, 4, 4, 1) == layer_activation_bytes(loop, 4, 4, 1)
    assert layer_activation_bytes(grouped, 8, 8, 0) == layer_activation_bytes(loop, 8, 8, 0)   # fp64: the loop


def test_flops_per_token_count_the_active_experts():
    """Training FLOPs of a top-2 MoE model = the dense model with an ffn twice as wide + the routers."""
    from megazero.models.gpt.spec import flops_per_token as model_flops_per_token

    moe, dense = _cfg(), GPTConfig(**{**GPT_CFG, "ffn_hidden_size": 2 * 4 * GPT_CFG["hidden_size"]})
    router = 3 * 2 * moe.num_layers * moe.hidden_size * moe.num_experts
    assert model_flops_per_token(moe, 256) == model_flops_per_token(dense, 256) + router


# --------------------------------------------------------------------------- DeepSeek-V3 routing

DSV3_KW = dict(num_experts=8, moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_num_groups=4,
               moe_router_group_topk=2, moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
               moe_shared_expert_intermediate_size=24, moe_ffn_hidden_size=8, swiglu=True, ffn_hidden_size=64,
               add_bias_linear=False, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Our SwiGLU fc1 layout: row 2j gate feature j, row 2j+1 up feature j."""
    return torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1])


def test_sigmoid_group_limited_routing_with_shared_experts_equals_hf_deepseek_v3():
    """Our MoE layer (sigmoid scores, expert bias, 4 groups keep 2, top-3, scaling 2.5, shared experts)
    equals transformers' DeepseekV3MoE on the same weights at 1e-6 (fp32): routed + shared output, and
    the chosen experts and gates equal its router's."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = _cfg(num_layers=1, **DSV3_KW)
    layer = GPT(cfg, seed=SEED).layers["0"].mlp
    hf_cfg = DeepseekV3Config(hidden_size=cfg.hidden_size, moe_intermediate_size=8, n_routed_experts=8,
                              num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True, n_shared_experts=3, hidden_act="silu")   # shared: 3 x 8 wide
    hf = DeepseekV3MoE(hf_cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        layer.expert_bias.copy_(torch.randn(8) * 0.1)
        hf.gate.weight.copy_(layer.router.weight)
        hf.gate.e_score_correction_bias.copy_(layer.expert_bias)
        for e in range(8):
            fc1 = layer.experts[str(e)].fc1.weight
            hf.experts.gate_up_proj[e].copy_(torch.cat([fc1[0::2], fc1[1::2]]))
            hf.experts.down_proj[e].copy_(layer.experts[str(e)].fc2.weight)
        shared = layer.shared_experts
        hf.shared_experts.gate_proj.weight.copy_(shared.fc1.weight[0::2])
        hf.shared_experts.up_proj.weight.copy_(shared.fc1.weight[1::2])
        hf.shared_experts.down_proj.weight.copy_(shared.fc2.weight)
        torch.testing.assert_close(_interleaved(shared.fc1.weight[0::2], shared.fc1.weight[1::2]), shared.fc1.weight)
    x = torch.randn(2, 12, cfg.hidden_size)                          # HF's [b, s, h]
    with torch.no_grad():
        ours = layer(x.transpose(0, 1)).transpose(0, 1)
        theirs = hf(x)
        _, hf_gates, hf_experts = hf.gate(x)
        _, gates, experts = layer.route(x.transpose(0, 1).reshape(-1, cfg.hidden_size) @ layer.router.weight.t())
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    hf_order = x.shape[1] * torch.arange(2).repeat(12) + torch.arange(12).repeat_interleave(2)  # our row -> HF row
    for ours_row, hf_row in ((experts, hf_experts[hf_order]), (gates, hf_gates[hf_order])):
        torch.testing.assert_close(ours_row.sort(-1).values, hf_row.sort(-1).values, rtol=1e-6, atol=1e-6)
    logits = x.transpose(0, 1).reshape(-1, cfg.hidden_size) @ layer.router.weight.t()
    for without in (dict(num_groups=None, group_topk=None), dict(expert_bias=None)):   # both change some choice
        args = {**dict(score_function="sigmoid", expert_bias=layer.expert_bias, num_groups=4, group_topk=2,
                       scaling_factor=2.5), **without}
        assert not torch.equal(route(logits, 3, **args)[2].sort(-1).values, experts.sort(-1).values), without


DSV3_TRAIN_KW = dict(DSV3_KW, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
                     moe_z_loss_coeff=0.001, moe_layer_freq="([0]*1+[1]*3)", moe_router_bias_update_rate=0.05)
DSV3_CASES = [(2, 1, 1, True, 1, DSV3_TRAIN_KW), (1, 1, 2, False, 0, DSV3_TRAIN_KW),
              (1, 1, 4, False, 3, DSV3_TRAIN_KW), (2, 1, 2, True, 3, DSV3_TRAIN_KW),
              (1, 2, 2, False, 1, DSV3_TRAIN_KW)]


def test_deepseek_v3_routing_matches_serial():
    """Sigmoid routing with 4 groups (best 2 kept), top-3 of 8 experts, the expert bias (rate 0.05, so it
    changes choices within 5 steps), scaling 2.5, shared experts, 8-wide routed experts, the
    sequence-wise balance loss and a dense first layer: tp 2 + SP (dp 2, ZeRO-1), ep 2 (dp 4), ep 4
    (dp 4, ZeRO-3), tp 2 + SP with ep 2 (ZeRO-3), pp 2 with ep 2 (ZeRO-1), 5 steps each equal to the serial run (losses, norms,
    parameters 1e-5; the expert biases bitwise on every rank)."""
    _check(run_on_ranks(4, _parity_body, DSV3_CASES, timeout=600), DSV3_CASES)


def test_expert_bias_saved_and_resumed_bitwise(tmp_path):
    """3 steps at ep 2, dp 2 (ZeRO-1), saved; loaded at tp 2 (another layout): every expert bias is
    bitwise the saved one, and after 2 more steps the losses and biases are the uninterrupted serial
    run's (biases bitwise; the checkpoint holds each once, ``model.buffer/<name>``)."""
    from megazero.checkpoint import format as fmt
    from megazero.checkpoint.reader import CheckpointReader

    kw = DSV3_TRAIN_KW
    saved = run_on_ranks(2, _resume_body, 1, 2, 1, 0, 3, str(tmp_path), False, kw, timeout=600)
    resumed = run_on_ranks(2, _resume_body, 2, 1, 0, 3, STEPS, str(tmp_path), True, kw, timeout=600)
    names = CheckpointReader(fmt.checkpoint_dir(tmp_path, 3)).names(fmt.MODEL_BUFFER)
    assert names == [f"layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)]
    ref_losses, _, _, ref_buffers = _reference(2, tuple(sorted(kw.items())))
    torch.testing.assert_close(torch.tensor(saved[0][2] + resumed[0][2]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for (*_, at_save, _), (*_, at_load, at_end) in zip(saved, resumed):
        assert at_save.keys() == at_load.keys() == set(names)
        for name in names:
            assert torch.equal(at_load[name], saved[0][4][name]) and torch.equal(at_end[name], ref_buffers[name])
        assert any(not torch.equal(at_save[n], ref_buffers[n]) for n in names)   # the last two steps moved some


def _per_step_load_cv(with_bias: bool, steps: int = 100, rate: float = 0.01) -> list[float]:
    """Coefficient of variation (std / mean) of the per-expert load at each of ``steps`` training steps of
    a one-layer sigmoid-routed GPT (8 experts, top-2, no balancing loss) whose router starts skewed: feature
    0 of its input is 1 for every token (the norm's weight 0, bias 1 there) and expert 0's weight on it is
    4, so expert 0 wins every token. With the bias, the biases step by ``rate`` after each optimizer step
    (:func:`expert_bias_step`, what the trainer's after-step hook runs on the summed loads)."""
    cfg = _cfg(num_layers=1, num_experts=8, moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.0,
               moe_z_loss_coeff=0.0, moe_router_enable_expert_bias=with_bias,
               moe_router_bias_update_rate=rate if with_bias else 1e-3)
    model = GPT(cfg, seed=SEED)
    layer = model.layers["0"].mlp
    with torch.no_grad():
        norm = model.layers["0"].post_attention_layernorm
        norm.weight[0], norm.bias[0] = 0.0, 1.0
        layer.router.weight[0, 0] = 4.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    cvs = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length), generator=gen)
        model(tokens, tokens).mean().backward()
        opt.step()
        opt.zero_grad()
        load = layer.step_load.double()
        cvs.append(float(load.std(unbiased=False) / load.mean()))
        if with_bias:
            expert_bias_step(layer.expert_bias, layer.step_load, rate)
        layer.step_load = None
    return cvs


def test_expert_bias_balances_a_skewed_router_without_aux_loss():
    """Auxiliary-loss-free balancing: from a router that sends every token to expert 0 (load CV ~1.25),
    the expert bias (rate 0.01) brings the per-expert load's coefficient of variation below 0.5 within
    100 steps (mean over the last 20 steps; 64 tokens x 2 a step, so sampling noise alone is ~0.25) with
    no balancing loss; without the bias it stays above 1.0 at every step."""
    with_bias, without = _per_step_load_cv(True), _per_step_load_cv(False)
    assert with_bias[0] > 1.0
    assert sum(with_bias[-20:]) / 20 < 0.5, with_bias
    assert min(without) > 1.0, without


def test_flops_and_activations_count_expert_widths_and_shared_experts():
    """FLOPs: an MoE layer's MLP counts top-k experts of --moe-ffn-hidden-size plus the shared experts, so a
    model whose layers are all MoE equals the dense model of ffn k*F + S plus the routers; a dense first
    layer (pattern) counts the dense MLP. Activations: an MoE layer keeps k experts' inner activations
    (whole experts; under SP its tokens only) and the shared experts' (split over tp)."""
    from megazero.models.gpt.memory import layer_activation_bytes
    from megazero.models.gpt.spec import flops_per_token as model_flops_per_token

    kw = dict(num_experts=8, moe_router_topk=3, moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=24)
    moe, h = _cfg(**kw), GPT_CFG["hidden_size"]
    dense = GPTConfig(**{**GPT_CFG, "ffn_hidden_size": 3 * 8 + 24})
    router = 3 * 2 * moe.num_layers * h * 8
    assert model_flops_per_token(moe, 256) == model_flops_per_token(dense, 256) + router
    first_dense = _cfg(**kw, moe_layer_freq="[0,1,1,1]")
    dense_mlp = 3 * 2 * 2 * h * (first_dense.ffn_hidden_size - (3 * 8 + 24)) - 3 * 2 * h * 8
    assert model_flops_per_token(first_dense, 256) == model_flops_per_token(moe, 256) + dense_mlp
    for tp, sp in ((1, False), (2, False), (2, True)):
        job = JobConfig(model=_cfg(**kw), parallel=ParallelConfig(tp=tp, sequence_parallel=sp),
                        train=TrainConfig(micro_batch_size=MB_SIZE))
        tokens = GPT_CFG["seq_length"] * MB_SIZE
        moe_bytes = layer_activation_bytes(job, 4, 1, 0)[0]
        dense_bytes = layer_activation_bytes(job, 4, 1, None)[0]      # the layer's parts with a dense MLP
        inner = 4 * tokens * (3 * 2 * 8 // (tp if sp else 1) + 2 * 24 // tp)
        assert moe_bytes - dense_bytes == inner - 4 * tokens * 2 * job.model.ffn_hidden_size // tp


def test_sequence_balance_loss_is_the_mean_of_each_sequences_loss():
    """seq_aux_loss: a * E * sum_e f_e P_e computed on each sequence alone, averaged over the batch; equal
    to load_balancing_loss of each sequence's tokens."""
    cfg = _cfg(num_layers=1, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1,
               moe_z_loss_coeff=0.0)
    layer = GPT(cfg, seed=SEED).layers["0"].mlp
    layer.keep_aux_graph = True
    x = torch.randn(8, 3, cfg.hidden_size)                     # [s, b, h]
    layer(x)
    per_sequence = []
    for b in range(3):
        logits = x[:, b] @ layer.router.weight.t()
        probs, _, experts = route(logits, 2)
        counts = torch.bincount(experts.reshape(-1), minlength=4)
        per_sequence.append(load_balancing_loss(probs, counts, 8, 2, 0.1))
    torch.testing.assert_close(layer.last_aux_loss, torch.stack(per_sequence).mean())


@pytest.mark.parametrize("kw,message", [
    (dict(moe_router_enable_expert_bias=True), r"^--moe-router-enable-expert-bias needs --moe-router-score-function "
                                               r"sigmoid"),
    (dict(moe_router_bias_update_rate=0.01), r"^--moe-router-bias-update-rate moves the expert bias: add "
                                             r"--moe-router-enable-expert-bias"),
    (dict(moe_router_num_groups=2), r"^--moe-router-num-groups and --moe-router-group-topk go together"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), r"^--num-experts 4 must split into "
                                                             r"--moe-router-num-groups 3 equal groups"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=3),
     r"^--moe-router-group-topk 1 must be <= --moe-router-num-groups 2 and keep at least --moe-router-topk 3"),
    (dict(moe_router_topk_scaling_factor=0.0), r"^--moe-router-topk-scaling-factor must be > 0"),
    (dict(moe_ffn_hidden_size=0), r"^--moe-ffn-hidden-size must be a positive integer"),
    (dict(moe_shared_expert_intermediate_size=-1), r"^--moe-shared-expert-intermediate-size must be a positive"),
    (dict(moe_router_score_function="tanh"), r"^--moe-router-score-function must be one of softmax, sigmoid"),
    (dict(moe_router_load_balancing_type="none"), r"^--moe-router-load-balancing-type none adds no balancing loss, "
                                                  r"yet --moe-aux-loss-coeff is 0.01: drop one of them"),
    (dict(moe_layer_freq="[0,1]"), r"^--moe-layer-freq pattern \[0, 1\] must hold one 0 \(dense\) or 1 \(MoE\) per "
                                   r"layer, 4 of them"),
    (dict(moe_layer_freq="[0,2,1,1]"), r"^--moe-layer-freq pattern \[0, 2, 1, 1\] must hold one 0"),
    (dict(moe_layer_freq="[0]+1"), r"^--moe-layer-freq '\[0\]\+1' is neither an integer nor a layer pattern"),
    (dict(num_experts=None, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0, moe_router_score_function="sigmoid"),
     r"^--moe-router-score-function sigmoid applies to Mixture-of-Experts layers and this model has none"),
])
def test_routing_flags_refused_in_one_line(kw, message):
    from megazero.config import validate
    from megazero.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as caught:
        validate(JobConfig(model=_cfg(**kw)), 1)
    assert "\n" not in str(caught.value)


def test_layer_pattern_parses_megatrons_forms_without_eval():
    from megazero.models.gpt.config import parse_layer_pattern

    assert parse_layer_pattern("([0]*1+[1]*3)") == [0, 1, 1, 1] == parse_layer_pattern(" [0, 1,1 ,1] ")
    assert parse_layer_pattern("([1]*1+[0]*1)*2") == [1, 0, 1, 0]
    for bad in ("[0]*", "[0,1]+", "[0]]", "([0]", "__import__('os')", "[0]*-1", "[0.5]"):
        with pytest.raises(ValueError):
            parse_layer_pattern(bad)
    cfg = _cfg(moe_layer_freq="([0]*1+[1]*3)")
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True] and cfg.layer_period == 4
    assert set(dict(GPT(cfg, device="meta").named_parameters())) >= {"layers.0.mlp.dense_h_to_4h.weight",
                                                                      "layers.1.mlp.router.weight"}
