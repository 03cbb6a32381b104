"""The checkpointing section of :class:`~megazero.config.sections.JobConfig` (its flags and rules)."""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config import checks
from megazero.config.fields import flag_field


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

    def check(self) -> None:
        checks.check_checkpoint(self)
