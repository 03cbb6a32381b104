"""The learning-rate schedule: a pure function of the iteration (Megatron's warmup and decay rule).

    learning_rate(it, OptimizerConfig(lr=6e-4, min_lr=6e-5, lr_warmup_iters=500, lr_decay_iters=10000))

Warmup 0.0012 x (it + 1) / 500 ... reaches 6e-4 at it = 499, then cosine to 6e-5 at it = 10000. Being
a function of the iteration alone, the schedule's position in a checkpoint is just the iteration.

With ``--decoupled-lr`` the input embedding and the output layer follow the same warmup and decay between
their own peak and final rates (:func:`decoupled_learning_rate`; Megatron-LM's param groups with their own
``max_lr`` / ``min_lr``).
"""
from __future__ import annotations

import math

from megazero.config import OptimizerConfig


def learning_rate(iteration: float, cfg: OptimizerConfig) -> float:
    """LR for a 0-based iteration (fractional under a batch-size schedule: ``TrainConfig.lr_position``): linear
    warmup to ``lr``, then decay to ``min_lr`` (Megatron's rule).

    Warmup: lr * (it + 1) / warmup_iters for it < warmup_iters (``lr_warmup_style`` "log", DeepSpeed's
    default warmup_type: lr * min(1, log(it + 2) / log(warmup_iters)), the same step indexing). Decay over
    [warmup_iters, lr_decay_iters]: constant, linear or cosine from lr to min_lr; min_lr after that.
    """
    return _scheduled(iteration, cfg, cfg.lr, cfg.min_lr)


def decoupled_learning_rate(iteration: int, cfg: OptimizerConfig) -> float | None:
    """The input embedding's and output layer's LR for a 0-based iteration (``--decoupled-lr``): the shape
    of :func:`learning_rate` between ``decoupled_lr`` and ``decoupled_min_lr``; None when not given (they
    follow :func:`learning_rate`)."""
    if cfg.decoupled_lr is None:
        return None
    floor = cfg.decoupled_min_lr if cfg.decoupled_min_lr is not None else cfg.min_lr
    return _scheduled(iteration, cfg, cfg.decoupled_lr, floor)


def _scheduled(iteration: int, cfg: OptimizerConfig, peak: float, floor: float) -> float:
    """The schedule's warmup to ``peak`` and decay to ``floor`` (see :func:`learning_rate`)."""
    if cfg.lr_warmup_iters and iteration < cfg.lr_warmup_iters:
        if cfg.lr_warmup_style == "log":        # DeepSpeed's log(step + 1) / log(W) at its step it + 1
            return peak * min(1.0, math.log(iteration + 2) / math.log(max(2, cfg.lr_warmup_iters)))
        return peak * min(1.0, (iteration + 1) / cfg.lr_warmup_iters)   # a fractional step (a batch schedule)
    if cfg.lr_decay_style == "constant":
        return peak
    decay_iters = cfg.lr_decay_iters - cfg.lr_warmup_iters
    if decay_iters <= 0 or iteration >= cfg.lr_decay_iters:
        return floor
    ratio = (iteration - cfg.lr_warmup_iters) / decay_iters
    coeff = 1.0 - ratio if cfg.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return floor + coeff * (peak - floor)
