"""The mixed-precision section: bf16 or fp16 parameters with fp32 masters, and fp16's dynamic loss
scaling.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.fields import FLAG, flag_field
from megazero.config.rules import fail, positive, positive_float


@dataclass
class PrecisionConfig:
    """Mixed precision and fp16's dynamic loss scaling."""

    bf16: bool = flag_field(False, "--bf16", action="store_true", group="mixed precision",
                            help="bf16 parameters and compute, fp32 master weights in the optimizer")
    fp16: bool = flag_field(False, "--fp16", action="store_true", group="mixed precision",
                            help="fp16 parameters and compute with dynamic loss scaling, fp32 master weights")
    initial_loss_scale: float = flag_field(2.0 ** 16, "--initial-loss-scale", type=float, group="mixed precision",
                                           help="fp16: the first loss scale")
    min_loss_scale: float = flag_field(1.0, "--min-loss-scale", type=float, group="mixed precision",
                                       help="fp16: the scale is never lowered below this")
    loss_scale_window: int = flag_field(1000, "--loss-scale-window", type=int, group="mixed precision",
                                        help="fp16: steps without an overflow before the scale doubles")
    hysteresis: int = flag_field(2, "--hysteresis", type=int, group="mixed precision",
                                 help="fp16: overflows before the scale is halved")
    max_consecutive_skipped_steps: int = flag_field(
        20, "--max-consecutive-skipped-steps", type=int, group="mixed precision",
        help="stop after this many skipped (overflowed) steps in a row (default 20)")

    def check(self) -> None:
        """One of bf16 / fp16 / fp32, and fp16's loss scaling."""
        if self.bf16 and self.fp16:
            fail(f"{FLAG.bf16} and {FLAG.fp16} are exclusive: pick one")
        for name in ("initial_loss_scale", "min_loss_scale"):
            positive_float(getattr(self, name), name)
        if self.min_loss_scale > self.initial_loss_scale:
            fail(f"{FLAG.min_loss_scale} {self.min_loss_scale} is above {FLAG.initial_loss_scale} "
                 f"{self.initial_loss_scale}")
        for name in ("loss_scale_window", "hysteresis", "max_consecutive_skipped_steps"):
            positive(getattr(self, name), name)

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
