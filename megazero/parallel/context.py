"""Context parallelism: each sequence split over the cp ranks of a :class:`ContextParallel` group.

Layout (causal load balancing, as Megatron-core and torchtitan do it). A sequence of ``S`` tokens is cut
into ``2 * cp`` equal chunks of ``c = S / (2 cp)``; cp rank ``r`` holds chunks ``r`` and ``2cp-1-r``, one
early and one late, so that under the causal mask every rank attends to the same number of keys.
Worked example, S = 16, cp = 2 (chunks of 4)::

    cp rank 0: positions 0-3 and 12-15        cp rank 1: positions 4-7 and 8-11

The data loader hands each cp rank its slice of the same samples
(:func:`~megazero.parallel.context_layout.rank_slice`; tokens, labels and loss mask alike), the model's
positions (learned or RoPE) are :func:`~megazero.parallel.context_layout.rank_positions`, and each rank's
loss is its share ``sum(loss * mask over its slice) / sum(mask over the whole sequence)``
(:func:`context_parallel_loss`), so the shares add up to the sequence's masked mean and the gradients,
summed over dp x cp and divided by dp, are the serial ones.

Attention (``--cp-comm-type``), each rank holding its queries, keys and values ``[S/cp, b, heads, d]``:

==========  =====================================================  ==========================================
type        what moves                                             per rank, per layer, forward (keys+values)
==========  =====================================================  ==========================================
allgather   keys/values all-gathered once (backward:               (cp - 1) / cp x the whole sequence's K/V;
            reduce-scatter of their gradients), then each rank     backward the same for their gradients
            attends its two chunks to the prefix they see
p2p         ring: K/V blocks passed to the next rank cp - 1 times, (cp - 1) / cp x the whole sequence's K/V,
            overlapped with the block's computation; online       sent in cp - 1 steps behind compute;
            softmax merge; backward passes K/V and their          backward (2cp - 1) / cp x K/V (K/V again,
            gradients around the ring (:mod:`.ring_attention`)    then dK/dV home in cp hops)
a2a         Ulysses: all-to-all from sequence-split to head-split  (cp - 1) / cp of this rank's Q, K, V and
            (each rank: the whole sequence, heads / cp heads),     of the output: 4 small all-to-alls
            causal attention, all-to-all back
==========  =====================================================  ==========================================
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.config import FLAG
from megazero.parallel import counted_comm
from megazero.parallel.context_layout import gathered_order
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.groups import ContextParallel
from megazero.parallel.ring_attention import ring_attention
from megazero.parallel.tensor import gather_from_sequence_parallel_region

# F.scaled_dot_product_attention shares key/value heads between query heads itself from torch 2.5.
_SDPA_GROUPED = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def grouped_key_values(k: torch.Tensor, v: torch.Tensor, heads: int, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/values [b, kv_heads, s, d] ready for ``F.scaled_dot_product_attention`` with ``heads`` query
    heads: shared by SDPA itself from torch 2.5 (``enable_gqa`` set in ``kw``), repeated before."""
    if k.shape[1] == heads:
        return k, v
    if _SDPA_GROUPED:
        kw["enable_gqa"] = True
        return k, v
    return tuple(t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))


# ---------------------------------------------------------------------------------------------- layout
# ---------------------------------------------------------------------------------------------- loss
def context_parallel_loss(loss_fn: Callable, cp: ContextParallel) -> Callable:
    """``loss_fn(per_token_loss, loss_mask)`` (a masked mean over the tokens it is given) turned into this
    cp rank's share of the whole sequence's: its masked mean times its share of the masked tokens, the
    token counts summed over cp (a small all-reduce per micro-batch). ``loss_fn`` itself at cp 1."""
    if cp.size == 1:
        return loss_fn

    def share(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        mine = loss_mask.sum().to(torch.float32)
        total = mine.clone()
        dist.all_reduce(total, group=cp.group)
        return loss_fn(per_token_loss, loss_mask) * (mine / total.clamp(min=1e-30)).to(per_token_loss.dtype)

    return share


# ---------------------------------------------------------------------------------------------- attention
def context_parallel_attention(q, k, v, cp: ContextParallel, comm_type: str,
                               log: CommLog | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries ``q`` [S/cp, b, heads, d] over the whole sequence's keys
    and values, of which this rank holds ``k``, ``v`` [S/cp, b, kv_heads, d] (the load-balanced layout,
    after RoPE); returns [S/cp, b, heads, d]. ``comm_type``: see the module docstring. The bytes this rank
    sends, forward and backward, are recorded in ``log`` under the tag "cp" (the table's column)."""
    if comm_type == "allgather":
        return allgather_attention(q, k, v, cp, log)
    if comm_type == "p2p":

        return ring_attention(q, k, v, cp, log)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, cp, log)
    raise ValueError(f"{FLAG.cp_comm_type} {comm_type!r} is not built (allgather, p2p, a2a)")


def sdpa(q, k, v, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on sequence-first tensors: q [sq, b, heads, d], k/v
    [sk, b, kv_heads, d] (kv_heads divides heads), ``mask`` [sq, sk] bool (True: attend) -> [sq, b, heads, d]."""
    heads = q.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kw = dict(attn_mask=mask) if mask is not None else dict(is_causal=causal)
    k, v = grouped_key_values(k, v, heads, kw)
    return F.scaled_dot_product_attention(q, k, v, **kw).permute(2, 0, 1, 3)


class _CountBothWays(torch.autograd.Function):
    """Identity on ``x`` that records ``nbytes`` under "cp" in ``log`` forward, and again backward (the
    gradient's collective mirrors the forward's: an all-gather's is a reduce-scatter of the same size)."""
    @staticmethod
    def forward(ctx, x, log: CommLog, nbytes: float, group):
        ctx.log, ctx.nbytes, ctx.group = log, nbytes, group
        log.record("cp", nbytes, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.record("cp", ctx.nbytes, ctx.group)
        return grad, None, None, None


def _gather_sequence(x: torch.Tensor, cp: ContextParallel, log: CommLog | None) -> torch.Tensor:
    """Every cp rank's ``x`` concatenated in rank order (backward: the gradient reduce-scattered), counted."""
    out = gather_from_sequence_parallel_region(x, cp.group)
    if log is not None:
        out = _CountBothWays.apply(out, log, (cp.size - 1) / cp.size * out.numel() * out.element_size(), cp.group)
    return out


def allgather_attention(q, k, v, cp: ContextParallel, log: CommLog | None = None) -> torch.Tensor:
    """The simple reference: all-gather the keys and values of the whole sequence (backward: their
    gradients reduce-scattered back), put them in sequence order, and attend each of this rank's two
    query chunks to the prefix it sees (chunk i: keys 0 .. (i+1)c - 1, causal inside its own chunk)."""
    s_local = q.shape[0]
    seq, c = s_local * cp.size, s_local // 2
    order = torch.argsort(gathered_order(seq, cp.size, q.device))
    k_all = _gather_sequence(k, cp, log).index_select(0, order)
    v_all = _gather_sequence(v, cp, log).index_select(0, order)
    outs = []
    for half, chunk in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
        end = (chunk + 1) * c
        mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(chunk * c)
        outs.append(sdpa(q[half * c:(half + 1) * c], k_all[:end], v_all[:end], mask))
    return torch.cat(outs, 0)


def allgather_held_bytes(seq: int, cp: int, b: int, heads: int, kv_heads: int, d: int, e: int) -> int:
    """Bytes one layer's :func:`allgather_attention` keeps for its backward beyond what attention over this
    rank's slice alone keeps (its q, k, v, output and log-sum-exp), for ``heads`` / ``kv_heads`` on this rank
    (after tp) and ``e`` bytes per element: the whole sequence's keys and values in sequence order (a copy, this
    rank's part included), ``2 s b kv_heads d``; each query chunk's attention output, which the fused kernel
    saves apart from their concatenation, ``s/cp b heads d``; and the two masks, which the kernel turns into
    additive masks of the query dtype, ``[c, end]`` each: ``c = s / (2 cp)`` rows against the ``(r + 1) c`` and
    ``(2cp - r) c`` keys the two chunks see, ``(2cp + 1) c^2`` elements on every rank."""
    c = seq // (2 * cp)
    return e * (2 * seq * b * kv_heads * d + seq // cp * b * heads * d + (2 * cp + 1) * c * c)


class _AllToAll(torch.autograd.Function):
    """Sequence-split -> head-split (``to_heads``) or back, over the cp group; backward is the other way."""
    @staticmethod
    def forward(ctx, x, group, size: int, to_heads: bool, log: CommLog | None):
        ctx.group, ctx.size, ctx.to_heads, ctx.log = group, size, to_heads, log
        return _all_to_all(x, group, size, to_heads, log)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.size, not ctx.to_heads, ctx.log), None, None, None, None


def _all_to_all(x: torch.Tensor, group, size: int, to_heads: bool, log: CommLog | None = None) -> torch.Tensor:
    """``to_heads``: [s, b, H, d] (this rank's sequence part, all heads) -> [size * s, b, H / size, d] (every
    rank's part in rank order, head block ``rank``). Else the inverse."""
    if to_heads:
        s, b, heads, d = x.shape
        send = x.view(s, b, size, heads // size, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        counted_comm.all_to_all(recv, send, group, log, "cp")
        return recv.view(size * s, b, heads // size, d)
    rows, b, h, d = x.shape
    send = x.contiguous().view(size, rows // size, b, h, d)
    recv = torch.empty_like(send)
    counted_comm.all_to_all(recv, send, group, log, "cp")
    return recv.permute(1, 2, 0, 3, 4).reshape(rows // size, b, size * h, d)


def ulysses_attention(q, k, v, cp: ContextParallel, log: CommLog | None = None) -> torch.Tensor:
    """Ulysses (DeepSpeed): all-to-all to the whole sequence with heads / cp heads (and kv_heads / cp
    key/value heads: query head block j uses key/value block j), causal attention in sequence order, and
    all-to-all back. Needs heads and kv_heads divisible by cp (validate() says so up front)."""
    if q.shape[2] % cp.size or k.shape[2] % cp.size:
        raise ValueError(f"{FLAG.cp_comm_type} a2a needs heads ({q.shape[2]}) and key/value heads ({k.shape[2]}) "
                         f"divisible by cp {cp.size}")
    seq = q.shape[0] * cp.size
    gathered = gathered_order(seq, cp.size, q.device)
    order = torch.argsort(gathered)
    q, k, v = (_AllToAll.apply(t, cp.group, cp.size, True, log).index_select(0, order) for t in (q, k, v))
    out = sdpa(q, k, v, causal=True).index_select(0, gathered)       # back to the gathered (rank) order
    return _AllToAll.apply(out, cp.group, cp.size, False, log)
