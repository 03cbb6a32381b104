"""GPT model: tp = 1, 2, 4 (with and without sequence parallel) give the same model, logits, loss
and AdamW updates; activation checkpointing gives the same gradients; bad shapes are rejected by
``megazero.config.validate``."""
import dataclasses

import pytest
import torch
from helpers import run_on_ranks

from megazero.config import JobConfig, ParallelConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from megazero.models.gpt import GPT, GPTConfig, masked_mean
from megazero.parallel.params import split_dim
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.parallel.zero import wrap_data_parallel

VOCAB = 100          # padded to 104 (tp1), 112 (tp2), 128 (tp4) with divisor 8: padding differs per tp
SEED = 4321


def _cfg(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
                make_vocab_size_divisible_by=8)
    return GPTConfig(**(base | kw))


def _batch(b=2, s=16):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    return tokens, labels, mask


def _full_state(model: GPT, group, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) gathered whole (vocab rows cut to the real vocab), by name."""
    out = {}
    for name, p in model.named_parameters():
        full = gather_full(p.grad if grads else p.detach(), split_dim(p), group).clone()
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert full[VOCAB:].abs().max() == 0, f"{name}: padded vocab rows must stay zero"
            full = full[:VOCAB]
        out[name] = full
    return out


def _run(topo, cfg: GPTConfig, sequence_parallel: bool, dtype=torch.float32, steps: int = 3) -> dict:
    """Init, record logits/loss, then train ``steps`` AdamW steps; return everything gathered whole."""
    model = GPT(cfg, topo.model_groups(sequence_parallel) if topo else None, seed=SEED, dtype=dtype)
    group = model.tp_group
    tokens, labels, mask = _batch(s=cfg.seq_length)
    init = _full_state(model, group)
    with torch.no_grad():
        logits = gather_full(model(tokens), 2, group)[..., :VOCAB].clone()
    # eps 1e-6 rather than 1e-8: the key bias's gradient is analytically zero (softmax is invariant to
    # a per-query constant, and q.b_k is one), so in fp32 it is rounding noise (~1e-11) whose sign
    # Adam with eps=1e-8 would amplify into lr-sized, layout-dependent updates. Every real gradient
    # here is >= ~1e-8 and keeps its ordinary Adam behaviour; the grads themselves are compared too.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    # the trainer's gradient finalisation (dp = 1): sums the sequence-parallel partial grads over tp
    sync = wrap_data_parallel(model, topo, ZeroConfig()) if topo is not None else None
    losses, grads = [], None
    for _ in range(steps):
        sync.zero_grad() if sync else opt.zero_grad()
        loss = masked_mean(model(tokens, labels), mask)
        loss.backward()
        if sync:
            sync.finalize_grads()
        if grads is None:
            grads = _full_state(model, group, grads=True)
        losses.append(loss.item())
        opt.step()
    return {"init": init, "logits": logits, "losses": losses, "grads": grads,
            "final": _full_state(model, group)}


def _run_on_rank(rank, world_size, cfg, sequence_parallel, dtype):
    topo = Topology(tp=world_size)
    result = _run(topo, cfg, sequence_parallel, dtype)
    return result if rank == 0 else None


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def reference():
    """tp=1 runs (no process group) keyed by (tied or untied, dtype)."""
    cache = {}

    def get(tie, dtype):
        if (tie, dtype) not in cache:
            cfg = _cfg(untie_embeddings_and_output_weights=(tie == "untied"))
            cache[tie, dtype] = _run(None, cfg, False, dtype)
        return cache[tie, dtype]
    return get


@pytest.mark.parametrize("tp,sp,tie,dtype,fused", [
    (2, False, "tied", torch.float32, False), (2, True, "tied", torch.float32, False),
    pytest.param(4, False, "untied", torch.float32, False, marks=pytest.mark.slow),
    pytest.param(4, True, "tied", torch.float32, False, marks=pytest.mark.slow),
    (2, True, "untied", torch.float64, False),
    (2, True, "tied", torch.float32, True), (2, False, "untied", torch.float64, True)])
def test_tp_matches_serial(reference, tp, sp, tie, dtype, fused):
    """Same seed at tp=1 and tp>1: bit-identical init; logits, loss, grads within 1e-5 relative; weights
    after 3 AdamW steps too. fp32 rounding in a gradient entry that cancels to ~0 is amplified by
    Adam's normalisation, so in fp32 the weights get an absolute floor of 1e-5 (1% of one step of
    lr=1e-3: a missing gradient sync or a wrong shard moves weights by ~lr). The float64 run shows
    the training trajectories agree to 1e-10 once rounding is out of the way. ``fused``: the tp run
    with ``--cross-entropy-loss-fusion`` (the loss in chunks of tokens) against the unfused serial run."""
    cfg = _cfg(untie_embeddings_and_output_weights=(tie == "untied"), cross_entropy_loss_fusion=fused)
    got = run_on_ranks(tp, _run_on_rank, cfg, sp, dtype)[0]
    ref = reference(tie, dtype)
    fp64 = dtype == torch.float64
    assert got["init"].keys() == ref["init"].keys()
    for name in ref["init"]:
        assert torch.equal(got["init"][name], ref["init"][name]), f"init of {name} depends on tp"
    _close(got["logits"], ref["logits"], "logits", atol=1e-12 if fp64 else 1e-6)
    _close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), "losses")
    for name in ref["grads"]:   # entries that cancel to ~0 are judged against the tensor's scale
        g = ref["grads"][name]
        _close(got["grads"][name], g, f"grad of {name}", atol=(1e-12 if fp64 else 1e-6) * g.abs().max().item())
    for name in ref["final"]:
        _close(got["final"][name], ref["final"][name], f"{name} after 3 AdamW steps",
               rtol=1e-10 if fp64 else 1e-5, atol=1e-10 if fp64 else 1e-5)


def test_serial_model_learns_and_masks_padding(reference):
    ref = reference("tied", torch.float32)
    assert ref["losses"][-1] < ref["losses"][0]
    model = GPT(_cfg(), seed=SEED)
    tokens, labels, _ = _batch()
    logits = model(tokens)
    assert logits.shape == (2, 16, 104) and torch.isinf(logits[..., VOCAB:]).all()
    model(tokens, labels).sum().backward()
    assert model.embedding.word_embeddings.weight.grad[VOCAB:].abs().max() == 0


def test_init_statistics_and_names():
    cfg = _cfg(num_layers=4, hidden_size=64, init_method_std=0.02)
    model = GPT(cfg, seed=1)
    params = dict(model.named_parameters())
    assert params["layers.3.attention.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / (2 * 4) ** 0.5
    assert params["layers.3.mlp.dense_4h_to_h.weight"].std().item() == pytest.approx(scaled, rel=0.05)
    assert params["layers.0.attention.dense.weight"].std().item() == pytest.approx(scaled, rel=0.05)
    assert torch.all(params["final_norm.weight"] == 1) and torch.all(params["layers.1.mlp.dense_h_to_4h.bias"] == 0)
    assert params["embedding.word_embeddings.weight"].shared_embedding
    # Different seeds differ; same seed and name agree across independently built models.
    assert not torch.equal(GPT(cfg, seed=2).embedding.word_embeddings.weight, params["embedding.word_embeddings.weight"])
    assert torch.equal(GPT(cfg, seed=1).layers["2"].attention.qkv.weight, params["layers.2.attention.qkv.weight"])


@pytest.mark.parametrize("llama", [False, True], ids=["layernorm", "rmsnorm"])
def test_zero_centred_norms_are_the_ordinary_model_at_weight_minus_one(llama):
    """--apply-layernorm-1p: every norm (each layer's two, the final one) stores scale - 1, starts at 0 (the
    ordinary model's scale 1), and gives the ordinary model's loss and gradients (the norm weights' included:
    d/dw of (1 + w) is 1) when it holds the ordinary weights minus 1; checkpoints must match the flag."""
    from megazero.checkpoint.distributed import model_mismatch

    kw = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
              add_bias_linear=False) if llama else {}
    plain, centred = GPT(_cfg(**kw), seed=SEED), GPT(_cfg(**kw, apply_layernorm_1p=True), seed=SEED)
    norms = {n for n in dict(plain.named_parameters()) if n.endswith("norm.weight")}
    assert len(norms) == 2 * 2 + 1
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for (name, p), q in zip(plain.named_parameters(), centred.parameters()):
            assert torch.equal(q, p - 1 if name in norms else p), name       # the init: scale 1 stored as 0
            p.add_(0.1 * torch.randn(p.shape, generator=g))                   # norms (and biases) away from 1/0
            q.copy_(p - 1 if name in norms else p)
    tokens, labels, mask = _batch()
    losses = [masked_mean(m(tokens, labels), mask) for m in (plain, centred)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), centred.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    saved = dataclasses.asdict(plain.cfg)                  # as a checkpoint's job records its model
    assert model_mismatch(saved, centred.cfg) == ("apply_layernorm_1p", False, True)
    del saved["apply_layernorm_1p"]                        # written before the field existed: the default
    assert model_mismatch(saved, centred.cfg) == ("apply_layernorm_1p", False, True)
    assert model_mismatch(dataclasses.asdict(centred.cfg), centred.cfg) is None


def test_pipeline_stage_names_match_the_whole_model():
    cfg = _cfg(num_layers=4)
    whole = dict(GPT(cfg, seed=SEED).named_parameters())
    first = dict(GPT(cfg, layer_ids=[0, 1], post_process=False, seed=SEED).named_parameters())
    last = dict(GPT(cfg, layer_ids=[2, 3], pre_process=False, seed=SEED).named_parameters())
    assert "embedding.position_embeddings.weight" not in last and "final_norm.weight" not in first
    assert last["embedding.word_embeddings.weight"].shared_embedding           # tied copy on the last stage
    for name, p in list(first.items()) + list(last.items()):
        assert torch.equal(p, whole[name]), name
    # Chained stages compute what the whole model computes.
    tokens, labels, _ = _batch()
    stage0 = GPT(cfg, layer_ids=[0, 1], post_process=False, seed=SEED)
    stage1 = GPT(cfg, layer_ids=[2, 3], pre_process=False, seed=SEED)
    hidden = stage0(tokens)
    assert hidden.shape == (16, 2, 32)
    torch.testing.assert_close(stage1(hidden, labels), GPT(cfg, seed=SEED)(tokens, labels), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_recompute_gives_same_grads(activation):
    tokens, labels, mask = _batch()
    grads = []
    for recompute in (False, True):
        cfg = _cfg(activation=activation, recompute_activations=recompute, attention_dropout=0.1,
                   hidden_dropout=0.1)
        model = GPT(cfg, seed=SEED).train()
        torch.manual_seed(0)
        masked_mean(model(tokens, labels), mask).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7, msg=name)


def _recompute_body(rank, world_size):
    topo = Topology(tp=world_size)
    tokens, labels, mask = _batch()
    grads = []
    for recompute in (False, True):
        cfg = _cfg(recompute_activations=recompute, attention_dropout=0.1, hidden_dropout=0.1)
        model = GPT(cfg, topo.model_groups(True), seed=SEED).train()
        masked_mean(model(tokens, labels), mask).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7, msg=name)

    # Two chained stages under sequence parallel pass [s/tp, b, h] chunks and match the whole model.
    cfg = _cfg(num_layers=4)
    stage0 = GPT(cfg, topo.model_groups(True), layer_ids=[0, 1], post_process=False, seed=SEED)
    stage1 = GPT(cfg, topo.model_groups(True), layer_ids=[2, 3], pre_process=False, seed=SEED)
    hidden = stage0(tokens)
    assert hidden.shape == (16 // world_size, 2, 32)
    whole = GPT(cfg, topo.model_groups(True), seed=SEED)(tokens, labels)
    torch.testing.assert_close(stage1(hidden, labels), whole, rtol=1e-6, atol=1e-6)
    return True


def test_sequence_parallel_recompute_with_dropout_and_stage_split():
    assert run_on_ranks(2, _recompute_body) == [True, True]


def test_bf16_params_give_fp32_loss():
    model = GPT(_cfg(), seed=SEED, dtype=torch.bfloat16)
    tokens, labels, _ = _batch()
    loss = model(tokens, labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()
    assert model.layers["0"].attention.qkv.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("field,value,tp,match", [
    ("num_attention_heads", 6, 4, "--num-attention-heads 6 is not divisible by"),
    ("ffn_hidden_size", 130, 4, "--ffn-hidden-size 130 is not divisible by"),
    ("seq_length", 18, 4, "--sequence-parallel needs --seq-length"),
])
def test_config_rejects_shapes_tp_cannot_split(field, value, tp, match):
    kw = {"hidden_size": 48} if field == "num_attention_heads" else {}
    model = _cfg(**kw, **{field: value, "max_position_embeddings": 32})
    job = JobConfig(model=model, parallel=ParallelConfig(tp=tp, sequence_parallel=True))
    with pytest.raises(ConfigError, match=match):     # validate() alone: the model trusts a validated job
        validate(job, world_size=tp)


def test_config_rejects_padded_vocab_not_divisible_by_tp(monkeypatch):
    # Megatron's padding rule always yields a multiple of tp; a config whose padded vocab is not
    # (e.g. a custom rule) must still be caught by validate.
    monkeypatch.setattr(GPTConfig, "padded_vocab_size", lambda self, tp: 100)
    with pytest.raises(ConfigError, match="padded vocab 100 is not divisible by"):
        validate(JobConfig(model=_cfg(num_attention_heads=8), parallel=ParallelConfig(tp=8)), world_size=8)


def test_fused_qkv_layout_matches_block_attention():
    """The documented QKV layout: converting our rows to [Q; K; V] blocks and running textbook
    attention reproduces the layer (the contract the checkpoint converters rely on)."""
    from megazero.models.gpt.model import qkv_blocks_to_interleaved, qkv_interleaved_to_blocks
    cfg = _cfg(hidden_size=32, num_attention_heads=4)
    attn = GPT(cfg, seed=SEED).layers["0"].attention
    with torch.no_grad():
        attn.qkv.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        attn.dense.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(3))          # [s, b, h]
    w = qkv_interleaved_to_blocks(attn.qkv.weight.detach(), 4)
    b = qkv_interleaved_to_blocks(attn.qkv.bias.detach(), 4)
    assert torch.equal(qkv_blocks_to_interleaved(w, 4), attn.qkv.weight.detach())
    q, k, v = (x @ w[i * 32:(i + 1) * 32].T + b[i * 32:(i + 1) * 32] for i in range(3))
    heads = [t.view(16, 2, 4, 8).permute(1, 2, 0, 3) for t in (q, k, v)]            # [b, nh, s, d]
    scores = heads[0] @ heads[1].transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ heads[2]).permute(2, 0, 1, 3).reshape(16, 2, 32)
    want = out @ attn.dense.weight.detach().T + attn.dense.bias.detach()
    torch.testing.assert_close(attn(x).detach(), want, rtol=1e-5, atol=1e-6)
