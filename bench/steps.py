"""One training step of each framework the rows drive in-process: megazero's engine, a torch-wrapped
model (DDP, FSDP2, ``parallelize_module``'s plain twin, ...) and DeepSpeed's engine, each written once
and called by every row that steps it.

A step takes this rank's micro-batches as ``(tokens, labels, loss_mask)`` tuples
(:func:`bench.common.step_batches`); :func:`as_tuples` and :func:`as_dicts` convert from and to the
dicts the trainer takes (:func:`bench.common.random_micro_batches`, ``megazero.training.train_step``).
Every step returns the mean loss of this rank's micro-batches as a Python float.
"""
from __future__ import annotations

import contextlib

import torch

from megazero.models.gpt import masked_mean


def as_dicts(micro: list[tuple]) -> list[dict]:
    """``(tokens, labels, loss_mask)`` micro-batches as the trainer takes them."""
    return [{"tokens": x, "labels": y, "loss_mask": m} for x, y, m in micro]


def as_tuples(micro: list[dict]) -> list[tuple]:
    """The trainer's micro-batch dicts as ``(tokens, labels, loss_mask)``."""
    return [(mb["tokens"], mb["labels"], mb["loss_mask"]) for mb in micro]


def untimed(name: str):
    """The phase context of a step nobody times."""
    return contextlib.nullcontext()


def engine_step(model, engine, micro: list[tuple], phase=untimed) -> float:
    """One step of megazero's engine on a whole-model chunk (no pipeline): ``zero_grad``, then per
    micro-batch the engine told whether it is the last (its gradient reduction waits for that), the
    forward and the backward of the loss over the micro-batch count; ``finalize_grads`` (the last
    reductions), ``step`` (clipping, the optimizer, ZeRO's parameter publication).

    The losses are read after the optimizer step, as ``train_step`` reads them: no host sync inside the
    step on a GPU. ``phase(name)`` is a context around each part of the step (``forward``,
    ``backward``, ``grad wait``, ``optimizer``) for a row that times them."""
    engine.zero_grad()
    losses = []
    for i, (x, y, m) in enumerate(micro):
        engine.before_backward(0, i == len(micro) - 1)
        with phase("forward"):
            loss = masked_mean(model(x, y), m)
        with phase("backward"):
            (loss / len(micro)).backward()
        losses.append(loss.detach())
    with phase("grad wait"):
        engine.finalize_grads()
    with phase("optimizer"):
        engine.step()
    total = 0.0
    for loss in losses:
        total += loss.item() / len(micro)
    return total


def torch_step(model, opt, micro: list[tuple], clip: float, *, no_sync=None, params=None,
               set_to_none: bool = False) -> float:
    """One step of a torch-wrapped model: forward and backward per micro-batch (``no_sync(last)``
    returns the context of a micro-batch: DDP's ``no_sync``, FSDP2's gradient-sync switch), clipping of
    ``params`` (default: the model's) at ``clip`` when above 0, the optimizer step. The gradients are
    zeroed first (``set_to_none``: freed instead)."""
    opt.zero_grad(set_to_none=set_to_none)
    total = 0.0
    for i, (x, y, m) in enumerate(micro):
        with (no_sync(i == len(micro) - 1) if no_sync else contextlib.nullcontext()):
            loss = masked_mean(model(x, y), m)
            (loss / len(micro)).backward()
        total += loss.item() / len(micro)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params if params is not None else model.parameters(), clip)
    opt.step()
    return total


def deepspeed_step(engine, micro: list[tuple]) -> float:
    """One step of a DeepSpeed engine: ``engine.backward`` divides each micro-batch's loss by its
    ``gradient_accumulation_steps`` and ``engine.step`` steps the optimizer on the accumulation
    boundary only."""
    total = 0.0
    for x, y, m in micro:
        loss = masked_mean(engine(x, y), m)
        engine.backward(loss)
        engine.step()
        total += loss.item() / len(micro)
    return total


__all__ = ["as_dicts", "as_tuples", "untimed", "engine_step", "torch_step", "deepspeed_step"]
