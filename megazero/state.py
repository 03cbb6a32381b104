"""What a run's position is, besides weights and optimizer state: saved in checkpoints, resumed from."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """What a resume needs besides weights and optimizer state."""

    iteration: int = 0              # optimizer steps taken
    consumed_samples: int = 0       # global samples consumed (the data order depends only on this)
    skipped_iterations: int = 0     # fp16 steps skipped on overflow
