"""One error for every rank: after a collective step (a load, a save) that failed on some ranks, every
rank raises the same one-line :class:`CheckpointError`, the first failing rank's own message (the
one naming the file), so the rank that prints (rank 0) prints what actually went wrong.

    try:
        ...                                   # this rank's part
    except Exception as e:  # noqa: BLE001
        error = e
    raise_first_error(error)                  # collective: every rank calls it
"""
from __future__ import annotations

import torch.distributed as dist

from megazero.errors import CheckpointError

# What a rank says when it failed only because another one did (the save path's agreement).
SECONDHAND = "failed on another rank"


def one_line(error: BaseException) -> str:
    """The error's first line (its type when it has no text)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def raise_first_error(error: BaseException | None) -> None:
    """Collective over the default group: if any rank's ``error`` is not None, raise on every rank a
    :class:`CheckpointError` with the first failing rank's message (``rank N: ...`` when there are
    several ranks), preferring a rank's own error to one that only reports another rank's failure."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = None if error is None else one_line(error)
    if world == 1:
        messages = [mine]
    else:
        messages = [None] * world
        dist.all_gather_object(messages, mine)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    own = [(r, m) for r, m in failed if SECONDHAND not in m]
    rank, message = (own or failed)[0]
    raise CheckpointError(message if world == 1 else f"rank {rank}: {message}") from error
