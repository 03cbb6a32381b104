"""Mixture of Experts: the MLP of every ``--moe-layer-freq``-th layer becomes ``--num-experts`` MLPs and a
router that sends each token to ``--moe-router-topk`` of them (Megatron-core's flags and losses).

One MoE layer on this rank's tokens x [s(/tp), b, h] (T = s(/tp) * b tokens)::

    logits = x W_router^T               [T, E]  in fp32 (the weight is cast; it is stored in the model dtype)
    probs  = softmax(logits)            [T, E]
    gates, experts = top-k(probs)       [T, k]  gates renormalised to sum to 1 when k > 1 (Mixtral);
                                                 k = 1 keeps the softmax probability (Switch)
    capacity (--moe-expert-capacity-factor c): expert e keeps its first C = ceil(c * T * k / E)
           assignments in token order and drops the rest (the token then gets no output from e);
           unset = dropless. Under sequence and context parallelism T and the order are the whole
           sequence's (the tp and cp ranks' choices are gathered and put back in the serial token
           order, undoing the cp load balancing), so the same tokens drop as on one process
    out[t] = sum over kept (t, e) of gates[t, e] * Expert_e(x[t])  (+ SharedExperts(x[t]) when given)

DeepSeek-V3 routing (``--moe-router-score-function sigmoid``, HF transformers' DeepseekV3TopkRouter)::

    scores = sigmoid(logits)            [T, E]  probs (for the losses) = scores / (sum_e scores + 1e-20)
    choice = scores + expert_bias       [T, E]  (--moe-router-enable-expert-bias; no gradient)
    group-limited (--moe-router-num-groups G --moe-router-group-topk K): the E experts in G consecutive
           groups, a group's score = sum of its two best choice values; the worst G - K groups -> -inf
    experts = top-k(choice); gates = scores[experts] / (sum + 1e-20) when k > 1
    gates *= --moe-router-topk-scaling-factor (either score function)

After each optimizer step :func:`update_expert_biases` moves every expert bias by
``rate * sign(mean load - load_e)`` on the step's loads summed over all micro-batches and ranks (the same
on every rank; the checkpoint stores it as ``model.buffer/<name>``).

Losses, added to the training loss of the micro-batch (they are not part of the returned per-token
loss; the log line reports them):

    load balancing (--moe-aux-loss-coeff a)   a * E * sum_e f_e * P_e,  f_e = (assignments to e before
                                              dropping) / (T k),  P_e = mean over tokens of probs[:, e]
    router z-loss  (--moe-z-loss-coeff z)      z * mean over tokens of logsumexp(logits)^2

Under sequence parallelism the T tokens are the whole sequence: counts and probability sums are summed
over the tp group, so the losses equal those of tp = 1. Under context parallelism likewise over the cp
group (each cp rank routes its slice of the sequence; Megatron's tp x cp group). The capacity is the
whole sequence's too: the queues are counted in the serial token order, so the same tokens drop at any tp
(with sequence parallelism) and cp as on one process.

How the losses reach backward without passing through the pipeline (Megatron-core's
MoEAuxLossAutoScaler): the layer's output goes through an identity autograd function whose backward
also hands the loss tensor a gradient ``aux_loss_scale`` (``loss_scale / micro-batches``, set by the
trainer with :func:`set_aux_loss_scale`; 1.0 for a plain ``loss.backward()``). So the stage owning the
layer back-propagates the losses as part of the layer's own backward.

Expert parallelism (``--expert-model-parallel-size`` EP, groups from
:class:`megazero.parallel.topology.Topology`): the E experts are split into EP contiguous blocks, ep rank r
holding experts ``r E/EP .. (r+1) E/EP - 1``. Worked example, E = 4, EP = 2, top-2, 3 tokens on ep rank 0
routed to experts (0,2) (1,2) (3,0)::

    sorted by expert: t0->0 t2->0 | t1->1 | t0->2 t1->2 | t2->3        counts [2, 1, 2, 1]
    counts exchanged first (all_to_all_single of the [E] counts), then the rows: 3 to rank 0
    (experts 0, 1), 3 to rank 1 (experts 2, 3); each rank regroups what it received by local expert,
    runs its experts and sends the rows back the same way; the gates weight them into the outputs.

Experts are replicated over tp (not tensor-split); each tp rank routes the tokens it holds (all of them
without sequence parallelism, its sequence chunk with it). Expert parameters carry ``expert_parallel``:
the ZeRO engine reduces and shards them over the expert-data-parallel group
(:mod:`megazero.parallel.zero.experts`). Parameter names use the *global* expert index, so they and
checkpoints do not depend on EP::

    layers.<i>.mlp.router.weight                 [E, h]        replicated
    layers.<i>.mlp.experts.<e>.fc1.{weight,bias} [ffn, h]      ([2 ffn, h] with --swiglu: gate/up rows
                                                                interleaved as in transformer.MLP)
    layers.<i>.mlp.experts.<e>.fc2.{weight,bias} [h, ffn]       (ffn: --moe-ffn-hidden-size)
    layers.<i>.mlp.router.expert_bias            [E] fp32      a buffer, replicated (with the expert bias)
    layers.<i>.mlp.shared_experts.fc1.weight     [S(/tp), h]   ([2S, h] with --swiglu), split dim 0
    layers.<i>.mlp.shared_experts.fc2.weight     [h, S(/tp)]   split dim 1 (--moe-shared-expert-intermediate-size S)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megazero.config import JobConfig
from megazero.kernels import swiglu
from megazero.parallel import counted_comm
from megazero.parallel.context_layout import gathered_order
from megazero.parallel.fp8 import linear
from megazero.parallel.pipeline.generators import stage_shape
from megazero.parallel.pipeline.partition import stage_layer_ids
from megazero.parallel.raw_comm import all_gather_dim0
from megazero.parallel.tensor import new_parameter, reduce_from_tp_region
from megazero.parallel.wgrad_fusion import gate_up
from megazero.spec.recompute import (
    checkpointed,
    free_until_backward,
    full_recompute_groups,
)


def is_expert_parameter(name: str) -> bool:
    """Is parameter ``name`` one of an expert's (``layers.<i>.mlp.experts.<e>.*``)? Expert-parallel ranks
    hold different experts; every other parameter is the same on all of them."""
    return ".experts." in name


@dataclass
class MoEStats:
    """What one MoE layer saw since the last :func:`reset_moe_stats` on this rank (detached figures)."""

    aux_loss: float = 0.0                 # sum over forwards of the layer's (load balancing + z) loss
    forwards: int = 0
    tokens_per_expert: torch.Tensor | None = None   # [E] assignments before dropping, summed
    assignments: int = 0
    dropped: int = 0


class ExpertMLP(nn.Module):
    """One expert: the model's MLP form, whole (not tensor-split). GELU MLP, or SwiGLU with fc1's rows
    interleaved gate/up (row 2j gate feature j, row 2j+1 up feature j)."""

    def __init__(self, ctx):
        super().__init__()
        cfg = ctx.cfg
        self.ctx, self.swiglu = ctx, cfg.swiglu
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        f, h = cfg.expert_ffn_hidden_size, cfg.hidden_size
        kw = dict(tensor_parallel=False, sequence_parallel_grad=ctx.sp, dtype=ctx.dtype, device=ctx.device)
        self.fc1 = nn.Module()
        self.fc1.weight = new_parameter((2 * f if self.swiglu else f, h), **kw)
        self.fc1.bias = new_parameter((2 * f if self.swiglu else f,), zeros=True, **kw) if cfg.add_bias_linear else None
        self.fc2 = nn.Module()
        self.fc2.weight = new_parameter((h, f), **kw)
        self.fc2.bias = new_parameter((h,), zeros=True, **kw) if cfg.add_bias_linear else None
        self.fc1.fp8 = self.fc2.fp8 = None          # megazero.parallel.fp8.enable sets them under FP8
        for p in self.parameters():
            p.expert_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1(x))), recomputing the activation as :meth:`act_then_fc2` says."""
        w, b, fp8 = self.fc1.weight, self.fc1.bias, self.fc1.fp8
        if self.swiglu and fp8 is not None:         # one FP8 product, one scale for gate and up
            both = linear(x, w, b, fp8)
            inner = (both[..., 0::2], both[..., 1::2])
        elif self.swiglu:
            inner = gate_up(x, w, b)
        else:
            inner = (linear(x, w, b, fp8),)
        return self.act_then_fc2(inner, lambda y: linear(y, self.fc2.weight, self.fc2.bias, self.fc2.fp8))

    def act_then_fc2(self, inner: tuple, fc2) -> torch.Tensor:
        """``fc2(act(*inner))``; under ``--recompute-modules moe_act`` the activation's output is freed once
        ``fc2`` has saved it and recomputed before fc2's backward (:func:`free_until_backward`)."""
        if not self.ctx.recomputes("moe_act"):
            return fc2(self._act(*inner))
        y = checkpointed(self._act, None, *inner) if self.swiglu else self._act(*inner)
        out = fc2(y)
        free_until_backward(y, out, lambda: self._act(*inner))
        return out

    def _act(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu(gate, up) if self.swiglu else F.gelu(gate, approximate=self.approximate)


class LocalExperts(nn.ModuleDict):
    """The experts this ep rank holds, keyed by global index. ``forward(x, counts)``: rows of ``x`` grouped
    by local expert, ``counts[j]`` rows for the j-th. A module of its own: ZeRO-3 gathers it as a unit.

    With ``--moe-grouped-gemm`` fc1 and fc2 each run as one grouped GEMM over all local experts
    (:func:`grouped_linear`) on an [experts, out, in] operand of their weights (:func:`stack_experts`):
    built here as views of one buffer per weight, it is a view of that buffer, no copy; where the
    parameters were moved since (ZeRO buckets in reverse order, a reload into separate tensors) it is a
    stacked copy, kept until backward. The per-expert loop runs instead under FP8 (each expert keeps its
    own scales) and where :func:`grouped_mm_supported` says no.

    Iteration (``keys``, ``values``, ``items``) is by ascending expert index. With the flag the experts
    are registered in descending order, so that their parameters come last expert first: the ZeRO
    engines lay a chunk's parameters out in reverse registration order (megazero.parallel.zero), which
    then holds each of the experts' weights ascending at one stride, where :func:`stack_experts` takes
    them without a copy."""

    def __init__(self, ctx, first: int, count: int):
        self.grouped_gemm = ctx.cfg.moe_grouped_gemm
        indices = range(first, first + count)
        super().__init__({str(e): ExpertMLP(ctx) for e in (reversed(indices) if self.grouped_gemm else indices)})
        self.indices = [str(e) for e in indices]
        if self.grouped_gemm:
            self._share_one_buffer_per_weight()

    def __iter__(self):
        return iter(self.indices)

    def keys(self):
        return list(self.indices)

    def values(self):
        return [self[k] for k in self.indices]

    def items(self):
        return [(k, self[k]) for k in self.indices]

    def _share_one_buffer_per_weight(self) -> None:
        """Make each of fc1.weight, fc1.bias, fc2.weight, fc2.bias of the experts consecutive views of one
        buffer, so that :func:`stack_experts` finds them at one stride (values unchanged)."""
        experts = list(self.values())
        for layer in ("fc1", "fc2"):
            for kind in ("weight", "bias"):
                params = [getattr(getattr(e, layer), kind) for e in experts]
                if params[0] is None or params[0].is_meta:
                    continue
                buffer = torch.stack([p.data for p in params])
                for p, view in zip(params, buffer):
                    p.data = view

    def forward(self, x: torch.Tensor, counts: list[int], by_source: list[list[int]] | None = None) -> torch.Tensor:
        """``by_source`` (FP8 under expert parallelism): ``by_source[j]`` the j-th expert's rows from each ep
        rank, in rank order. Each expert then runs on each rank's rows apart, so that its FP8 scales are
        those of one micro-batch's tokens, as in the serial run (megazero.parallel.fp8)."""
        if self.grouped_gemm and self._grouped_runs(x):
            return self.grouped_forward(x, counts)
        pieces = torch.split(x, counts)
        if by_source is None:
            return torch.cat([expert(piece) for expert, piece in zip(self.values(), pieces)])
        return torch.cat([expert(part) for expert, piece, sources in zip(self.values(), pieces, by_source)
                          for part in torch.split(piece, sources)])

    def _grouped_runs(self, x: torch.Tensor) -> bool:
        first = next(iter(self.values()))
        widths = (first.fc1.weight.shape[1], first.fc1.weight.shape[0], first.fc2.weight.shape[1])
        return first.fc1.fp8 is None and grouped_mm_supported(x.dtype, x.device, widths)

    def grouped_forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """All local experts on their rows as grouped GEMMs, equal bitwise in fp32 on CPU to the per-expert
        loop when the expert ffn width is a multiple of 32 elements (tests/test_moe.py); at other widths
        torch's vectorised activation rounds an expert's last elements through its scalar tail on one path
        and not the other, and the two agree to fp32 rounding. Under SwiGLU fc1's interleaved gate/up rows
        (even rows gate, odd rows up) run as two grouped GEMMs on the strided rows, as the loop's two
        linear layers do, so gate and up come out as contiguous tensors (the activation then takes the
        loop's vectorised path, which strided columns would not)."""
        experts = list(self.values())
        first = experts[0]
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)

        def stacked(layer: str):
            modules = [getattr(e, layer) for e in experts]
            bias = stack_experts([m.bias for m in modules]) if first.fc1.bias is not None else None
            return stack_experts([m.weight for m in modules]), bias

        inner = grouped_linear(x, *stacked("fc1"), offsets, counts, 2 if first.swiglu else 1)
        w2, b2 = stacked("fc2")
        return first.act_then_fc2(inner, lambda y: grouped_linear(y, w2, b2, offsets, counts)[0])


def uniform_stride_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(tensors)`` as a view, no copy, when the tensors are contiguous, of one shape, in one
    storage at one positive stride (in their order), the first and the stride 16-byte aligned (as
    ``_grouped_mm`` wants its operands); None otherwise."""
    first = tensors[0]
    if not first.is_contiguous() or first.data_ptr() % 16:
        return None
    if len(tensors) == 1:
        return first.unsqueeze(0)
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    step = tensors[1].storage_offset() - start
    if step < first.numel() or step * first.element_size() % 16:
        return None
    for i, t in enumerate(tensors):
        if (t.storage_offset() != start + i * step or t.shape != first.shape or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage or t.dtype != first.dtype):
            return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), start)


class _StackExperts(torch.autograd.Function):
    """[E, ...] of E same-shape tensors (:func:`uniform_stride_view`, else a stacked copy); backward hands
    each tensor its slice of the one stacked gradient (views, no copy)."""

    @staticmethod
    def forward(ctx, *tensors):
        view = uniform_stride_view(tensors)
        return torch.stack(tensors) if view is None else view

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def stack_experts(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The experts' same-shape parameters as one [E, ...] operand, a view where their layout allows
    (:class:`_StackExperts`); gradients flow back to each."""
    return _StackExperts.apply(*tensors)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, widths) -> bool:
    """Can ``torch._grouped_mm`` run the experts' products and their gradients here? It needs torch's
    ``_grouped_mm`` (absent before torch 2.8), fp32, bf16 or fp16 on CPU or bf16 on CUDA (it refuses
    fp64 on CPU; other CUDA dtypes are not taken on every GPU), and feature widths (hidden, fc1's and
    fc2's input widths) whose rows are a multiple of 16 bytes (its stride rule). Else the loop runs."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    allowed = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
    if dtype not in allowed.get(device.type, ()):
        return False
    element = torch.empty((), dtype=dtype).element_size()
    return all(w * element % 16 == 0 for w in widths)


class _GroupedLinear(torch.autograd.Function):
    """``x`` [T, in] rows grouped by expert (``offsets`` the int32 cumulative ``counts``), ``weight``
    [E, out, in], ``bias`` [E, out] or None -> ``out_blocks`` tensors [T, out / out_blocks], row block j
    times expert j's weight (plus its bias). ``out_blocks`` > 1 (SwiGLU's interleaved gate and up): output
    k takes the weight rows ``k::out_blocks``, a product of its own as the loop's linear layers run them.

    Backward in grouped GEMMs too: dX = the sum over outputs of grouped(dY_k, W_k), as the loop's layers
    add up; dW_j = dY_j^T X_j (``_grouped_mm``'s 2D x 2D form with offsets over T: an empty group's dW is
    zero) on the outputs' gradients interleaved back into the weight's row order; dB_j = the sum of dY_j's
    rows. torch's own autograd of ``_grouped_mm`` fails on an empty group, which routing makes common."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, counts, out_blocks):
        ctx.save_for_backward(x, weight, offsets)
        ctx.counts, ctx.has_bias, ctx.out_blocks = counts, bias is not None, out_blocks
        rows = None
        if bias is not None:
            rows = torch.repeat_interleave(bias, torch.tensor(counts, device=bias.device), dim=0,
                                           output_size=x.shape[0])
        outs = []
        for k in range(out_blocks):
            out = torch._grouped_mm(x, weight[:, k::out_blocks].transpose(1, 2), offs=offsets)
            outs.append(out if rows is None else out + rows[:, k::out_blocks])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, weight, offsets = ctx.saved_tensors
        blocks, step = [], ctx.out_blocks
        for grad in grads:
            blocks.append(torch.zeros(x.shape[0], weight.shape[1] // step, dtype=x.dtype, device=x.device)
                          if grad is None else grad.contiguous())
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            for k, block in enumerate(blocks):
                part = torch._grouped_mm(block, weight[:, k::step], offs=offsets)
                grad_x = part if grad_x is None else grad_x + part
        interleaved = blocks[0]
        if step > 1:                                    # the weight's row order: row i * step + k from output k
            interleaved = torch.empty(x.shape[0], blocks[0].shape[1], step, dtype=x.dtype, device=x.device)
            for k, block in enumerate(blocks):
                interleaved[:, :, k] = block
            interleaved = interleaved.flatten(1)
        if ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(interleaved.t(), x, offs=offsets)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = torch.stack([torch.stack([rows.sum(0) for rows in per_expert], -1).flatten()
                                  for per_expert in zip(*(torch.split(block, ctx.counts) for block in blocks))])
        return grad_x, grad_w, grad_b, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor,
                   counts: list[int], out_blocks: int = 1) -> tuple[torch.Tensor, ...]:
    """Each expert's linear layer on its block of rows, as grouped GEMMs (:class:`_GroupedLinear`):
    ``out_blocks`` outputs, of the weight's rows ``k::out_blocks`` each."""
    return _GroupedLinear.apply(x, weight, bias, offsets, counts, out_blocks)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` (split ``send`` by destination) to the ep ranks; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, log):
        ctx.send, ctx.recv, ctx.group, ctx.log = send, recv, group, log
        out = x.new_empty((sum(recv), *x.shape[1:]))
        counted_comm.all_to_all(out, x.contiguous(), group, log, "ep", output_splits=recv, input_splits=send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        counted_comm.all_to_all(out, grad.contiguous(), ctx.group, ctx.log, "ep", output_splits=ctx.send,
                                input_splits=ctx.recv)
        return out, None, None, None, None


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward also gives ``aux`` the gradient ``layer.aux_loss_scale``."""

    @staticmethod
    def forward(ctx, x, aux, layer):
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.layer.aux_loss_scale, dtype=torch.float32, device=grad.device), None


def route(logits: torch.Tensor, topk: int, score_function: str = "softmax", expert_bias: torch.Tensor | None = None,
          num_groups: int | None = None, group_topk: int | None = None,
          scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (probs [T, E], gates [T, k], experts [T, k]); see the module docstring.

    ``probs`` are what the balancing losses average: the softmax, or the sigmoid scores normalised to sum
    1 per token. The experts are chosen on the scores plus ``expert_bias`` (within the best
    ``group_topk`` of ``num_groups`` groups when given); the gates are the unbiased scores of the chosen
    experts, renormalised when k > 1, times ``scaling_factor``."""
    sigmoid = score_function == "sigmoid"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if sigmoid else scores
    if expert_bias is None and num_groups is None:
        gates, experts = scores.topk(topk, dim=-1)
    else:
        choice = scores + expert_bias if expert_bias is not None else scores
        if num_groups is not None:
            choice = best_groups_only(choice, num_groups, group_topk)
        experts = choice.topk(topk, dim=-1).indices
        gates = scores.gather(1, experts)
    if topk > 1:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20) if sigmoid else gates / gates.sum(-1, keepdim=True)
    if scaling_factor is not None:
        gates = gates * scaling_factor
    return probs, gates, experts


def best_groups_only(choice: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): the E experts in ``num_groups`` consecutive groups; a group's
    score is the sum of its two best choice scores; each token keeps its best ``group_topk`` groups and
    the other experts' choice scores become -inf. [T, E] -> [T, E]."""
    t, e = choice.shape
    grouped = choice.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(t, e)


def expert_bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing, in place: ``bias += rate * sign(mean(load) - load)``; ``load`` [E]
    is the step's assignments per expert over the whole global batch (exact integer counts)."""
    load = load.to(torch.float64)
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity_factor: float | None) -> torch.Tensor:
    """[T, k] bool: which assignments are kept. Expert e keeps its first ceil(c T k / E) assignments in
    token order (token t's choices before token t+1's); all of them when ``capacity_factor`` is None."""
    if capacity_factor is None:
        return torch.ones_like(experts, dtype=torch.bool)
    t, k = experts.shape
    capacity = math.ceil(capacity_factor * t * k / num_experts)
    one_hot = F.one_hot(experts.reshape(-1), num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1          # 0-based place in its expert's queue
    return (position < capacity).reshape(t, k)


def sequence_load_balancing_loss(prob_sums: torch.Tensor, counts: torch.Tensor, seq_length: int, topk: int,
                                 coeff: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the load-balancing loss of each sequence, averaged over the
    batch. ``prob_sums`` and ``counts`` [b, E]: per sequence, the probabilities summed over its
    ``seq_length`` tokens and the assignments per expert."""
    b, e = prob_sums.shape
    return coeff * e * (prob_sums * counts.to(prob_sums.dtype)).sum() / (seq_length * seq_length * topk * b)


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, num_tokens: int, topk: int,
                        coeff: float) -> torch.Tensor:
    """coeff * E * sum_e f_e P_e with f_e = counts_e / (T k), P_e = probs[:, e] summed / T (``probs`` may
    be the sum over tokens already, [E])."""
    prob_sum = probs if probs.dim() == 1 else probs.sum(0)
    e = prob_sum.numel()
    return coeff * e * (prob_sum * counts.to(prob_sum.dtype)).sum() / (num_tokens * num_tokens * topk)


def z_loss(logits: torch.Tensor, coeff: float, num_tokens: int) -> torch.Tensor:
    """coeff * sum over these tokens of logsumexp(logits)^2 / num_tokens (the mean when all are here)."""
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / num_tokens


class MoELayer(nn.Module):
    """Router + this rank's experts (+ the shared experts, when given), in place of a layer's MLP:
    [s(/tp), b, h] -> same shape. ``shared_experts``: an always-on MLP on the same input, tensor-split
    like a dense MLP, its output added to the routed experts'."""

    def __init__(self, ctx, shared_experts: nn.Module | None = None):
        super().__init__()
        cfg = ctx.cfg
        self.ctx, self.num_experts, self.topk = ctx, cfg.num_experts, cfg.moe_router_topk
        self.ep_group, self.ep_size, self.ep_rank = ctx.ep_group, ctx.ep_size, ctx.ep_rank
        self.local_count = self.num_experts // self.ep_size
        self.router = nn.Module()
        self.router.weight = new_parameter((self.num_experts, cfg.hidden_size), tensor_parallel=False,
                                           sequence_parallel_grad=ctx.sp, dtype=ctx.dtype, device=ctx.device)
        if cfg.moe_router_enable_expert_bias:      # not a parameter: moved by expert_bias_step after each step
            self.router.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                                   device=ctx.rng.device))
        self.experts = LocalExperts(ctx, self.ep_rank * self.local_count, self.local_count)
        if shared_experts is not None:
            self.shared_experts = shared_experts
        self.aux_loss_scale = 1.0
        self.keep_aux_graph = False          # tests: keep the last forward's loss tensor (``last_aux_loss``)
        self.last_aux_loss = None
        self.stats = MoEStats()
        self.step_load = None                # [E] this rank's assignments in the step's training forwards

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """The router's per-expert choice bias [E] fp32 (``--moe-router-enable-expert-bias``), else None."""
        return getattr(self.router, "expert_bias", None)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`route` with this model's routing flags."""
        cfg = self.ctx.cfg
        return route(logits, self.topk, cfg.moe_router_score_function, self.expert_bias, cfg.moe_router_num_groups,
                     cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor)

    def _capacity_keep(self, experts: torch.Tensor, batch: int) -> torch.Tensor:
        """:func:`capacity_keep` over the whole sequence in its serial token order, as on one process.
        ``experts`` [T, k] holds this rank's rows (local position major, ``batch`` minor). Under sequence
        parallelism this tp rank's positions are a contiguous run of its cp slice; under context
        parallelism cp rank r's slice is chunks r and 2cp-1-r of the sequence (causal load balancing). So
        the choices are gathered over tp, then over cp, each row given its serial index (position * batch
        + sample, from :func:`gathered_order`), the queues counted in that order, and this rank's rows kept."""
        factor, ctx = self.ctx.cfg.moe_expert_capacity_factor, self.ctx
        tp = ctx.tp_size if ctx.sp else 1
        cp = ctx.cp.size if ctx.cp is not None else 1
        if factor is None or tp * cp == 1:
            return capacity_keep(experts, self.num_experts, factor)
        everyone = experts
        for group, size in ((ctx.tp_group, tp), (ctx.cp.group if cp > 1 else None, cp)):
            if size > 1:
                everyone = all_gather_dim0(everyone, group)
        seq = everyone.shape[0] // batch
        serial = (gathered_order(seq, cp, experts.device).repeat_interleave(batch) * batch
                  + torch.arange(batch, device=experts.device).repeat(seq))
        keep = capacity_keep(everyone[torch.argsort(serial)], self.num_experts, factor)[serial]
        t, mine = experts.shape[0], (ctx.cp.rank if cp > 1 else 0) * tp + (ctx.tp_rank if tp > 1 else 0)
        return keep[mine * t:(mine + 1) * t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(-1, h)
        logits = F.linear(tokens.float(), self.router.weight.float())
        probs, gates, experts = self.route(logits)
        keep = self._capacity_keep(experts, b)
        aux, aux_value = self._aux_loss(logits, probs, experts, b)
        self._record(aux, aux_value, experts, keep)

        flat_expert, flat_gate = experts.reshape(-1)[keep.reshape(-1)], gates.reshape(-1)[keep.reshape(-1)]
        flat_token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.topk)[keep.reshape(-1)]
        order = torch.argsort(flat_expert, stable=True)
        flat_expert, flat_gate, flat_token = flat_expert[order], flat_gate[order], flat_token[order]
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        outputs = self._run_experts(tokens[flat_token], counts)
        out = torch.zeros_like(tokens).index_add(0, flat_token, outputs * flat_gate.unsqueeze(1).to(outputs.dtype))
        out = out.view(s, b, h)
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AttachAuxLoss.apply(out, aux, self)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert, ``counts`` [E] -> the experts' outputs in the same order."""
        if self.ep_size == 1:
            return self.experts(rows, counts.tolist())
        ep, local = self.ep_size, self.local_count
        received = torch.empty_like(counts)
        # The counts first: received[j, e] = rows ep rank j sends to my local expert e.
        counted_comm.all_to_all(received, counts, self.ep_group, self.ctx.comm_log, "ep")
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = _AllToAll.apply(rows, send, recv, self.ep_group, self.ctx.comm_log)
        local_ids = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep), received.reshape(-1))
        by_expert = torch.argsort(local_ids, stable=True)
        by_source = received.t().tolist() if next(iter(self.experts.values())).fc1.fp8 is not None else None
        done = self.experts(arrived[by_expert], received.sum(0).tolist(), by_source)
        back = done[torch.argsort(by_expert)]
        return _AllToAll.apply(back, recv, send, self.ep_group, self.ctx.comm_log)

    def _token_groups(self) -> list:
        """The groups whose ranks route the other parts of this rank's sequences: tp under sequence
        parallelism, cp under context parallelism (each rank holds its slice)."""
        ctx = self.ctx
        return ([ctx.tp_group] if ctx.sp else []) + ([ctx.cp.group] if ctx.cp is not None else [])

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, batch: int):
        """(loss tensor to back-propagate on this rank, its value for the whole sequence): load balancing
        (over the micro-batch, or per sequence with ``seq_aux_loss``) + z-loss of this micro-batch. Under
        sequence or context parallelism the load-balancing loss is the whole sequence's on every rank
        (counts and probability sums summed over tp and cp; the sums' backward is the identity, so each
        rank back-propagates through its own tokens' probabilities); the z-loss is this rank's tokens'
        share, so the value sums the shares. A zero without graph when both are off."""
        cfg, ctx = self.ctx.cfg, self.ctx
        groups = self._token_groups()
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        spread = (ctx.tp_size if ctx.sp else 1) * (ctx.cp.size if ctx.cp is not None else 1)
        num_tokens = logits.shape[0] * spread
        balancing = cfg.moe_router_load_balancing_type
        if cfg.moe_aux_loss_coeff > 0 and balancing != "none":
            per_sequence = balancing == "seq_aux_loss"
            if per_sequence:             # [b, E]: rows are (position, sample), position major
                counts = F.one_hot(experts, self.num_experts).sum(1).view(-1, batch, self.num_experts).sum(0)
                prob_sum = probs.view(-1, batch, self.num_experts).sum(0)
            else:
                counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
                prob_sum = probs.sum(0)
            for group in groups:
                counts = counts.clone()
                dist.all_reduce(counts, group=group)
                prob_sum = reduce_from_tp_region(prob_sum, group)
            if per_sequence:
                total = total + sequence_load_balancing_loss(prob_sum, counts, num_tokens // batch, self.topk,
                                                             cfg.moe_aux_loss_coeff)
            else:
                total = total + load_balancing_loss(prob_sum, counts, num_tokens, self.topk, cfg.moe_aux_loss_coeff)
        value = total.detach().clone()
        if cfg.moe_z_loss_coeff > 0:
            z = z_loss(logits, cfg.moe_z_loss_coeff, num_tokens)
            total = total + z
            z = z.detach().clone()
            for group in groups:
                dist.all_reduce(z, group=group)
            value = value + z
        return total, value

    @torch.no_grad()
    def _record(self, aux: torch.Tensor, value: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor) -> None:
        """Count this forward in :attr:`stats` (training forwards only: not evaluation, nor the
        recomputation of a checkpointed layer in backward)."""
        self.last_aux_loss = aux if self.keep_aux_graph else None
        if not self.training or torch._C._current_graph_task_id() != -1:
            return
        st = self.stats
        st.aux_loss += float(value)
        st.forwards += 1
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        st.tokens_per_expert = counts if st.tokens_per_expert is None else st.tokens_per_expert + counts
        self.step_load = counts if self.step_load is None else self.step_load + counts
        st.assignments += experts.numel()
        st.dropped += int((~keep).sum())


def moe_layers(chunks) -> list[tuple[str, MoELayer]]:
    """(name, layer) of every MoE layer in the given model chunks."""
    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    return [(n, m) for c in chunks for n, m in c.named_modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(chunks, scale: float) -> None:
    """The gradient the MoE losses get in backward: ``loss_scale / micro-batches``, as the main loss."""
    for _, layer in moe_layers(chunks):
        layer.aux_loss_scale = float(scale)


def start_moe_step(chunks, loss_scale: float) -> None:
    """Before a step's first forward: the MoE losses' gradient scale (:func:`set_aux_loss_scale`), and the
    step's expert loads counted from zero."""
    set_aux_loss_scale(chunks, loss_scale)
    for _, layer in moe_layers(chunks):
        layer.step_load = None


def update_expert_biases(chunks, num_layers: int, num_experts: int, tp_rank: int, sequence_parallel: bool,
                         rate: float, device) -> None:
    """After a step: every MoE layer's expert bias moves by :func:`expert_bias_step` on the step's loads
    summed over every micro-batch and every rank routing other tokens (dp and ep ranks, tp ranks under
    sequence parallelism, else tp rank 0 only, cp ranks), so it stays the same on every rank holding the
    layer. A collective over the world (one all-reduce of a [layers, E] table), every rank calls it."""
    table = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
    layers = [(int(name.split(".")[1]), layer) for name, layer in moe_layers(chunks)]
    for i, layer in layers:
        if layer.step_load is not None and (sequence_parallel or tp_rank == 0):
            table[i] = layer.step_load.to(device=device, dtype=torch.float64)
    dist.all_reduce(table)
    for i, layer in layers:
        if layer.expert_bias is not None:
            expert_bias_step(layer.expert_bias, table[i].to(layer.expert_bias.device), rate)
        layer.step_load = None


def reset_moe_stats(chunks) -> None:
    for _, layer in moe_layers(chunks):
        layer.stats = MoEStats()


def collect_moe_metrics(chunks, num_layers: int, num_experts: int, tp_rank: int, sequence_parallel: bool,
                        iterations: int, device) -> dict:
    """The MoE figures of the last ``iterations`` steps, over all ranks, and reset the layers' counters.
    A collective over the world (every rank calls it, with or without MoE layers of its own).

    Returns {} without MoE layers anywhere, else ``moe_aux_loss`` (the losses added per micro-batch, summed
    over layers), ``moe_dropped_fraction`` (dropped / routed assignments), and for every MoE layer i
    ``moe_layer{i}_tokens_{min,max,mean}``: assignments per expert per step (over the global batch).
    Token counts come from every tp rank under sequence parallelism (each routes its own chunk), else
    from tp rank 0; the loss values from tp rank 0 (they are the whole sequence's on every tp rank).
    """
    width = num_experts + 4 if num_experts else 4
    table = torch.zeros(num_layers, width, dtype=torch.float64, device=device)
    for name, layer in moe_layers(chunks):
        i, st = int(name.split(".")[1]), layer.stats
        if st.tokens_per_expert is not None and (sequence_parallel or tp_rank == 0):
            table[i, :num_experts] = st.tokens_per_expert.to(device=device, dtype=torch.float64)
            table[i, num_experts + 2] = st.dropped
            table[i, num_experts + 3] = st.assignments
        if tp_rank == 0:
            table[i, num_experts] = st.aux_loss
            table[i, num_experts + 1] = st.forwards
        layer.stats = MoEStats()
    dist.all_reduce(table)
    if not num_experts:
        return {}
    out, aux, dropped, routed = {}, 0.0, 0.0, 0.0
    for i in range(num_layers):
        row = table[i]
        if row[num_experts + 1] == 0:
            continue
        aux += float(row[num_experts] / row[num_experts + 1])
        dropped, routed = dropped + float(row[num_experts + 2]), routed + float(row[num_experts + 3])
        per_step = row[:num_experts] / max(iterations, 1)
        out[f"moe_layer{i}_tokens_min"] = float(per_step.min())
        out[f"moe_layer{i}_tokens_max"] = float(per_step.max())
        out[f"moe_layer{i}_tokens_mean"] = float(per_step.mean())
    out["moe_aux_loss"] = aux
    out["moe_dropped_fraction"] = dropped / routed if routed else 0.0
    return out


def describe_moe_metrics(metrics: dict) -> str:
    """The log line's MoE part: `` | moe aux 0.0123 | dropped 1.5% | tokens/expert L0 10/22/16 ...``
    (min/max/mean per layer); empty without MoE."""
    if not metrics:
        return ""
    layers = sorted({int(k[len("moe_layer"):].split("_")[0]) for k in metrics if k.startswith("moe_layer")})
    per_layer = " ".join(f"L{i} {metrics[f'moe_layer{i}_tokens_min']:.0f}/{metrics[f'moe_layer{i}_tokens_max']:.0f}"
                         f"/{metrics[f'moe_layer{i}_tokens_mean']:.0f}" for i in layers)
    return (f" | moe aux {metrics['moe_aux_loss']:.4f} | dropped {100 * metrics['moe_dropped_fraction']:.1f}% | "
            f"tokens/expert (min/max/mean) {per_layer}")


def moe_alltoall_bytes(tokens: int, topk: int, hidden: int, num_experts: int, ep: int, element_bytes: int,
                       moe_layers: int = 1, micro_batches: int = 1) -> int:
    """Bytes one rank sends in expert-parallel all-to-alls (tag "ep") for ``micro_batches`` forward and
    backward passes through ``moe_layers`` MoE layers, each routing ``tokens`` rows of this rank to
    ``topk`` experts, when routing is balanced (every expert gets tokens * topk / E of them)::

        per layer and micro-batch   4 * tokens * topk * (ep-1)/ep * hidden * element_bytes
                                    (dispatch and combine, in forward and again in backward)
                                  + 8 * (E - E/ep)        (the int64 counts sent ahead of the dispatch)

    0 at ep = 1. Unbalanced routing moves what the routing says (counted exactly by the layers)."""
    if ep == 1:
        return 0
    rows = tokens * topk * (ep - 1) // ep
    return micro_batches * moe_layers * (4 * rows * hidden * element_bytes + 8 * (num_experts - num_experts // ep))


def moe_alltoall_bytes_per_step(job: JobConfig, pp_rank: int = 0) -> int:
    """:func:`moe_alltoall_bytes` for one step of ``job`` on a rank of pipeline stage ``pp_rank``
    (balanced routing; a layer full recompute runs again repeats its forward's half)."""
    cfg, par = job.model, job.parallel
    if not cfg.num_experts:
        return 0
    tokens = cfg.seq_length * job.train.micro_batch_size // (par.tp if par.sequence_parallel else 1)
    layers = again = 0                  # MoE layers of the rank's chunks; those a full recompute runs again
    for c in range(par.virtual_stages):
        ids = stage_layer_ids(cfg.num_layers, par.pp, pp_rank, par.virtual_stages, c, stage_shape(par))
        layers += sum(cfg.is_moe_layer(i) for i in ids)
        again += sum(cfg.is_moe_layer(ids[i]) for group, on in full_recompute_groups(cfg, len(ids)) if on
                     for i in group)
    e = 2 if (job.precision.bf16 or job.precision.fp16) else 4
    per_layer = moe_alltoall_bytes(tokens, cfg.moe_router_topk, cfg.hidden_size, cfg.num_experts,
                                   par.expert_model_parallel_size, e, 1, job.num_micro_batches)
    return layers * per_layer + again * per_layer // 2       # a recomputed layer's forward half again
