"""The optimizer section: AdamW or Muon, and the learning-rate schedule (Megatron's flags: warmup and decay in
iterations, or in samples for a sample-based run).

``--optimizer muon`` steps the transformer layers' matrices with Muon (momentum orthogonalised by Newton-Schulz,
:mod:`megazero.parallel.zero.muon`) and every other parameter (embeddings, the output layer, norms, biases) with
AdamW under the same learning-rate schedule and weight decay, as Moonlight and ``torch.optim.Muon``'s docs advise.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from megazero.config.fields import FLAG, flag, flag_field
from megazero.config.rules import fail, one_of, positive_float
from megazero.config.train import TrainConfig
from megazero.config.zero import ZeroConfig

DECAY_STYLES = ("constant", "linear", "cosine")
# Megatron-LM's spellings: its "adam" is AdamW (decoupled weight decay); "dist_muon" is its Muon under the
# distributed optimizer, which is how Muon always runs here
OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "muon": "muon", "dist_muon": "muon"}
MUON_ADJUST_LR = ("match_rms_adamw", "original")


def iterations_of(samples: float, global_batch_size: int) -> int:
    """The iterations ``samples`` samples last at ``global_batch_size`` a step, rounded up: the iteration at
    which Megatron's sample-counting schedule reaches that point (a float's last bit never adds one)."""
    return math.ceil(round(samples / global_batch_size, 9))


@dataclass
class OptimizerConfig:
    """AdamW or Muon, and the learning-rate schedule."""

    optimizer: str = flag_field(
        "adamw", "--optimizer", choices=tuple(OPTIMIZERS), group="optimizer",
        help="adamw (Megatron's adam), or muon (Megatron's dist_muon): the transformer layers' matrices under "
             "Muon, the other parameters under AdamW")
    muon_momentum: float = flag_field(0.95, "--muon-momentum", type=float, group="optimizer",
                                      help="Muon's momentum")
    muon_nesterov: bool = flag_field(True, "--muon-nesterov", "--muon-use-nesterov",
                                     action=argparse.BooleanOptionalAction, group="optimizer",
                                     help="Muon orthogonalises the Nesterov look-ahead of its momentum")
    muon_ns_steps: int = flag_field(5, "--muon-ns-steps", "--muon-num-ns-steps", type=int, group="optimizer",
                                    help="Newton-Schulz iterations of each Muon update")
    muon_ns_dtype: str = flag_field(
        "fp32", "--muon-ns-dtype", choices=("fp32", "bf16"), group="optimizer",
        help="the type Newton-Schulz runs in: fp32 (as Megatron-LM's Muon), or bf16 (as torch.optim.Muon: faster on "
             "tensor cores, and the orthogonalised update then depends on the rounding of every input bit)")
    muon_adjust_lr: str = flag_field(
        "match_rms_adamw", "--muon-adjust-lr", choices=MUON_ADJUST_LR, group="optimizer",
        help="match_rms_adamw: the update of an A x B matrix scaled by 0.2 sqrt(max(A, B)), so AdamW's --lr and "
             "--weight-decay carry over (Moonlight); original: sqrt(max(1, A / B)) (Keller Jordan's)")
    lr: float = flag_field(1.5e-3, "--lr", type=float, group="optimizer", help="the peak learning rate", metavar="LR")
    min_lr: float = flag_field(0.0, "--min-lr", type=float, group="optimizer", metavar="LR",
                               help="the learning rate at the end of the decay")
    decoupled_lr: float | None = flag_field(
        None, "--decoupled-lr", type=float, group="optimizer", metavar="LR",
        help="the peak learning rate of the input embedding and the output layer (default: --lr), under the same "
             "warmup and decay")
    decoupled_min_lr: float | None = flag_field(
        None, "--decoupled-min-lr", type=float, group="optimizer", metavar="LR",
        help="with --decoupled-lr: their learning rate at the end of the decay (default: --min-lr)")
    lr_warmup_iters: int = flag_field(0, "--lr-warmup-iters", type=int, group="optimizer",
                                      help="iterations of linear warmup from 0")
    lr_warmup_fraction: float | None = flag_field(
        None, "--lr-warmup-fraction", type=float, group="optimizer", metavar="F",
        help="warmup over this fraction of the decay iterations (or samples), rounded up to whole iterations")
    lr_warmup_samples: int | None = flag_field(
        None, "--lr-warmup-samples", type=int, group="optimizer",
        help="with --train-samples: warmup samples, as iterations of --global-batch-size (rounded up)")
    lr_decay_iters: int | None = flag_field(
        None, "--lr-decay-iters", type=int, group="optimizer",
        help="iterations to the end of the decay (default: the training iterations)")
    lr_decay_samples: int | None = flag_field(
        None, "--lr-decay-samples", type=int, group="optimizer",
        help="with --train-samples: samples to the end of the decay (default: all), as iterations (rounded up)")
    lr_decay_style: str = flag_field("cosine", "--lr-decay-style", choices=DECAY_STYLES, group="optimizer",
                                     help="the decay after the warmup")
    min_lr_ratio: float | None = None           # (DeepSpeed's cos_min_ratio) min_lr = this * lr
    lr_warmup_style: str = "linear"             # or "log" (DeepSpeed's default warmup_type): megazero.lr_schedule
    weight_decay: float = flag_field(0.01, "--weight-decay", type=float, group="optimizer",
                                     help="AdamW's decoupled weight decay")
    adam_beta1: float = flag_field(0.9, "--adam-beta1", type=float, group="optimizer", help="AdamW's beta1")
    adam_beta2: float = flag_field(0.999, "--adam-beta2", type=float, group="optimizer", help="AdamW's beta2")
    adam_eps: float = flag_field(1e-8, "--adam-eps", type=float, group="optimizer", help="AdamW's epsilon")
    clip_grad: float = flag_field(1.0, "--clip-grad", type=float, group="optimizer",
                                  help="gradient norm clip (0: none)")

    @property
    def muon(self) -> bool:
        """Muon steps the layers' matrices (``--optimizer muon`` or ``dist_muon``)."""
        return OPTIMIZERS.get(self.optimizer) == "muon"

    def check(self, t: TrainConfig, zero: ZeroConfig | None = None) -> None:
        """The optimizer's settings and the schedule; fills ``min_lr`` from ``min_lr_ratio`` (a DeepSpeed
        setting, no flag), ``lr_decay_iters`` (default: the training iterations) and ``decoupled_min_lr``
        (default: ``min_lr``, as Megatron-LM's, when ``decoupled_lr`` is given)."""
        self._check_muon(zero or ZeroConfig())
        if self.min_lr_ratio is not None:
            if not 0 <= self.min_lr_ratio <= 1:
                fail(f"the minimum learning-rate ratio must be in [0, 1], got {self.min_lr_ratio}")
            self.min_lr = self.min_lr_ratio * self.lr
        one_of(self, "lr_decay_style")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            fail(f"need 0 <= {FLAG.min_lr} ({self.min_lr}) <= {FLAG.lr} ({self.lr}) and {FLAG.lr} > 0")
        self._check_decoupled()
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            fail(f"{FLAG.lr_warmup_fraction} must be in [0, 1], got {self.lr_warmup_fraction}")
        self._samples_to_iterations(t)
        if self.lr_decay_iters is None:
            self.lr_decay_iters = t.train_iters
        if self.lr_warmup_fraction is not None and t.train_samples is None:    # the warmup's share of the decay
            self.lr_warmup_iters = iterations_of(self.lr_warmup_fraction * self.lr_decay_iters, 1)
        if self.lr_decay_iters < 1:
            fail(f"{FLAG.lr_decay_iters} must be a positive integer, got {self.lr_decay_iters}: leave it out to decay "
                  f"over the training iterations ({FLAG.lr_decay_style} constant for no decay)")
        if self.lr_warmup_iters < 0 or self.lr_warmup_iters > self.lr_decay_iters:
            fail(f"{FLAG.lr_warmup_iters} {self.lr_warmup_iters} must be between 0 and {FLAG.lr_decay_iters} "
                  f"{self.lr_decay_iters}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            fail(f"{FLAG.adam_beta1} and {FLAG.adam_beta2} must be in [0, 1)")
        if self.clip_grad < 0 or self.weight_decay < 0:
            fail(f"{FLAG.clip_grad} and {FLAG.weight_decay} must be >= 0")
        positive_float(self.adam_eps, "adam_eps")

    def _check_muon(self, zero: ZeroConfig) -> None:
        """Muon's settings: given only with ``--optimizer muon``; its state stays where the parameters are."""
        if self.optimizer not in OPTIMIZERS:
            fail(f"{FLAG.optimizer} {self.optimizer} does not exist here: use one of {', '.join(OPTIMIZERS)}")
        defaults = OptimizerConfig()
        changed = [flag(n) for n in ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_dtype",
                                          "muon_adjust_lr")
                   if getattr(self, n) != getattr(defaults, n)]
        if not self.muon:
            if changed:
                fail(f"{changed[0]} sets Muon, but {FLAG.optimizer} is {self.optimizer}: add {FLAG.optimizer} muon, "
                     f"or drop {changed[0]}")
            return
        one_of(self, "muon_adjust_lr")
        one_of(self, "muon_ns_dtype")
        if not 0 <= self.muon_momentum < 1:
            fail(f"{FLAG.muon_momentum} must be in [0, 1), got {self.muon_momentum}")
        if not 1 <= self.muon_ns_steps < 100:
            fail(f"{FLAG.muon_ns_steps} must be between 1 and 99, got {self.muon_ns_steps}")
        if zero.offload_optimizer != "none":
            fail(f"{FLAG.optimizer} muon with {FLAG.offload_optimizer} {zero.offload_optimizer}: Muon's state "
                 f"stays on the device (the offloaded step is AdamW's): drop {FLAG.offload_optimizer}, or use "
                 f"{FLAG.optimizer} adamw")

    def _check_decoupled(self) -> None:
        """The input embedding's and output layer's own peak and final learning rates (Megatron-LM's
        ``--decoupled-lr`` / ``--decoupled-min-lr``): a positive peak, a final rate only beside a peak."""
        if self.decoupled_lr is None:
            if self.decoupled_min_lr is not None:
                fail(f"{FLAG.decoupled_min_lr} needs {FLAG.decoupled_lr} (the peak it decays from): add it, or drop "
                     f"{FLAG.decoupled_min_lr} (every parameter then follows {FLAG.min_lr})")
            return
        if self.decoupled_min_lr is None:
            self.decoupled_min_lr = self.min_lr
        if self.decoupled_lr <= 0 or self.decoupled_min_lr < 0 or self.decoupled_min_lr > self.decoupled_lr:
            fail(f"need 0 <= {FLAG.decoupled_min_lr} ({self.decoupled_min_lr}) <= {FLAG.decoupled_lr} "
                 f"({self.decoupled_lr}) and {FLAG.decoupled_lr} > 0 ({FLAG.decoupled_min_lr} defaults to "
                 f"{FLAG.min_lr})")

    def _samples_to_iterations(self, t: TrainConfig) -> None:
        """Megatron's rules for the schedule's units: a sample-based run (``--train-samples``) gives its decay and
        warmup in samples, an iteration-based one in iterations, and a warmup fraction excludes a warmup length.
        Samples become iterations of the global batch (:func:`iterations_of`)."""
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            given = FLAG.lr_warmup_iters if self.lr_warmup_iters else FLAG.lr_warmup_samples
            fail(f"{FLAG.lr_warmup_fraction} and {given} both set the warmup: keep one")
        if t.train_samples is None:
            for name, instead in (("lr_decay_samples", "lr_decay_iters"), ("lr_warmup_samples", "lr_warmup_iters")):
                if getattr(self, name) is not None:
                    fail(f"{flag(name)} belongs to a sample-based run ({FLAG.train_samples}); with iterations "
                         f"({FLAG.train_iters}) use {flag(instead)}")
            return
        for name, instead in (("lr_decay_iters", "lr_decay_samples"), ("lr_warmup_iters", "lr_warmup_samples")):
            if getattr(self, name):
                fail(f"{flag(name)} belongs to an iteration-based run; with {FLAG.train_samples} use {flag(instead)}")
        for name in ("lr_decay_samples", "lr_warmup_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                fail(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        decay = self.lr_decay_samples if self.lr_decay_samples is not None else t.train_samples
        self.lr_decay_iters = iterations_of(decay, t.global_batch_size)
        warmup = decay * self.lr_warmup_fraction if self.lr_warmup_fraction is not None else self.lr_warmup_samples or 0
        self.lr_warmup_iters = iterations_of(warmup, t.global_batch_size)
