"""An Accelerate ``default_config.yaml`` (``--accelerate-config``) onto megazero's settings.

Its ``deepspeed_config`` section and ``mixed_precision`` map onto the flags, a ``deepspeed_config_file``
it names is read as a DeepSpeed config (:mod:`.deepspeed`), ``dynamo_config`` (or an older file's
top-level ``dynamo_backend``) onto --compile. The launch keys are checked against what torchrun started
(:class:`Launch`), not mapped; accelerate launch's environment keys (``gpu_ids``, ``main_process_port``,
...) are accepted, and listed as unused when they are not at their defaults. Sections that older
``accelerate config`` versions wrote empty or at their defaults (``fsdp_config: {}``,
``megatron_lm_config: {}``, ``ipex_config: {ipex: false}``) are accepted; a section with settings for
another engine is refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from megazero.config import FLAG, setting
from megazero.errors import ConfigError
from megazero.foreign_config.deepspeed import nvme_path, offload_device, read_deepspeed
from megazero.foreign_config.reader import AUTO, Reader, load_yaml, read_text

# accelerate launch's environment keys and their defaults: torchrun (and CUDA_VISIBLE_DEVICES) decide these.
_LAUNCHER = {"compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "enable_cpu_affinity": False,
             "gpu_ids": "all", "main_process_ip": None, "main_process_port": None, "main_training_function": "main",
             "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
             "tpu_use_sudo": False, "tpu_name": None, "tpu_zone": None, "commands": None, "command_file": None,
             "use_cpu": False}
_DS_LAUNCHER = {"deepspeed_multinode_launcher": "standard", "deepspeed_hostfile": None,
                "deepspeed_exclusion_filter": None, "deepspeed_inclusion_filter": None}
# Accelerate's distributed_type values megazero runs as its own data/ZeRO parallelism.
_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU",
                      "DEEPSPEED")


def _other_sections() -> dict[str, str]:
    """Sections for other engines or launchers, accepted empty or at their defaults (what `accelerate config`
    writes): each one's key -> what to do instead, said when it holds settings."""
    return {"fsdp_config": "megazero shards with ZeRO: use distributed_type DEEPSPEED with a zero_stage",
            "megatron_lm_config": f"give {FLAG.tp}, {FLAG.pp} and {FLAG.sequence_parallel} as flags",
            "ipex_config": "megazero does not use IPEX", "mpirun_config": "torchrun starts megazero",
            "fp8_config": "megazero trains in fp32, bf16 or fp16", "parallelism_config": "use the flags"}


def _other_engines() -> dict[str, str]:
    """Accelerate's distributed_type values megazero refuses -> what to use instead."""
    return {"FSDP": "megazero shards with ZeRO: use DEEPSPEED with a zero_stage (3 shards the parameters)",
            "MEGATRON_LM": f"megazero is the parallelism: use DEEPSPEED and give {FLAG.tp} and {FLAG.pp} as flags",
            "XLA": "megazero runs on CPUs and CUDA GPUs", "TPU": "megazero runs on CPUs and CUDA GPUs"}


@dataclass(frozen=True)
class Launch:
    """What the launcher started, to check an Accelerate config's ``num_processes``, ``num_machines``
    and ``machine_rank`` against: the world size, and (when known) the nodes and this node's rank."""

    world_size: int
    nodes: int | None = None
    node_rank: int | None = None

    @classmethod
    def from_env(cls, world_size: int, env=os.environ) -> Launch:
        """torchrun's ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (SLURM-style ``NODE_RANK`` too); one node,
        rank 0, for a single process without a launcher."""
        local, node = env.get("LOCAL_WORLD_SIZE"), env.get("GROUP_RANK", env.get("NODE_RANK"))
        if local and int(local) > 0:
            nodes = max(1, world_size // int(local))
        else:
            nodes = 1 if world_size == 1 else None
        node_rank = int(node) if node not in (None, "") else (0 if nodes == 1 else None)
        return cls(world_size, nodes, node_rank)


def _is_default(value, default) -> bool:
    """Unset, off or at accelerate's default (``'no'``/``'NO'`` and empty count as unset)."""
    if value in (None, False, "", "no", "NO", [], {}) or value == default:
        return True
    return isinstance(value, dict) and all(_is_default(v, None) for v in value.values())


def from_accelerate(path: str | Path, launch: Launch | None = None,
                    unused: list[tuple[str, str]] | None = None, decided: dict[str, str] | None = None) -> dict:
    """The settings of an Accelerate ``default_config.yaml`` (see the module docstring). With ``launch``,
    its ``num_processes``, ``num_machines`` and ``machine_rank`` must describe this launch; its unused keys
    (and its deepspeed_config_file's) are appended to ``unused``, the settings both leave to others to
    ``decided`` (:attr:`Reader.decided`). Every problem is refused in one message."""
    path = Path(path)
    source = f"--accelerate-config {path}"
    data = load_yaml(read_text(path, source), source) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected keys and values (a mapping) at the top, got {type(data).__name__}")
    r = Reader(source, data)
    r.only("", {*_LAUNCHER, *_other_sections(), "deepspeed_config", "mixed_precision", "dynamo_config",
                "dynamo_backend", "distributed_type", "num_processes", "num_machines", "machine_rank"})
    _defaults_only(r, "", _LAUNCHER)
    for key, instead in _other_sections().items():
        if not _is_default(r.raw(key), None):
            r.fail(key, f"has settings megazero cannot use ({instead}): remove them, or the section")
    _launch(r, launch)
    _dynamo(r)
    mp = r.get("mixed_precision")
    if mp not in (None, "no", "fp16", "bf16"):
        r.fail("mixed_precision", f"must be no, fp16 or bf16, got {mp!r}")
    r.set("precision.fp16", True if mp == "fp16" else None)
    r.set("precision.bf16", True if mp == "bf16" else None)
    inner = _deepspeed_section(r, path.parent)
    out = r.done()
    if unused is not None:
        unused += [(source, key) for key in r.unused]
        if inner is not None:
            unused += [(inner.source, key) for key in inner.unused]
    merged = {**(inner.out if inner is not None else {}), **out}
    if decided is not None:               # "auto" in one of the two files, a value in the other: the value
        both = {**(inner.decided if inner is not None else {}), **r.decided}
        decided.update({dest: how for dest, how in both.items() if not (how == AUTO and dest in merged)})
    return merged


def _defaults_only(r: Reader, path: str, defaults: dict) -> None:
    """Launcher keys under ``path`` away from their defaults are listed as unused."""
    node = r.raw(path) if path else r.data
    for key, default in defaults.items():
        if isinstance(node, dict) and key in node and not _is_default(node[key], default):
            r.unused.append(f"{path + '.' if path else ''}{key}")


def _deepspeed_section(r: Reader, here: Path) -> Reader | None:
    """``deepspeed_config``'s keys, and the DeepSpeed file it names (its problems reported as this file's,
    under the key that names it; a setting both give must agree)."""
    d = "deepspeed_config"
    r.only(d, {"zero_stage", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
               "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
               "offload_param_nvme_path", "deepspeed_config_file", *_DS_LAUNCHER}, {"zero3_save_16bit_model"})
    _defaults_only(r, d, _DS_LAUNCHER)
    for key, dest in (("offload_optimizer", "zero.offload_optimizer"), ("offload_param", "zero.offload_params")):
        device = offload_device(r, f"{d}.{key}_device", dest)
        nvme_path(r, r.get(f"{d}.{key}_nvme_path"), device, f"{d}.{key}_nvme_path")
    r.take("zero.zero_stage", f"{d}.zero_stage", int)
    r.take("train.gradient_accumulation_steps", f"{d}.gradient_accumulation_steps", int)
    r.take("optimizer.clip_grad", f"{d}.gradient_clipping", float)
    r.take("zero.sharded_init", f"{d}.zero3_init_flag", bool)
    name = r.get(f"{d}.deepspeed_config_file")
    if name is None:
        return None
    key, file = f"{d}.deepspeed_config_file", here / str(name)
    try:
        inner = read_deepspeed(file, f"{r.source}: {key} {file}")
    except ConfigError as e:                      # unreadable: the message already names this file and key
        r.fail(key, str(e).removeprefix(f"{r.source}: {key}: ").removeprefix(f"{r.source}: {key} "))
        return None
    for path, why in inner.errors:
        r.fail(f"{key} {file}: {path}", why)
    for dest, value in r.out.items():
        if dest in inner.out and inner.out[dest] != value:
            r.fail(key, f"{setting(dest.partition('.')[2])} is {value!r} in this file but {inner.out[dest]!r} in "
                        f"{file}: set it in one place")
    return inner


def _dynamo(r: Reader) -> None:
    """Accelerate's ``dynamo_config`` (an older file's top-level ``dynamo_backend``) onto --compile /
    --compile-mode."""
    d = "dynamo_config"
    r.only(d, {"dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
               "dynamo_use_regional_compilation"})
    for path in ("dynamo_backend", f"{d}.dynamo_backend"):
        backend = r.get(path)
        if backend is not None and str(backend).upper() not in ("NO", "INDUCTOR"):
            r.fail(path, f"must be NO or INDUCTOR (megazero compiles with inductor), got {backend!r}")
        elif backend is not None:
            r.agree("compilation.compile", str(backend).upper() == "INDUCTOR", path, "the other dynamo_backend")
    mode = r.get(f"{d}.dynamo_mode")
    if mode is not None:
        r.set("compilation.compile_mode", mode)
    for key in ("dynamo_use_fullgraph", "dynamo_use_dynamic"):
        if r.get(f"{d}.{key}", bool):
            r.fail(f"{d}.{key}", "is not supported: megazero compiles each transformer layer with static shapes "
                                 "and reports graph breaks at start; set it to false")
    if r.get(f"{d}.dynamo_use_regional_compilation", bool) is False:
        r.fail(f"{d}.dynamo_use_regional_compilation", "megazero always compiles layer by layer: set it true or "
                                                       "remove it")


def _launch(r: Reader, launch: Launch | None) -> None:
    """``distributed_type`` is one megazero runs as (unknown values refused); ``num_processes``,
    ``num_machines`` and ``machine_rank`` agree with the launch (torchrun's, not Accelerate's, starts it)."""
    kind = r.get("distributed_type")
    refused = _other_engines()
    if kind is not None and str(kind).upper() in refused:
        r.fail("distributed_type", f"{kind} is not supported: {refused[str(kind).upper()]}")
    elif kind is not None and str(kind).upper() not in _DISTRIBUTED_TYPES:
        r.fail("distributed_type", f"must be one of {', '.join(_DISTRIBUTED_TYPES)}, got {kind!r}")
    counts = {key: r.get(key, int) for key in ("num_processes", "num_machines", "machine_rank")}
    for key, value in list(counts.items()):
        if value is not None and value < (0 if key == "machine_rank" else 1):
            r.fail(key, f"must be {'>= 0' if key == 'machine_rank' else 'a positive integer'}, got {value}")
            counts[key] = None
    if launch is None:
        return
    here = {"num_processes": (launch.world_size, "process", "(WORLD_SIZE)", "--nnodes x --nproc-per-node"),
            "num_machines": (launch.nodes, "node", "(WORLD_SIZE / LOCAL_WORLD_SIZE)", "--nnodes"),
            "machine_rank": (launch.node_rank, "", "as this node's rank (GROUP_RANK)", "--node-rank")}
    for key, value in counts.items():
        actual, noun, what, flag = here[key]
        if noun:
            what = f"{noun}{'' if actual == 1 else 'es' if noun.endswith('s') else 's'} {what}"
        if value is not None and actual is not None and value != actual:
            r.fail(key, f"is {value} but this launch has {actual} {what}: start torchrun with {flag} as the "
                        f"file says, or set {key}: {actual}")
