"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Everything here takes the tensor-parallel process group explicitly (``topo.tp_group``); ``None`` or a
group of one rank turns every communication into a no-op, so the same layers serve tp=1.

Activations are [s, b, h] (sequence first). With sequence parallel the tensor *between* TP regions
is this rank's contiguous sequence chunk [s/tp, b, h]: tp rank r holds positions
``r*s/tp .. (r+1)*s/tp - 1``.

Communication functions (autograd-aware; forward / backward):

=========================================== ======================== ===========================
function                                    forward                  backward
=========================================== ======================== ===========================
copy_to_tp_region                           identity                 all-reduce
reduce_from_tp_region                       all-reduce               identity
scatter_to_tp_region                        keep own last-dim chunk  all-gather last dim
gather_from_tp_region                       all-gather last dim      keep own last-dim chunk
scatter_to_sequence_parallel_region         keep own dim-0 chunk     all-gather dim 0
gather_from_sequence_parallel_region        all-gather dim 0         reduce-scatter dim 0 (*)
reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0     all-gather dim 0
=========================================== ======================== ===========================

(*) or "keep own dim-0 chunk" with ``tensor_parallel_output_grad=False`` (when the gathered tensor is
used identically on every rank rather than feeding a tensor-parallel layer).

Parameter attributes (``tensor_parallel``, ``partition_dim``, ``sequence_parallel_grad``, ...) are
stamped by the layers here and documented, with who reads them, in :mod:`megazero.parallel.params`.

Worked example: an MLP ``h=4 -> ffn=8 -> h=4`` at tp=2 on input x [s=6, b, 4]::

    dense_h_to_4h  ColumnParallelLinear(4, 8): rank r holds weight rows 4r..4r+3 ([4, 4]) and bias[4r:4r+4]
    dense_4h_to_h  RowParallelLinear(8, 4):    rank r holds weight cols 4r..4r+3 ([4, 4]); bias [4] on both

    no sequence parallel: x [6,b,4] on both -> copy_to (bwd all-reduce) -> [6,b,4] (this rank's 4 of 8 ffn) -> GELU
                          -> partial [6,b,4] -> reduce_from (all-reduce) -> + bias -> [6,b,4] on both
    sequence parallel:    x [3,b,4] (rank r: positions 3r..3r+2) -> all-gather -> [6,b,4] -> ... -> partial
                          [6,b,4] -> reduce-scatter -> [3,b,4] + bias (bias grad partial: sum over tp)

The TP-aware dropout RNG lives in :mod:`megazero.parallel.rng` (re-exported here).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megazero.kernels import fused, one_kernel
from megazero.parallel.fp8 import linear
from megazero.parallel.params import set_tp_attributes
from megazero.parallel.raw_comm import (
    all_gather_dim0,
    all_gather_last_dim,
    all_reduce,
    group_rank,
    group_size,
    reduce_scatter_dim0,
)
from megazero.parallel.rng import TensorParallelRNG  # noqa: F401  (re-exported: part of this API)

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
    "column_parallel_linear",
    "set_tp_attributes", "TensorParallelRNG", "shard",
    "gather_full", "mask_padded_vocab",
]


# ----------------------------------------------------------------------------- communication

def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim``."""
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the tp size {size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # The incoming gradient may be a tensor the caller still holds: reduce a copy.
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return _chunk(grad, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


def _single(group) -> bool:
    return group_size(group) == 1


def copy_to_tp_region(x, group):
    """Enter a TP region: identity forward, all-reduce of the input gradient backward."""
    return x if _single(group) else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group):
    """Leave a TP region: all-reduce (sum of partial results) forward, identity backward."""
    return x if _single(group) else _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x, group):
    """Keep this rank's chunk of the last dim forward; all-gather the gradient backward."""
    return x if _single(group) else _ScatterToTP.apply(x, group)


def gather_from_tp_region(x, group):
    """All-gather the last dim (rank order) forward; keep this rank's gradient chunk backward."""
    return x if _single(group) else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    """[s, ...] -> this rank's [s/tp, ...] chunk; backward all-gathers the gradient."""
    return x if _single(group) else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad: bool = True):
    """[s/tp, ...] -> [s, ...] by all-gather. Backward: reduce-scatter (the gathered tensor fed a
    tensor-parallel layer, so each rank's gradient is partial) or, with
    ``tensor_parallel_output_grad=False``, keep this rank's chunk."""
    return x if _single(group) else _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """[s, ...] partial sums -> summed [s/tp, ...] chunk; backward all-gathers the gradient."""
    return x if _single(group) else _ReduceScatterToSP.apply(x, group)


# ----------------------------------------------------------------------------- parameters

def new_parameter(shape: tuple[int, ...], *, tensor_parallel: bool, partition_dim: int = -1,
                  sequence_parallel_grad: bool = False, zeros: bool = False, dtype=torch.float32,
                  device=None) -> nn.Parameter:
    """A parameter of this rank's ``shape`` (uninitialised, or zeros) with the contract attributes."""
    make = torch.zeros if zeros else torch.empty
    return set_tp_attributes(nn.Parameter(make(*shape, dtype=dtype, device=device)), tensor_parallel,
                             partition_dim, sequence_parallel_grad)


def shard(full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """tp rank ``tp_rank``'s contiguous chunk of a full tensor (the inverse of concatenating shards)."""
    if partition_dim < 0 or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {d}")
    return n // d


# ----------------------------------------------------------------------------- layers

def column_parallel_linear(x, weight, bias, group, *, sequence_parallel: bool = False,
                           gather_output: bool = False, fp8=None):
    """y = x @ W_shard.T + b_shard for a column-parallel weight [out/tp, in].

    ``x``: [s, b, in] replicated (or [s/tp, b, in] with sequence parallel, all-gathered here).
    Returns [s, b, out/tp] (or [s, b, out] with ``gather_output``). ``fp8``: the layer's
    :class:`megazero.parallel.fp8.LinearFP8` (its product in FP8), or None.
    """
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, group)
    else:
        x = copy_to_tp_region(x, group)
    y = linear(x, weight, bias, fp8)
    return gather_from_tp_region(y, group) if gather_output else y


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in, out)`` with the weight split along dim 0 (the output features).

    tp rank r holds ``weight[r*out/tp:(r+1)*out/tp, :]`` and the same slice of the bias. Input is
    replicated ([s/tp, b, in] chunks with ``sequence_parallel``, all-gathered along the sequence);
    output is this rank's [.., out/tp] slice unless ``gather_output``. Parameters are allocated
    uninitialised: the model fills them (see ``megazero.models.gpt`` for layout-independent init).
    ``fp8``: set by :func:`megazero.parallel.fp8.enable` when the product runs in FP8.
    """

    fp8 = None

    def __init__(self, in_features: int, out_features: int, tp_group=None, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _divide(out_features, group_size(tp_group), "ColumnParallelLinear out_features")
        kw = dict(dtype=dtype, device=device)
        self.weight = new_parameter((local, in_features), tensor_parallel=True, partition_dim=0, **kw)
        self.bias = new_parameter((local,), tensor_parallel=True, partition_dim=0, zeros=True, **kw) if bias else None

    def forward(self, x, loss_target=None, *, vocab_size: int | None = None):
        """The layer's output; or, given ``loss_target`` (an output layer over the vocabulary), the
        per-token cross-entropy of that output without making it
        (:func:`vocab_parallel_linear_cross_entropy`: no bias, no FP8, output not gathered)."""
        if loss_target is not None:
            if self.bias is not None or self.fp8 is not None or self.gather_output:
                raise ValueError("the fused linear cross-entropy takes a bias-free, non-FP8, split output layer")
            return vocab_parallel_linear_cross_entropy(x, self.weight, loss_target, self.tp_group, vocab_size=vocab_size,
                                                       sequence_parallel=self.sequence_parallel)
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group, sequence_parallel=self.sequence_parallel,
                                      gather_output=self.gather_output, fp8=self.fp8)


class RowParallelLinear(nn.Module):
    """``nn.Linear(in, out)`` with the weight split along dim 1 (the input features).

    tp rank r holds ``weight[:, r*in/tp:(r+1)*in/tp]``; the bias is replicated and added once after
    the partial products are summed (all-reduce, or reduce-scatter along the sequence with
    ``sequence_parallel``, giving [s/tp, b, out]). Input is already split on its last dim unless
    ``input_is_parallel=False``. ``fp8``: as :class:`ColumnParallelLinear`'s.
    """

    fp8 = None

    def __init__(self, in_features: int, out_features: int, tp_group=None, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _divide(in_features, group_size(tp_group), "RowParallelLinear in_features")
        kw = dict(dtype=dtype, device=device)
        self.weight = new_parameter((out_features, local), tensor_parallel=True, partition_dim=1, **kw)
        self.bias = new_parameter((out_features,), tensor_parallel=False, sequence_parallel_grad=sequence_parallel,
                                  zeros=True, **kw) if bias else None

    def forward(self, x):
        if _single(self.tp_group):                  # nothing to sum: the bias fuses into the matmul
            return linear(x, self.weight, self.bias, self.fp8)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        y = linear(x, self.weight, None, self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, dim)`` with the (padded) vocabulary split along dim 0.

    tp rank r holds rows ``r*V/tp .. (r+1)*V/tp - 1``; a token owned by another rank looks up zeros
    here and the partial results are summed. ``forward(ids [b, s])`` returns [b, s, dim], or with
    ``sequence_parallel`` this rank's sequence chunk [s/tp, b, dim] (transposed and reduce-scattered).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, *,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _divide(num_embeddings, group_size(tp_group), "padded vocab size")
        self.vocab_start = group_rank(tp_group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = set_tp_attributes(
            nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype, device=device)), True, 0)

    def forward(self, ids):
        if group_size(self.tp_group) > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1), self.tp_group)
        return reduce_from_tp_region(out, self.tp_group)


# ----------------------------------------------------------------------------- cross-entropy

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy over logits split on the last dim; never gathers the full logits.

    1. global max over the vocab (all-reduce MAX) for stability;
    2. the target's logit from the rank that owns it (others contribute 0; all-reduce SUM);
    3. sum of exp over the vocab (all-reduce SUM);  loss = log(sum_exp) - target_logit.
    Backward: softmax - one_hot(target) on the local shard, times the incoming gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        ctx.in_dtype = logits.dtype
        ctx.used = False
        if _single(group):          # no collective between the steps: one fused kernel each way on CUDA
            loss, softmax = one_kernel("cross_entropy", fused(whole_vocab_cross_entropy, logits), logits, target)
            ctx.save_for_backward(softmax, target, None)
            return loss
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()                  # the loss is at least float32
        local_vocab = logits.shape[-1]
        max_logit = all_reduce(logits.amax(dim=-1), group, op=dist.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)

        owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        all_reduce(target_logit, group)

        exp = shifted.exp_()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = torch.log(sum_exp) - target_logit

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, owned)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("vocab_parallel_cross_entropy reuses its saved softmax as the gradient "
                               "buffer, so its graph can be back-propagated only once (no retain_graph)")
        ctx.used = True
        softmax, local_target, owned = ctx.saved_tensors
        if owned is None:           # one rank: every target is its own
            grad = one_kernel("cross_entropy_backward", fused(whole_vocab_cross_entropy_backward, softmax), softmax,
                              local_target, grad_loss, ctx.in_dtype)
            return grad, None, None, None
        grad = softmax                                  # in place: saves a logits-sized buffer
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def whole_vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, softmax) of whole-vocabulary ``logits`` (one rank): the steps of
    :class:`_VocabParallelCrossEntropy` with nothing to reduce over ranks, in the same ops (bitwise its result)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shifted = logits - logits.amax(dim=-1).unsqueeze(-1)
    target_logit = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    exp = shifted.exp_()
    sum_exp = exp.sum(dim=-1)
    return torch.log(sum_exp) - target_logit, exp.div_(sum_exp.unsqueeze(-1))


def whole_vocab_cross_entropy_backward(softmax: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor,
                                       dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient (softmax - one_hot(target)) * grad_loss in ``dtype``, made in ``softmax``'s storage."""
    minus_one = torch.full_like(target, -1, dtype=softmax.dtype).unsqueeze(-1)
    grad = softmax.scatter_add_(-1, target.unsqueeze(-1), minus_one)
    return grad.mul_(grad_loss.unsqueeze(-1)).to(dtype)


def vocab_parallel_cross_entropy(logits_shard, target, group=None, *, vocab_size: int | None = None,
                                 loss_mask=None):
    """Per-token cross-entropy (float32, or float64 for float64 logits; shape of ``target``) from this
    rank's logits shard.

    ``logits_shard``: [..., V/tp] where tp rank r holds vocab entries ``r*V/tp .. (r+1)*V/tp - 1``
    (fp16/bf16 are computed in float32). ``target``: int64 [...] of global vocab ids < ``vocab_size``.
    ``vocab_size``: the real vocab; entries at or beyond it (padding) are masked to -inf, so they get
    no probability mass and no gradient. ``loss_mask``: optional [...] weights multiplied into the
    per-token loss (masked positions contribute 0 loss and 0 gradient).
    """
    local_vocab = logits_shard.shape[-1]
    vocab_start = group_rank(group) * local_vocab
    if vocab_size is not None:
        logits_shard = mask_padded_vocab(logits_shard, vocab_size, vocab_start)
    # One code path at every tp (also tp=1): torch's fused F.cross_entropy is a little faster on a GPU,
    # but its CPU kernel is not bitwise independent of the batch it is given, which breaks the exact
    # agreement of a pipeline's micro-batches with the serial whole batch (seen with torch 2.11).
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, group, vocab_start)
    if loss_mask is not None:
        loss = loss * loss_mask.to(loss.dtype)
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    """The output layer's product and the vocab-parallel cross-entropy in chunks of tokens, so the
    logits of all tokens never exist at once (Megatron's ``--cross-entropy-loss-fusion``, Liger's fused
    linear cross-entropy).

    Forward, per chunk of ``chunk`` tokens: ``logits = h_c W^T`` (this rank's vocab shard, in the
    weight's dtype, then at least float32), padded entries -inf, the shard's log-sum-exp and the target's logit;
    after the last chunk three all-reduces over the tp group (max, sum of exp, target) give each token's
    log-sum-exp over the whole vocabulary: ``loss = lse - target_logit``. Saved: ``h``, the per-token
    ``lse`` and the targets (the chunk logits are dropped).

    Backward, per chunk: the logits again (one more product of the head), ``G = (softmax - one_hot) *
    grad_loss`` in the loss's dtype, ``dh_c = G W`` and ``dW += G^T h_c`` (accumulated in the loss's dtype, cast once).
    No communication: ``dh`` is this rank's partial (the caller's copy / sequence gather sums it over tp).
    """

    @staticmethod
    def forward(ctx, h, weight, target, group, vocab_start: int, vocab_size: int | None, chunk: int):
        tokens, local_vocab = h.shape[0], weight.shape[0]
        acc = torch.promote_types(h.dtype, torch.float32)     # the loss is at least float32
        owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(~owned, 0)
        lse = torch.empty(tokens, dtype=acc, device=h.device)
        target_logit = torch.empty(tokens, dtype=acc, device=h.device)
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            logits = _chunk_logits(h[rows], weight, vocab_start, vocab_size)
            target_logit[rows] = logits.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
            top = logits.amax(dim=-1)                  # the log-sum-exp in place: no second chunk
            top.masked_fill_(top == float("-inf"), 0.0)     # a shard of padding only: its lse is -inf
            lse[rows] = top + logits.sub_(top.unsqueeze(-1)).exp_().sum(dim=-1).log_()
            del logits                                  # before the next chunk's is made
        target_logit.masked_fill_(~owned, 0.0)
        if not _single(group):                      # lse over the shards: max, then the sum of exp
            top = all_reduce(lse.clone(), group, op=dist.ReduceOp.MAX)
            lse = top + torch.log(all_reduce((lse - top).exp(), group))
            all_reduce(target_logit, group)
        ctx.save_for_backward(h, weight, local_target, owned, lse)
        ctx.vocab_start, ctx.vocab_size, ctx.chunk = vocab_start, vocab_size, chunk
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, local_target, owned, lse = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        for start in range(0, h.shape[0], ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, h.shape[0]))
            g = _chunk_logits(h[rows], weight, ctx.vocab_start, ctx.vocab_size)
            g.sub_(lse[rows].unsqueeze(-1)).exp_()
            g.scatter_add_(-1, local_target[rows].unsqueeze(-1), -owned[rows].to(g.dtype).unsqueeze(-1))
            g.mul_(grad_loss[rows].unsqueeze(-1))
            g = g.to(h.dtype)
            if grad_h is not None:
                torch.matmul(g, weight, out=grad_h[rows])
            grad_w.addmm_(g.t().to(lse.dtype), h[rows].to(lse.dtype))
            del g                                       # before the next chunk's is made
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_size: int | None) -> torch.Tensor:
    """float32 (float64 for float64 weights) logits [n, V/tp] of ``n`` tokens on this rank's vocab shard, padded entries -inf."""
    logits = torch.matmul(h, weight.t())
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if vocab_size is not None:
        logits = mask_padded_vocab(logits, vocab_size, vocab_start, inplace=True)
    return logits


LINEAR_CROSS_ENTROPY_MIN_CHUNK = 64


def linear_cross_entropy_chunk(tokens: int, local_vocab: int, hidden: int) -> int:
    """Tokens per chunk of :func:`vocab_parallel_linear_cross_entropy`: a chunk's logits hold about as
    many elements as the hidden states of all tokens (Liger's choice: at Llama-3's vocabulary 128256,
    width 2048 and 8192 tokens, chunks of 131 tokens, 64 MiB of float32 logits, against 4 GiB whole),
    but at least :data:`LINEAR_CROSS_ENTROPY_MIN_CHUNK` tokens: each chunk reads the whole weight
    shard, and a product of fewer rows is bound by that read (at width 64, Liger's rule gives one
    token per chunk and runs 5x slower than the unfused loss on a CPU)."""
    liger = math.ceil(tokens / max(1, math.ceil(local_vocab / hidden)))
    return max(1, min(tokens, max(liger, LINEAR_CROSS_ENTROPY_MIN_CHUNK)))


def vocab_parallel_linear_cross_entropy(h, weight, target, group=None, *, vocab_size: int | None = None,
                                        sequence_parallel: bool = False, chunk: int | None = None):
    """Per-token cross-entropy of the output layer ``weight`` (this rank's [V/tp, h] vocab shard) on the
    final hidden states ``h``, without the whole logits: what ``vocab_parallel_cross_entropy(
    column_parallel_linear(h, weight, None, group, sequence_parallel=...), target)`` returns (float32,
    shape of ``target``), computed :class:`_LinearCrossEntropy`'s way.

    ``h``: [s, b, h] replicated over tp, or [s/tp, b, h] with ``sequence_parallel`` (all-gathered here, as
    the column-parallel head does); ``target``: int64 [s, b] of global vocab ids < ``vocab_size``.
    ``chunk``: tokens per chunk (default :func:`linear_cross_entropy_chunk`)."""
    h = gather_from_sequence_parallel_region(h, group) if sequence_parallel else copy_to_tp_region(h, group)
    flat = h.reshape(-1, h.shape[-1])
    local_vocab = weight.shape[0]
    chunk = chunk or linear_cross_entropy_chunk(flat.shape[0], local_vocab, flat.shape[1])
    vocab_start = group_rank(group) * local_vocab
    loss = _LinearCrossEntropy.apply(flat, weight, target.reshape(-1), group, vocab_start, vocab_size, chunk)
    return loss.view(target.shape)


def mask_padded_vocab(logits_shard, vocab_size: int, vocab_start: int, inplace: bool = False):
    """Set logits of padded vocab entries (global id >= ``vocab_size``) to -inf; no-op if none here.

    ``inplace`` is for a fresh tensor that autograd does not need (e.g. a matmul's output)."""
    local_vocab = logits_shard.shape[-1]
    if vocab_start + local_vocab <= vocab_size:
        return logits_shard
    first_padded = max(vocab_size - vocab_start, 0)      # padding is a tail of columns: fill only those
    out = logits_shard if inplace else logits_shard.clone()
    out[..., first_padded:] = float("-inf")
    return out


def init_std_scaled(std: float, num_layers: int) -> float:
    """GPT-2's init for output projections feeding the residual stream: std / sqrt(2 * layers)."""
    return std / math.sqrt(2.0 * num_layers)


def gather_full(tensor: torch.Tensor, partition_dim: int, group) -> torch.Tensor:
    """The full tensor from every tp rank's shard (concatenated along ``partition_dim`` in rank order);
    replicated tensors (``partition_dim`` -1) are returned as they are. A collective over ``group``."""
    if partition_dim < 0 or group_size(group) == 1:
        return tensor
    gathered = all_gather_dim0(tensor.detach().movedim(partition_dim, 0), group)
    return gathered.movedim(0, partition_dim).contiguous()
