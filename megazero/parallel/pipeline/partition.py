"""Which pipeline rank holds which layers: the stage split, pure arithmetic (no model, no groups).
 ``pp`` ranks, each with ``v`` model chunks (``v = 1`` without the
interleaved schedule), split ``L`` layers into ``pp * v`` *virtual stages* of ``L / (pp * v)`` layers.

Two shapes place the virtual stages on the ranks. ``LOOP`` (interleaved 1F1B, Narayanan et al.
2021): chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r``, so the activations visit
rank 0, 1, ..., pp-1, then rank 0 again with its next chunk (a ring). ``V`` (ZB-V, Qi et al. 2024):
even chunks run down the ranks and odd chunks back up, chunk ``c`` of rank ``r`` being virtual stage
``c * pp + r`` for even ``c`` and ``c * pp + pp - 1 - r`` for odd ``c``; rank 0 then holds the first
and the last stage, and the turn at rank pp-1 (its chunk 0 feeds its own chunk 1) is a local
hand-off, no message. Worked example, ``L = 8``, ``pp = 2``::

    v = 1:   rank 0 -> layers 0-3 (+ embedding)       rank 1 -> layers 4-7 (+ final norm, output, loss)
    v = 2:   rank 0 chunk 0 -> layers 0-1 (+ embedding)   rank 1 chunk 0 -> layers 2-3
             rank 0 chunk 1 -> layers 4-5                 rank 1 chunk 1 -> layers 6-7 (+ final norm, ...)
    V:       rank 0 chunk 0 -> layers 0-1 (+ embedding)   rank 1 chunk 0 -> layers 2-3
             rank 0 chunk 1 -> layers 6-7 (+ final norm, ...)  rank 1 chunk 1 -> layers 4-5

The layers keep their global indices in every shape (parameter names ``layers.<i>...``), so a
checkpoint written by one shape loads in any other, or at pp = 1.

The first virtual stage owns the input side of the model (``pre_process``: the embedding), the
last the output side and the loss (``post_process``). A :class:`StagePlacement` says all of that for
one chunk; what a model builds for it is the model spec's business (``ModelSpec.build_chunk``). With
tied embeddings the last stage holds a copy of the word embedding whose gradient the ZeRO engine sums
with the first stage's over the pipeline's embedding group (``PipelineLayout.embedding``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config import FLAG

LOOP, V = "loop", "v"
SHAPES = (LOOP, V)


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


def placements(num_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1,
               shape: str = LOOP) -> list[StagePlacement]:
    """The placements of pipeline rank ``pp_rank``'s ``virtual_stages`` chunks (chunk c is virtual stage
    :func:`virtual_stage` ``(pp_rank, c)`` of the ``shape``).

    >>> [p.layer_ids for p in placements(8, pp=2, pp_rank=1, virtual_stages=2)]
    [(2, 3), (6, 7)]
    >>> [p.layer_ids for p in placements(8, pp=2, pp_rank=1, virtual_stages=2, shape=V)]
    [(2, 3), (4, 5)]
    """
    return [StagePlacement(tuple(stage_layer_ids(num_layers, pp, pp_rank, virtual_stages, c, shape)),
                           is_first_virtual_stage(pp_rank, c),
                           is_last_virtual_stage(pp_rank, pp, c, virtual_stages, shape))
            for c in range(virtual_stages)]


def virtual_stage(pp_rank: int, pp: int, chunk: int, shape: str = LOOP) -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``pp_rank`` runs (module docstring).

    >>> [virtual_stage(r, 4, c, V) for c in range(2) for r in range(4)]
    [0, 1, 2, 3, 7, 6, 5, 4]
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown stage shape {shape!r}: one of {SHAPES}")
    if shape == V and chunk % 2:
        return chunk * pp + pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_position(stage: int, pp: int, shape: str = LOOP) -> tuple[int, int]:
    """(pipeline rank, chunk) that runs virtual stage ``stage``: the inverse of :func:`virtual_stage`."""
    chunk, k = divmod(stage, pp)
    return (pp - 1 - k if shape == V and chunk % 2 else k), chunk


def runs_backwards(chunk: int, shape: str = LOOP) -> bool:
    """True when chunk ``chunk``'s next virtual stage is on the previous pipeline rank (the odd chunks
    of the V): its "send to the next stage" goes to the previous rank and vice versa."""
    return shape == V and chunk % 2 == 1


def stage_layer_ids(num_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1,
                    chunk: int = 0, shape: str = LOOP) -> list[int]:
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
        raise ValueError(f"{FLAG.num_layers} {num_layers} is not divisible by pp {pp} * virtual stages "
                         f"{virtual_stages} = {stages}: every virtual stage needs the same layer count")
    per_stage = num_layers // stages
    first = virtual_stage(pp_rank, pp, chunk, shape) * per_stage
    return list(range(first, first + per_stage))


def is_first_virtual_stage(pp_rank: int, chunk: int) -> bool:
    """True for the chunk that holds the embedding (chunk 0 of pipeline rank 0)."""
    return pp_rank == 0 and chunk == 0


def is_last_virtual_stage(pp_rank: int, pp: int, chunk: int, virtual_stages: int, shape: str = LOOP) -> bool:
    """True for the chunk that holds the final norm, output layer and loss (rank 0's last chunk in the V)."""
    return chunk == virtual_stages - 1 and virtual_stage(pp_rank, pp, chunk, shape) == pp * virtual_stages - 1
