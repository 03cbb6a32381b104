"""Dynamic loss scaling for fp16 training (bf16 and fp32 need none).

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero;
the optimizer divides the gradients by it again. When any rank finds an inf/nan gradient the step
is skipped and :meth:`DynamicLossScaler.update` is told so:

* an overflow decrements the hysteresis counter; when it reaches 0 the scale is multiplied by
  ``backoff_factor`` (never below ``min_scale``). With ``hysteresis=1`` every overflow halves it;
  with the default 2 the first overflow after a growth is tolerated (the step is still skipped).
* ``growth_interval`` overflow-free steps in a row multiply the scale by ``growth_factor`` and
  refill the hysteresis counter.

Example: initial 2**16, hysteresis 1 -> overflow -> 2**15 -> 1000 clean steps -> 2**16.
"""
from __future__ import annotations

from megazero.config import FLAG, PrecisionConfig


class DynamicLossScaler:
    def __init__(self, initial_scale: float = 2.0 ** 16, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(f"{FLAG.initial_loss_scale} and {FLAG.min_loss_scale} must be > 0")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"{FLAG.loss_scale_window} and {FLAG.hysteresis} must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "DynamicLossScaler":
        return cls(cfg.initial_loss_scale, cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (skipped) or did not overflow."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
