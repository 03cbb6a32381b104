"""A checkpoint is written only from finite state: the check run over what a save is about to write.

Every rank looks at the pieces it writes (weights in the run's precision, fp32 master weights, Adam
moments; :func:`megazero.checkpoint.distributed.rank_pieces`), one flag per rank is all-reduced, and
only when some rank found a non-finite value are the ranks' findings gathered -- as fixed-size UTF-8
byte tensors, nothing pickled -- so every rank knows the first one in rank order::

    bad = first_over_ranks(first_nonfinite(pieces), topo.device)
    # "layers.0.mlp.dense_4h_to_h.weight (fp16 weights, rank 1)" or None

The same two helpers name the parameter whose fp16/bf16 copy overflowed after an applied step
(:func:`megazero.checkpoint.distributed.first_nonfinite_weight`, which the training loop's
:func:`megazero.training.stop_reason` asks). :func:`nonfinite_names` and :func:`listed` name every
non-finite tensor of what comes in: an HF model imported, a checkpoint's pieces a rank loaded.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.checkpoint import format as fmt

_WHAT = {fmt.MODEL: "weights", fmt.MASTER: "master weights", fmt.EXP_AVG: "Adam exp_avg",
         fmt.EXP_AVG_SQ: "Adam exp_avg_sq"}
_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
_TEXT_BYTES = 512            # one finding per rank: a parameter name and what it is, or an error's first line


def describe(key: str, dtype: torch.dtype) -> str:
    """``"layers.0.attention.dense.weight (fp16 weights)"`` for a checkpoint key and the piece's dtype."""
    kind, _, name = key.partition("/")
    return f"{name} ({_DTYPE.get(dtype, str(dtype))} {_WHAT.get(kind, kind)})"


def maybe_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool, True when ``t`` may hold a non-finite value: its sum (fp32 or wider) is not finite.
    Never False for a tensor holding one (inf and nan survive a sum); True for finite values only when
    their sum overflows, so a True needs :func:`torch.isfinite` to confirm. A sum is ~10x faster than
    ``isfinite(t).all()`` on a CPU (28 vs 240 ms for 94M fp32 elements)."""
    return ~torch.isfinite(t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum())


def first_nonfinite(pieces) -> str | None:
    """What the first of this rank's pieces ``[(key, shape, box, (a, b), tensor)]`` holding a non-finite
    value is (:func:`describe`), or None. One host sync when all are finite (the usual case)."""
    floats = [(key, t) for key, _, _, _, t in pieces if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    bad = torch.zeros((), dtype=torch.int32, device=floats[0][1].device)
    for _, t in floats:
        bad += maybe_nonfinite(t).to(bad.device)
    if not bad.item():
        return None
    return next((describe(key, t.dtype) for key, t in floats if not bool(torch.isfinite(t).all())), None)


def nonfinite_names(named_tensors) -> list[str]:
    """The names, in order, of the floating-point tensors among ``[(name, tensor)]`` that hold a NaN or
    an inf. One host sync when all are finite (the usual case)."""
    floats = [(name, t) for name, t in named_tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return []
    bad = torch.zeros((), dtype=torch.int32, device=floats[0][1].device)
    for _, t in floats:
        bad += maybe_nonfinite(t).to(bad.device)
    if not bad.item():
        return []
    return [name for name, t in floats if not bool(torch.isfinite(t).all())]


def listed(names: list[str], shown: int = 3) -> str:
    """``"2 tensors (a, b)"`` or ``"5 tensors (a, b, c, ...)"``: how many, and the first few by name."""
    more = ", ..." if len(names) > shown else ""
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} ({', '.join(names[:shown])}{more})"


def first_over_ranks(text: str | None, device, group=None) -> str | None:
    """The first non-None ``text`` over the ranks of ``group`` (default: the world), in rank order, with
    ``", rank N"`` added inside its closing parenthesis (or after it); None when every rank passed None.

    A collective: a flag all-reduce, and only when a rank has something to say an all-gather of
    fixed-size byte tensors (a long text is cut at 512 bytes)."""
    if not dist.is_initialized():
        return text
    flag = torch.tensor([0 if text is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return None
    mine = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    if text is not None:
        data = text.encode()[:_TEXT_BYTES]
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.to(device), group=group)
    for rank, t in enumerate(everyone):
        raw = bytes(t.cpu().tolist()).rstrip(b"\0")
        if raw:
            found = raw.decode(errors="replace")
            global_rank = dist.get_global_rank(group, rank) if group is not None else rank
            if found.endswith(")"):
                return f"{found[:-1]}, rank {global_rank})"
            return f"{found} (rank {global_rank})"
    return None
