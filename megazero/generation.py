"""Text generation with a single-process model: greedy decoding, top-k and nucleus (top-p) sampling, and
the whole model of a distributed run gathered on rank 0 to generate from (:func:`gather_full_model`).

    model, job = build_full_model("checkpoints/")        # megazero.checkpoint.offline
    new_ids = generate(model, tokenizer.tokenize("Hello"), 20)                  # greedy
    new_ids = generate(model, prompt_ids, 20, top_k=40, top_p=0.9, temperature=0.8,
                       generator=torch.Generator().manual_seed(0))             # sampling

With a KV cache (the default) the prompt is run once and every new token costs one position: each
layer keeps the keys and values of the tokens before it (:mod:`megazero.spec.kv_cache`). Without
one (``use_cache=False``) every new token re-runs the model over the whole context. Both give the
same tokens. Once the context outgrows ``max_position_embeddings`` the model sees the last that many
tokens; the cache is then refilled from that window at every step, which is what the cache-free
path computes.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from megazero.config import JobConfig
from megazero.parallel.params import split_dim
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.spec import get_model_spec
from megazero.spec.kv_cache import KVCache


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the ``top_k`` largest and outside the smallest set of tokens
    whose probabilities sum to at least ``top_p`` (the most likely token always survives).

    >>> filter_logits(torch.tensor([1.0, 3.0, 2.0]), top_k=2)
    tensor([-inf, 3., 2.])
    """
    logits = logits.clone()
    if top_k:
        k = min(int(top_k), logits.numel())
        kth = torch.topk(logits, k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p     # mass before this token already >= p
        drop[0] = False
        logits[order[drop]] = float("-inf")
    return logits


def next_token(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
               temperature: float = 1.0, generator: torch.Generator | None = None) -> int:
    """Greedy (argmax) unless ``top_k`` or ``top_p`` is given, then a sample from the filtered,
    temperature-scaled distribution. ``top_k=0`` samples from the whole vocabulary."""
    if (top_k is None and top_p is None) or temperature == 0.0:
        return int(torch.argmax(logits))
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, *, top_k: int | None = None,
             top_p: float | None = None, temperature: float = 1.0, generator: torch.Generator | None = None,
             eos_id: int | None = None, use_cache: bool = True) -> list[int]:
    """The ``max_new_tokens`` token ids that follow ``prompt_ids`` (fewer if ``eos_id`` is produced;
    it is included). ``model`` is a whole GPT on one process (tp=1, all layers); its training mode
    is restored afterwards. Greedy unless ``top_k``/``top_p`` is given (see :func:`next_token`)."""
    if getattr(model, "ctx", None) is not None and model.ctx.tp_size != 1:
        raise ValueError("generate needs a single-process model (tp=1): build it with "
                         "megazero.checkpoint.offline.build_full_model")
    if not (model.pre_process and model.post_process) or len(model.layer_ids) != model.cfg.num_layers:
        raise ValueError("generate needs the whole model (all layers, embedding and output), not a pipeline stage")
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token id")
    vocab = model.cfg.vocab_size
    if max(ids) >= vocab or min(ids) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
    was_training = model.training
    model.eval()
    step = _cached_step(model) if use_cache else _full_step(model)
    try:
        for _ in range(max_new_tokens):
            logits = step(ids)[:vocab]
            ids.append(next_token(logits, top_k=top_k, top_p=top_p, temperature=temperature, generator=generator))
            if eos_id is not None and ids[-1] == eos_id:
                break
    finally:
        model.train(was_training)
    return ids[len(prompt_ids):]


def _full_step(model):
    """ids -> the next token's logits, running the model over the last ``max_position_embeddings`` ids."""
    device, window = next(model.parameters()).device, model.cfg.max_position_embeddings

    def step(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids[-window:]], dtype=torch.long, device=device))[0, -1]
    return step


def _cached_step(model):
    """ids -> the next token's logits, running the model only over the ids the cache has not seen."""
    device, window = next(model.parameters()).device, model.cfg.max_position_embeddings
    cache = KVCache(window)

    def step(ids: list[int]) -> torch.Tensor:
        if len(ids) > window:                  # sliding window: positions shift, so refill from scratch
            cache.reset()
            new = ids[-window:]
        else:
            new = ids[cache.length:]
        return model(torch.tensor([new], dtype=torch.long, device=device), kv_cache=cache)[0, -1]
    return step


@torch.no_grad()
def gather_full_model(chunks, topo: Topology, job: JobConfig, engine=None) -> torch.nn.Module | None:
    """A single-process (tp = pp = 1) model with the trained weights (the spec's ``build_full``), on
    global rank 0; None elsewhere.

    Every rank takes part: tp shards are gathered within each tp group, then the first dp replica's
    tp rank 0 of every pipeline stage sends its tensors to rank 0 (and, with expert parallelism, the
    other members of the first ep group in its dp x cp group their experts: the parameters the spec's
    ``is_expert`` names). Under ZeRO stage 3 the engine's ``gathered_parameters()`` materialises the
    shards first; the tensors taken are copies, not views of the gathered buffers it releases after.
    """
    spec = get_model_spec(job.model.model_family)
    with engine.gathered_parameters() if engine is not None else nullcontext():
        local = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                local[name] = gather_full(p.detach(), split_dim(p), topo.tp_group).to("cpu", torch.float32, copy=True)
    # Experts are carved from dp x cp in consecutive blocks of ep: members 0..ep-1 of the dp x cp group hold
    # one copy of every expert (member 0 the dense weights too). E.g. dp 2 x cp 2, ep 2: members 0, 1.
    member, mine = topo.data_context_parallel().rank, {}
    if topo.tp_rank == 0 and member < topo.ep_size:
        mine = {n: t for n, t in local.items() if member == 0 or spec.is_expert(n)}
    everything = [None] * topo.world_size if topo.rank == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if topo.rank != 0:
        return None
    model = spec.build_full(job.model, seed=job.train.seed)
    state = {}
    for part in everything:
        state.update(part)
    for name, p in model.named_parameters():      # the padded vocab differs between tp sizes
        src = state[name]
        if src.shape != p.shape:
            rows = min(src.shape[0], p.shape[0])
            src = torch.cat([src[:rows], src.new_zeros((p.shape[0] - rows,) + tuple(src.shape[1:]))])
        p.copy_(src)
    return model.eval()


@torch.no_grad()
def greedy_continuation(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The next ``max_new_tokens`` ids a single-process model predicts greedily after ``prompt_ids``
    (:func:`megazero.generation.generate`, which also samples with top-k / top-p)."""
    return generate(model, prompt_ids, max_new_tokens)
