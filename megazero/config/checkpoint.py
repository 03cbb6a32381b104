"""The checkpointing section: where checkpoints are written and read, and what a resume takes from them.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.fields import FLAG, flag_field
from megazero.config.rules import fail


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
        """The save interval and finetuning have the directories they need."""
        if self.save_interval is not None and self.save_interval < 1:
            fail(f"{FLAG.save_interval} must be a positive integer, got {self.save_interval}")
        if self.save_interval and not self.save:
            fail(f"{FLAG.save_interval} needs {FLAG.save} DIR (where to write the checkpoints)")
        if self.async_save and not self.save:
            fail(f"{FLAG.async_save} needs {FLAG.save} DIR (where to write the checkpoints)")
        if self.finetune and not self.load:
            fail(f"{FLAG.finetune} needs {FLAG.load} DIR (the checkpoint whose weights to start from)")
