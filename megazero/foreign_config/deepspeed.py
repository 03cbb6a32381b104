"""A DeepSpeed JSON config (``--deepspeed-config ds_config.json``) onto megazero's settings.

Every key is one of three kinds (the tables are in docs/foreign-configs.md):

* mapped: it lands on a flag's setting (``zero_optimization.reduce_bucket_size`` -> ``--bucket-size``);
  ``"auto"`` leaves the setting to the command line or megazero's default, as the Hugging Face
  integration does; an absent scheduler parameter takes DeepSpeed's default (``warmup_type`` log,
  ``warmup_num_steps`` 1000, ``warmup_max_lr`` 0.001, ``cos_min_ratio`` 0.0001).
* unused: it tunes only DeepSpeed's own implementation (``steps_per_print``, ``allgather_bucket_size``,
  ``stage3_param_persistence_threshold``, a disabled ``flops_profiler``, ...): accepted, and listed on
  one warning line.
* refused: it would change training and megazero has no equivalent (``fp16.loss_scale`` 128, an
  ``optimizer.type`` Lamb, an unknown key, ...): every such key of the file in one message.
"""
from __future__ import annotations

from pathlib import Path

from megazero.config import FLAG, OFFLOAD_DEVICES
from megazero.foreign_config.reader import Reader, read_json

# Top-level keys that tune only DeepSpeed's engine (logging, its optimizer checks, gradient pre-division).
_TOP_UNUSED = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
               "memory_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor", "aio",
               "sparse_gradients", "checkpoint"}
_ZERO_MAPPED = {"stage", "reduce_bucket_size", "overlap_comm", "contiguous_gradients", "reduce_scatter",
                "allgather_partitions", "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "offload_optimizer",
                "offload_param", "sub_group_size", "zero_quantized_weights", "zero_hpz_partition_size",
                "zero_quantized_gradients"}
# ZeRO keys that tune only how DeepSpeed's engine communicates, keeps memory or saves: megazero gathers
# in its --bucket-size buckets, shards every parameter, writes sharded checkpoints (tools/convert_checkpoint.py
# writes the whole model) and reloads them itself.
_ZERO_UNUSED = {"allgather_bucket_size", "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
                "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save", "elastic_checkpoint",
                "load_from_fp32_weights", "ignore_unused_parameters", "legacy_stage1", "memory_efficient_linear",
                "use_multi_rank_bucket_allreduce", "log_trace_cache_warnings", "stage3_module_granularity_threshold"}
_OFFLOAD_UNUSED = {"buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline", "pipeline_read",
                   "pipeline_write"}
_SCHEDULERS = {"WarmupLR": ("constant", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}),
               "WarmupDecayLR": ("linear", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                            "total_num_steps"}),
               "WarmupCosineLR": ("cosine", {"warmup_min_ratio", "cos_min_ratio", "warmup_num_steps", "warmup_type",
                                             "total_num_steps"})}
_DTYPES = {"fp32": True, "fp16": False, "bf16": False, "bfp16": False}   # reduce in fp32, or in the training dtype


def _feature_offers() -> dict[str, str]:
    """DeepSpeed's features kept off with {"enabled": false} (unused): each one's key -> what megazero offers
    instead, said when it is on (refused)."""
    return {
        "flops_profiler": "megazero reports throughput and MFU on its log line",
        "comms_logger": "megazero has no communication logger",
        "tensorboard": f"use {FLAG.tensorboard_dir}", "csv_monitor": f"use {FLAG.metrics_file}",
        "wandb": f"use the trainer's logging flags ({FLAG.tensorboard_dir}, {FLAG.metrics_file})",
        "autotuning": f"megazero has no autotuner ({FLAG.memory_budget_gib} picks recompute and offload)",
        "curriculum_learning": "megazero has no curriculum learning",
        "data_efficiency": "megazero has no data efficiency",
        "elasticity": "megazero has no elastic batch size", "progressive_layer_drop": "megazero has no layer drop",
        "amp": f"use {FLAG.fp16} or {FLAG.bf16}", "nebula": f"megazero writes its own checkpoints ({FLAG.save})",
    }


def from_deepspeed(path: str | Path, unused: list[tuple[str, str]] | None = None,
                   decided: dict[str, str] | None = None) -> dict:
    """The settings a DeepSpeed JSON config asks for; its unused keys are appended to ``unused`` as
    ``(source, key path)``, the settings it leaves to others (``"auto"``, or DeepSpeed's default) to
    ``decided`` (:attr:`Reader.decided`). Every problem of the file is refused in one ConfigError."""
    source = f"--deepspeed-config {path}"
    r = read_deepspeed(Path(path), source)
    out = r.done()
    if unused is not None:
        unused += [(source, key) for key in r.unused]
    if decided is not None:
        decided.update(r.decided)
    return out


def read_deepspeed(path: Path, source: str) -> Reader:
    """The walked file (settings, problems, unused keys); a file that cannot be read is a ConfigError."""
    r = Reader(source, read_json(path, source))
    r.only("", {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "fp16", "bf16", "zero_optimization", "optimizer", "scheduler",
                "communication_data_type", "data_types", "activation_checkpointing", *_feature_offers()}, _TOP_UNUSED)
    r.take("train.global_batch_size", "train_batch_size", int)
    r.take("train.micro_batch_size", "train_micro_batch_size_per_gpu", int)
    r.take("train.gradient_accumulation_steps", "gradient_accumulation_steps", int)
    r.take("optimizer.clip_grad", "gradient_clipping", float)
    _features(r)
    _precision(r)
    _zero(r)
    _optimizer(r)
    _scheduler(r)
    return r


def _features(r: Reader) -> None:
    """DeepSpeed's optional features: off is unused, on is refused (with megazero's nearest offer)."""
    for key, instead in _feature_offers().items():
        if not r.given(key):
            continue
        enabled = r.get(f"{key}.enabled", bool, default=False)
        if enabled:
            r.fail(f"{key}.enabled", f"DeepSpeed's {key} is not in megazero ({instead}): set it false or remove it")
        else:
            r.unused.append(key)
    section = r.raw("activation_checkpointing")
    if not isinstance(section, dict):
        if section is not None:
            r.fail("activation_checkpointing", f"must be a mapping, got {section!r}")
        return
    on = [k for k, v in section.items() if k != "number_checkpoints" and v not in (False, None)]
    if on:
        r.fail("activation_checkpointing", f"{', '.join(on)}: DeepSpeed's checkpointing API is not used here: use "
                                           f"{FLAG.recompute_activations} (or {FLAG.recompute_granularity} full) and "
                                           f"{FLAG.cpu_offloading}, and remove this section")
    elif section:
        r.unused.append("activation_checkpointing")


def _precision(r: Reader) -> None:
    """bf16 / fp16 and fp16's dynamic loss scale; the reduce dtype (communication_data_type,
    data_types.grad_accum_dtype) onto --accumulate-allreduce-grads-in-fp32."""
    r.only("bf16", {"enabled"})
    scaling = {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
               "auto_cast", "consecutive_hysteresis"}
    section = r.only("fp16", {"enabled"} | scaling)
    if r.get("bf16.enabled", bool):
        r.set("precision.bf16", True)
    fp16 = r.get("fp16.enabled", bool, default=False)
    r.set("precision.fp16", True if fp16 else None)
    if fp16 is False:                        # a section of a precision that is off (DeepSpeed's default: off)
        r.unused += [f"fp16.{k}" for k in section if k in scaling]
    else:
        if r.get("fp16.loss_scale", float):
            r.fail("fp16.loss_scale", "a static loss scale is not supported: use 0 (dynamic scaling)")
        for key in ("auto_cast", "consecutive_hysteresis"):
            if r.get(f"fp16.{key}", bool):
                r.fail(f"fp16.{key}", "is not supported: set it false")
        power = r.get("fp16.initial_scale_power", int)
        r.note("precision.initial_loss_scale", "fp16.initial_scale_power")
        r.set("precision.initial_loss_scale", None if power is None else float(2 ** power))
        r.take("precision.loss_scale_window", "fp16.loss_scale_window", int)
        r.take("precision.hysteresis", "fp16.hysteresis", int)
        r.take("precision.min_loss_scale", "fp16.min_loss_scale", float)
    r.only("data_types", {"grad_accum_dtype"})
    for path in ("communication_data_type", "data_types.grad_accum_dtype"):
        dtype = r.get(path)
        if dtype is not None and str(dtype).lower() not in _DTYPES:
            r.fail(path, f"must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        elif dtype is not None:
            r.agree("zero.accumulate_allreduce_grads_in_fp32", _DTYPES[str(dtype).lower()], path,
                    "the other of communication_data_type and data_types.grad_accum_dtype")


def _zero(r: Reader) -> None:
    z = "zero_optimization"
    r.only(z, _ZERO_MAPPED, _ZERO_UNUSED)
    stage = r.take("zero.zero_stage", f"{z}.stage", int)
    r.take("zero.bucket_size", f"{z}.reduce_bucket_size", int)
    r.take("zero.overlap_grad_reduce", f"{z}.overlap_comm", bool)
    for key in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        if r.get(f"{z}.{key}", bool) is False:    # DeepSpeed's other way to the same gradients (memory, traffic)
            r.unused.append(f"{z}.{key}")
    for key, dest in (("stage3_prefetch_bucket_size", "zero.prefetch_bucket_elements"),
                      ("stage3_max_live_parameters", "zero.max_live_elements")):
        if stage is not None and stage != 3 and r.given(f"{z}.{key}"):
            r.unused.append(f"{z}.{key}")         # stage 3's only, as in DeepSpeed
        else:
            r.take(dest, f"{z}.{key}", int)
    r.take("zero.offload_sub_group_size", f"{z}.sub_group_size", int)
    r.take("zero.quantized_weights", f"{z}.zero_quantized_weights", bool)
    r.take("zero.hpz_partition_size", f"{z}.zero_hpz_partition_size", int)
    r.take("zero.quantized_gradients", f"{z}.zero_quantized_gradients", bool)
    for key, dest in (("offload_optimizer", "zero.offload_optimizer"), ("offload_param", "zero.offload_params")):
        path = f"{z}.{key}"
        r.only(path, {"device", "nvme_path", "pin_memory", "ratio"}, _OFFLOAD_UNUSED)
        ratio = r.get(f"{path}.ratio", float)
        if ratio is not None and ratio != 1:
            r.fail(f"{path}.ratio", "megazero offloads all of it or none: set 1.0 or remove it")
        device = offload_device(r, f"{path}.device", dest)
        nvme_path(r, r.get(f"{path}.nvme_path"), device, f"{path}.nvme_path")
        r.agree("zero.offload_pin_memory", r.get(f"{path}.pin_memory", bool), f"{path}.pin_memory")


def offload_device(r: Reader, path: str, dest: str) -> str | None:
    device = r.get(path)
    if device is not None and device not in OFFLOAD_DEVICES:
        return r.fail(path, f"must be {', '.join(OFFLOAD_DEVICES[:-1])} or {OFFLOAD_DEVICES[-1]}, got {device!r}")
    r.set(dest, device)
    return device


def nvme_path(r: Reader, value, device: str | None, path: str) -> None:
    if value in (None, "none"):
        return
    if device != "nvme":
        return r.fail(path, f"applies to device nvme only (this section's device is {device or 'none'}): remove it "
                            f"or set the device to nvme")
    r.agree("zero.nvme_path", value, path)


def _optimizer(r: Reader) -> None:
    r.only("optimizer", {"type", "params"})
    kind = r.get("optimizer.type")
    if kind is None:
        if r.raw("optimizer.params"):
            r.fail("optimizer.type", "is missing, so DeepSpeed would not read optimizer.params: give \"AdamW\"")
        return
    if str(kind).lower() not in ("adam", "adamw"):
        return r.fail("optimizer.type", f"{kind!r} is not supported: use \"AdamW\" (Muon is {FLAG.optimizer} muon)")
    p = "optimizer.params"
    r.only(p, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}, {"torch_adam"})
    if r.get(f"{p}.adam_w_mode", bool) is False:
        r.fail(f"{p}.adam_w_mode", "Adam with L2 regularisation is not supported: use AdamW (true)")
    if r.get(f"{p}.bias_correction", bool) is False:
        r.fail(f"{p}.bias_correction", "Adam without bias correction is not supported: set true or remove it")
    r.take("optimizer.lr", f"{p}.lr", float)
    betas = r.get(f"{p}.betas")
    r.note("optimizer.adam_beta1", f"{p}.betas")
    r.note("optimizer.adam_beta2", f"{p}.betas")
    if betas is not None and not (isinstance(betas, list) and len(betas) == 2
                                  and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
        r.fail(f"{p}.betas", f"must be two numbers, got {betas!r}")
    elif betas is not None:
        r.set("optimizer.adam_beta1", float(betas[0]))
        r.set("optimizer.adam_beta2", float(betas[1]))
    r.take("optimizer.adam_eps", f"{p}.eps", float)
    r.take("optimizer.weight_decay", f"{p}.weight_decay", float)


def _scheduler(r: Reader) -> None:
    """WarmupLR / WarmupDecayLR / WarmupCosineLR onto the schedule flags. An absent parameter is DeepSpeed's
    default; "auto" is the command line's (--lr, --lr-warmup-iters, --lr-decay-iters) or megazero's."""
    r.only("scheduler", {"type", "params"})
    kind = r.get("scheduler.type")
    if kind is None:
        if r.raw("scheduler.params"):
            r.fail("scheduler.type", f"is missing, so DeepSpeed would not read scheduler.params: give one of "
                                     f"{', '.join(_SCHEDULERS)}")
        return
    if kind not in _SCHEDULERS:
        return r.fail("scheduler.type", f"{kind!r} is not supported: use one of {', '.join(_SCHEDULERS)}")
    decay, allowed = _SCHEDULERS[kind]
    p = "scheduler.params"
    r.only(p, allowed | {"last_batch_iteration"})
    if r.get(f"{p}.last_batch_iteration", int) not in (None, -1):
        r.fail(f"{p}.last_batch_iteration", "the schedule follows the iteration megazero resumes from "
                                            f"({FLAG.load}): set -1 or remove it")
    warmup = r.take("optimizer.lr_warmup_style", f"{p}.warmup_type", default="log")
    if warmup not in (None, "log", "linear"):
        r.fail(f"{p}.warmup_type", f"must be log or linear, got {warmup!r}")
    r.take("optimizer.lr_warmup_iters", f"{p}.warmup_num_steps", int, default=1000)
    r.set("optimizer.lr_decay_style", decay)
    r.take("optimizer.lr_decay_iters", f"{p}.total_num_steps", int)
    start = "warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr"
    if r.get(f"{p}.{start}", float):
        r.fail(f"{p}.{start}", "the warmup starts from 0 in megazero: set 0")
    if kind == "WarmupCosineLR":                  # the peak is the optimizer's lr
        r.take("optimizer.min_lr_ratio", f"{p}.cos_min_ratio", float, default=0.0001)
        return
    if kind == "WarmupDecayLR":
        r.set("optimizer.min_lr", 0.0)
    peak, optimizer_lr = r.get(f"{p}.warmup_max_lr", float, default=0.001), r.out.get("optimizer.lr")
    if peak is not None and optimizer_lr is not None and peak != optimizer_lr:
        default = "" if r.given(f"{p}.warmup_max_lr") else " (absent: DeepSpeed's default)"
        return r.fail(f"{p}.warmup_max_lr", f"is {peak:g}{default} but optimizer.params.lr is {optimizer_lr:g}: "
                                            f"DeepSpeed trains at the scheduler's, make them agree")
    if optimizer_lr is None:
        r.note("optimizer.lr", f"{p}.warmup_max_lr", default=0.001)
    r.set("optimizer.lr", peak)
