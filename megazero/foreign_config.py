"""DeepSpeed JSON and Accelerate YAML configs, mapped onto megazero's own settings.

    pretrain_gpt.py --deepspeed-config ds_config.json ...       # DeepSpeed's "custom deepspeed_config.json"
    pretrain_gpt.py --accelerate-config default_config.yaml ... # `accelerate config`'s file

Both give ``{"section.field": value}`` (the trainer's flag destinations) and are read like a
``--config`` file: flags on the command line may repeat a value but not contradict it. A key megazero
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
megazero compiles each layer with static shapes and reports graph breaks instead).
"""
from __future__ import annotations

import json
from pathlib import Path

from megazero.config import ConfigError

AUTO = "auto"
_ACCELERATE_IGNORED = {"compute_environment", "debug", "distributed_type", "downcast_bf16", "enable_cpu_affinity",
                       "gpu_ids", "machine_rank", "main_process_ip", "main_process_port", "main_training_function",
                       "num_machines", "num_processes", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster",
                       "tpu_use_sudo", "use_cpu"}


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
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed-config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path}: not valid JSON: {e}") from None
    return _deepspeed(_Reader(f"--deepspeed-config {path}", data))


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


def from_accelerate(path: str | Path) -> dict:
    """The settings of an Accelerate ``default_config.yaml`` (see the module docstring)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--accelerate-config {path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--accelerate-config {path}: not valid YAML: {e}".splitlines()[0]) from None
    r = _Reader(f"--accelerate-config {path}", data)
    r.only("", _ACCELERATE_IGNORED | {"deepspeed_config", "mixed_precision", "dynamo_config"})
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
            r.fail(f"{d}", f"{dest} is {value!r} here and {out[dest]!r} in {file}: set one")
    return {**out, **r.out}
