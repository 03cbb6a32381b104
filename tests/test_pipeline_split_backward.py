"""Split backward (zero-bubble I and W): for every layer kind with weights, I (the input gradient)
followed by W (the parameters' gradients) equals a full backward bit for bit, on real model chunks."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn as nn
from helpers import run_on_ranks

from megazero.memory.measure import LiveTensorBytes
from megazero.models.gpt import GPT, GPTConfig, masked_mean
from megazero.parallel.pipeline.split_backward import backward_input, deferrable_saves

S, B, H = 8, 2, 32


def _cfg(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, vocab_size=64,
                make_vocab_size_divisible_by=16)
    return GPTConfig(**{**base, **kw})


def _data(seed: int, shape=(S, B, H)):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(shape, generator=g), "dy": torch.randn(shape, generator=g),
            "tokens": torch.randint(0, 64, (B, S), generator=g), "labels": torch.randint(0, 64, (B, S), generator=g),
            "mask": (torch.rand(B, S, generator=g) < 0.8).float()}


def _run(module, kind: str, d, split: bool):
    """One forward + backward of ``module`` (a middle chunk: hidden -> hidden; 'last': hidden -> loss;
    'first': tokens -> hidden); with ``split`` as I then W, the forward recording its saved tensors for
    I to free. Returns the input gradient seen right
    after I, the parameters that had a gradient then, and every parameter's gradient."""
    x = None if kind == "first" else d["x"].clone().requires_grad_()
    with deferrable_saves() if split else contextlib.nullcontext():      # as the pipeline runner does
        if kind == "last":
            out, dy = masked_mean(module(x, d["labels"]), d["mask"]), None
        else:
            out, dy = module(d["tokens"] if kind == "first" else x), d["dy"]
    if not split:
        torch.autograd.backward(out, dy)
        return (None if x is None else x.grad), set(), [p.grad.clone() for p in module.parameters()]
    work = backward_input(out, dy, x)
    x_grad = None if x is None else x.grad.clone()
    early = {n for n, p in module.named_parameters() if p.grad is not None}
    work.run()
    with pytest.raises(RuntimeError, match="has run already"):
        work.run()
    return x_grad, early, [p.grad.clone() for p in module.parameters()]


def _assert_split_equals_full(make, kind: str, seed: int = 1):
    d = _data(seed)
    full, split = make(), make()
    ref_x, _, ref = _run(full, kind, d, split=False)
    got_x, early, got = _run(split, kind, d, split=True)
    if ref_x is not None:
        assert torch.equal(got_x, ref_x)                        # I gave the input gradient exactly
    if kind != "first":                                         # ... and no parameter gradient but the marked
        assert early == {n for n, p in split.named_parameters() if getattr(p, "weight_grad_in_input", False)}
    names = [n for n, _ in full.named_parameters()]
    assert len(got) == len(ref) > 0
    for n, a, b in zip(names, got, ref):
        assert torch.equal(a, b), n


LAYER_KINDS = {   # transformer layers of each family; the layer kinds they hold
    "gpt": {},                                               # LayerNorm, QKV/proj/fc1/fc2 with biases, GELU
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                  group_query_attention=True, num_query_groups=2),   # RMSNorm (a custom Function), GQA
    "moe": dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
    "recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@pytest.mark.parametrize("family", list(LAYER_KINDS))
def test_transformer_layers_split_exactly(family):
    cfg = _cfg(**LAYER_KINDS[family])
    _assert_split_equals_full(lambda: GPT(cfg, pre_process=False, post_process=False, seed=3), "middle")


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "output-layer"])
def test_last_stage_head_and_loss_split_exactly(tied):
    """Final norm, the LM head (the tied word-embedding copy or the output layer) and the
    vocab-parallel cross entropy, backward from the scalar loss. The head's weight is the one parameter
    whose gradient I computes (the model marks it, ``weight_grad_in_input``)."""
    cfg = _cfg(untie_embeddings_and_output_weights=not tied)
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    chunk = GPT(cfg, pre_process=False, post_process=True, seed=3)
    assert [n for n, p in chunk.named_parameters() if getattr(p, "weight_grad_in_input", False)] == [head]
    _assert_split_equals_full(lambda: GPT(cfg, pre_process=False, post_process=True, seed=3), "last")


def test_first_stage_has_no_input_gradient_and_w_is_the_whole_backward():
    cfg = _cfg()
    _assert_split_equals_full(lambda: GPT(cfg, pre_process=True, post_process=False, seed=3), "first")


class _Embedded(nn.Module):
    """Hidden state plus word and position embeddings: embeddings off the input-gradient path."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.word, self.pos = nn.Embedding(64, H), nn.Embedding(S, H)
        with torch.no_grad():
            self.word.weight.copy_(torch.randn(64, H, generator=g))
            self.pos.weight.copy_(torch.randn(S, H, generator=g))
        self.tokens = torch.randint(0, 64, (S, B), generator=g)

    def forward(self, x):
        return x * 2 + self.word(self.tokens) + self.pos(torch.arange(S))[:, None]


def test_embeddings_off_the_input_path_wait_for_w():
    _assert_split_equals_full(_Embedded, "middle")


class _OddMatmuls(nn.Module):
    """Matrix products in every layout W computes by hand: ``addmm`` with alpha and beta (a broadcast
    bias), a weight as the first operand, a column-major weight as the first and as the second operand,
    and a plain ``mm`` with a row-major weight."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1, self.b1 = nn.Parameter(torch.randn(H, H, generator=g)), nn.Parameter(torch.randn(H, generator=g))
        self.w2 = nn.Parameter(torch.randn(S * B, S * B, generator=g))
        self.w3 = nn.Parameter(torch.randn(S * B, S * B, generator=g))
        self.w4 = nn.Parameter(torch.randn(H, H, generator=g))

    def forward(self, x):
        h = torch.addmm(self.b1, x.reshape(S * B, H), self.w1.t(), beta=0.5, alpha=2.0)
        h = torch.mm(self.w2, torch.tanh(h))                 # the weight first, row-major
        h = torch.mm(self.w3.t(), h)                         # the weight first, column-major
        h = torch.mm(torch.tanh(h), self.w4)                 # the weight second, row-major
        return h.reshape(S, B, H)


def test_matmul_weight_halves_by_hand_are_exact_in_every_layout(monkeypatch):
    """W computes a plain matrix product's weight half itself (no autograd pass through the node):
    bit for bit what autograd's backward gives, for each operand position and layout, and no pass of W
    runs from a node of the input path."""
    inputs = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: inputs.append(k.get("inputs")) or backward(*a, **k))
    _assert_split_equals_full(_OddMatmuls, "middle")
    assert len(inputs) >= 5 and all(i is None for i in inputs)      # 4 by hand + the held bias: none on the path


def test_w_accumulates_over_micro_batches_in_any_order():
    """I0, I1, then W1 before W0 (as a zero-bubble schedule may) equals two full backwards."""
    cfg = _cfg()
    full, split = (GPT(cfg, pre_process=False, post_process=False, seed=3) for _ in range(2))
    works = []
    for seed in (5, 6):
        d = _data(seed)
        torch.autograd.backward(full(d["x"].clone().requires_grad_()), d["dy"])
        x = d["x"].clone().requires_grad_()
        works.append(backward_input(split(x), d["dy"], x))
    works[1].run()
    works[0].run()
    for (n, a), b in zip(split.named_parameters(), full.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=n)   # summed in the other order


def test_post_accumulate_grad_hooks_fire_in_w_not_in_i():
    """The ZeRO grad sync learns that a gradient is ready from these hooks: they must see W."""
    layer = GPT(_cfg(), pre_process=False, post_process=False, seed=3)
    seen = []
    for p in layer.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p))
    d = _data(1)
    x = d["x"].clone().requires_grad_()
    work = backward_input(layer(x), d["dy"], x)
    assert seen == []
    work.run()
    assert len(seen) == len(list(layer.parameters()))


def test_w_runs_one_autograd_pass_per_weight_matmul_and_i_hooks_only_them(monkeypatch):
    """What I + W add to a full backward is autograd passes and Python hooks: W makes one pass per
    weight matmul (qkv, proj, fc1, fc2 per GPT layer), each from the weight's own edges (its X^T dY
    computed by hand), and one for the norms' and biases' gradients held since I; I hooks only the
    matmul nodes (to keep their dY), not every node of the graph."""
    cfg = _cfg()
    layer = GPT(cfg, pre_process=False, post_process=False, seed=3)
    d = _data(1)
    x = d["x"].clone().requires_grad_()
    with deferrable_saves():
        out = layer(x)
    hooked, passes = [], []
    from megazero.parallel.pipeline import split_backward
    hook_nodes = split_backward._hooked
    monkeypatch.setattr(split_backward, "_hooked",
                        lambda keeping, *a: hooked.extend(keeping) or hook_nodes(keeping, *a))
    work = backward_input(out, d["dy"], x)
    assert len(hooked) == 4 * cfg.num_layers
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: passes.append(k.get("inputs")) or backward(*a, **k))
    work.run()
    assert len(passes) == 4 * cfg.num_layers + 1
    assert passes == [None] * len(passes)     # every matmul by hand: no pass starts on the input path


def _tp_body(rank, world, sp, kind):
    from megazero.parallel.topology import Topology
    topo = Topology(tp=world)
    cfg = _cfg(num_experts=4 if kind == "moe" else None)
    groups = topo.model_groups(sp)
    d = _data(1)
    if sp:                                                    # this rank's sequence chunk
        d = {**d, "x": d["x"].chunk(world, 0)[rank].contiguous(), "dy": d["dy"].chunk(world, 0)[rank].contiguous()}
    make = {"middle": lambda: GPT(cfg, groups, pre_process=False, post_process=False, seed=3),
            "moe": lambda: GPT(cfg, groups, pre_process=False, post_process=False, seed=3),
            "last": lambda: GPT(cfg, groups, pre_process=False, post_process=True, seed=3)}[kind]
    _assert_split_equals_full(make, "last" if kind == "last" else "middle")
    return True


@pytest.mark.parametrize("sp,kind", [(False, "middle"), (True, "middle"), (False, "last"), (False, "moe")],
                         ids=["tp2", "tp2-sp", "tp2-vocab-parallel-head", "tp2-moe"])
def test_split_through_tensor_parallel_layers(sp, kind):
    """Column- and row-parallel linears (the tp communication carries input gradients: it runs in I,
    W is local), sequence parallelism, the vocab-parallel head and cross entropy, tp-sharded experts."""
    assert run_on_ranks(2, _tp_body, sp, kind, timeout=120) == [True, True]


def _held_between_i_and_w(hooked: bool, cfg, upto: str) -> tuple[int, list]:
    """Bytes live after one micro-batch's F, I (with the input's gradient sent away) or W (``upto``)
    through a middle chunk, counted from before F (one profiler block: it sees only the frees of what
    it saw allocated), and the parameters' gradients."""
    layer = GPT(cfg, pre_process=False, post_process=False, seed=3)
    for p in layer.parameters():                              # gradient storage exists before the step
        p.grad = torch.zeros_like(p)
    d = _data(1)
    x, dy = d["x"].clone().requires_grad_(), d["dy"]
    gc.collect()
    with LiveTensorBytes() as probe:
        with deferrable_saves() if hooked else contextlib.nullcontext():
            out = layer(x)
        if upto != "F":
            work = backward_input(out, dy, x)
            x.grad = None                                     # sent to the previous stage
            del out
            if upto == "W":
                work.run()
                del work
    return probe.end, [p.grad.clone() for p in layer.parameters()]


def test_between_i_and_w_a_micro_batch_keeps_only_what_w_needs():
    """After I a micro-batch holds each weight matmul's input X and output gradient dY -- per GPT
    layer 16 sbh elements: X of qkv, proj and fc1 (h each) and fc2 (4h); dY of qkv (3h), proj (h),
    fc1 (4h) and fc2 (h) -- and nothing else of its activations (attention, GELU inputs, dropout
    masks, norms' inputs and statistics: the norms' and biases' gradients are computed right after I).
    Without ``deferrable_saves`` the whole graph stays until W, on top of dY. Same gradients either way."""
    cfg = _cfg(hidden_dropout=0.1, attention_dropout=0.1)
    needed = cfg.num_layers * 16 * S * B * H * 4
    # Warm: the kernels' one-time caches (8 KiB in a process's first forward) are not the micro-batch's.
    _held_between_i_and_w(False, cfg, "W")
    _held_between_i_and_w(True, cfg, "W")
    forward, _ = _held_between_i_and_w(True, cfg, "F")
    after_i, _ = _held_between_i_and_w(True, cfg, "I")
    after_w, grads = _held_between_i_and_w(True, cfg, "W")
    norms = cfg.num_layers * 2 * 2 * H * 4                    # the norms' weight and bias gradients, kept for W
    rng = 2 * torch.get_rng_state().nbytes     # both dropout streams' states, replaced per fork: the model's
    assert abs(after_i - rng - needed) <= norms, (after_i, needed)
    assert after_i < 0.75 * forward                           # masks and attention probabilities: gone
    assert after_w <= rng                                      # W let everything go
    forward_old, _ = _held_between_i_and_w(False, cfg, "F")
    after_i_old, grads_old = _held_between_i_and_w(False, cfg, "I")
    assert abs(forward_old - forward) <= rng and after_i_old > forward  # the whole graph stays, and dY with it
    _, grads_old = _held_between_i_and_w(False, cfg, "W")
    for a, b in zip(grads, grads_old):
        assert torch.equal(a, b)


def _held_after_i_on_last_stage(cfg, head_in_input: bool) -> int:
    """Bytes live after one micro-batch's F and I through a last-stage chunk (the loss), counted from
    before F, with the output layer's weight marked for I (as the model does) or not."""
    chunk = GPT(cfg, pre_process=False, post_process=True, seed=3)
    if not head_in_input:
        del chunk.output_layer.weight.weight_grad_in_input
    for p in chunk.parameters():                              # gradient storage exists before the step
        p.grad = torch.zeros_like(p)
    d = _data(1)
    x = d["x"].clone().requires_grad_()
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(2))
    gc.collect()
    with LiveTensorBytes() as probe:
        with deferrable_saves():
            loss = masked_mean(chunk(x, labels), d["mask"])
        work = backward_input(loss, None, x)
        x.grad = None                                         # sent to the previous stage
        del loss
    assert (chunk.output_layer.weight.grad.abs().sum() > 0) == head_in_input
    work.run()
    return probe.end


def test_last_stage_holds_no_logits_gradient_between_i_and_w():
    """The head's X and dY (the logits gradient, tokens x vocab: the largest dY) do not wait for W: I
    computes the output layer's weight gradient into ``.grad``. After I the last stage holds its
    layers' 16 sbh each and the norms' gradients, nothing of the head; unmarked, the head would add its
    X and dY, (h + V) per token."""
    cfg = _cfg(vocab_size=256, untie_embeddings_and_output_weights=True)    # V = 8h
    layers = cfg.num_layers * 16 * S * B * H * 4
    norms = (2 * cfg.num_layers + 1) * 2 * H * 4
    head = S * B * (H + cfg.padded_vocab_size(1)) * 4
    after_i = _held_after_i_on_last_stage(cfg, head_in_input=True)
    assert abs(after_i - layers) <= norms, (after_i, layers)
    deferred = _held_after_i_on_last_stage(cfg, head_in_input=False)
    assert abs(deferred - after_i - head) <= norms, (deferred - after_i, head)


class _SharedWeight(nn.Module):
    """One linear applied at two depths: the outer use's weight gradient is reachable from the inner's
    through the input path, so W cannot take it apart from I."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(torch.nn.functional.gelu(self.lin(x)))


def test_a_weight_used_at_two_depths_is_refused_with_the_fix():
    """Not silently counted twice: W needs what I freed, and says which schedule to use instead."""
    module, d = _SharedWeight(), _data(1)
    x = d["x"].clone().requires_grad_()
    with deferrable_saves():
        out = module(x)
    work = backward_input(out, d["dy"], x)
    with pytest.raises(RuntimeError, match="two depths of one model chunk.*--pipeline-schedule 1f1b"):
        work.run()
