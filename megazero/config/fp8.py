"""The FP8 section: which linear layers run their three matrix products in FP8, with which scaling.

Megatron-LM's flags, Megatron's defaults: ``--fp8-format e4m3|hybrid`` turns FP8 on (hybrid: e4m3 forward,
e5m2 gradients); ``--fp8-recipe`` picks how each operand's scale is found:

=============  =======================================================================================
recipe         scale of each operand of each product
=============  =======================================================================================
tensorwise     one per tensor, from its current largest magnitude (amax), agreed over the ranks that
               split the tensor (torchao's dynamic tensor-wise recipe; Megatron's "tensorwise")
rowwise        one per row along the product's inner dimension, from the current amax of that row,
               agreed the same way (torchao's row-wise recipe)
delayed        one per tensor, from the amax history of earlier steps (``--fp8-amax-history-len``
               entries, their ``max`` or ``most_recent``), agreed over every rank holding the layer at
               the end of each step (Transformer Engine's delayed scaling; Megatron's default)
=============  =======================================================================================

How the scales are agreed, and which layers take FP8: :mod:`megazero.parallel.fp8` and docs/fp8.md.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from megazero.config.fields import FLAG, flag, flag_field
from megazero.config.rules import fail

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise", "delayed")
AMAX_ALGORITHMS = ("max", "most_recent")


@dataclass
class FP8Config:
    """FP8 matrix products in the transformer layers' linear layers (off unless ``fp8_format``)."""

    fp8_format: str | None = flag_field(
        None, "--fp8-format", choices=FP8_FORMATS, group="mixed precision",
        help="FP8 matrix products in the transformer layers' linear layers: e4m3 everywhere, or hybrid "
             "(e4m3 forward, e5m2 gradients); weights, masters and checkpoints keep their precision")
    fp8_recipe: str | None = flag_field(
        None, "--fp8-recipe", choices=FP8_RECIPES, group="mixed precision",
        help="how FP8 scales are found: tensorwise or rowwise from the current values, or delayed from the "
             "amax history of earlier steps (default: delayed, as Megatron-LM)")
    fp8_amax_history_len: int | None = flag_field(
        None, "--fp8-amax-history-len", type=int, group="mixed precision",
        help="delayed recipe: steps of amax history each scale is taken from (default 1)")
    fp8_amax_compute_algo: str | None = flag_field(
        None, "--fp8-amax-compute-algo", choices=AMAX_ALGORITHMS, group="mixed precision",
        help="delayed recipe: the history's max or its most recent entry (default most_recent)")
    fp8_margin: int = flag_field(
        0, "--fp8-margin", type=int, group="mixed precision",
        help="FP8 scales are divided by 2**margin, headroom below the format's largest value (default 0)")
    fp8_head: bool = flag_field(
        False, "--fp8-head", action="store_true", group="mixed precision",
        help="the output layer's product in FP8 too (default: it stays in the parameters' precision)")
    fp8_param_gather: bool = flag_field(
        False, "--fp8-param-gather", action="store_true", group="mixed precision",
        help="ZeRO's parameter all-gathers send the FP8 layers' weights in FP8 (half of bf16's bytes); "
             "needs --zero-stage 1-3 and a tensor-wise scale (tensorwise or delayed)")

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None

    @property
    def recipe(self) -> str:
        return self.fp8_recipe or "delayed"

    @property
    def history_len(self) -> int:
        return self.fp8_amax_history_len or 1

    @property
    def amax_compute_algo(self) -> str:
        return self.fp8_amax_compute_algo or "most_recent"

    def check(self, zero_stage: int, quantized_weights: bool = False) -> None:
        """FP8 settings only with ``--fp8-format``; history settings only with the delayed recipe; the FP8
        parameter all-gather only where ZeRO gathers parameters, the scale is one per tensor and ZeRO++'s
        int8 gather (``quantized_weights``) does not take the weights; torchao (the scaling and casting
        code) installed."""
        given = [name for name in ("fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo")
                 if getattr(self, name) is not None]
        given += [name for name in ("fp8_margin", "fp8_head", "fp8_param_gather") if getattr(self, name)]
        if not self.enabled:
            if given:
                fail(f"{flag(given[0])} sets up FP8 training, which is off: add {FLAG.fp8_format} e4m3 or hybrid, "
                     f"or drop it")
            return
        if self.fp8_amax_history_len is not None and self.fp8_amax_history_len < 1:
            fail(f"{FLAG.fp8_amax_history_len} must be a positive integer, got {self.fp8_amax_history_len}")
        if self.fp8_margin < 0:
            fail(f"{FLAG.fp8_margin} must be >= 0, got {self.fp8_margin}")
        if self.recipe != "delayed":
            for name in ("fp8_amax_history_len", "fp8_amax_compute_algo"):
                if getattr(self, name) is not None:
                    fail(f"{flag(name)} is a setting of the delayed recipe; {FLAG.fp8_recipe} {self.recipe} scales "
                         f"from the current values: drop it, or use {FLAG.fp8_recipe} delayed")
        if self.fp8_param_gather:
            if zero_stage == 0:
                fail(f"{FLAG.fp8_param_gather} shrinks ZeRO's parameter all-gather, which --zero-stage 0 does not "
                     f"run: use --zero-stage 1, 2 or 3, or drop it")
            if self.recipe == "rowwise":
                fail(f"{FLAG.fp8_param_gather} sends each weight in FP8 with one scale, and {FLAG.fp8_recipe} "
                     f"rowwise scales each row: use tensorwise or delayed, or drop {FLAG.fp8_param_gather}")
            if quantized_weights:
                fail(f"{FLAG.fp8_param_gather} and {FLAG.quantized_weights} both shrink the parameter all-gather "
                     f"(FP8 weights, int8 blocks): pick one of them")
        if importlib.util.find_spec("torchao") is None:
            fail(f"{FLAG.fp8_format} uses torchao's FP8 scaling and casting, which is not installed: "
                 f"pip install 'megazero[fp8]' (or torchao)")
