"""The torch.compile section of :class:`~megazero.config.sections.JobConfig` (its flags and rules)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megazero.config import checks
from megazero.config.fields import flag_field

if TYPE_CHECKING:
    from megazero.config.sections import ModelConfig

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileConfig:
    """torch.compile, applied region by region: each transformer layer its own compiled function, so
    compile time does not grow with depth and repeated layers share one graph (megazero/compile.py)."""

    compile: bool = flag_field(False, "--compile", action="store_true", group="compile",
                               help="compile each transformer layer with torch.compile (regional compilation)")
    compile_mode: str = flag_field("default", "--compile-mode", choices=COMPILE_MODES, group="compile",
                                   help="torch.compile's mode (default, reduce-overhead, max-autotune, "
                                        "max-autotune-no-cudagraphs)")

    def check(self, model: ModelConfig | None = None) -> None:
        checks.check_compile(self, model)
