"""What the training loop, checkpoints and tools drive of a gradient / optimizer engine: the
:class:`Engine` protocol. :class:`megazero.parallel.zero.engine.ZeroEngine` (ZeRO 0-3 over bucket groups)
is the one implementation; another (a replica dimension, another optimizer) satisfies the same methods.

One step, on every rank::

    engine.set_lr(lr); engine.zero_grad()
    run_schedule(chunks, micro_batches, ..., loss_scale=engine.loss_scale, grad_sync=engine)   # hooks below
    engine.finalize_grads()
    grad_norm, skipped = engine.step(iteration)

During the schedule the pipeline runner calls the engine's gradient-sync hooks
(:class:`megazero.parallel.pipeline.runner.GradSyncHooks`): before each chunk's backward, before a split
backward's input half and around its weight half, so that buckets reduce as the backward fills them.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from megazero.parallel.counted_comm import CommLog
from megazero.parallel.pipeline.runner import GradSyncHooks


class Engine(GradSyncHooks, Protocol):
    """The engine's side of a step, of a checkpoint and of a whole-model gather (see the module
    docstring). Collective methods say so: every rank calls them."""

    comm_log: CommLog                           # the bytes its collectives sent, by tag

    def zero_grad(self) -> None: ...

    def finalize_grads(self) -> None:
        """Finish the gradient reductions of the step (collective)."""

    def step(self, iteration: int | None = None) -> tuple[float, bool]:
        """(global gradient norm, skipped) of one optimizer step (collective)."""

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """This step's learning rate, and that of the embedding and output layer (``--decoupled-lr``; None:
        ``lr``)."""

    @property
    def loss_scale(self) -> float: ...

    @property
    def params_overflowed(self) -> bool:
        """Did the last applied step leave a non-finite fp16/bf16 parameter on any rank?"""

    def nonfinite_parameters(self, limit: int = 3, everywhere: bool = False) -> list[str]:
        """Names of parameters whose reduced gradient is not finite (``everywhere``: collective)."""

    def model_state_bytes(self) -> dict[str, int]: ...

    def saved_pieces(self) -> list:
        """What this rank writes to a checkpoint (:class:`~megazero.parallel.zero.engine.StatePiece`)."""

    def loaded_pieces(self, weights_only: bool = False) -> list: ...

    def loaded(self, step: int, loss_scaler: dict | None, weights_only: bool) -> None: ...

    def gathered_parameters(self, write_back: bool = False) -> AbstractContextManager[None]:
        """Inside: every parameter holds its full tp-local value (collective at ZeRO-3)."""

    def close(self) -> None: ...
