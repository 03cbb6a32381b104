"""The trainer's command line: Megatron flag names -> a validated :class:`JobConfig`.

Imported only by the entry point ``pretrain_gpt.py`` (tools have their own small parsers and never
import this). Every flag maps to one dataclass field (``section.field``); its default is the dataclass
default, so defaults live in one place (``megazero/config.py``).

A config file (``--config run.toml`` or ``.yaml``) uses the same names as keys (dashes or underscores,
short aliases allowed, optionally grouped in tables); flags given on the command line override it::

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
import os
from pathlib import Path

from megazero.config import (ACTIVATIONS, BACKENDS, DECAY_STYLES, NORMALIZATIONS, OFFLOAD_DEVICES,
                             POSITION_EMBEDDING_TYPES, SCHEDULES, TOKENIZERS, ZERO_STAGES, ConfigError, JobConfig,
                             validate)
from megazero.foreign_config import from_accelerate, from_deepspeed

# (flags, "section.field", argparse kwargs). Booleans are store_true unless a kwarg says otherwise.
ARGUMENTS: dict[str, list[tuple[tuple[str, ...], str, dict]]] = {
    "parallelism": [
        (("--tensor-model-parallel-size", "--tp"), "parallel.tp", dict(type=int)),
        (("--pipeline-model-parallel-size", "--pp"), "parallel.pp", dict(type=int)),
        (("--data-parallel-size", "--dp"), "parallel.dp", dict(type=int, help="inferred when absent")),
        (("--num-layers-per-virtual-pipeline-stage",), "parallel.num_layers_per_virtual_pipeline_stage",
         dict(type=int, help="interleaved 1F1B: layers per model chunk")),
        (("--pipeline-schedule",), "parallel.pipeline_schedule", dict(choices=SCHEDULES)),
        (("--sequence-parallel",), "parallel.sequence_parallel", dict(action="store_true")),
        (("--parallel-order",), "parallel.order", dict(help="rank order, fastest first (default tp-dp-pp)")),
        (("--distributed-timeout-minutes",), "parallel.distributed_timeout_minutes",
         dict(type=float, help="a collective waiting longer ends the job with an error (default 10)")),
        (("--zero-stage",), "zero.zero_stage", dict(type=int, choices=ZERO_STAGES)),
        (("--bucket-size",), "zero.bucket_size", dict(type=int, help="elements per gradient bucket")),
        (("--overlap-grad-reduce",), "zero.overlap_grad_reduce", dict(action=argparse.BooleanOptionalAction)),
        (("--overlap-param-gather",), "zero.overlap_param_gather",
         dict(action="store_true", help="ZeRO-1/2: the updated parameters' all-gathers finish behind the next forward")),
        (("--zero3-prefetch-layers",), "zero.prefetch_layers", dict(type=int)),
        (("--zero3-keep-params-gathered",), "zero.keep_params_gathered", dict(action="store_true")),
        (("--zero-quantized-weights",), "zero.quantized_weights",
         dict(action="store_true", help="ZeRO++ qwZ (stage 3): int8 parameter all-gathers")),
        (("--zero-quantization-block-size",), "zero.quantization_block_size",
         dict(type=int, help="elements per int8 block of qwZ and qgZ (one fp32 scale each)")),
        (("--zero-hpz-partition-size",), "zero.hpz_partition_size",
         dict(type=int, help="ZeRO++ hpZ (stage 3): backward gathers over K dp ranks (K = dp ranks per node)")),
        (("--zero-quantized-gradients",), "zero.quantized_gradients",
         dict(action="store_true", help="ZeRO++ qgZ (stage 2/3): hierarchical int8 all-to-all gradient reduce")),
        (("--ranks-per-node",), "parallel.ranks_per_node",
         dict(type=int, help="ranks on each node (default: torchrun's LOCAL_WORLD_SIZE); lets one machine "
                             "act as several nodes")),
        (("--zero2-reduce-each-microbatch",), "zero.reduce_each_microbatch",
         dict(action="store_true", help="stage 2: reduce gradients every micro-batch (less memory, "
                                        "m x the gradient traffic)")),
        (("--accumulate-allreduce-grads-in-fp32",), "zero.accumulate_allreduce_grads_in_fp32",
         dict(action=argparse.BooleanOptionalAction, help="accumulate and reduce gradients in fp32 "
              "(default: on with --bf16)")),
        (("--sharded-init",), "zero.sharded_init",
         dict(action=argparse.BooleanOptionalAction, help="build the model on the meta device and give each "
              "parameter its values where it lives (ZeRO-3: shard by shard); default on")),
    ],
    "model": [
        (("--num-layers",), "model.num_layers", dict(type=int)),
        (("--hidden-size",), "model.hidden_size", dict(type=int)),
        (("--ffn-hidden-size",), "model.ffn_hidden_size", dict(type=int, help="default 4 * hidden size")),
        (("--num-attention-heads",), "model.num_attention_heads", dict(type=int)),
        (("--seq-length",), "model.seq_length", dict(type=int)),
        (("--max-position-embeddings",), "model.max_position_embeddings", dict(type=int)),
        (("--vocab-size",), "model.vocab_size", dict(type=int, help="with --mock-data; else the tokenizer's")),
        (("--make-vocab-size-divisible-by",), "model.make_vocab_size_divisible_by", dict(type=int)),
        (("--untie-embeddings-and-output-weights",), "model.untie_embeddings_and_output_weights",
         dict(action="store_true")),
        (("--attention-dropout",), "model.attention_dropout", dict(type=float)),
        (("--hidden-dropout",), "model.hidden_dropout", dict(type=float)),
        (("--init-method-std",), "model.init_method_std", dict(type=float)),
        (("--scaled-output-init",), "model.scaled_output_init", dict(action=argparse.BooleanOptionalAction)),
        (("--norm-epsilon", "--layernorm-epsilon"), "model.layernorm_epsilon", dict(type=float)),
        (("--activation",), "model.activation", dict(choices=ACTIVATIONS)),
        (("--recompute-activations",), "model.recompute_activations", dict(action="store_true")),
        (("--position-embedding-type",), "model.position_embedding_type", dict(choices=POSITION_EMBEDDING_TYPES)),
        (("--rotary-base",), "model.rotary_base", dict(type=float, help="RoPE theta (default 10000)")),
        (("--rotary-percent",), "model.rotary_percent", dict(type=float, help="fraction of head features rotated")),
        (("--use-rope-scaling",), "model.use_rope_scaling", dict(action="store_true",
                                                                 help="Llama 3.1 RoPE frequency scaling")),
        (("--rope-scaling-factor",), "model.rope_scaling_factor", dict(type=float)),
        (("--normalization",), "model.normalization", dict(choices=NORMALIZATIONS)),
        (("--swiglu",), "model.swiglu", dict(action="store_true")),
        (("--group-query-attention",), "model.group_query_attention", dict(action="store_true")),
        (("--num-query-groups",), "model.num_query_groups", dict(type=int, help="key/value heads (default 1)")),
        (("--disable-bias-linear",), "model.add_bias_linear", dict(action="store_false",
                                                                   help="no biases in the linear layers")),
        (("--add-qkv-bias",), "model.add_qkv_bias", dict(action="store_true",
                                                         help="bias in the QKV projection only (Qwen2)")),
    ],
    "mixture of experts": [
        (("--num-experts",), "model.num_experts", dict(type=int, help="experts per MoE layer (default: dense)")),
        (("--moe-router-topk",), "model.moe_router_topk", dict(type=int, help="experts per token (default 2)")),
        (("--moe-layer-freq",), "model.moe_layer_freq", dict(type=int, help="an MoE layer every N layers (default 1)")),
        (("--moe-aux-loss-coeff",), "model.moe_aux_loss_coeff", dict(type=float, help="load-balancing loss weight")),
        (("--moe-z-loss-coeff",), "model.moe_z_loss_coeff", dict(type=float, help="router z-loss weight")),
        (("--moe-expert-capacity-factor",), "model.moe_expert_capacity_factor",
         dict(type=float, help="drop tokens beyond this x the even share (default: dropless)")),
        (("--expert-model-parallel-size",), "parallel.expert_model_parallel_size",
         dict(type=int, help="experts split over this many dp ranks (default 1)")),
    ],
    "training": [
        (("--micro-batch-size",), "train.micro_batch_size", dict(type=int)),
        (("--global-batch-size",), "train.global_batch_size", dict(type=int,
                                                                   help="gradient accumulation derived")),
        (("--train-iters",), "train.train_iters", dict(type=int)),
        (("--seed",), "train.seed", dict(type=int)),
        (("--eval-interval",), "train.eval_interval", dict(type=int)),
        (("--eval-iters",), "train.eval_iters", dict(type=int)),
        (("--log-interval",), "train.log_interval", dict(type=int)),
        (("--check-for-nan-in-loss-and-grad",), "train.check_for_nan_in_loss_and_grad",
         dict(action=argparse.BooleanOptionalAction, help="stop the run on a non-finite loss or gradient "
              "(default on; off: such steps are skipped)")),
    ],
    "optimizer": [
        (("--lr",), "optimizer.lr", dict(type=float)),
        (("--min-lr",), "optimizer.min_lr", dict(type=float)),
        (("--lr-warmup-iters",), "optimizer.lr_warmup_iters", dict(type=int)),
        (("--lr-decay-iters",), "optimizer.lr_decay_iters", dict(type=int)),
        (("--lr-decay-style",), "optimizer.lr_decay_style", dict(choices=DECAY_STYLES)),
        (("--weight-decay",), "optimizer.weight_decay", dict(type=float)),
        (("--adam-beta1",), "optimizer.adam_beta1", dict(type=float)),
        (("--adam-beta2",), "optimizer.adam_beta2", dict(type=float)),
        (("--adam-eps",), "optimizer.adam_eps", dict(type=float)),
        (("--clip-grad",), "optimizer.clip_grad", dict(type=float, help="0 disables")),
    ],
    "mixed precision": [
        (("--bf16",), "precision.bf16", dict(action="store_true")),
        (("--fp16",), "precision.fp16", dict(action="store_true")),
        (("--initial-loss-scale",), "precision.initial_loss_scale", dict(type=float)),
        (("--min-loss-scale",), "precision.min_loss_scale", dict(type=float)),
        (("--loss-scale-window",), "precision.loss_scale_window", dict(type=int)),
        (("--hysteresis",), "precision.hysteresis", dict(type=int)),
        (("--max-consecutive-skipped-steps",), "precision.max_consecutive_skipped_steps",
         dict(type=int, help="stop after this many skipped (overflowed) steps in a row (default 20)")),
    ],
    "data": [
        (("--data-path",), "data.data_path", dict(nargs="+", help="prefix, or weight prefix pairs")),
        (("--split",), "data.split", dict()),
        (("--mock-data",), "data.mock_data", dict(action="store_true")),
        (("--tokenizer-type",), "data.tokenizer_type",
         dict(choices=TOKENIZERS)),
        (("--vocab-file",), "data.vocab_file", dict()),
        (("--merge-file",), "data.merge_file", dict()),
        (("--tokenizer-model",), "data.tokenizer_model", dict()),
        (("--data-cache-path",), "data.data_cache_path", dict()),
        (("--eod-mask-loss",), "data.eod_mask_loss", dict(action="store_true",
                                                          help="no loss on the end-of-document token")),
    ],
    "checkpointing": [
        (("--save",), "checkpoint.save", dict()),
        (("--load",), "checkpoint.load", dict()),
        (("--save-interval",), "checkpoint.save_interval", dict(type=int)),
        (("--finetune",), "checkpoint.finetune", dict(action="store_true",
                                                      help="load weights only: no optimizer, iteration 0")),
    ],
    "logging": [
        (("--tensorboard-dir",), "logging.tensorboard_dir", dict()),
        (("--metrics-file",), "logging.metrics_file", dict(help="JSON lines, one per logged iteration")),
    ],
    "offload": [
        (("--offload-optimizer",), "zero.offload_optimizer",
         dict(choices=OFFLOAD_DEVICES, help="ZeRO 1-3: fp32 masters, Adam moments and the update on the host (cpu) "
                                           "or in swap files (nvme)")),
        (("--offload-params",), "zero.offload_params",
         dict(choices=OFFLOAD_DEVICES, help="ZeRO-3: parameter shards on the host (cpu) or in swap files (nvme)")),
        (("--nvme-path",), "zero.nvme_path", dict(help="directory for the swap files of nvme offloading")),
        (("--offload-pin-memory",), "zero.offload_pin_memory",
         dict(action=argparse.BooleanOptionalAction, help="page-locked host buffers on CUDA (default on)")),
        (("--offload-sub-group-size",), "zero.offload_sub_group_size",
         dict(type=int, help="elements updated (and swapped) at a time on the host (default: 1/32 of the "
                             "rank's shard, at most 4M)")),
    ],
}


def build_parser(prog: str = "pretrain_gpt.py", description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's flags (and ``--config``); tools that take the same flags add their own to it."""
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description=description or "Pretrain a GPT with tensor, pipeline and data parallelism and ZeRO. With no "
                                   "data flags it trains a tiny GPT on the bundled sample corpus.")
    parser.add_argument("--config", help="TOML or YAML file with flag names as keys; CLI overrides it")
    parser.add_argument("--deepspeed-config", help="a DeepSpeed JSON config, mapped onto these flags "
                                                   "(README: DeepSpeed and Accelerate configs)")
    parser.add_argument("--accelerate-config", help="an Accelerate default_config.yaml with a deepspeed_config")
    parser.add_argument("--backend", choices=BACKENDS, help="default: nccl with CUDA, else gloo")
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
                              f"'num-layers' for --num-layers)")
        dest = known[key]
        if dest in where:
            raise ConfigError(f"--config {path}: {full_key!r} sets what {where[dest]!r} already set: keep one")
        where[dest] = full_key
        out[dest] = _typed(path, full_key, value, specs[dest])
        if key.replace("_", "-") in _NEGATIVE_FLAGS:     # `disable-bias-linear = true` sets add_bias_linear False
            out[dest] = not out[dest]
    return out


def _merge(base: dict, more: dict, where: str) -> dict:
    """``base`` and ``more`` together; a setting they give different values is an error."""
    for dest, value in more.items():
        if dest in base and base[dest] != value:
            section, name = dest.split(".")
            raise ConfigError(f"{where} sets --{name.replace('_', '-')} {value!r}, the DeepSpeed/Accelerate config "
                              f"{base[dest]!r}: set it in one place")
    return {**base, **more}


def _parse_config_text(p: Path):
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ConfigError(f"--config {p}: YAML needs PyYAML (pip install pyyaml), or use TOML") from e

        class UniqueKeys(yaml.SafeLoader):
            """YAML that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

        def mapping(loader, node):
            keys = [loader.construct_object(k) for k, _ in node.value]
            twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
            if twice:
                raise ConfigError(f"--config {p}: key {twice[0]!r} is given twice: keep one")
            return loader.construct_mapping(node)

        UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        try:
            return yaml.load(text, Loader=UniqueKeys) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {p}: not valid YAML: {e}".splitlines()[0]) from e
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
        values = load_config_file(args.config) if args.config else {}
        foreign = {}
        if args.deepspeed_config:
            foreign.update(from_deepspeed(args.deepspeed_config))
        if args.accelerate_config:
            foreign = _merge(foreign, from_accelerate(args.accelerate_config), "--accelerate-config")
        flags = {k: v for k, v in vars(args).items() if "." in k}
        values.update(_merge(foreign, flags, "the command line"))
        return validate(job_from_values(values), world_size)
    except (ConfigError, TypeError) as e:
        # One line from the launcher, not one per rank: rank 0 prints and exits at once, and the launcher
        # stops the others while they wait; a rank still alive after the wait prints the line itself.
        if os.environ.get("RANK", "0") != "0":
            import time
            time.sleep(5.0)
        parser.exit(2, f"{parser.prog}: error: {e}\n")
