"""DeepSpeed JSON and Accelerate YAML configs, mapped onto megazero's own settings.

    pretrain_gpt.py --deepspeed-config ds_config.json ...       # DeepSpeed's "custom deepspeed_config.json"
    pretrain_gpt.py --accelerate-config default_config.yaml ... # `accelerate config`'s file

Both give ``{"section.field": value}`` (the trainer's flag destinations) and are read like a
``--config`` file: flags on the command line, a ``--config`` file and the other foreign file may
repeat a value but not contradict it. A key megazero
does not support is refused with its path (``zero_optimization.offload_optimizer.ratio``), never
ignored; ``"auto"`` means "from the flags". The mapping, one key at a time:

=============================================  ===============================================
DeepSpeed key                                  megazero setting
=============================================  ===============================================
train_batch_size                               --global-batch-size
train_micro_batch_size_per_gpu                 --micro-batch-size
gradient_accumulation_steps                    global batch = micro x steps x dp (checked)
gradient_clipping                              --clip-grad
fp16.enabled / bf16.enabled                    --fp16 / --bf16
fp16.initial_scale_power, loss_scale_window,   --initial-loss-scale 2^power, --loss-scale-window,
hysteresis, min_loss_scale                     --hysteresis, --min-loss-scale (loss_scale: 0 only)
zero_optimization.stage                        --zero-stage
zero_optimization.reduce_bucket_size           --bucket-size
zero_optimization.overlap_comm                 --overlap-grad-reduce
zero_optimization.contiguous_gradients         (always: true only)
zero_optimization.stage3_prefetch_bucket_size  --zero3-prefetch-layers (elements, in whole layers)
zero_optimization.offload_optimizer.device     --offload-optimizer none / cpu / nvme
zero_optimization.offload_param.device         --offload-params none / cpu / nvme
zero_optimization.offload_*.nvme_path          --nvme-path (one directory for both)
zero_optimization.offload_*.pin_memory         --offload-pin-memory / --no-offload-pin-memory
zero_optimization.sub_group_size               --offload-sub-group-size
zero_optimization.zero_quantized_weights       --zero-quantized-weights (ZeRO++ qwZ)
zero_optimization.zero_hpz_partition_size      --zero-hpz-partition-size (ZeRO++ hpZ)
zero_optimization.zero_quantized_gradients     --zero-quantized-gradients (ZeRO++ qgZ)
optimizer {type: Adam/AdamW, params: lr,       --lr, --adam-beta1/2, --adam-eps, --weight-decay
betas, eps, weight_decay}                      (AdamW: decoupled weight decay)
scheduler WarmupLR (linear warmup)             --lr-warmup-iters, --lr-decay-style constant
scheduler WarmupDecayLR                        + linear decay to 0 over total_num_steps
scheduler WarmupCosineLR                       + cosine decay to cos_min_ratio x lr
=============================================  ===============================================

Accelerate (``deepspeed_config`` section): ``zero_stage``, ``gradient_accumulation_steps``,
``gradient_clipping``, ``zero3_init_flag`` (--sharded-init), ``offload_optimizer_device`` and
``offload_param_device`` (--offload-optimizer / --offload-params), ``offload_optimizer_nvme_path`` and
``offload_param_nvme_path`` (--nvme-path), ``deepspeed_config_file`` (read as above); the top-level
``mixed_precision`` (no / fp16 / bf16); ``dynamo_config`` (``dynamo_backend`` INDUCTOR: --compile, NO: off;
``dynamo_mode``: --compile-mode; ``dynamo_use_fullgraph`` / ``dynamo_use_dynamic`` false only:
megazero compiles each layer with static shapes and reports graph breaks instead). The launch keys are
checked, not mapped: ``distributed_type`` must be one megazero runs as (FSDP, MEGATRON_LM, XLA, TPU and
unknown values are refused), and ``num_processes``, ``num_machines``, ``machine_rank`` must describe
the launch (:class:`Launch`: torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK).

A key given twice in one JSON object or YAML mapping is refused (both readers keep the last one
silently). How these files combine with ``--config`` and the flags is :func:`megazero.arguments._combine`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megazero.config import ConfigError, setting

AUTO = "auto"
_ACCELERATE_IGNORED = {"compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity",
                       "gpu_ids", "main_process_ip", "main_process_port", "main_training_function",
                       "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu"}
# Accelerate's distributed_type values megazero runs as its own data/ZeRO parallelism, and those it refuses.
_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU",
                      "DEEPSPEED")
_OTHER_ENGINES = {"FSDP": "megazero shards with ZeRO: use DEEPSPEED with a zero_stage (3 shards the parameters)",
                  "MEGATRON_LM": "megazero is the parallelism: use DEEPSPEED and give --tp / --pp as flags",
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


def load_yaml(text: str, source: str):
    """YAML whose mappings may not repeat a key (PyYAML keeps the last silently): ``source`` leads the
    message (``--config run.yaml``)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        keys = [loader.construct_object(k) for k, _ in node.value]
        twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        if twice:
            raise ConfigError(f"{source}: key {twice[0]!r} is given twice: keep one")
        return loader.construct_mapping(node)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(text, Loader=UniqueKeys)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}".splitlines()[0]) from None


def _unique_json_keys(source: str):
    """A ``json.loads`` object hook that refuses a key given twice in one object (json keeps the last)."""
    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ConfigError(f"{source}: key {key!r} is given twice in one object: keep one")
            seen.add(key)
        return dict(pairs)
    return hook


class _Reader:
    """Walks a nested dict, mapping keys to settings and remembering which keys were used."""

    def __init__(self, source: str, data: dict):
        self.source, self.data, self.out = source, data, {}

    def fail(self, path: str, why: str) -> None:
        raise ConfigError(f"{self.source}: {path}: {why}")

    def get(self, path: str, kind=None):
        node = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        if node == AUTO or node is None:
            return None
        if kind is bool and not isinstance(node, bool):
            self.fail(path, f"must be true or false, got {node!r}")
        if kind in (int, float) and (isinstance(node, bool) or not isinstance(node, (int, float))
                                     or (kind is int and node != int(node))):
            self.fail(path, f"must be {'an integer' if kind is int else 'a number'}, got {node!r}")
        return kind(node) if kind in (int, float) else node

    def set(self, dest: str, value) -> None:
        if value is not None:
            self.out[dest] = value

    def agree(self, dest: str, value, path: str) -> None:
        """Set ``dest`` from a key that may appear twice (the optimizer's and the parameters' offload
        sections share one --nvme-path and one pin setting): both places must agree."""
        if value is not None and self.out.get(dest, value) != value:
            self.fail(path, f"is {value!r} but another offload section says {self.out[dest]!r}: megazero uses one "
                            f"setting for both, make them agree")
        self.set(dest, value)

    def only(self, path: str, allowed: set[str]) -> None:
        """Refuse keys under ``path`` that megazero does not map (by their full path)."""
        node = self.data if not path else self.get(path) or {}
        if not isinstance(node, dict):
            self.fail(path, f"must be a mapping, got {node!r}")
        for key in node:
            if key not in allowed:
                self.fail(f"{path + '.' if path else ''}{key}", "is not supported by megazero: remove it")


def from_deepspeed(path: str | Path) -> dict:
    """The settings a DeepSpeed JSON config asks for (see the module docstring)."""
    path = Path(path)
    source = f"--deepspeed-config {path}"
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_unique_json_keys(source))
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top, got {type(data).__name__}")
    return _deepspeed(_Reader(source, data))


def _deepspeed(r: _Reader) -> dict:
    r.only("", {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "fp16", "bf16", "zero_optimization", "optimizer", "scheduler",
                "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"})
    r.set("train.global_batch_size", r.get("train_batch_size", int))
    r.set("train.micro_batch_size", r.get("train_micro_batch_size_per_gpu", int))
    r.set("train.gradient_accumulation_steps", r.get("gradient_accumulation_steps", int))
    r.set("optimizer.clip_grad", r.get("gradient_clipping", float))
    _precision(r)
    _zero(r)
    _optimizer(r)
    _scheduler(r)
    return r.out


def _precision(r: _Reader) -> None:
    r.only("bf16", {"enabled"})
    r.only("fp16", {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "min_loss_scale", "auto_cast", "consecutive_hysteresis"})
    if r.get("bf16.enabled", bool):
        r.set("precision.bf16", True)
    if not r.get("fp16.enabled", bool):
        return
    r.set("precision.fp16", True)
    if r.get("fp16.loss_scale", float):
        r.fail("fp16.loss_scale", "a static loss scale is not supported: use 0 (dynamic scaling)")
    if r.get("fp16.auto_cast", bool) or r.get("fp16.consecutive_hysteresis", bool):
        r.fail("fp16", "auto_cast and consecutive_hysteresis are not supported: set them false")
    power = r.get("fp16.initial_scale_power", int)
    r.set("precision.initial_loss_scale", None if power is None else float(2 ** power))
    r.set("precision.loss_scale_window", r.get("fp16.loss_scale_window", int))
    r.set("precision.hysteresis", r.get("fp16.hysteresis", int))
    r.set("precision.min_loss_scale", r.get("fp16.min_loss_scale", float))


def _zero(r: _Reader) -> None:
    r.only("zero_optimization", {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                                 "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                                 "stage3_prefetch_bucket_size", "offload_optimizer", "offload_param",
                                 "sub_group_size", "zero_quantized_weights", "zero_hpz_partition_size",
                                 "zero_quantized_gradients"})
    r.set("zero.zero_stage", r.get("zero_optimization.stage", int))
    r.set("zero.bucket_size", r.get("zero_optimization.reduce_bucket_size", int))
    r.set("zero.overlap_grad_reduce", r.get("zero_optimization.overlap_comm", bool))
    for key in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        if r.get(f"zero_optimization.{key}", bool) is False:
            r.fail(f"zero_optimization.{key}", "megazero always does this: set it true or remove it")
    prefetch = r.get("zero_optimization.stage3_prefetch_bucket_size", int)
    r.set("zero.prefetch_bucket_elements", prefetch)
    r.set("zero.offload_sub_group_size", r.get("zero_optimization.sub_group_size", int))
    r.set("zero.quantized_weights", r.get("zero_optimization.zero_quantized_weights", bool))
    r.set("zero.hpz_partition_size", r.get("zero_optimization.zero_hpz_partition_size", int))
    r.set("zero.quantized_gradients", r.get("zero_optimization.zero_quantized_gradients", bool))
    for key, dest in (("offload_optimizer", "zero.offload_optimizer"), ("offload_param", "zero.offload_params")):
        path = f"zero_optimization.{key}"
        r.only(path, {"device", "nvme_path", "pin_memory"})
        device = _offload_device(r, f"{path}.device", dest)
        _nvme_path(r, r.get(f"{path}.nvme_path"), device, f"{path}.nvme_path")
        r.agree("zero.offload_pin_memory", r.get(f"{path}.pin_memory", bool), f"{path}.pin_memory")


def _offload_device(r: _Reader, path: str, dest: str) -> str | None:
    device = r.get(path)
    if device is not None and device not in ("none", "cpu", "nvme"):
        r.fail(path, f"must be none, cpu or nvme, got {device!r}")
    r.set(dest, device)
    return device


def _nvme_path(r: _Reader, value, device: str | None, path: str) -> None:
    if value in (None, "none"):
        return
    if device != "nvme":
        r.fail(path, f"applies to device nvme only (this section's device is {device or 'none'}): remove it or "
                     f"set the device to nvme")
    r.agree("zero.nvme_path", value, path)


def _optimizer(r: _Reader) -> None:
    r.only("optimizer", {"type", "params"})
    kind = r.get("optimizer.type")
    if kind is None:
        return
    if str(kind).lower() not in ("adam", "adamw"):
        r.fail("optimizer.type", f"{kind!r} is not supported: megazero trains with AdamW")
    r.only("optimizer.params", {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"})
    if r.get("optimizer.params.adam_w_mode", bool) is False:
        r.fail("optimizer.params.adam_w_mode", "Adam with L2 regularisation is not supported: use AdamW (true)")
    r.set("optimizer.lr", r.get("optimizer.params.lr", float))
    betas = r.get("optimizer.params.betas")
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2):
            r.fail("optimizer.params.betas", f"must be two numbers, got {betas!r}")
        r.set("optimizer.adam_beta1", float(betas[0]))
        r.set("optimizer.adam_beta2", float(betas[1]))
    r.set("optimizer.adam_eps", r.get("optimizer.params.eps", float))
    r.set("optimizer.weight_decay", r.get("optimizer.params.weight_decay", float))


def _scheduler(r: _Reader) -> None:
    r.only("scheduler", {"type", "params"})
    kind = r.get("scheduler.type")
    if kind is None:
        return
    p = "scheduler.params"
    allowed = {"WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
               "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                 "total_num_steps"},
               "WarmupCosineLR": {"warmup_min_ratio", "cos_min_ratio", "warmup_num_steps", "total_num_steps"}}
    if kind not in allowed:
        r.fail("scheduler.type", f"{kind!r} is not supported: use one of {', '.join(allowed)}")
    r.only(p, allowed[kind])
    if kind != "WarmupCosineLR":
        if r.get(f"{p}.warmup_type") not in (None, "linear"):
            r.fail(f"{p}.warmup_type", "only a linear warmup is implemented: set \"linear\"")
        if r.get(f"{p}.warmup_type") is None and r.get(f"{p}.warmup_num_steps", int):
            r.fail(f"{p}.warmup_type", "DeepSpeed's default warmup is logarithmic, megazero's linear: "
                                       "set \"warmup_type\": \"linear\"")
        if r.get(f"{p}.warmup_min_lr", float):
            r.fail(f"{p}.warmup_min_lr", "the warmup starts from 0 in megazero: set 0")
        r.set("optimizer.lr", r.get(f"{p}.warmup_max_lr", float))
    elif r.get(f"{p}.warmup_min_ratio", float):
        r.fail(f"{p}.warmup_min_ratio", "the warmup starts from 0 in megazero: set 0")
    r.set("optimizer.lr_warmup_iters", r.get(f"{p}.warmup_num_steps", int) or 0)
    r.set("optimizer.lr_decay_style", {"WarmupLR": "constant", "WarmupDecayLR": "linear",
                                       "WarmupCosineLR": "cosine"}[kind])
    r.set("optimizer.lr_decay_iters", r.get(f"{p}.total_num_steps", int))
    if kind == "WarmupDecayLR":
        r.set("optimizer.min_lr", 0.0)
    ratio = r.get(f"{p}.cos_min_ratio", float)
    if ratio is not None:
        r.set("optimizer.min_lr_ratio", ratio)


def _dynamo(r: _Reader) -> None:
    """Accelerate's ``dynamo_config`` onto --compile / --compile-mode."""
    d = "dynamo_config"
    r.only(d, {"dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic"})
    backend = r.get(f"{d}.dynamo_backend")
    if backend is not None and str(backend).upper() not in ("NO", "INDUCTOR"):
        r.fail(f"{d}.dynamo_backend", f"must be NO or INDUCTOR (megazero compiles with inductor), got {backend!r}")
    if backend is not None:
        r.set("compilation.compile", str(backend).upper() == "INDUCTOR")
    mode = r.get(f"{d}.dynamo_mode")
    if mode is not None:
        r.set("compilation.compile_mode", mode)
    for key in ("dynamo_use_fullgraph", "dynamo_use_dynamic"):
        if r.get(f"{d}.{key}", bool):
            r.fail(f"{d}.{key}", "is not supported: megazero compiles each transformer layer with static shapes "
                                 "and reports graph breaks at start; set it to false")


def from_accelerate(path: str | Path, launch: Launch | None = None) -> dict:
    """The settings of an Accelerate ``default_config.yaml`` (see the module docstring). With ``launch``,
    its ``num_processes``, ``num_machines`` and ``machine_rank`` must describe this launch."""
    path = Path(path)
    source = f"--accelerate-config {path}"
    try:
        data = load_yaml(path.read_text(), source) or {}
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected keys and values (a mapping) at the top, got {type(data).__name__}")
    r = _Reader(source, data)
    r.only("", _ACCELERATE_IGNORED | {"deepspeed_config", "mixed_precision", "dynamo_config", "distributed_type",
                                      "num_processes", "num_machines", "machine_rank"})
    _launch(r, launch)
    _dynamo(r)
    mp = r.get("mixed_precision")
    if mp not in (None, "no", "fp16", "bf16"):
        r.fail("mixed_precision", f"must be no, fp16 or bf16, got {mp!r}")
    r.set("precision.fp16", True if mp == "fp16" else None)
    r.set("precision.bf16", True if mp == "bf16" else None)
    d = "deepspeed_config"
    r.only(d, {"zero_stage", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
               "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
               "offload_param_nvme_path", "deepspeed_config_file", "deepspeed_multinode_launcher",
               "zero3_save_16bit_model"})
    for key, dest in (("offload_optimizer", "zero.offload_optimizer"), ("offload_param", "zero.offload_params")):
        device = _offload_device(r, f"{d}.{key}_device", dest)
        _nvme_path(r, r.get(f"{d}.{key}_nvme_path"), device, f"{d}.{key}_nvme_path")
    file = r.get(f"{d}.deepspeed_config_file")
    out = from_deepspeed(Path(path).parent / file) if file else {}
    r.set("zero.zero_stage", r.get(f"{d}.zero_stage", int))
    r.set("train.gradient_accumulation_steps", r.get(f"{d}.gradient_accumulation_steps", int))
    r.set("optimizer.clip_grad", r.get(f"{d}.gradient_clipping", float))
    r.set("zero.sharded_init", r.get(f"{d}.zero3_init_flag", bool))
    for dest, value in r.out.items():
        if dest in out and out[dest] != value:
            raise ConfigError(f"{setting(dest.partition('.')[2])} is {value!r} in {source} but {out[dest]!r} in its "
                              f"deepspeed_config_file {Path(path).parent / file}: set it in one place")
    return {**out, **r.out}


def _launch(r: _Reader, launch: Launch | None) -> None:
    """``distributed_type`` is one megazero runs as (unknown values refused); ``num_processes``,
    ``num_machines`` and ``machine_rank`` agree with the launch (torchrun's, not Accelerate's, starts it)."""
    kind = r.get("distributed_type")
    if kind is not None:
        if str(kind).upper() in _OTHER_ENGINES:
            r.fail("distributed_type", f"{kind} is not supported: {_OTHER_ENGINES[str(kind).upper()]}")
        if str(kind).upper() not in _DISTRIBUTED_TYPES:
            r.fail("distributed_type", f"must be one of {', '.join(_DISTRIBUTED_TYPES)}, got {kind!r}")
    counts = {key: r.get(key, int) for key in ("num_processes", "num_machines", "machine_rank")}
    for key, value in counts.items():
        if value is not None and value < (0 if key == "machine_rank" else 1):
            r.fail(key, f"must be {'>= 0' if key == 'machine_rank' else 'a positive integer'}, got {value}")
    if launch is None:
        return
    here = {"num_processes": (launch.world_size, "processes (WORLD_SIZE)"),
            "num_machines": (launch.nodes, "nodes (WORLD_SIZE / LOCAL_WORLD_SIZE)"),
            "machine_rank": (launch.node_rank, "as this node's rank (GROUP_RANK)")}
    for key, value in counts.items():
        actual, what = here[key]
        if value is not None and actual is not None and value != actual:
            r.fail(key, f"is {value} but this launch has {actual} {what}: launch what the config says "
                        f"(e.g. torchrun --nnodes / --nproc-per-node / --node-rank), or set {key}: {actual}")
