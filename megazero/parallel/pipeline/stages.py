"""Splitting the GPT into pipeline stages, and keeping the tied embedding in sync across them.

Which rank holds which layers. ``pp`` ranks, each with ``v`` model chunks (``v = 1`` without the
interleaved schedule), split ``L`` layers into ``pp * v`` *virtual stages* of ``L / (pp * v)`` layers.
Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r`` (Narayanan et al. 2021): the
activations visit rank 0, 1, ..., pp-1, then rank 0 again with its next chunk. Worked example,
``L = 8``, ``pp = 2``::

    v = 1:   rank 0 -> layers 0-3 (+ embedding)       rank 1 -> layers 4-7 (+ final norm, output, loss)
    v = 2:   rank 0 chunk 0 -> layers 0-1 (+ embedding)   rank 1 chunk 0 -> layers 2-3
             rank 0 chunk 1 -> layers 4-5                 rank 1 chunk 1 -> layers 6-7 (+ final norm, ...)

The first virtual stage owns the embedding (``pre_process``), the last the final norm, the output
layer and the loss (``post_process``). With tied embeddings the last stage still owns a parameter
``embedding.word_embeddings.weight`` initialised from the same seed as the first stage's; the two
copies stay equal because their gradients are summed over ``topo.embedding_group`` every step
(:func:`sync_tied_embedding_grads`) and both ranks apply the same optimizer update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def stage_layer_ids(num_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1,
                    chunk: int = 0) -> list[int]:
    """Global indices of the transformer layers held by chunk ``chunk`` of pipeline rank ``pp_rank``.

    >>> stage_layer_ids(8, pp=2, pp_rank=1)
    [4, 5, 6, 7]
    >>> stage_layer_ids(8, pp=2, pp_rank=1, virtual_stages=2, chunk=0)
    [2, 3]
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is outside [0, {pp})")
    if not 0 <= chunk < virtual_stages:
        raise ValueError(f"chunk {chunk} is outside [0, {virtual_stages}) model chunks")
    stages = pp * virtual_stages
    if num_layers % stages:
        raise ValueError(f"--num-layers {num_layers} is not divisible by pp {pp} * virtual stages "
                         f"{virtual_stages} = {stages}: every virtual stage needs the same layer count")
    per_stage = num_layers // stages
    first = (chunk * pp + pp_rank) * per_stage
    return list(range(first, first + per_stage))


def is_first_virtual_stage(pp_rank: int, chunk: int) -> bool:
    """True for the chunk that holds the embedding (chunk 0 of pipeline rank 0)."""
    return pp_rank == 0 and chunk == 0


def is_last_virtual_stage(pp_rank: int, pp: int, chunk: int, virtual_stages: int) -> bool:
    """True for the chunk that holds the final norm, output layer and loss."""
    return pp_rank == pp - 1 and chunk == virtual_stages - 1


def build_model_chunks(model_cfg, parallel_cfg, topo, seed: int = 1234,
                       dtype: torch.dtype = torch.float32) -> list:
    """The ``v`` GPT chunks this rank runs (``v = parallel_cfg.virtual_stages``, 1 unless interleaved).

    Each chunk is a :class:`megazero.models.gpt.GPT` holding only its layers; parameter names are the
    full model's (``layers.5.mlp...``), so checkpoints and comparisons do not depend on the layout.
    ``parallel_cfg`` should have been through :func:`megazero.config.validate` (it derives
    ``virtual_stages`` from --num-layers-per-virtual-pipeline-stage).
    """
    from megazero.models.gpt import GPT

    if parallel_cfg.pp != topo.pp_size or parallel_cfg.tp != topo.tp_size:
        raise ValueError(f"parallel config (tp {parallel_cfg.tp}, pp {parallel_cfg.pp}) does not match the "
                         f"topology (tp {topo.tp_size}, pp {topo.pp_size}): build both from the same config")
    v = parallel_cfg.virtual_stages
    chunks = []
    for c in range(v):
        chunks.append(GPT(model_cfg, topo, sequence_parallel=parallel_cfg.sequence_parallel,
                          layer_ids=stage_layer_ids(model_cfg.num_layers, topo.pp_size, topo.pp_rank, v, c),
                          pre_process=is_first_virtual_stage(topo.pp_rank, c),
                          post_process=is_last_virtual_stage(topo.pp_rank, topo.pp_size, c, v),
                          seed=seed, dtype=dtype, device=topo.device))
    return chunks


def activation_shape(model_cfg, micro_batch_size: int, tp: int = 1,
                     sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the tensor passed between stages: ``[s, b, h]``, or ``[s / tp, b, h]`` under sequence
    parallelism (each tp rank sends its own sequence chunk to the same tp rank of the next stage)."""
    seq = model_cfg.seq_length
    if sequence_parallel and tp > 1:
        if seq % tp:
            raise ValueError(f"--sequence-parallel needs --seq-length {seq} divisible by tp {tp}")
        seq //= tp
    return (seq, micro_batch_size, model_cfg.hidden_size)


def shared_embedding_params(chunks) -> list[torch.nn.Parameter]:
    """The parameters marked ``shared_embedding`` (the tied word embedding) in this rank's chunks."""
    return [p for chunk in chunks for p in chunk.parameters() if getattr(p, "shared_embedding", False)]


def sync_tied_embedding_grads(chunks, topo) -> None:
    """Sum the tied word-embedding gradient of the first and last pipeline stage.

    The word embedding is used twice: as the input embedding on the first stage and as the output
    layer on the last. Each stage's copy only sees its own use, so after the backward passes the
    two gradients are all-reduced over ``topo.embedding_group`` (e.g. ranks {0, 3} for pp=4); both
    copies then take the same optimizer step and stay identical. A no-op with pp=1 (one copy,
    autograd already sums the two uses), on middle stages and for untied models. Uses
    ``p.main_grad`` when a data-parallel wrapper keeps gradients there, else ``p.grad``.
    """
    if topo.pp_size == 1 or not (topo.is_first_stage or topo.is_last_stage):
        return
    params = shared_embedding_params(chunks)
    if len(params) > 1:
        raise RuntimeError(f"found {len(params)} shared_embedding parameters on pipeline rank "
                           f"{topo.pp_rank}; expected one (first or last stage of a tied model)")
    for p in params:
        grad = getattr(p, "main_grad", None)
        if grad is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
        dist.all_reduce(grad, group=topo.embedding_group)
