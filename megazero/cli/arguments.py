"""The trainer's command line: Megatron flag names and config files -> ``{section.field: value}``.

Every flag is one dataclass field (``section.field``) and is declared there, in the field's metadata
(``megazero/config/<section>.py``, a model family's config class for its own flags): its spellings,
help, group and default. This module turns that into the parser, the config-file keys and the flag
reference ``docs/flags.md`` (``python -m megazero.cli.arguments --markdown > docs/flags.md``). Turning
the values into a validated job is :mod:`megazero.cli.job`'s; ``tools/estimate_memory.py`` and the
layout fuzzer take the trainer's flags through both.

A config file (``--config run.toml`` or ``.yaml``) uses the same names as keys (dashes or underscores,
short aliases allowed, optionally grouped in tables); flags given on the command line override it, and
any other disagreement between two sources (``--config``, ``--deepspeed-config``, ``--accelerate-config``)
is refused naming both (:func:`combine`; docs/foreign-configs.md)::

    # run.toml
    tp = 2
    pp = 2
    zero-stage = 1
    [model]                      # tables only group keys; the names are the flag names
    num-layers = 4
    hidden-size = 128
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from megazero.cli.launcher import end_launch_after_refusal, report_to_launcher
from megazero.config import BACKENDS, FLAG, TOKENIZERS, JobConfig, flag, flag_fields, setting
from megazero.config import megatron_flags as megatron
from megazero.config.fields import GROUPS
from megazero.config.model import BUILTIN_FAMILIES, family
from megazero.errors import ConfigError
from megazero.foreign_config import load_yaml


def arguments(builtin_only: bool = False) -> dict[str, list[tuple[tuple[str, ...], str, dict]]]:
    """{group title: [(spellings, "section.field", argparse kwargs)]} from the field metadata of the config
    sections and of every registered model family's config class (the one place a flag is declared):
    groups in GROUPS order, flags in field order. ``builtin_only``: the model fields of megazero's own
    families only (docs/flags.md)."""
    table: dict[str, list] = {title: [] for title in GROUPS}
    own = {f.name for name in BUILTIN_FAMILIES for f in dataclasses.fields(family(name).config)}
    for section, f, meta in flag_fields():
        if builtin_only and section == "model" and f.name not in own:
            continue
        table[meta.group].append((meta.spellings, f"{section}.{f.name}", meta.argparse_kwargs()))
    return table


# The options that are not a JobConfig field: where settings come from, and the process group backend.
OTHER_OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--config",), dict(metavar="PATH", help="TOML or YAML file with flag names as keys; CLI overrides it")),
    (("--deepspeed-config",), dict(metavar="PATH", help="a DeepSpeed JSON config, mapped onto these flags "
                                                        "(docs/foreign-configs.md)")),
    (("--accelerate-config",), dict(metavar="PATH", help="an Accelerate default_config.yaml with a deepspeed_config "
                                                         "(docs/foreign-configs.md)")),
    (("--backend", *(a for a, ours in megatron.ALIASES.items() if ours == "--backend")),
     dict(choices=BACKENDS, help="the process group backend (default: nccl with CUDA, else gloo)")),
]


class TrainerArgumentParser(argparse.ArgumentParser):
    """argparse whose refusals are one line each, with no usage block: a Megatron-LM flag that has no meaning
    here says why (megazero/config/megatron_flags.py), an unknown flag names the closest flags, and every other
    parse error is its one line. Under a launcher rank 0 says them (:func:`stop_with`)."""

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(argv, namespace)
        given = {k.partition(":")[2]: v for k, v in vars(parsed).items() if k.startswith("megatron:")}
        known = sorted(s for s in self._option_string_actions if s.startswith("--"))
        lines = megatron.refusal_lines(argv, extras, given, known)
        if lines or extras:
            stop_with(self.prog, lines or [f"unexpected value {extras[0]!r}"])
        return parsed

    def error(self, message: str):
        stop_with(self.prog, [f"{message} (see --help)"])


def stop_with(prog: str, lines: list[str]) -> None:
    """Exit with status 2 after one ``prog: error: ...`` line per item of ``lines``: printed by rank 0 only under
    a launcher (the launcher stops the others while they wait; a rank still alive after the wait prints them)."""
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        time.sleep(5.0)
        lines = [f"rank {rank}: {line}" for line in lines]    # rank 0 did not stop it: found here alone
    text = "".join(f"{prog}: error: {line}\n" for line in lines)
    sys.stderr.write(text)
    sys.stderr.flush()
    if not end_launch_after_refusal():
        report_to_launcher(text.rstrip("\n"), "; ".join(lines))     # under torchrun: again after its report
    raise SystemExit(2)


def _help_with_default(kwargs: dict, default) -> dict:
    """``kwargs`` with the default at the end of the help text (unless the help already says it), ``%``
    escaped for argparse."""
    text = kwargs["help"]
    shown = _default_text(default, kwargs).strip("`")
    if shown and shown != "see meaning" and "default" not in text:
        text += f" (default: {shown})"
    return dict(kwargs, help=text.replace("%", "%%"))


def build_parser(prog: str = "pretrain_gpt.py", description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's flags (and ``--config``); tools that take the same flags add their own to it."""
    parser = TrainerArgumentParser(
        prog=prog, allow_abbrev=False,
        description=description or "Pretrain a GPT with tensor, pipeline and data parallelism and ZeRO. With no "
                                   "data flags it trains a tiny GPT on the bundled sample corpus. Flag reference: "
                                   "docs/flags.md; Megatron-LM's flags here: docs/megatron-flags.md.")
    for options, kwargs in OTHER_OPTIONS:
        parser.add_argument(*options, **kwargs)
    defaults = _defaults()
    for title, entries in arguments().items():
        group = parser.add_argument_group(title)
        for flags, dest, kwargs in entries:
            group.add_argument(*flags, dest=dest, default=argparse.SUPPRESS,
                               **_help_with_default(kwargs, defaults[dest]))
    megatron.add_arguments(parser)
    return parser


def _defaults() -> dict[str, object]:
    """{dest: the field's default} of every flag."""
    return {f"{section}.{f.name}": (f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
            for section, f, _ in flag_fields()}


def _key_to_dest() -> dict[str, str]:
    """Every spelling of every flag (dashes or underscores, no leading --) -> its dest."""
    table = {}
    for entries in arguments().values():
        for flags, dest, _ in entries:
            for f in flags:
                name = f.lstrip("-")
                table[name] = table[name.replace("-", "_")] = dest
    return table


def load_config_file(path: str) -> dict[str, object]:
    """Read a TOML or YAML config file into {dest: value}. Unknown keys, a setting given twice (in two
    tables, or under two spellings) and values of the wrong type are errors naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    raw = _parse_config_text(p)
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected keys and values (a mapping) at the top, got {type(raw).__name__}")
    flat: list[tuple[str, object]] = []
    for key, value in raw.items():
        if isinstance(value, dict):  # a table just groups keys
            flat += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            flat.append((key, value))
    known, specs, out, where = _key_to_dest(), _dest_specs(), {}, {}
    for full_key, value in flat:
        key = full_key.rpartition(".")[2]
        if key not in known:
            raise ConfigError(f"--config {path}: unknown key {full_key!r} (keys are the flag names, e.g. "
                              f"'{flag('num_layers')[2:]}' for {flag('num_layers')})")
        dest = known[key]
        if dest in where:
            raise ConfigError(f"--config {path}: {full_key!r} sets what {where[dest]!r} already set: keep one")
        where[dest] = full_key
        out[dest] = _typed(path, full_key, value, specs[dest])
        if key.replace("_", "-") in _negative_flags():     # `disable-bias-linear = true` sets add_bias_linear False
            out[dest] = not out[dest]
    return out


def combine(sources: list[tuple[str, dict]], overridable: set[str] = frozenset(),
             set_by: dict[str, str] | None = None) -> dict:
    """The settings of every source (``[(its name, {dest: value})]``, highest precedence first) in one
    dict: the one precedence rule (docs/foreign-configs.md). A setting two sources give different
    values is refused naming both, unless the lower one is in ``overridable`` (the ``--config`` file,
    which the command line overrides). ``set_by``: {dest: the Megatron-LM flag that set it on the command
    line}, named in the message."""
    out: dict[str, object] = {}
    given_by: dict[str, str] = {}
    for name, values in sources:
        for dest, value in values.items():
            if dest not in out:
                out[dest], given_by[dest] = value, name
            elif out[dest] != value and not (name in overridable and given_by[dest] == "the command line"):
                what = setting(dest.partition(".")[2])
                what += f" (from {set_by[dest]})" if set_by and dest in set_by and given_by[dest] == "the command line" \
                    else ""
                raise ConfigError(f"{what} is {out[dest]!r} {_where(given_by[dest])} but {value!r} {_where(name)}: "
                                  f"set it in one place")
    return out


def _where(source: str) -> str:
    return f"on {source}" if source == "the command line" else f"in {source}"


def _parse_config_text(p: Path):
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"--config {p}: YAML needs PyYAML (pip install pyyaml), or use TOML") from e
        return load_yaml(text, f"--config {p}") or {}
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {p}: not valid TOML: {e}") from e


def _dest_specs() -> dict[str, dict]:
    return {dest: kwargs for entries in arguments().values() for _, dest, kwargs in entries}


def _typed(path: str, key: str, value, spec: dict):
    """``value`` as the flag takes it, or an error: booleans are booleans (``bf16 = "false"`` is not
    false), integers integers, numbers numbers, choices one of them."""
    action, kind = spec.get("action"), spec.get("type")
    if action in ("store_true", "store_false", argparse.BooleanOptionalAction):
        ok, want = isinstance(value, bool), "true or false"
    elif spec.get("nargs") == "+" and kind is int:        # `profile-ranks = [0, 1]`
        ok, want = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value), \
            "a list of integers"
    elif kind is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif kind not in (None, str) and isinstance(value, (int, list)) and not isinstance(value, bool):
        ok, want = True, "its text"           # a flag with its own parser (--moe-layer-freq N or [0,1,1,1])
        value = kind(str(value))
    elif spec.get("nargs") == "+":
        value = value.split() if isinstance(value, str) else value
        ok, want = isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value), "a list"
        value = [str(v) for v in value] if ok else value
    else:
        ok, want = isinstance(value, str), "a string"
    if ok and spec.get("choices") is not None and value not in spec["choices"]:
        ok, want = False, "one of " + ", ".join(map(str, spec["choices"]))
    if not ok:
        raise ConfigError(f"--config {path}: {key!r} must be {want}, got {value!r}")
    return value


def _negative_flags() -> set[str]:
    """Flags that store False into their field (their config-file key takes the flag's meaning)."""
    return {f.lstrip("-") for entries in arguments().values() for flags, _, kw in entries for f in flags
            if kw.get("action") == "store_false"}


def job_from_values(values: dict[str, object]) -> JobConfig:
    """Build a JobConfig from {"section.field": value}, starting from the dataclass defaults."""
    sections: dict[str, dict[str, object]] = {}
    for dest, value in values.items():
        section, name = dest.split(".")
        sections.setdefault(section, {})[name] = value
    return JobConfig.from_dict(sections)


def flag_settings(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, object]]:
    """The parsed flags as ({"section.field": value}, {Megatron-LM flag: value}) before they are applied."""
    return ({k: v for k, v in vars(args).items() if "." in k},
            {k.partition(":")[2]: v for k, v in vars(args).items() if k.startswith("megatron:")})


def flag_values(args: argparse.Namespace) -> tuple[dict[str, object], list[str]]:
    """{"section.field": value} of the parsed flags alone, with Megatron-LM's spellings applied and their
    requirements checked (as :func:`job_from_args` does), and the lines they say at start: what a tool
    that takes a run's flags builds its job from (the layout fuzzer, ``tools/check_layout.py``).
    :class:`ConfigError` when refused."""
    cli, given = flag_settings(args)
    notes, _ = megatron.from_command_line(given, cli)
    notes += megatron.canonical_tokenizer(cli)
    megatron.check_requirements(given, job_from_values(cli))
    return cli, notes


def flag_reference_markdown() -> str:
    """docs/flags.md: one section per help group, a table of each flag's spellings, value, default and
    help, all read from the field metadata (regenerate with ``python -m megazero.cli.arguments --markdown``)."""
    defaults = _defaults()
    lines = ["# Flags", "",
             "Every flag of `pretrain_gpt.py`, by group. Generated from the field metadata of the config",
             "sections (`megazero/config/`) and of the built-in model families' config classes",
             "(`megazero/models/<family>/config.py`) by `python -m megazero.cli.arguments --markdown >",
             "docs/flags.md`: edit the metadata, not this page. Spellings after the first are aliases; a config file",
             "(`--config`) takes any spelling as a key, without the dashes. A `--x` / `--no-x` pair turns a",
             "setting on or off; any other switch is off unless given. Megatron-LM's flags and what each",
             "is here: [megatron-flags.md](megatron-flags.md).", ""]
    groups = [*arguments(builtin_only=True).items(), ("other", [(o, None, kw) for o, kw in OTHER_OPTIONS])]
    for title, entries in groups:
        lines += [f"## {title}", "", "| flag | value | default | meaning |", "|---|---|---|---|"]
        for spellings, dest, kwargs in entries:
            if kwargs.get("action") is argparse.BooleanOptionalAction:
                spellings = [*spellings, *("--no-" + s[2:] for s in spellings)]
            cells = [", ".join(f"`{s}`" for s in spellings), _value_kind(kwargs),
                     _default_text(defaults.get(dest), kwargs), kwargs.get("help") or ""]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def megatron_rows() -> list[tuple[str, str, str]]:
    """``(Megatron-LM flag, status, what it is here)`` for every flag of megazero/config/megatron_flags.py, the
    status one of ``accepted as-is``, ``mapped``, ``implementation choice``, ``restated``, ``refused``."""
    rows = [(name, "accepted as-is", "") for name in megatron.AS_IS]
    rows += [(name, "mapped", f"`{ours}`") for name, ours in megatron.ALIASES.items()]
    rows += [(name, "mapped", m.help) for name, m in megatron.MAPPED.items()]
    for name, impl in megatron.IMPLEMENTATION.items():
        values = f"{' / '.join(impl.choices)}: " if impl.choices else ""
        by_reason: dict[str, list[str]] = {}
        for value, why in impl.refused.items():
            by_reason.setdefault(why, []).append(value)
        limits = [f"refused {' / '.join(v)}: {why}" for why, v in by_reason.items()]
        limits += [f"refused with {flag(f)}: {impl.why}" if want is False else f"needs {flag(f)} {want}: {impl.why}"
                   for f, want in impl.requires.items()]
        rows.append((name, "implementation choice", "; ".join([values + impl.note, *limits])))
    rows += [(name, "restated", r.help) for name, r in megatron.RESTATED.items()]
    rows += [(name, "refused", why) for name, why in megatron.REFUSED.items()]
    return rows


def megatron_reference_markdown() -> str:
    """docs/megatron-flags.md: the Megatron-LM flags table and the tokenizer names, from
    megazero/config/megatron_flags.py (regenerate with ``python -m megazero.cli.arguments --megatron-markdown``)."""
    lines = ["# Megatron-LM flags", "",
             "What each Megatron-LM `pretrain_gpt.py` flag does here. Generated from",
             "`megazero/config/megatron_flags.py` by `python -m megazero.cli.arguments --megatron-markdown >",
             "docs/megatron-flags.md` (edit the module, not this page); `tests/test_megatron_flags.py` checks every",
             "row against the parser. Our own flags: [flags.md](flags.md).", "",
             "* **accepted as-is**: the same flag and meaning here.",
             "* **mapped**: accepted, and sets the setting named (a contradicting flag is refused in one line).",
             "* **implementation choice**: accepted; it only tunes Megatron-LM's implementation (kernels, fusions,",
             "  loaders) and ignoring it cannot change the numbers. One line at start names every such flag given;",
             "  the row says what runs instead.",
             "* **restated**: accepted when it equals what the model already is, refused in one line otherwise.",
             "* **refused**: the run stops before any work with one line per such flag, naming our equivalent or",
             "  saying it does not exist here. A flag in no row is refused as unknown, with the closest names.", "",
             f"Sample-based runs (`{FLAG.train_samples}`, `{FLAG.lr_decay_samples}`, `{FLAG.lr_warmup_samples}`) "
             "become iterations",
             f"of `{FLAG.global_batch_size}` samples: `{FLAG.train_samples}` // the global batch, the schedule's "
             "lengths rounded",
             "up; as in Megatron-LM a run is iteration- or sample-based, not both.", "",
             f"`{FLAG.sequence_parallel}` at `{FLAG.tp}` 1 is turned off with a one-line warning, as Megatron-LM "
             "does.", "",
             "| Megatron-LM flag | status | here |", "|---|---|---|"]
    lines += [f"| `{name}` | {status} | {detail.replace('|', '/')} |" for name, status, detail in megatron_rows()]
    lines += ["", "## Tokenizer types", "", f"| `{FLAG.tokenizer_type}` | here |", "|---|---|"]
    lines += [f"| `{name}` | accepted as-is |" for name in TOKENIZERS]
    lines += [f"| `{name}` | {f'read as `{ours}`: ' + note if ours else 'refused: ' + note} |"
              for name, (ours, note) in megatron.MEGATRON_TOKENIZERS.items()]
    return "\n".join(lines) + "\n"


def _value_kind(kwargs: dict) -> str:
    """The value column: a switch, the choices offered, or the kind of number or text. A flag whose metavar
    lists values (``{p2p,a2a,allgather}``) offers those: its parser takes more, each refused by name
    (Megatron-LM's values not built here)."""
    if kwargs.get("action") is not None:
        return "switch"
    if kwargs.get("choices") is not None:
        metavar = kwargs.get("metavar") or ""
        offered = metavar[1:-1].split(",") if metavar.startswith("{") else kwargs["choices"]
        return " / ".join(f"`{c}`" for c in offered)
    kind = {int: "integer", float: "number"}.get(kwargs.get("type"), "text")
    return f"{kind}..." if kwargs.get("nargs") == "+" else kind


def _default_text(value, kwargs: dict) -> str:
    action = kwargs.get("action")
    if action in ("store_true", "store_false"):
        return "off"
    if action is argparse.BooleanOptionalAction:
        return {True: "on", False: "off"}.get(value, "see meaning")
    return "" if value in (None, []) else f"`{value}`"


if __name__ == "__main__":
    _cli = argparse.ArgumentParser(prog="python -m megazero.cli.arguments", description="The trainer's flag reference.")
    _cli.add_argument("--markdown", action="store_true", help="print docs/flags.md")
    _cli.add_argument("--megatron-markdown", action="store_true", help="print docs/megatron-flags.md")
    _args = _cli.parse_args()
    if _args.markdown:
        print(flag_reference_markdown(), end="")
    elif _args.megatron_markdown:
        print(megatron_reference_markdown(), end="")
    else:
        build_parser().print_help()
