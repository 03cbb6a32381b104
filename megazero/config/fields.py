"""Flag metadata on config fields: the one home of each flag's spellings, help, group and argparse kind.

A section field that is a command-line flag is declared with :func:`flag_field`::

    tp: int = flag_field(1, "--tensor-model-parallel-size", "--tp", type=int, group="parallelism",
                         help="tensor-parallel size: ranks that split each layer's weight matrices")

The :class:`Flag` it stores under ``field.metadata["flag"]`` is read by :func:`flag` (the spelling an
error message uses), by :mod:`megazero.cli.arguments` (the parser, config-file keys) and by the generated
``docs/flags.md``. A field without it (a derived value such as ``virtual_stages``, a setting only a
DeepSpeed or Accelerate config gives such as ``gradient_accumulation_steps``) is not on the command line;
:func:`setting` names either kind. Messages never spell a flag by hand: ``FLAG.num_layers`` is
``flag("num_layers")``, so renaming a flag renames it in every message (a test holds that).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

# The help groups of the command line, in the order ``--help`` and docs/flags.md list them.
GROUPS = ("parallelism", "model", "mixture of experts", "training", "optimizer", "mixed precision", "data",
          "checkpointing", "fault tolerance", "logging", "offload", "compile", "activation memory")
_BOOLEAN_ACTIONS = ("store_true", "store_false", argparse.BooleanOptionalAction)


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    ``spellings``: the canonical spelling first, then aliases. ``action``: how a boolean is given
    (``"store_true"``, ``"store_false"`` for a flag that turns its field off, such as
    ``--disable-bias-linear`` for ``add_bias_linear``, or ``argparse.BooleanOptionalAction`` for a
    ``--x`` / ``--no-x`` pair); ``type``, ``choices`` and ``nargs`` as argparse takes them.
    """

    spellings: tuple[str, ...]
    group: str
    help: str | None = None
    type: Any = None
    choices: tuple | None = None
    action: Any = None
    nargs: str | None = None
    metavar: str | None = None

    @property
    def display(self) -> str:
        """The spelling messages use: the canonical one, then each alias shorter than it after a slash.

        ``--tensor-model-parallel-size/--tp``; ``--norm-epsilon`` (its alias ``--layernorm-epsilon``,
        Megatron's older spelling, is longer: accepted, not shown)."""
        canonical = self.spellings[0]
        return "/".join([canonical, *(s for s in self.spellings[1:] if len(s) < len(canonical))])

    @property
    def negations(self) -> tuple[str, ...]:
        """The ``--no-x`` spellings of a ``--x`` / ``--no-x`` pair (none for any other flag)."""
        if self.action is not argparse.BooleanOptionalAction:
            return ()
        return tuple("--no-" + s[2:] for s in self.spellings)

    @property
    def placeholder(self) -> str | None:
        """The value's name in ``--help`` (``--num-layers N``, ``--lr LR``, ``--save DIR``): the declared
        ``metavar``, else N for an integer, X for a number, TEXT otherwise; None for a switch or a choice
        without one (argparse lists the choices)."""
        if self.metavar or self.action is not None or self.choices is not None:
            return self.metavar
        return {int: "N", float: "X"}.get(self.type, "TEXT")

    def argparse_kwargs(self) -> dict:
        """The keyword arguments of ``parser.add_argument`` (besides the spellings, dest and default)."""
        kwargs = dict(type=self.type, choices=self.choices, action=self.action, nargs=self.nargs, help=self.help,
                      metavar=self.placeholder)
        return {k: v for k, v in kwargs.items() if v is not None}


def flag_field(default, *spellings: str, group: str, help: str | None = None, type: Any = None,
               choices: tuple | None = None, action: Any = None, nargs: str | None = None,
               metavar: str | None = None):
    """A dataclass field that is a command-line flag (see the module docstring for an example).

    A list default is copied for each instance (``flag_field([], "--data-path", nargs="+", ...)``);
    ``metavar`` names the value in ``--help`` where N / X / TEXT would say too little (``DIR``, ``LR``)."""
    if not spellings or not all(s.startswith("--") for s in spellings):
        raise ValueError(f"flag spellings must start with --, got {spellings}")
    if group not in GROUPS:
        raise ValueError(f"{spellings[0]}: group {group!r} is not one of {GROUPS}")
    if action is not None and action not in _BOOLEAN_ACTIONS:
        raise ValueError(f"{spellings[0]}: action {action!r} is not one of {_BOOLEAN_ACTIONS}")
    if not help:
        raise ValueError(f"{spellings[0]}: every flag needs help text (--help and docs/flags.md show it)")
    meta = {"flag": Flag(tuple(spellings), group, help, type, choices, action, nargs, metavar)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# The provider of every config section's (name, dataclass) pairs, registered by job.py (which imports
# this module): the job's sections and every registered model family's config class under "model".
_SECTIONS: list[Callable[[], Iterable[tuple[str, type]]]] = []


def register_sections(provider: Callable[[], Iterable[tuple[str, type]]]) -> None:
    """Make the sections' fields known to :func:`flag` (job.py does this once: the lookup cannot import
    the sections, which import this module)."""
    _SECTIONS[:] = [provider]
    fields_changed()


def fields_changed() -> None:
    """Forget the field table: a model family registered its config class (:mod:`megazero.config.model`)."""
    _fields_by_name.cache_clear()


@functools.cache
def _fields_by_name() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every section field by its name -> (section, field). Names are unique over the sections, so a
    message can name a field without its section; two model families may declare the same field only
    with the same flag (``num_experts`` of two MoE families)."""
    table: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in _SECTIONS[0]():
        for f in dataclasses.fields(cls):
            if f.name in table:
                known_section, known = table[f.name]
                if known_section == section == "model" and known.metadata.get("flag") == f.metadata.get("flag"):
                    continue
                raise RuntimeError(f"config field {f.name!r} is declared by both {known_section} and {section} "
                                   f"({cls.__name__}) with different flags: rename one")
            table[f.name] = (section, f)
    return table


class _Flags:
    """``FLAG.name`` is ``flag("name")``: a flag's spelling inside an f-string."""

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        return flag(name)


FLAG = _Flags()


def flag_fields() -> Iterator[tuple[str, dataclasses.Field, Flag]]:
    """``(section, field, flag)`` for every field that is a flag, in JobConfig's section and field order."""
    for section, f in _fields_by_name().values():
        if "flag" in f.metadata:
            yield section, f, f.metadata["flag"]


def flag(name: str) -> str:
    """The command-line spelling of config field ``name`` (see :attr:`Flag.display`)::

        flag("num_attention_heads") == "--num-attention-heads"
        flag("tp") == "--tensor-model-parallel-size/--tp"
        flag("add_bias_linear") == "--disable-bias-linear"      # stores False into the field

    A name that is not a field, or a field with no flag, is a programming error (KeyError); a message
    about a setting that may have no flag names it with :func:`setting`."""
    section, f = _fields_by_name().get(name, (None, None))
    if f is None or "flag" not in f.metadata:
        why = "is not a config field" if f is None else f"({section}) has no command-line flag: use setting()"
        raise KeyError(f"{name!r} {why}")
    return f.metadata["flag"].display


def flag_off(name: str) -> str:
    """The spelling that turns a ``--x`` / ``--no-x`` field off: ``flag_off("overlap_grad_reduce") ==
    "--no-overlap-grad-reduce"``; a KeyError for a flag of another kind."""
    flag(name)                                          # a KeyError for a field that is not a flag
    negations = _fields_by_name()[name][1].metadata["flag"].negations
    if not negations:
        raise KeyError(f"{name!r} is not a --x / --no-x flag")
    return negations[0]


def dest(name: str) -> str:
    """The ``"section.field"`` key of config field ``name`` (the parser's dest, a config file's place)."""
    if name not in _fields_by_name():
        raise KeyError(f"{name!r} is not a config field")
    return f"{_fields_by_name()[name][0]}.{name}"


def setting(name: str) -> str:
    """How a message names config field ``name``: its flag when it has one, else the field's own name
    (``gradient_accumulation_steps``, which only a DeepSpeed or Accelerate config sets)."""
    if name not in _fields_by_name():
        raise KeyError(f"{name!r} is not a config field")
    return flag(name) if "flag" in _fields_by_name()[name][1].metadata else name


def choices(name: str) -> tuple:
    """The allowed values of choice flag ``name`` (``choices("zero_stage") == (0, 1, 2, 3)``)."""
    flag(name)                                          # a KeyError for a field that is not a flag
    allowed = _fields_by_name()[name][1].metadata["flag"].choices
    if allowed is None:
        raise KeyError(f"{name!r} is not a choice flag")
    return allowed
