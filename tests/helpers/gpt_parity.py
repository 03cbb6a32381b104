"""The test GPT for tp x pp x dp x ZeRO parity: its config, batches and the single-process reference.

``gpt_reference`` trains the whole model in one process with torch's AdamW and clip_grad_norm_;
``check_against_reference`` compares a parallel run's losses, clipped norms and every (tp-local)
parameter with it at about 1e-5 relative. ``LLAMA_KW`` turns the test GPT into a Llama-style one
(pass it as ``model_kw``).
"""
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.optim import _muon as torch_muon

from megazero.config import OptimizerConfig
from megazero.models.gpt import (
    GPT,
    GPTConfig,
    activation_shape,
    build_model_chunks,
    masked_mean,
)
from megazero.parallel.params import attribute, split_dim
from megazero.parallel.pipeline import run_schedule
from megazero.parallel.tensor import shard
from megazero.parallel.zero import build_engine
from megazero.parallel.zero.adamw import reference_param_groups

VOCAB, SEED, MICRO, MB_SIZE = 200, 4321, 4, 2
GPT_CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
               make_vocab_size_divisible_by=64)   # padded vocab 256 for tp 1 and 2: same full shapes
# Llama style: RoPE, RMSNorm, SwiGLU, 2 key/value groups for 4 heads (split at tp 2, replicated at
# tp 4), no biases, untied output; 8 layers so that pp 4 can interleave two chunks per rank.
LLAMA_KW = dict(num_layers=8, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                ffn_hidden_size=64, group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                untie_embeddings_and_output_weights=True)
# eps 1e-6: the key bias's gradient is analytically zero, i.e. layout-dependent rounding noise that
# eps=1e-8 would turn into lr-sized updates (see tests/test_gpt.py).
GPT_OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, clip_grad=0.3, adam_eps=1e-6)


def gpt_batches(steps: int, count: int):
    g = torch.Generator().manual_seed(11)
    s = GPT_CFG["seq_length"]
    return [[{"tokens": torch.randint(0, VOCAB, (MB_SIZE, s), generator=g),
              "labels": torch.randint(0, VOCAB, (MB_SIZE, s), generator=g),
              "loss_mask": (torch.rand(MB_SIZE, s, generator=g) > 0.2).float()} for _ in range(count)]
            for _ in range(steps)]


# --optimizer muon: the layers' matrices under Muon (torch.optim.Muon's defaults, Moonlight's lr scaling,
# Newton-Schulz in fp32), the rest under GPT_OPT's AdamW. MUON_BF16_OPT: Newton-Schulz in bf16 as torch.optim.Muon
# runs it, with clipping out of reach: bf16 rounding makes the orthogonalised update depend on every bit of its
# input, and torch's clip coefficient is rounded to fp32 where ours is not.
MUON_OPT = dataclasses.replace(GPT_OPT, optimizer="muon")
MUON_BF16_OPT = dataclasses.replace(MUON_OPT, muon_ns_dtype="bf16", clip_grad=1e9)
OPTIMIZERS = {"adamw": GPT_OPT, "muon": MUON_OPT, "muon_bf16": MUON_BF16_OPT}


def gpt_reference(steps: int, dp: int, model_kw: dict | None = None, decoupled_lr: float | None = None,
                  optimizer: str = "adamw", delayed: bool = False):
    """``decoupled_lr``: the embedding's and output layer's own learning rate (GPT_OPT's decoupled_lr);
    ``optimizer``: a key of OPTIMIZERS (Muon steps the layers' matrices with ``torch.optim.Muon``);
    ``delayed``: each step's (clipped) gradients are applied one step late, after the next step's backward,
    and the last step's after the loop (ZeRO-Offload's delayed parameter update)."""
    return _reference(steps, dp, tuple(sorted((model_kw or {}).items())), decoupled_lr, optimizer, delayed)


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration (``torch.optim._muon._zeropower_via_newtonschulz``) at full
    fp32 precision: its steps with the cast to bf16 left out (``--muon-ns-dtype fp32``)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class _Optimizers:
    """torch.optim.Muon (``ns_dtype``: its Newton-Schulz in bf16 as shipped, or in fp32) and AdamW stepped as
    one optimizer."""

    def __init__(self, muon, adamw, ns_dtype: str):
        self.opts, self.ns_dtype = (muon, adamw), ns_dtype

    def step(self):
        shipped = torch_muon._zeropower_via_newtonschulz
        if self.ns_dtype == "fp32":
            torch_muon._zeropower_via_newtonschulz = fp32_newton_schulz
        try:
            for opt in self.opts:
                opt.step()
        finally:
            torch_muon._zeropower_via_newtonschulz = shipped

    def zero_grad(self):
        for opt in self.opts:
            opt.zero_grad()


def reference_optimizer(model, decoupled_lr: float | None = None, optimizer: str = "adamw"):
    """torch's optimizers for the single-process reference: AdamW (``reference_param_groups``), or, for a
    Muon key of OPTIMIZERS, ``torch.optim.Muon`` over the ``layer_matrix`` parameters and AdamW over the rest."""
    cfg = OPTIMIZERS[optimizer]
    named = list(model.named_parameters())
    matrices = [p for _, p in named if cfg.muon and attribute(p, "layer_matrix")]
    rest = [(n, p) for n, p in named if not (cfg.muon and attribute(p, "layer_matrix"))]
    adamw = torch.optim.AdamW(reference_param_groups(rest, cfg.weight_decay, decoupled_lr), lr=cfg.lr,
                              eps=cfg.adam_eps, fused=cfg.muon or None)
    if not matrices:
        return adamw
    muon = torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                            nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr)
    return _Optimizers(muon, adamw, cfg.muon_ns_dtype)


@functools.lru_cache(maxsize=8)
def _reference(steps: int, dp: int, model_kw: tuple, decoupled_lr: float | None, optimizer: str, delayed: bool):
    model = GPT(GPTConfig(**{**GPT_CFG, **dict(model_kw)}), seed=SEED)
    opt = reference_optimizer(model, decoupled_lr, optimizer)
    clip = OPTIMIZERS[optimizer].clip_grad
    losses, norms, pending = [], [], None

    def step_with(grads):
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()

    for batches in gpt_batches(steps, dp * MICRO):
        total = 0.0
        for mb in batches:
            loss = masked_mean(model(mb["tokens"], mb["labels"]), mb["loss_mask"])
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        grads = [p.grad.clone() for p in model.parameters()]
        if not delayed:
            opt.step()
        elif pending is not None:
            step_with(pending)
        pending = grads
        opt.zero_grad()
        losses.append(total)
    if delayed and pending is not None:
        step_with(pending)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def trainer_steps(chunks, topo, engine, job, steps: int):
    """``steps`` steps of the trainer's ``train_step`` on this dp rank's MICRO micro-batches of
    :func:`gpt_batches` (each cut to this cp rank's slice of the sequence, as the data loader does):
    (losses, clipped norms, {name: (tp-local value, split dim)}) as :func:`check_against_reference`
    takes them."""
    from megazero.parallel.context_layout import rank_slice
    from megazero.parallel.params import split_dim
    from megazero.training import train_step

    losses, norms = [], []
    for batches in gpt_batches(steps, topo.dp_size * MICRO):
        mine = [{key: rank_slice(t, 1, topo.cp_rank, topo.cp_size) for key, t in batch.items()}
                for batch in batches[topo.dp_rank * MICRO:(topo.dp_rank + 1) * MICRO]]
        result = train_step(chunks, mine, topo, engine, job)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    with engine.gathered_parameters():
        params = {n: (p.detach().clone(), split_dim(p)) for c in chunks for n, p in c.named_parameters()}
    return losses, norms, params


def global_loss(losses, topo) -> float:
    t = torch.zeros(2)
    if topo.is_last_stage and topo.tp_rank == 0:
        t[0], t[1] = float(sum(x.item() for x in losses)), float(len(losses))
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def check_against_reference(results, steps: int, dp: int, model_kw: dict | None = None, param_atol: float = 1e-6,
                            decoupled_lr: float | None = None, optimizer: str = "adamw", rtol: float = 1e-5,
                            delayed: bool = False):
    """``param_atol``: the absolute floor for parameters. Adam normalises every update, so an element
    whose true gradient is ~0 moves by fp32 rounding noise of either sign, up to ~1% of an lr step.
    ``decoupled_lr``: the run gave the embedding and output layer that learning rate; ``optimizer``: the run's
    optimizer, a key of OPTIMIZERS; ``delayed``: against :func:`gpt_reference`'s delayed update."""
    ref_losses, ref_norms, ref_params = gpt_reference(steps, dp, model_kw, decoupled_lr, optimizer, delayed)
    if optimizer != "muon_bf16":
        assert max(ref_norms) > GPT_OPT.clip_grad, "clipping should be active in this test"
    seen = set()
    for tp_rank, tp, losses, norms, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=0)
        for name, (value, pdim) in params.items():
            expected = shard(ref_params[name], pdim, tp_rank, tp)
            torch.testing.assert_close(value, expected, rtol=rtol, atol=param_atol, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert seen == set(ref_params), f"parameters never compared: {set(ref_params) - seen}"


def engine_steps(topo, par, zero_cfg, steps: int, model_kw: dict | None = None, optimizer: str = "adamw"):
    """``steps`` steps of the test GPT (``model_kw`` on top of GPT_CFG) under OPTIMIZERS[optimizer] and
    ``zero_cfg`` on these ranks, driving the engine and the schedule directly: (what
    :func:`check_against_reference` takes for this rank, the engine; its byte log counts these steps only)."""
    chunks = build_model_chunks(GPTConfig(**{**GPT_CFG, **(model_kw or {})}), par, topo, seed=SEED)
    engine = build_engine(chunks, topo, zero_cfg, OPTIMIZERS[optimizer])
    engine.comm_log.reset()
    losses, norms = [], []
    for batches in gpt_batches(steps, topo.dp_size * MICRO):
        mine = batches[topo.dp_rank * MICRO:(topo.dp_rank + 1) * MICRO]
        engine.zero_grad()
        shape = activation_shape(chunks[0].cfg, MB_SIZE, topo.tp_size, par.sequence_parallel)
        out = run_schedule(chunks, mine, topo.pipeline(), loss_fn=masked_mean, loss_scale=engine.loss_scale,
                           grad_sync=engine, tensor_shape=shape)
        engine.finalize_grads()
        norm, skipped = engine.step()
        assert not skipped
        losses.append(global_loss(out, topo))
        norms.append(norm)
    with engine.gathered_parameters():
        params = {n: (p.detach().clone(), split_dim(p)) for c in chunks for n, p in c.named_parameters()}
    return (topo.tp_rank, topo.tp_size, losses, norms, params), engine
