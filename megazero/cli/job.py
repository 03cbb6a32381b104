"""From the command line to a validated job: every source of settings gathered (the flags, ``--config``,
``--deepspeed-config``, ``--accelerate-config`` and, with ``--use-checkpoint-args``, the model settings a
checkpoint holds), combined by the one precedence rule (:func:`megazero.cli.arguments.combine`), and
checked by :func:`megazero.config.validate`; a resumed run's schedule is held against its checkpoint's
(:func:`resume_schedule`). A refusal is one line and status 2, before any process group exists::

    job, args = parse_job(["--tp", "2", "--num-layers", "8"], world_size=4)   # job.parallel.dp == 2
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from megazero.checkpoint.distributed import (
    latest_iteration,
    saved_job,
    saved_model_settings,
    saved_optimizer,
)
from megazero.cli.arguments import (
    build_parser,
    combine,
    flag_settings,
    job_from_values,
    load_config_file,
    stop_with,
)
from megazero.config import FLAG, JobConfig, setting, validate
from megazero.config import megatron_flags as megatron
from megazero.config.checkpoint import resumed_batch
from megazero.errors import CheckpointError, ConfigError
from megazero.foreign_config import (
    Launch,
    from_accelerate,
    from_deepspeed,
    resolved,
    resolved_line,
    unused_warning,
)


def parse_job(argv: list[str] | None = None, world_size: int | None = None) -> tuple[JobConfig, argparse.Namespace]:
    """Parse the command line (and its config files), validate against the world size, return (job,
    namespace). Unknown flags and invalid combinations exit with status 2 and a one-line message naming
    the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    return job_from_args(parser, args, world_size), args


def job_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> JobConfig:
    """The validated JobConfig of parsed flags (and their config files). An invalid one exits with
    status 2 and a one-line message naming the flag (printed by rank 0 only under a launcher); on rank 0,
    what the Megatron-LM flags chose and what a foreign config gave unused are said once."""
    try:
        cli, given = flag_settings(args)
        notes, set_by = megatron.from_command_line(given, cli)
        unused: list[tuple[str, str]] = []     # foreign keys accepted but not used: one warning line
        decided: dict[str, dict] = {}          # by foreign file: the settings it left to others
        sources = [("the command line", cli)] + foreign_sources(args, world_size, unused, decided)
        from_checkpoint = checkpoint_source(sources)
        if from_checkpoint:
            sources.append(from_checkpoint)
        values = combine(sources, overridable={f"--config {args.config}"}, set_by=set_by)
        notes += megatron.canonical_tokenizer(values)
        warnings = megatron.sequence_parallel_at_tp1(values)
        job, said = resume_schedule(values, world_size)
        megatron.check_requirements(given, job)
        job, lines = with_config_files(job, sources, decided)
        notes += said + lines
    except (ConfigError, TypeError) as e:
        stop_with(parser.prog, [str(e)])
    if unused:
        warnings.append(unused_warning(unused))
    if warnings and os.environ.get("RANK", "0") == "0":
        print("".join(f"{parser.prog}: warning: {w}\n" for w in warnings), end="", file=sys.stderr, flush=True)
    if notes and os.environ.get("RANK", "0") == "0":         # what the Megatron-LM flags chose, once
        print("\n".join(notes), flush=True)
    return job


def resume_schedule(values: dict, world_size: int) -> tuple[JobConfig, list[str]]:
    """The validated job of ``values`` (every source's settings, combined), holding the schedule of the
    checkpoint it resumes (:meth:`megazero.config.CheckpointConfig.resumed_schedule`: refused, kept or
    replaced), and the lines that say what was taken from it."""
    load = resumed_directory(values)
    if load is None:
        return validate(job_from_values(values), world_size), []
    try:
        saved, saved_state = saved_job(load), saved_optimizer(load)
    except (CheckpointError, KeyError) as e:
        raise ConfigError(f"{FLAG.load} {load}: cannot read the job its checkpoint stored: {e}") from None
    where = f"the checkpoint in {load}"
    keep = bool(values.get("checkpoint.use_checkpoint_opt_param_scheduler"))
    taken, note = resumed_batch(saved, values, keep, where)
    try:
        job = validate(job_from_values({**values, **taken}), world_size)
    except ConfigError as e:
        if not taken:
            raise
        raise ConfigError(f"{e} ({taken['train.global_batch_size']} is the global batch of {where}, which this "
                          f"run continues: to train at another, give {FLAG.global_batch_size} with "
                          f"{FLAG.override_opt_param_scheduler})") from None
    job.checkpoint.check_resumed_optimizer(saved_state, job.optimizer, where)
    optimizer, said = job.checkpoint.resumed_schedule(saved, job.train, job.optimizer, where)
    job = dataclasses.replace(job, optimizer=optimizer)
    return job, [line for line in (note, said) if line]


def resumed_directory(values: dict) -> str | None:
    """The directory whose latest checkpoint a run with these settings continues (as
    :func:`megazero.checkpoint.resume.resume` decides): ``--load``'s, or with ``--finetune`` a finetuning
    run's own ``--save``; None when it starts a new schedule (no checkpoint yet, or weights only)."""
    load, save = values.get("checkpoint.load"), values.get("checkpoint.save")
    try:
        if values.get("checkpoint.finetune"):
            same = load and save and Path(load).resolve() == Path(save).resolve()
            return save if save and not same and latest_iteration(save) is not None else None
        return load if load and latest_iteration(load) is not None else None
    except CheckpointError:                 # a damaged tracker: the preflight names it, with its fix
        return None


def foreign_sources(args: argparse.Namespace, world_size: int, unused: list,
                    decided: dict | None = None) -> list[tuple[str, dict]]:
    """The config files named on the command line, each as (its name, {dest: value}); the keys a foreign
    config gives but nothing here uses are appended to ``unused``, the settings each leaves to others
    (``"auto"``, or DeepSpeed's default) go in ``decided`` under its name."""
    sources, decided = [], {} if decided is None else decided
    if args.config:
        sources.append((f"--config {args.config}", load_config_file(args.config)))
    if args.deepspeed_config:
        name = f"--deepspeed-config {args.deepspeed_config}"
        sources.append((name, from_deepspeed(args.deepspeed_config, unused, decided.setdefault(name, {}))))
    if args.accelerate_config:
        name = f"--accelerate-config {args.accelerate_config}"
        sources.append((name, from_accelerate(args.accelerate_config, Launch.from_env(world_size), unused,
                                              decided.setdefault(name, {}))))
    return sources


def with_config_files(job: JobConfig, sources: list[tuple[str, dict]],
                      decided: dict[str, dict]) -> tuple[JobConfig, list[str]]:
    """``job`` with ``logging.config_files`` (what each DeepSpeed or Accelerate file named in ``decided``
    resolved to: :func:`megazero.foreign_config.resolved`), and the line to say for each."""
    files, lines = {}, []
    for name, values in sources:
        if name not in decided:
            continue
        elsewhere = {}
        for other, given in sources:             # where an "auto" setting came from: the first source giving it
            for dest in given:
                if other != name and dest in decided[name]:
                    elsewhere.setdefault(dest, setting(dest.partition(".")[2]) if other == "the command line"
                                         else other)
        files[name] = resolved(values, decided[name], job, elsewhere)
        lines.append(resolved_line(name, files[name]))
    if not files:
        return job, []
    return dataclasses.replace(job, logging=dataclasses.replace(job.logging, config_files=files)), lines


def checkpoint_source(sources: list[tuple[str, dict]]) -> tuple[str, dict] | None:
    """With ``--use-checkpoint-args``: the model settings stored in the ``--load`` checkpoint, as one more
    source of settings (the flags may repeat them, not contradict them); None when ``--load`` holds no
    checkpoint yet (a first start that resumes after a restart: the flags' settings then, as in Megatron)."""
    def given(dest: str):
        return next((values[dest] for _, values in sources if dest in values), None)

    if not given("checkpoint.use_checkpoint_args"):
        return None
    load = given("checkpoint.load")
    if not load:
        raise ConfigError(f"{FLAG.use_checkpoint_args} needs {FLAG.load} DIR (the checkpoint whose model "
                          f"settings to take)")
    try:
        saved, job = saved_model_settings(load), saved_job(load)
    except (CheckpointError, KeyError) as e:
        raise ConfigError(f"{FLAG.use_checkpoint_args}: cannot read the model settings of {load}: {e}") from None
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
    return f"the checkpoint in {FLAG.load} {load} ({FLAG.use_checkpoint_args})", values
