"""Ring attention (``--cp-comm-type p2p``) over the causal load-balanced layout of
:mod:`megazero.parallel.context`.

cp rank ``r`` holds query, key and value chunks ``r`` and ``2cp-1-r`` (each ``c`` tokens). At step ``t``
(0 .. cp-1) it holds the key/value block of rank ``src = r - t (mod cp)`` and, while it computes with it,
sends it on to rank ``r + 1`` and receives the next one from ``r - 1`` (isend/irecv behind the compute).
Which part of the block its queries see under the causal mask::

    t = 0        (src == r)  all 2c queries x all 2c keys, masked by position (own chunks)
    src < r                  all 2c queries x the block's first chunk (src < r: seen whole; its second
                             chunk 2cp-1-src lies after both query chunks)
    src > r                  the second query chunk (2cp-1-r) x the whole block (both chunks before it;
                             the first query chunk r sees neither)

so every step after the first is c x 2c work on every rank: the ranks do equal work. Blocks are merged
with the online softmax (each block's output and log-sum-exp ``lse``; ``lse = logaddexp(lse, lse_blk)``,
``out = out e^(lse_old - lse) + out_blk e^(lse_blk - lse)``). The backward recomputes each block's
probabilities from the saved ``lse`` (``P = exp(S - lse)``, ``dS = P (dP - rowsum(dO O))``), passes the
key/value blocks around the ring again and, behind them, the blocks' gradient accumulators, which come
home after cp hops. Grouped-query attention: queries are [b, G, heads/G, s, d] against keys [b, G, 1, s, d]
(broadcast), the key/value gradients summed over the heads of a group. Computed in float32 (float64
inputs in float64).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megazero.parallel.context_layout import rank_positions
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.groups import ContextParallel


def ring_attention(q, k, v, cp: ContextParallel, log: CommLog | None = None) -> torch.Tensor:
    """Causal ring attention of this cp rank's ``q`` [S/cp, b, heads, d] with the whole sequence's keys
    and values (this rank's part ``k`` [S/cp, b, kv_heads, d], ``v`` [S/cp, b, kv_heads, d_v]); returns
    [S/cp, b, heads, d_v]. The
    bytes of the blocks this rank sends (as sent: float32 for 16-bit inputs) are recorded in ``log``
    under "cp"."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    qg = q.permute(1, 2, 0, 3).reshape(b, groups, heads // groups, s, d)
    kg, vg = (t.permute(1, 2, 0, 3).unsqueeze(2) for t in (k, v))         # [b, G, 1, s, d]
    out = _RingAttention.apply(qg, kg, vg, cp, log)
    return out.reshape(b, heads, s, v.shape[-1]).permute(2, 0, 1, 3)


def local_mask(s: int, cp: ContextParallel, device) -> torch.Tensor:
    """[s, s] bool: this rank's own two chunks, query position >= key position."""
    pos = rank_positions(s * cp.size, cp.rank, cp.size, device)
    return pos[None, :] <= pos[:, None]


def block_parts(t: int, cp: ContextParallel, s: int):
    """(query rows, key rows, mask?) of step ``t``'s block (see the module docstring)."""
    src, c = (cp.rank - t) % cp.size, s // 2
    if t == 0:
        return slice(0, s), slice(0, s), True
    if src < cp.rank:
        return slice(0, s), slice(0, c), False
    return slice(c, s), slice(0, s), False


# Query rows per tile times key rows: the largest score matrix held at once (per batch row and head).
TILE_SCORES = 128 * 128


def row_tiles(rows: slice, cols: slice):
    """``rows`` cut into tiles whose score matrices against ``cols`` hold at most :data:`TILE_SCORES`
    entries per head: a block's whole ``[s/cp, s/cp]`` scores at once would be held in the forward and
    three times in the backward (p, dp, ds), more than one process's flash attention holds for the whole
    sequence at cp 2 (measured: 12.4 vs 10.6 MiB of activations per rank at seq 512, hidden 64)."""
    tile = max(16, TILE_SCORES // max(1, cols.stop - cols.start))
    for start in range(rows.start, rows.stop, tile):
        yield slice(start, min(start + tile, rows.stop))


def _scores(q, k, scale, mask):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf")) if mask is not None else scores


class _Ring:
    """Sends this rank's tensors to the next cp rank and receives the previous rank's, in the background."""

    def __init__(self, cp: ContextParallel, log: CommLog | None):
        self.group, self.size, self.log = cp.group, cp.size, log
        self.next = cp.ranks[(cp.rank + 1) % cp.size]
        self.prev = cp.ranks[(cp.rank - 1) % cp.size]

    def start(self, tensors: list[torch.Tensor], tag: int):
        received = [torch.empty_like(t) for t in tensors]
        if self.log is not None:
            self.log.record("cp", sum(t.numel() * t.element_size() for t in tensors), self.group)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag=tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag=tag) for r in received]
        return dist.batch_isend_irecv(ops), received


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, log: CommLog | None):
        dtype = q.dtype
        wide = torch.promote_types(dtype, torch.float32)           # float32, or float64 for float64
        q, k, v = (t.to(wide).contiguous() for t in (q, k, v))
        s, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        ring, mask = _Ring(cp, log), local_mask(s, cp, q.device)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])                # values may be narrower or wider than q
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kb, vb = k, v
        for t in range(cp.size):
            pending = ring.start([kb, vb], 0) if t < cp.size - 1 else None
            rows, cols, masked = block_parts(t, cp, s)
            for r in row_tiles(rows, cols):       # the scores of a tile of query rows at a time
                scores = _scores(q[..., r, :], kb[..., cols, :], scale, mask[r, cols] if masked else None)
                blk_lse = torch.logsumexp(scores, -1)
                blk_out = torch.matmul(torch.exp(scores - blk_lse[..., None]), vb[..., cols, :])
                new_lse = torch.logaddexp(lse[..., r], blk_lse)
                out[..., r, :] = (out[..., r, :] * torch.exp(lse[..., r] - new_lse)[..., None]
                                  + blk_out * torch.exp(blk_lse - new_lse)[..., None])
                lse[..., r] = new_lse
            if pending is not None:
                _wait(pending[0])
                kb, vb = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.dtype, ctx.log = cp, dtype, log
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        s, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        ring, mask = _Ring(cp, ctx.log), local_mask(s, cp, q.device)
        grad_out = grad_out.to(q.dtype)
        delta = (grad_out * out).sum(-1)                                # rowsum(dO * O)
        dq = torch.zeros_like(q)
        kb, vb = k, v
        acc, arriving = None, None           # the gradient accumulator of the block held now, and its transfer
        for t in range(cp.size):
            pending = ring.start([kb, vb], 0) if t < cp.size - 1 else None
            rows, cols, masked = block_parts(t, cp, s)
            ks, vs = kb[..., cols, :], vb[..., cols, :]
            dk_blk = dv_blk = 0
            for r in row_tiles(rows, cols):       # a tile of query rows at a time, as in the forward
                qs, dos = q[..., r, :], grad_out[..., r, :]
                p = torch.exp(_scores(qs, ks, scale, mask[r, cols] if masked else None) - lse[..., r, None])
                dv_blk = dv_blk + torch.matmul(p.transpose(-1, -2), dos).sum(2, keepdim=True)
                dp = torch.matmul(dos, vs.transpose(-1, -2))
                ds = p * (dp - delta[..., r, None]) * scale
                dq[..., r, :] += torch.matmul(ds, ks)
                dk_blk = dk_blk + torch.matmul(ds.transpose(-1, -2), qs).sum(2, keepdim=True)
            if arriving is not None:
                _wait(arriving[0])
                acc = arriving[1]
            else:
                acc = [torch.zeros_like(k), torch.zeros_like(v)]
            acc[0][..., cols, :] += dk_blk
            acc[1][..., cols, :] += dv_blk
            arriving = ring.start(acc, 1)       # on to the next rank; the last hop brings each block home
            if pending is not None:
                _wait(pending[0])
                kb, vb = pending[1]
        _wait(arriving[0])
        dk, dv = arriving[1]
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None
