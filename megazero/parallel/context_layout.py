"""Which positions of a sequence each context-parallel rank holds (pure tensor arithmetic, no process
group; used by the data slicing, the attention's gathers and ring attention's causal masks).

Causal load balancing: the sequence is cut into 2 cp chunks and cp rank r holds chunks r and 2cp-1-r,
so every rank has as many early (cheap) as late (expensive) query positions. seq 16, cp 2::

    chunk:   0       1       2       3
    rank:    0       1       1       0        rank 0: positions 0-3 and 12-15; rank 1: 4-11
"""
from __future__ import annotations

import torch


def rank_positions(seq_length: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The positions (int64) of cp rank ``cp_rank``'s tokens in a sequence of ``seq_length``: chunk
    ``cp_rank`` then chunk ``2cp-1-cp_rank`` of ``2 cp``."""
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x cp = {2 * cp}")
    c = seq_length // (2 * cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def rank_slice(t: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """cp rank ``cp_rank``'s part of the whole-sequence tensor ``t`` (the sequence along ``dim``)."""
    if cp == 1:
        return t
    return t.index_select(dim, rank_positions(t.shape[dim], cp_rank, cp, t.device)).contiguous()


def unslice(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every cp rank's part (``parts[r]`` of rank r): the inverse of :func:`rank_slice`."""
    cp = len(parts)
    order = gathered_order(parts[0].shape[dim] * cp, cp, parts[0].device)
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


def gathered_order(seq_length: int, cp: int, device=None) -> torch.Tensor:
    """Positions of the rows of the cp ranks' parts concatenated in rank order."""
    return torch.cat([rank_positions(seq_length, r, cp, device) for r in range(cp)])
