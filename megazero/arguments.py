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
import time
from pathlib import Path

from megazero.config import BACKENDS, TOKENIZERS, JobConfig, flag, flag_fields, setting, validate
from megazero.config import megatron_flags as megatron
from megazero.config.fields import GROUPS
from megazero.errors import ConfigError
from megazero.foreign_config import Launch, from_accelerate, from_deepspeed, load_yaml, unused_warning
from megazero.launcher import report_to_launcher
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
            stop_with(self, lines or [f"unexpected value {extras[0]!r}"])
        return parsed

    def error(self, message: str):
        stop_with(self, [f"{message} (see --help)"])


def stop_with(parser: argparse.ArgumentParser, lines: list[str]) -> None:
    """Exit with status 2 after one ``prog: error: ...`` line per item of ``lines``: printed by rank 0 only under
    a launcher (the launcher stops the others while they wait; a rank still alive after the wait prints them)."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(5.0)
    text = "".join(f"{parser.prog}: error: {line}\n" for line in lines)
    sys.stderr.write(text)
    report_to_launcher(text.rstrip("\n"), "; ".join(lines))     # under torchrun: again after its report
    parser.exit(2)


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
    for title, entries in ARGUMENTS.items():
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


def _combine(sources: list[tuple[str, dict]], overridable: set[str] = frozenset(),
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


def _checkpoint_args(sources: list[tuple[str, dict]]) -> tuple[str, dict] | None:
    """With ``--use-checkpoint-args``: the model settings stored in the ``--load`` checkpoint, as one more
    source of settings (the flags may repeat them, not contradict them); None when ``--load`` holds no
    checkpoint yet (a first start that resumes after a restart: the flags' settings then, as in Megatron)."""
    def given(dest: str):
        return next((values[dest] for _, values in sources if dest in values), None)

    if not given("checkpoint.use_checkpoint_args"):
        return None
    load = given("checkpoint.load")
    if not load:
        raise ConfigError(f"{flag('use_checkpoint_args')} needs {flag('load')} DIR (the checkpoint whose model "
                          f"settings to take)")
    from megazero.checkpoint.distributed import saved_job, saved_model_settings
    from megazero.errors import CheckpointError

    try:
        saved, job = saved_model_settings(load), saved_job(load)
    except (CheckpointError, KeyError) as e:
        raise ConfigError(f"{flag('use_checkpoint_args')}: cannot read the model settings of {load}: {e}") from None
    if saved is None:
        return None
    values = {f"model.{name}": value for name, value in saved.items()}
    # As Megatron's: the sequence length and the tokenizer too, where no flag or file gives them (a
    # fine-tune of an imported model then needs none of its settings retyped).
    if given("model.seq_length") is None and job["model"].get("seq_length"):
        values["model.seq_length"] = job["model"]["seq_length"]
    tokenizer = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
    if all(given(f"data.{name}") is None for name in tokenizer):
        values.update({f"data.{name}": job.get("data", {}).get(name) for name in tokenizer
                       if job.get("data", {}).get(name) is not None})
    return f"the checkpoint in {flag('load')} {load} ({flag('use_checkpoint_args')})", values


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


def _flag_settings(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, object]]:
    """The parsed flags as ({"section.field": value}, {Megatron-LM flag: value}) before they are applied."""
    return ({k: v for k, v in vars(args).items() if "." in k},
            {k.partition(":")[2]: v for k, v in vars(args).items() if k.startswith("megatron:")})


def flag_values(args: argparse.Namespace) -> tuple[dict[str, object], list[str]]:
    """{"section.field": value} of the parsed flags alone, with Megatron-LM's spellings applied and their
    requirements checked (as :func:`job_from_args` does), and the lines they say at start: what a tool
    that takes a run's flags builds its job from (the layout fuzzer, ``tools/check_layout.py``).
    :class:`ConfigError` when refused."""
    cli, given = _flag_settings(args)
    notes, _ = megatron.from_command_line(given, cli)
    megatron.check_requirements(given, cli)
    return cli, notes + megatron.canonical_tokenizer(cli)


def job_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> JobConfig:
    """The validated JobConfig of parsed flags (and their ``--config`` file). An invalid one exits with
    status 2 and a one-line message naming the flag (printed by rank 0 only under a launcher)."""
    try:
        cli, given = _flag_settings(args)
        notes, set_by = megatron.from_command_line(given, cli)
        sources = [("the command line", cli)]
        unused: list[tuple[str, str]] = []     # foreign keys accepted but not used: one warning line
        if args.config:
            sources.append((f"--config {args.config}", load_config_file(args.config)))
        if args.deepspeed_config:
            sources.append((f"--deepspeed-config {args.deepspeed_config}",
                            from_deepspeed(args.deepspeed_config, unused)))
        if args.accelerate_config:
            sources.append((f"--accelerate-config {args.accelerate_config}",
                            from_accelerate(args.accelerate_config, Launch.from_env(world_size), unused)))
        checkpoint_args = _checkpoint_args(sources)
        if checkpoint_args:
            sources.append(checkpoint_args)
        values = _combine(sources, overridable={f"--config {args.config}"}, set_by=set_by)
        megatron.check_requirements(given, values)
        notes += megatron.canonical_tokenizer(values)
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
        if notes and os.environ.get("RANK", "0") == "0":         # what the Megatron-LM flags chose, once
            print("\n".join(notes), flush=True)
        return job
    except (ConfigError, TypeError) as e:
        stop_with(parser, [str(e)])


def flag_reference_markdown() -> str:
    """docs/flags.md: one section per help group, a table of each flag's spellings, value, default and
    help, all read from the field metadata (regenerate with ``python -m megazero.arguments --markdown``)."""
    defaults = _defaults()
    lines = ["# Flags", "",
             "Every flag of `pretrain_gpt.py`, by group. Generated from the field metadata in",
             "`megazero/config/sections.py` by `python -m megazero.arguments --markdown > docs/flags.md`:",
             "edit the metadata, not this page. Spellings after the first are aliases; a config file",
             "(`--config`) takes any spelling as a key, without the dashes. A `--x` / `--no-x` pair turns a",
             "setting on or off; any other switch is off unless given. Megatron-LM's flags and what each",
             "is here: [megatron-flags.md](megatron-flags.md).", ""]
    for title, entries in [*ARGUMENTS.items(), ("other", [(o, None, kw) for o, kw in OTHER_OPTIONS])]:
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
    status one of ``accepted as-is``, ``mapped``, ``implementation choice``, ``refused``."""
    rows = [(name, "accepted as-is", "") for name in megatron.AS_IS]
    rows += [(name, "mapped", f"`{ours}`") for name, ours in megatron.ALIASES.items()]
    rows += [(name, "mapped", m.help) for name, m in megatron.MAPPED.items()]
    for name, impl in megatron.IMPLEMENTATION.items():
        values = f"{' / '.join(impl.choices)}: " if impl.choices else ""
        refused = "; ".join(f"refused {v}: {why}" for v, why in impl.refused.items())
        rows.append((name, "implementation choice", values + impl.note + (f"; {refused}" if refused else "")))
    rows += [(name, "refused", why) for name, why in megatron.REFUSED.items()]
    return rows


def megatron_reference_markdown() -> str:
    """docs/megatron-flags.md: the Megatron-LM flags table and the tokenizer names, from
    megazero/config/megatron_flags.py (regenerate with ``python -m megazero.arguments --megatron-markdown``)."""
    lines = ["# Megatron-LM flags", "",
             "What each Megatron-LM `pretrain_gpt.py` flag does here. Generated from",
             "`megazero/config/megatron_flags.py` by `python -m megazero.arguments --megatron-markdown >",
             "docs/megatron-flags.md` (edit the module, not this page); `tests/test_megatron_flags.py` checks every",
             "row against the parser. Our own flags: [flags.md](flags.md).", "",
             "* **accepted as-is**: the same flag and meaning here.",
             "* **mapped**: accepted, and sets the setting named (a contradicting flag is refused in one line).",
             "* **implementation choice**: accepted; it only picks among implementations Megatron-LM has several",
             "  of, and the run says in one line at start what runs here.",
             "* **refused**: the run stops before any work with one line per such flag, naming our equivalent or",
             "  saying it does not exist here. A flag in no row is refused as unknown, with the closest names.", "",
             "Sample-based runs (`--train-samples`, `--lr-decay-samples`, `--lr-warmup-samples`) become iterations",
             "of `--global-batch-size` samples: `--train-samples` // the global batch, the schedule's lengths rounded",
             "up; as in Megatron-LM a run is iteration- or sample-based, not both.", "",
             "| Megatron-LM flag | status | here |", "|---|---|---|"]
    lines += [f"| `{name}` | {status} | {detail.replace('|', '/')} |" for name, status, detail in megatron_rows()]
    lines += ["", "## Tokenizer types", "", "| `--tokenizer-type` | here |", "|---|---|"]
    lines += [f"| `{name}` | accepted as-is |" for name in TOKENIZERS]
    lines += [f"| `{name}` | {f'read as `{ours}`: ' + note if ours else 'refused: ' + note} |"
              for name, (ours, note) in megatron.MEGATRON_TOKENIZERS.items()]
    return "\n".join(lines) + "\n"


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
    _cli.add_argument("--megatron-markdown", action="store_true", help="print docs/megatron-flags.md")
    _args = _cli.parse_args()
    if _args.markdown:
        print(flag_reference_markdown(), end="")
    elif _args.megatron_markdown:
        print(megatron_reference_markdown(), end="")
    else:
        build_parser().print_help()
