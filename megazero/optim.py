"""AdamW on flat fp32 tensors, and which parameters get weight decay.

The ZeRO optimizer keeps master weights and moments as flat fp32 tensors (one per bucket shard),
so the update is written here once on flat tensors. It is the same arithmetic, in the same order,
as ``torch.optim.AdamW`` (single-tensor path), so results agree to float rounding.

Weight decay (GPT-2 / Megatron practice): matrices and embeddings decay, biases and norm weights
(every 1-D parameter) do not. Inside a flat shard that is a list of element ranges.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn


def wants_weight_decay(param: nn.Parameter) -> bool:
    """True for weights (>= 2-D: linear, embedding); False for biases and norm parameters (1-D)."""
    return param.dim() >= 2


def weight_decay_groups(named_params, weight_decay: float) -> list[dict]:
    """torch.optim param groups with the same rule (for single-process reference runs)."""
    named_params = list(named_params)
    no_decay = [p for _, p in named_params if not wants_weight_decay(p)]
    decay = [p for _, p in named_params if wants_weight_decay(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 decay_ranges: list[tuple[int, int]]) -> None:
    """One AdamW step on flat fp32 tensors, in place; decay only on ``decay_ranges`` of ``param``.

    ``step`` counts from 1. Matches ``torch.optim.AdamW(..., foreach=False)``::

        p *= 1 - lr * wd                       (decay ranges only)
        m  = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g^2
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    """
    if weight_decay != 0.0 and lr != 0.0:
        for a, b in decay_ranges:
            param[a:b].mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    # The denominator in chunks through one small buffer: a whole-shard temporary would add
    # 4 bytes per element (two, briefly) to the step's peak memory. Same per-element arithmetic.
    denom = torch.empty(min(param.numel(), _DENOM_CHUNK), dtype=exp_avg_sq.dtype, device=exp_avg_sq.device)
    for a in range(0, param.numel(), _DENOM_CHUNK):
        b = min(a + _DENOM_CHUNK, param.numel())
        d = torch.sqrt(exp_avg_sq[a:b], out=denom[:b - a])
        d.div_(bias_correction2_sqrt).add_(eps)
        param[a:b].addcdiv_(exp_avg[a:b], d, value=-lr / bias_correction1)


_DENOM_CHUNK = 1 << 18      # elements (1 MiB in fp32) per chunk of the AdamW denominator
