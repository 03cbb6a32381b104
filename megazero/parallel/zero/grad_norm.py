"""The squared L2 norm of a range of gradients, accurate whatever way a layout cuts the ranges (the global
gradient norm is the square root of their sum over ranks: :meth:`BucketAdamW.grad_norm`)."""
from __future__ import annotations

import torch

NORM_ROW = 1 << 14


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """float64 squared L2 norm of the flat tensor ``t``, from the norms of its rows of :data:`NORM_ROW`
    elements (one kernel, plus one for the tail). A float32 norm over one long range loses ~1e-5 relative
    on CPU (3e-6 at 400k elements, against 4e-9 in rows), so a layout that cuts the gradients into other
    ranges would see another norm: the layout fuzzer's draws 11, 23 and 2023 (1.2e-5 apart)."""
    return squared_norms([t])[0]


def squared_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`squared_norm` of each flat tensor (all on one device) in few kernels: each tensor's row norms (and
    its tail's), one cast to float64 and one square for all of them together (not one of each per tensor), then
    each tensor's sum of its squares. With a gradient bucket per large matrix that is two to four kernels a
    bucket fewer in every step."""
    pieces, spans = [], []
    for t in tensors:
        t = t.reshape(-1)
        whole = t.numel() // NORM_ROW * NORM_ROW
        rows = torch.linalg.vector_norm(t[:whole].view(-1, NORM_ROW), dim=1) if whole else None
        tail = torch.linalg.vector_norm(t[whole:]).reshape(1) if whole < t.numel() else None
        spans.append((rows.numel() if rows is not None else 0, tail is not None, t.device))
        pieces += [p for p in (rows, tail) if p is not None]
    if not pieces:
        return [torch.zeros((), dtype=torch.float64, device=t.device) for t in tensors]
    squares = torch.cat(pieces).double().square()
    out, at = [], 0
    for n_rows, has_tail, device in spans:
        sq = squares[at:at + n_rows].sum() if n_rows else None
        at += n_rows
        if has_tail:
            sq = squares[at] if sq is None else sq + squares[at]
            at += 1
        out.append(sq if sq is not None else torch.zeros((), dtype=torch.float64, device=device))
    return out
