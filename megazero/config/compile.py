"""The compile section: torch.compile, applied region by region (:mod:`megazero.compile`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.fields import FLAG, flag_field
from megazero.config.fp8 import FP8Config
from megazero.config.model import ModelConfig
from megazero.config.parallel import ParallelConfig
from megazero.config.rules import fail, one_of

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

    def check(self, m: ModelConfig | None = None, parallel: ParallelConfig | None = None,
              fp8: FP8Config | None = None) -> None:
        """A compile mode only with compilation on (whether torch can compile on this machine is the
        pre-launch check's: megazero/cli/preflight.py); with the model, the activation-memory choices a compiled
        layer can hold (full recompute wraps the compiled layers; selective recompute and offload hook into
        the layer's inside, which dynamo would break into pieces)."""
        one_of(self, "compile_mode")
        if self.compile_mode != "default" and not self.compile:
            fail(f"{FLAG.compile_mode} {self.compile_mode} applies with {FLAG.compile}: add {FLAG.compile} or drop "
                  f"{FLAG.compile_mode}")
        if self.compile and m is not None and (m.recompute_granularity == "selective" or m.cpu_offloading):
            fail(f"{FLAG.compile} compiles whole layers, which {FLAG.recompute_granularity} selective and "
                  f"{FLAG.cpu_offloading} reach inside: use full recompute ({FLAG.recompute_granularity} full) with "
                  f"{FLAG.compile}, or drop {FLAG.compile}")
        if self.compile and parallel is not None and parallel.cp > 1:
            fail(f"{FLAG.cp} {parallel.cp} with {FLAG.compile} is not built (the attention's collectives sit inside "
                 f"the compiled layers): drop {FLAG.compile}")
        if self.compile and fp8 is not None and fp8.enabled:
            fail(f"{FLAG.fp8_format} with {FLAG.compile} is not built (compiled FP8 layers are not proven equal to "
                 f"eager ones, and the delayed recipe's amax records do not compile): drop {FLAG.compile}")
