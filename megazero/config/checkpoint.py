"""The checkpointing section: where checkpoints are written and read, and what a resume takes from them.

A resumed run continues the checkpoint's global batch and learning-rate schedule (Megatron-LM's
``OptimizerParamScheduler`` checks the same): a run whose flags give another one is refused before any
process group unless ``--use-checkpoint-opt_param-scheduler`` (keep the checkpoint's) or
``--override-opt_param-scheduler`` (take the flags') says which (:meth:`CheckpointConfig.resumed_schedule`).
It continues the checkpoint's optimizer too: AdamW's moments and Muon's momentum are different state, so a run
whose ``--optimizer`` steps with another one than the checkpoint's state was written by is refused unless
``--no-load-optim`` starts the optimizer fresh (:meth:`CheckpointConfig.check_resumed_optimizer`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megazero.config.fields import FLAG, flag_field, setting
from megazero.config.optimizer import OPTIMIZERS, OptimizerConfig
from megazero.config.rules import fail
from megazero.config.train import TrainConfig

# What a resumed run continues, as a checkpoint's job stores it (resolved: the decay and warmup in
# iterations, min_lr from a ratio). The training length counts through the decay, which follows it by
# default: a longer run with the same decay keeps its schedule, as in Megatron-LM.
SCHEDULE = (("train", "global_batch_size"), ("train", "step_batch_size_schedule"),
            ("optimizer", "lr"), ("optimizer", "min_lr"),
            ("optimizer", "decoupled_lr"), ("optimizer", "decoupled_min_lr"),
            ("optimizer", "lr_warmup_iters"), ("optimizer", "lr_warmup_style"), ("optimizer", "lr_decay_iters"),
            ("optimizer", "lr_decay_style"), ("optimizer", "weight_decay"))
OPTIMIZER = {name for section, name in SCHEDULE if section == "optimizer"}


@dataclass
class CheckpointConfig:
    """Where checkpoints are written and read."""

    save: str | None = flag_field(None, "--save", group="checkpointing", metavar="DIR", help="where checkpoints go")
    load: str | None = flag_field(None, "--load", group="checkpointing", metavar="DIR",
                                  help="checkpoint directory to resume (or, with --finetune, start) from")
    save_interval: int | None = flag_field(None, "--save-interval", type=int, group="checkpointing",
                                           help="iterations between checkpoints")
    finetune: bool = flag_field(False, "--finetune", action="store_true", group="checkpointing",
                                help="load weights only: no optimizer, iteration 0")
    no_load_optim: bool = flag_field(False, "--no-load-optim", action="store_true", group="checkpointing",
                                     help="resume weights, iteration and RNG from --load, with a fresh optimizer")
    no_load_rng: bool = flag_field(False, "--no-load-rng", action="store_true", group="checkpointing",
                                   help="resume from --load with random states fresh from --seed")
    use_checkpoint_args: bool = flag_field(
        False, "--use-checkpoint-args", action="store_true", group="checkpointing",
        help="take the model's shape from the --load checkpoint, its sequence length and tokenizer too if not given")
    async_save: bool = flag_field(False, "--async-save", action="store_true", group="checkpointing",
                                  help="write and commit checkpoints in a background thread from a host copy "
                                       "while training goes on (one extra copy of the rank's shard in host memory)")
    use_checkpoint_opt_param_scheduler: bool = flag_field(
        False, "--use-checkpoint-opt_param-scheduler", action="store_true", group="checkpointing",
        help="on resume, keep the checkpoint's global batch size and learning-rate schedule where the flags give "
             "others (a resume that changes them is refused without this or --override-opt_param-scheduler)")
    override_opt_param_scheduler: bool = flag_field(
        False, "--override-opt_param-scheduler", action="store_true", group="checkpointing",
        help="on resume, train with the flags' global batch size and learning-rate schedule where they differ "
             "from the checkpoint's")

    def check(self) -> None:
        """The save interval and finetuning have the directories they need."""
        if self.save_interval is not None and self.save_interval < 1:
            fail(f"{FLAG.save_interval} must be a positive integer, got {self.save_interval}")
        if self.save_interval and not self.save:
            fail(f"{FLAG.save_interval} needs {FLAG.save} DIR (where to write the checkpoints)")
        if self.async_save and not self.save:
            fail(f"{FLAG.async_save} needs {FLAG.save} DIR (where to write the checkpoints)")
        if self.finetune and not self.load:
            fail(f"{FLAG.finetune} needs {FLAG.load} DIR (the checkpoint whose weights to start from)")
        if self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler:
            fail(f"{FLAG.use_checkpoint_opt_param_scheduler} keeps the checkpoint's schedule and "
                 f"{FLAG.override_opt_param_scheduler} replaces it: keep one")

    def check_resumed_optimizer(self, saved: str | None, optimizer: OptimizerConfig, where: str) -> None:
        """A resume loads optimizer state written by the optimizer ``saved`` ("adamw" or "muon", the
        checkpoint's record; None: it holds none) into a run stepping with ``optimizer``: refused (one line
        naming the flag and both fixes) when they differ, unless ``--no-load-optim`` starts it fresh."""
        mine = OPTIMIZERS[optimizer.optimizer]
        if saved is None or self.no_load_optim or saved == mine:
            return
        fail(f"{where} holds {saved} optimizer state but {FLAG.optimizer} is {optimizer.optimizer} ({mine} keeps "
             f"other state): give {FLAG.optimizer} {saved} to continue it, or add {FLAG.no_load_optim} to start "
             f"the {mine} optimizer fresh from the checkpoint's weights")

    def resumed_schedule(self, saved: dict, train: TrainConfig, optimizer: OptimizerConfig,
                         where: str) -> tuple[OptimizerConfig, str | None]:
        """The schedule a run resuming the checkpoint whose job is ``saved`` (by section) trains with, and
        the line to say about it (None when nothing differs). ``train`` and ``optimizer`` are this run's,
        validated; ``where`` names the checkpoint in messages. A difference in :data:`SCHEDULE` is refused
        (one line naming each: flag, checkpoint's value, this run's) unless one of the two flags chooses.
        The global batch is the caller's to take before validation (:func:`resumed_batch`: it must fit
        this layout)."""
        differs = schedule_differences(saved, train, optimizer)
        if not differs:
            return optimizer, None
        listed = "; ".join(f"{setting(name)}: checkpoint {theirs} vs this run {mine}" for name, theirs, mine in differs)
        if self.override_opt_param_scheduler:
            return optimizer, (f" {FLAG.override_opt_param_scheduler}: this run's schedule replaces the one of "
                               f"{where} ({listed})")
        if not self.use_checkpoint_opt_param_scheduler:
            fail(f"{where} was trained with another schedule ({listed}): add {FLAG.use_checkpoint_opt_param_scheduler} "
                 f"to continue the checkpoint's, or {FLAG.override_opt_param_scheduler} to train with this run's")
        kept = dataclasses.replace(optimizer, **{name: theirs for name, theirs, _ in differs if name in OPTIMIZER})
        return kept, f" {FLAG.use_checkpoint_opt_param_scheduler}: the schedule of {where} is kept ({listed})"


def schedule_differences(saved: dict, train: TrainConfig,
                         optimizer: OptimizerConfig) -> list[tuple[str, object, object]]:
    """(field, checkpoint's value, this run's) of each :data:`SCHEDULE` setting the checkpoint's job ``saved``
    (by section) holds with another value; a setting a checkpoint older than it does not hold is not compared."""
    mine = {"train": train, "optimizer": optimizer}
    out = []
    for section, name in SCHEDULE:
        stored = saved.get(section) or {}
        if name in stored and stored[name] != getattr(mine[section], name):
            out.append((name, stored[name], getattr(mine[section], name)))
    return out


def resumed_batch(saved: dict, given: dict, use_checkpoint: bool, where: str) -> tuple[dict, str | None]:
    """The settings (``{"section.field": value}``) a resumed run takes from the checkpoint's job ``saved``
    before validation, and the line saying so: the checkpoint's global batch where no source ``given``
    (``{"section.field": value}`` of every source) sets it, or with ``--use-checkpoint-opt_param-scheduler``;
    not with a gradient-accumulation count that implies another one (then compared after validation). A
    ``--step-batch-size-schedule`` is a source of the global batch too, and is taken with it."""
    train = saved.get("train") or {}
    theirs = train.get("global_batch_size")
    stepped = train.get("step_batch_size_schedule")
    if theirs is None or (given.get("train.global_batch_size") == theirs
                          and "train.step_batch_size_schedule" not in given):
        return {}, None
    sources = ("train.global_batch_size", "train.gradient_accumulation_steps", "train.step_batch_size_schedule")
    if not use_checkpoint and any(source in given for source in sources):
        return {}, None
    why = f"kept by {FLAG.use_checkpoint_opt_param_scheduler}" if use_checkpoint else "no flag gives one"
    taken = {"train.global_batch_size": theirs, "train.gradient_accumulation_steps": None}
    if "step_batch_size_schedule" in train:              # the checkpoint's batch-size schedule, or none
        taken["train.step_batch_size_schedule"] = stepped
    grown = f" ({FLAG.step_batch_size_schedule} '{stepped}')" if stepped else ""
    return taken, f" {FLAG.global_batch_size} {theirs}{grown} taken from {where} ({why})"
