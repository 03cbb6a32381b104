"""The trainer's command line: Megatron flag names -> a validated :class:`JobConfig`.

Imported by the entry point ``pretrain_gpt.py`` and by ``tools/estimate_memory.py``, which takes the
trainer's flags; the other tools have their own small parsers. Besides :func:`megazero.config.validate`,
parsing checks that ``--model-family`` names a registered model spec and runs its rules. Every flag is
one dataclass field (``section.field``) and is declared there, in the field's
metadata (``megazero/config/sections.py``): its spellings, help, group and default. This module turns
that into the parser, the config-file keys and the flag reference ``docs/flags.md``
(``python -m megazero.arguments --markdown > docs/flags.md``).

A config file (``--config run.toml`` or ``.yaml``) uses the same names as keys (dashes or underscores,
short aliases allowed, optionally grouped in tables); flags given on the command line override it, and
any other disagreement between two sources (``--config``, ``--deepspeed-config``, ``--accelerate-config``)
is refused naming both (:func:`_combine`; docs/foreign-configs.md)::

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
from pathlib import Path

from megazero.config import BACKENDS, ConfigError, JobConfig, flag, flag_fields, setting, validate
from megazero.config.fields import GROUPS
from megazero.foreign_config import Launch, from_accelerate, from_deepspeed, load_yaml, unused_warning
from megazero.models.spec import check_family


def _arguments() -> dict[str, list[tuple[tuple[str, ...], str, dict]]]:
    """{group title: [(spellings, "section.field", argparse kwargs)]} from the field metadata of
    megazero/config/sections.py (the one place a flag is declared): groups in GROUPS order, flags in
    field order."""
    table: dict[str, list] = {title: [] for title in GROUPS}
    for section, f, meta in flag_fields():
        table[meta.group].append((meta.spellings, f"{section}.{f.name}", meta.argparse_kwargs()))
    return table


ARGUMENTS = _arguments()

# The options that are not a JobConfig field: where settings come from, and the process group backend.
OTHER_OPTIONS: list[tuple[str, dict]] = [
    ("--config", dict(help="TOML or YAML file with flag names as keys; CLI overrides it")),
    ("--deepspeed-config", dict(help="a DeepSpeed JSON config, mapped onto these flags "
                                     "(README: DeepSpeed and Accelerate configs)")),
    ("--accelerate-config", dict(help="an Accelerate default_config.yaml with a deepspeed_config")),
    ("--backend", dict(choices=BACKENDS, help="default: nccl with CUDA, else gloo")),
]


def build_parser(prog: str = "pretrain_gpt.py", description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's flags (and ``--config``); tools that take the same flags add their own to it."""
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description=description or "Pretrain a GPT with tensor, pipeline and data parallelism and ZeRO. With no "
                                   "data flags it trains a tiny GPT on the bundled sample corpus.")
    for option, kwargs in OTHER_OPTIONS:
        parser.add_argument(option, **kwargs)
    for title, entries in ARGUMENTS.items():
        group = parser.add_argument_group(title)
        for flags, dest, kwargs in entries:
            group.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, **kwargs)
    return parser


def _key_to_dest() -> dict[str, str]:
    """Every spelling of every flag (dashes or underscores, no leading --) -> its dest."""
    table = {}
    for entries in ARGUMENTS.values():
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
        if key.replace("_", "-") in _NEGATIVE_FLAGS:     # `disable-bias-linear = true` sets add_bias_linear False
            out[dest] = not out[dest]
    return out


def _combine(sources: list[tuple[str, dict]], overridable: set[str] = frozenset()) -> dict:
    """The settings of every source (``[(its name, {dest: value})]``, highest precedence first) in one
    dict: the one precedence rule (docs/foreign-configs.md). A setting two sources give different
    values is refused naming both, unless the lower one is in ``overridable`` (the ``--config`` file,
    which the command line overrides)."""
    out: dict[str, object] = {}
    given_by: dict[str, str] = {}
    for name, values in sources:
        for dest, value in values.items():
            if dest not in out:
                out[dest], given_by[dest] = value, name
            elif out[dest] != value and not (name in overridable and given_by[dest] == "the command line"):
                what = setting(dest.partition(".")[2])
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
    return {dest: kwargs for entries in ARGUMENTS.values() for _, dest, kwargs in entries}


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


# Flags that store False into their field (their config-file key takes the flag's meaning).
_NEGATIVE_FLAGS = {f.lstrip("-") for entries in ARGUMENTS.values() for flags, _, kw in entries for f in flags
                   if kw.get("action") == "store_false"}


def job_from_values(values: dict[str, object]) -> JobConfig:
    """Build a JobConfig from {"section.field": value}, starting from the dataclass defaults."""
    sections: dict[str, dict[str, object]] = {}
    for dest, value in values.items():
        section, name = dest.split(".")
        sections.setdefault(section, {})[name] = value
    return JobConfig.from_dict(sections)


def parse_job(argv: list[str] | None = None, world_size: int | None = None) -> tuple[JobConfig, argparse.Namespace]:
    """Parse the command line (and --config), validate against the world size, return (job, namespace).

    Unknown flags and invalid combinations exit with status 2 and a one-line message naming the flag.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    return job_from_args(parser, args, world_size), args


def job_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> JobConfig:
    """The validated JobConfig of parsed flags (and their ``--config`` file). An invalid one exits with
    status 2 and a one-line message naming the flag (printed by rank 0 only under a launcher)."""
    try:
        sources = [("the command line", {k: v for k, v in vars(args).items() if "." in k})]
        unused: list[tuple[str, str]] = []     # foreign keys accepted but not used: one warning line
        if args.config:
            sources.append((f"--config {args.config}", load_config_file(args.config)))
        if args.deepspeed_config:
            sources.append((f"--deepspeed-config {args.deepspeed_config}",
                            from_deepspeed(args.deepspeed_config, unused)))
        if args.accelerate_config:
            sources.append((f"--accelerate-config {args.accelerate_config}",
                            from_accelerate(args.accelerate_config, Launch.from_env(world_size), unused)))
        values = _combine(sources, overridable={f"--config {args.config}"})
        job = validate(job_from_values(values), world_size)
        check_family(job.model, job.parallel, job.compilation)   # the model family is registered; its own rules
        if job.train.memory_budget_gib is not None:              # the memory planner picks recompute / offload
            import torch

            from megazero.memory.planner import plan_for_budget
            job, plan = plan_for_budget(job, world_size, "cuda" if torch.cuda.is_available() else "cpu")
            if os.environ.get("RANK", "0") == "0":
                print(plan, flush=True)
        if unused and os.environ.get("RANK", "0") == "0":
            print(f"{parser.prog}: warning: {unused_warning(unused)}", file=sys.stderr, flush=True)
        return job
    except (ConfigError, TypeError) as e:
        # One line from the launcher, not one per rank: rank 0 prints and exits at once, and the launcher
        # stops the others while they wait; a rank still alive after the wait prints the line itself.
        if os.environ.get("RANK", "0") != "0":
            import time
            time.sleep(5.0)
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def flag_reference_markdown() -> str:
    """docs/flags.md: one section per help group, a table of each flag's spellings, value, default and
    help, all read from the field metadata (regenerate with ``python -m megazero.arguments --markdown``)."""
    defaults = {f"{section}.{f.name}": (f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
                for section, f, _ in flag_fields()}
    lines = ["# Flags", "",
             "Every flag of `pretrain_gpt.py`, by group. Generated from the field metadata in",
             "`megazero/config/sections.py` by `python -m megazero.arguments --markdown > docs/flags.md`:",
             "edit the metadata, not this page. Spellings after the first are aliases; a config file",
             "(`--config`) takes any spelling as a key, without the dashes. A `--x` / `--no-x` pair turns a",
             "setting on or off; any other switch is off unless given.", ""]
    for title, entries in [*ARGUMENTS.items(), ("other", [((o,), None, kw) for o, kw in OTHER_OPTIONS])]:
        lines += [f"## {title}", "", "| flag | value | default | meaning |", "|---|---|---|---|"]
        for spellings, dest, kwargs in entries:
            if kwargs.get("action") is argparse.BooleanOptionalAction:
                spellings = [*spellings, *("--no-" + s[2:] for s in spellings)]
            cells = [", ".join(f"`{s}`" for s in spellings), _value_kind(kwargs),
                     _default_text(defaults.get(dest), kwargs), kwargs.get("help") or ""]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _value_kind(kwargs: dict) -> str:
    if kwargs.get("action") is not None:
        return "switch"
    if kwargs.get("choices") is not None:
        return " / ".join(f"`{c}`" for c in kwargs["choices"])
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
    _cli = argparse.ArgumentParser(prog="python -m megazero.arguments", description="The trainer's flag reference.")
    _cli.add_argument("--markdown", action="store_true", help="print docs/flags.md")
    if _cli.parse_args().markdown:
        print(flag_reference_markdown(), end="")
    else:
        build_parser().print_help()
