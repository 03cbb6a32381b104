"""The vocabulary every section's ``check`` is written in: a failed rule raises :class:`ConfigError` with
one line naming the flag a user typed and the fix, the flag's spelling read from its field
(``flag("num_layers")``, ``FLAG.num_layers`` inside an f-string)::

    positive(par.tp, "tp")          # ConfigError: --tensor-model-parallel-size/--tp must be a positive integer, got 0
    one_of(opt, "lr_decay_style")   # ConfigError: --lr-decay-style must be one of constant, linear, cosine, got 'x'
"""
from __future__ import annotations

from megazero.config.fields import choices, flag
from megazero.errors import ConfigError


def fail(msg: str) -> None:
    raise ConfigError(msg)


def positive(value, name: str) -> None:
    """Field ``name`` holds a positive integer."""
    if value is None or value < 1:
        fail(f"{flag(name)} must be a positive integer, got {value}")


def positive_float(value: float, name: str) -> None:
    if not value > 0:
        fail(f"{flag(name)} must be > 0, got {value}")


def one_of(section, name: str) -> None:
    """The field's value is one of its flag's choices."""
    value, allowed = getattr(section, name), choices(name)
    if value not in allowed:
        fail(f"{flag(name)} must be one of {', '.join(map(str, allowed))}, got {value!r}")
