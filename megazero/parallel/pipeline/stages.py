"""Which pipeline rank holds which layers: the stage split, pure arithmetic (no model, no groups).

Which rank holds which layers. ``pp`` ranks, each with ``v`` model chunks (``v = 1`` without the
interleaved schedule), split ``L`` layers into ``pp * v`` *virtual stages* of ``L / (pp * v)`` layers.
Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r`` (Narayanan et al. 2021): the
activations visit rank 0, 1, ..., pp-1, then rank 0 again with its next chunk. Worked example,
``L = 8``, ``pp = 2``::

    v = 1:   rank 0 -> layers 0-3 (+ embedding)       rank 1 -> layers 4-7 (+ final norm, output, loss)
    v = 2:   rank 0 chunk 0 -> layers 0-1 (+ embedding)   rank 1 chunk 0 -> layers 2-3
             rank 0 chunk 1 -> layers 4-5                 rank 1 chunk 1 -> layers 6-7 (+ final norm, ...)

The first virtual stage owns the input side of the model (``pre_process``: the embedding), the
last the output side and the loss (``post_process``). What a model builds for each chunk is the
model's business (:func:`megazero.models.gpt.build_model_chunks`); with tied embeddings the last
stage holds a copy of the word embedding whose gradient the ZeRO engine sums with the first
stage's over ``topo.embedding_group`` (:meth:`megazero.parallel.zero.BucketedGradSync.finalize_grads`).
"""
from __future__ import annotations


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
