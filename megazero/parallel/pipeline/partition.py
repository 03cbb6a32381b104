"""Which pipeline rank holds which layers: the stage split, pure arithmetic (no model, no groups).
 ``pp`` ranks, each with ``v`` model chunks (``v = 1`` without the
interleaved schedule), split ``L`` layers into ``pp * v`` *virtual stages* of ``L / (pp * v)`` layers.
Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r`` (Narayanan et al. 2021): the
activations visit rank 0, 1, ..., pp-1, then rank 0 again with its next chunk. Worked example,
``L = 8``, ``pp = 2``::

    v = 1:   rank 0 -> layers 0-3 (+ embedding)       rank 1 -> layers 4-7 (+ final norm, output, loss)
    v = 2:   rank 0 chunk 0 -> layers 0-1 (+ embedding)   rank 1 chunk 0 -> layers 2-3
             rank 0 chunk 1 -> layers 4-5                 rank 1 chunk 1 -> layers 6-7 (+ final norm, ...)

The first virtual stage owns the input side of the model (``pre_process``: the embedding), the
last the output side and the loss (``post_process``). A :class:`StagePlacement` says all of that for
one chunk; what a model builds for it is the model spec's business (``ModelSpec.build_chunk``). With
tied embeddings the last stage holds a copy of the word embedding whose gradient the ZeRO engine sums
with the first stage's over the pipeline's embedding group (``PipelineLayout.embedding``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlacement:
    """The part of the model one chunk holds: its global layer indices, and whether it is the first
    virtual stage (``pre_process``: the input side) and/or the last (``post_process``: the output side
    and the loss). ``whole(L)`` is a single process's model."""

    layer_ids: tuple[int, ...]
    pre_process: bool = True
    post_process: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> "StagePlacement":
        return cls(tuple(range(num_layers)))


def placements(num_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[StagePlacement]:
    """The placements of pipeline rank ``pp_rank``'s ``virtual_stages`` chunks (chunk c is virtual stage
    ``c * pp + pp_rank``).

    >>> [p.layer_ids for p in placements(8, pp=2, pp_rank=1, virtual_stages=2)]
    [(2, 3), (6, 7)]
    """
    return [StagePlacement(tuple(stage_layer_ids(num_layers, pp, pp_rank, virtual_stages, c)),
                           is_first_virtual_stage(pp_rank, c), is_last_virtual_stage(pp_rank, pp, c, virtual_stages))
            for c in range(virtual_stages)]


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
