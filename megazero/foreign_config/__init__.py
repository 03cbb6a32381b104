"""DeepSpeed JSON and Accelerate YAML configs, mapped onto megazero's own settings.

    pretrain_gpt.py --deepspeed-config ds_config.json ...       # DeepSpeed's "custom deepspeed_config.json"
    pretrain_gpt.py --accelerate-config default_config.yaml ... # `accelerate config`'s file

Both give ``{"section.field": value}`` (the trainer's flag destinations) and are read like a ``--config``
file: flags on the command line, a ``--config`` file and the other foreign file may repeat a value but
not contradict it (:func:`megazero.cli.arguments._combine`). Each key is mapped onto a setting, accepted as
unused (it tunes only DeepSpeed's or accelerate launch's own implementation: listed on one warning line,
:func:`unused_warning`), or refused; a file's refused keys are named in one message. ``"auto"`` means
"from the command line or megazero's default", as in the Hugging Face integration. The tables of keys
are in docs/foreign-configs.md; the DeepSpeed file is :mod:`.deepspeed`, the Accelerate one
:mod:`.accelerate`, the reading and the messages :mod:`.reader`; what a file resolved to (said at start, the
metrics file's first record) :mod:`.resolved`.
"""
from megazero.foreign_config.accelerate import Launch, from_accelerate
from megazero.foreign_config.deepspeed import from_deepspeed
from megazero.foreign_config.reader import load_yaml, unused_warning
from megazero.foreign_config.resolved import resolved, resolved_line

__all__ = ["Launch", "from_accelerate", "from_deepspeed", "load_yaml", "resolved", "resolved_line", "unused_warning"]
