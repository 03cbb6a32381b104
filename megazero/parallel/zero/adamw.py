"""AdamW's arithmetic on flat fp32 tensors, and which parameters get weight decay.

The ZeRO optimizer (:mod:`.optimizer`) keeps master weights and moments as flat fp32 tensors (one per
owned bucket range), wherever they live (on the device, or on the host: :mod:`.offload`), so the update
is written here once on flat tensors, through torch's fused AdamW kernel: the same arithmetic as
``torch.optim.AdamW``, so results agree to float rounding.

Weight decay (GPT-2 / Megatron practice): matrices and embeddings decay, biases and norm weights
(every 1-D parameter) do not. Inside a flat shard that is a list of element ranges.

Learning rate (Megatron-LM's ``--decoupled-lr``): the parameters marked ``embedding_or_output``
(:mod:`megazero.parallel.params`) may step with their own rate; inside a flat shard that is another list of
element ranges, and the update runs once per rate over views of those ranges.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from megazero.parallel.params import attribute


def decays(shape: torch.Size | tuple[int, ...]) -> bool:
    """True for weights (>= 2-D: linear, embedding); False for biases and norm parameters (1-D)."""
    return len(shape) >= 2


def wants_weight_decay(param: nn.Parameter) -> bool:
    """:func:`decays` for a parameter."""
    return decays(param.shape)


def weight_decay_groups(named_params, weight_decay: float) -> list[dict]:
    """torch.optim param groups with the same rule (for single-process reference runs)."""
    named_params = list(named_params)
    no_decay = [p for _, p in named_params if not wants_weight_decay(p)]
    decay = [p for _, p in named_params if wants_weight_decay(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def reference_param_groups(named_params, weight_decay: float, decoupled_lr: float | None) -> list[dict]:
    """:func:`weight_decay_groups` with the ``embedding_or_output`` parameters in groups of their own at
    ``decoupled_lr`` (all in the plain groups when None), for single-process reference runs."""
    named_params = list(named_params)
    own = [(n, p) for n, p in named_params if decoupled_lr is not None and attribute(p, "embedding_or_output")]
    rest = [(n, p) for n, p in named_params if not (decoupled_lr is not None and attribute(p, "embedding_or_output"))]
    groups = weight_decay_groups(rest, weight_decay)
    if own:
        groups += [dict(g, lr=decoupled_lr) for g in weight_decay_groups(own, weight_decay)]
    return [g for g in groups if g["params"]]


def clip_ranges(ranges: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """The parts of ``ranges`` inside [a, b), relative to a."""
    return [(max(x, a) - a, min(y, b) - a) for x, y in ranges if max(x, a) < min(y, b)]


def complement_ranges(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The elements of [0, n) outside the sorted, disjoint ``ranges``."""
    out, at = [], 0
    for a, b in ranges:
        if at < a:
            out.append((at, a))
        at = max(at, b)
    return out + ([(at, n)] if at < n else [])


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and merge touching [a, b) ranges: fewer, longer in-place ops."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@torch.no_grad()
def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, decay_ranges: list[list[tuple[int, int]]],
                 decoupled_lr: float | None = None,
                 decoupled_ranges: list[list[tuple[int, int]]] | None = None,
                 only_ranges: list[list[tuple[int, int]]] | None = None) -> None:
    """One AdamW step on lists of flat fp32 tensors, in place; decay only on ``decay_ranges[i]`` of
    ``params[i]``; the sorted, disjoint ``decoupled_ranges[i]`` step at ``decoupled_lr`` instead of ``lr``
    (when both are given; decay there is ``decoupled_lr * weight_decay``, as in a torch param group);
    ``only_ranges[i]`` (sorted, disjoint): the elements of ``params[i]`` AdamW steps (None: all; under
    ``--optimizer muon`` Muon steps the others). ``step`` counts from 1."""
    state = (params, grads, exp_avgs, exp_avg_sqs)
    if only_ranges is not None:
        cuts = [(i, a, b) for i, ranges in enumerate(only_ranges) for a, b in ranges]
        views = [[t[i][a:b] for i, a, b in cuts] for t in state]
        adamw_update(*views, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     decay_ranges=[clip_ranges(decay_ranges[i], a, b) for i, a, b in cuts],
                     decoupled_lr=decoupled_lr,
                     decoupled_ranges=None if decoupled_ranges is None else
                     [clip_ranges(decoupled_ranges[i], a, b) for i, a, b in cuts])
        return
    if decoupled_lr is None or decoupled_lr == lr or not decoupled_ranges or not any(decoupled_ranges):
        _adamw_step(*state, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    decay_ranges=decay_ranges)
        return
    others = [complement_ranges(own, p.numel()) for own, p in zip(decoupled_ranges, params)]
    for group_lr, groups in ((lr, others), (decoupled_lr, decoupled_ranges)):
        cuts = [(i, a, b) for i, ranges in enumerate(groups) for a, b in ranges]
        views = [[t[i][a:b] for i, a, b in cuts] for t in state]
        _adamw_step(*views, step=step, lr=group_lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    decay_ranges=[clip_ranges(decay_ranges[i], a, b) for i, a, b in cuts])


def _adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, decay_ranges: list[list[tuple[int, int]]]) -> None:
    """:func:`adamw_update` at one learning rate. The arithmetic of ``torch.optim.AdamW``::

        p *= 1 - lr * wd                       (decay ranges only)
        m  = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g^2
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    The decay, moment and parameter update is torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``,
    CPU and CUDA): one pass over every tensor, no temporaries, and a handful of kernel launches for the whole
    model instead of several per tensor (which left a GPU step launch-bound). It runs twice: over the decayed
    slices with the kernel's own decay (on a CPU bitwise the separate ``p *= 1 - lr * wd`` before it), and over
    the rest without.
    """
    state = (params, grads, exp_avgs, exp_avg_sqs)
    if weight_decay != 0.0 and lr != 0.0:
        decayed = [(i, a, b) for i, ranges in enumerate(decay_ranges) for a, b in ranges if b > a]
        kept = [(i, a, b) for i, p in enumerate(params) for a, b in complement_ranges(decay_ranges[i], p.numel())]
        groups = ((decayed, weight_decay), (kept, 0.0))
    else:
        groups = (([(i, 0, p.numel()) for i, p in enumerate(params) if p.numel() > 0], 0.0),)
    for cuts, decay in groups:
        if not cuts:
            continue
        views = [[t[i][a:b] for i, a, b in cuts] for t in state]
        steps = [torch.tensor(float(step), dtype=torch.float32, device=v.device) for v in views[0]]
        torch._fused_adamw_(*views, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=decay, eps=eps,
                            amsgrad=False, maximize=False)
