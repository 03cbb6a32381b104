"""The rules of each config section: one ``check_<section>`` function each, called by the section's
``check`` method (and, in order, by :func:`megazero.config.validate`).

A failed rule raises :class:`ConfigError` with a one-line message naming the flag a user typed and
the fix. Messages never spell a flag by hand: ``FLAG.num_layers`` is ``flag("num_layers")``, read
from the field's metadata, so renaming a flag renames it in every message::

    check_model(ModelConfig(hidden_size=65), ParallelConfig())
    # ConfigError: --hidden-size 65 is not divisible by --num-attention-heads 4: choose a head count ...

Some checks fill derived values in the section they check (``parallel.dp``, ``train.global_batch_size``,
...); :func:`megazero.config.validate` runs them on a copy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from megazero.config.fields import ConfigError, choices, flag, setting

if TYPE_CHECKING:
    from megazero.config.sections import (CheckpointConfig, CompileConfig, DataConfig, JobConfig, LoggingConfig,
                                          ModelConfig, OptimizerConfig, ParallelConfig, PrecisionConfig, TrainConfig,
                                          ZeroConfig)


class _Flags:
    """``FLAG.name`` is ``flag("name")``: a flag's spelling inside an f-string."""

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        return flag(name)


FLAG = _Flags()


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def _positive(value, name: str) -> None:
    if value is None or value < 1:
        _fail(f"{flag(name)} must be a positive integer, got {value}")


def _positive_float(value: float, name: str) -> None:
    if not value > 0:
        _fail(f"{flag(name)} must be > 0, got {value}")


def _one_of(section, name: str) -> None:
    """The field's value is one of its flag's choices."""
    value, allowed = getattr(section, name), choices(name)
    if value not in allowed:
        _fail(f"{flag(name)} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def check_finite(job: JobConfig) -> None:
    """Every float setting of every section is a real number: nan and inf pass every comparison check
    (comparisons with nan are false), so they are refused first, by name."""
    for section in dataclasses.fields(job):
        for f in dataclasses.fields(getattr(job, section.name)):
            value = getattr(getattr(job, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                _fail(f"{setting(f.name)} must be a finite number, got {value}")


def check_parallel(par: ParallelConfig, world: int) -> None:
    """tp x pp x dp is the world size; fills ``dp`` (world // (tp * pp)) when it is None."""
    _positive(par.tp, "tp")
    _positive(par.pp, "pp")
    mp = par.tp * par.pp
    if par.dp is None:
        if world % mp:
            _fail(f"world size {world} is not divisible by tp*pp = {par.tp}*{par.pp} = {mp}: "
                  f"launch a multiple of {mp} processes (e.g. --nproc-per-node {mp * max(1, world // mp)}) "
                  f"or change {FLAG.tp} / {FLAG.pp}")
        par.dp = world // mp
    _positive(par.dp, "dp")
    if par.tp * par.pp * par.dp != world:
        _fail(f"tp*pp*dp = {par.tp}*{par.pp}*{par.dp} = {par.tp * par.pp * par.dp} does not equal the "
              f"world size {world}: launch {par.tp * par.pp * par.dp} processes or change "
              f"{FLAG.dp} (or leave it out to infer it)")
    if not par.distributed_timeout_minutes > 0:
        _fail(f"{FLAG.distributed_timeout_minutes} must be > 0, got {par.distributed_timeout_minutes}")
    if sorted(par.order.split("-")) != ["dp", "pp", "tp"]:
        _fail(f"{FLAG.order} {par.order!r} must name tp, dp and pp once each, e.g. 'tp-dp-pp'")


def check_model(m: ModelConfig, par: ParallelConfig) -> None:
    """The model's shape against the tensor-parallel layout (also used by tools that reshard)."""
    if not isinstance(m.model_family, str) or not m.model_family.strip():
        _fail(f"{FLAG.model_family} must name a model family, got {m.model_family!r}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                 "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by"):
        _positive(getattr(m, name), name)
    if m.hidden_size % m.num_attention_heads:
        _fail(f"{FLAG.hidden_size} {m.hidden_size} is not divisible by {FLAG.num_attention_heads} "
              f"{m.num_attention_heads}: choose a head count that divides the hidden size")
    if m.num_attention_heads % par.tp:
        _fail(f"{FLAG.num_attention_heads} {m.num_attention_heads} is not divisible by {FLAG.tp} {par.tp}: "
              f"each tensor-parallel rank needs whole heads; use a tp that divides the head count")
    if m.ffn_hidden_size % par.tp:
        _fail(f"{FLAG.ffn_hidden_size} {m.ffn_hidden_size} is not divisible by {FLAG.tp} {par.tp}: "
              f"choose an ffn size that is a multiple of tp")
    if m.padded_vocab_size(par.tp) % par.tp:
        _fail(f"padded vocab {m.padded_vocab_size(par.tp)} is not divisible by {FLAG.tp} {par.tp}: "
              f"set {FLAG.make_vocab_size_divisible_by} to a multiple of tp")
    if m.max_position_embeddings < m.seq_length:
        _fail(f"{FLAG.max_position_embeddings} {m.max_position_embeddings} is smaller than {FLAG.seq_length} "
              f"{m.seq_length}: raise it to at least the sequence length")
    if par.sequence_parallel and m.seq_length % par.tp:
        _fail(f"{FLAG.sequence_parallel} needs {FLAG.seq_length} ({m.seq_length}) divisible by {FLAG.tp} "
              f"{par.tp}: change the sequence length or drop {FLAG.sequence_parallel}")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            _fail(f"{flag(name)} must be in [0, 1), got {getattr(m, name)}")
    for name in ("layernorm_epsilon", "init_method_std"):
        _positive_float(getattr(m, name), name)
    _one_of(m, "activation")
    _one_of(m, "normalization")
    _check_rope(m)
    _check_query_groups(m, par.tp)
    _check_moe(m, par)


def _check_moe(m: ModelConfig, par: ParallelConfig) -> None:
    """Mixture-of-Experts flags against each other and the expert-parallel layout."""
    ep = par.expert_model_parallel_size
    _positive(ep, "expert_model_parallel_size")
    if not m.num_experts:
        if m.num_experts is not None:
            _fail(f"{FLAG.num_experts} must be a positive integer, got {m.num_experts}: leave it unset for dense MLPs")
        if ep > 1:
            _fail(f"{FLAG.expert_model_parallel_size} {ep} needs {FLAG.num_experts}: there are no experts to split")
        return
    _positive(m.moe_router_topk, "moe_router_topk")
    _positive(m.moe_layer_freq, "moe_layer_freq")
    if m.moe_router_topk > m.num_experts:
        _fail(f"{FLAG.moe_router_topk} {m.moe_router_topk} exceeds {FLAG.num_experts} {m.num_experts}: "
              f"a token cannot pick more experts than there are")
    if m.num_experts % ep:
        _fail(f"{FLAG.num_experts} {m.num_experts} is not divisible by {FLAG.expert_model_parallel_size} {ep}: "
              f"each expert-parallel rank holds the same number of whole experts")
    if par.dp is not None and par.dp % ep:
        _fail(f"data-parallel size {par.dp} is not divisible by {FLAG.expert_model_parallel_size} {ep}: "
              f"expert groups are carved out of the data-parallel group; choose EP dividing dp")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(m, name) < 0:
            _fail(f"{flag(name)} must be >= 0, got {getattr(m, name)}")
    if m.moe_expert_capacity_factor is not None and not m.moe_expert_capacity_factor > 0:
        _fail(f"{FLAG.moe_expert_capacity_factor} must be > 0, got {m.moe_expert_capacity_factor}: "
              f"leave it unset for dropless routing")


def _check_rope(m: ModelConfig) -> None:
    _one_of(m, "position_embedding_type")
    rope = m.position_embedding_type == "rope"
    if not rope and (m.use_rope_scaling or m.rotary_percent != 1.0):
        _fail(f"{FLAG.use_rope_scaling} and {FLAG.rotary_percent} apply to rotary embeddings only: add "
              f"{FLAG.position_embedding_type} rope or drop them")
    if not rope:
        return
    if not 0.0 < m.rotary_percent <= 1.0:
        _fail(f"{FLAG.rotary_percent} must be in (0, 1], got {m.rotary_percent}")
    if m.rotary_dim < 2 or m.rotary_dim % 2:
        _fail(f"{FLAG.rotary_percent} {m.rotary_percent} rotates {m.rotary_dim} of the {m.head_dim} features of "
              f"a head: RoPE needs an even number, at least 2; change {FLAG.rotary_percent}")
    if not m.rotary_base > 0 or (m.use_rope_scaling and not m.rope_scaling_factor >= 1.0):
        _fail(f"{FLAG.rotary_base} must be > 0 (got {m.rotary_base}) and {FLAG.rope_scaling_factor} >= 1 "
              f"(got {m.rope_scaling_factor})")


def _check_query_groups(m: ModelConfig, tp: int) -> None:
    """Megatron's rule: each tp rank holds whole key/value groups when there are at least tp of them
    (G % tp == 0); with fewer, the groups are replicated (tp % G == 0), each rank using one."""
    if not m.group_query_attention:
        if m.num_query_groups is not None:
            _fail(f"{FLAG.num_query_groups} {m.num_query_groups} needs {FLAG.group_query_attention}: add it, or "
                  f"drop {FLAG.num_query_groups} for multi-head attention")
        return
    g, heads = m.num_query_groups, m.num_attention_heads
    _positive(g, "num_query_groups")
    if heads % g:
        _fail(f"{FLAG.num_attention_heads} {heads} is not divisible by {FLAG.num_query_groups} {g}: every group "
              f"needs the same number of query heads; choose a group count that divides the heads")
    if g >= tp and g % tp:
        _fail(f"{FLAG.num_query_groups} {g} is not divisible by {FLAG.tp} {tp}: each tensor-parallel rank "
              f"needs whole key/value groups; use a tp that divides {g}")
    if g < tp and tp % g:
        _fail(f"{FLAG.tp} {tp} is not a multiple of {FLAG.num_query_groups} {g}: with fewer groups than tp "
              f"ranks each group is replicated over tp / groups ranks; use a tp that {g} divides")


def check_pipeline(m: ModelConfig, par: ParallelConfig) -> None:
    """The layers over the pipeline stages (and virtual chunks); fills ``par.virtual_stages`` and, with
    virtual chunks, the interleaved schedule."""
    _one_of(par, "pipeline_schedule")
    per_virtual = par.num_layers_per_virtual_pipeline_stage
    virtual = FLAG.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None:
        _positive(per_virtual, "num_layers_per_virtual_pipeline_stage")
        if par.pp < 2:
            _fail(f"{virtual} needs {FLAG.pp} >= 2 (got {par.pp}): drop it or use pipeline parallelism")
        if m.num_layers % (par.pp * per_virtual):
            _fail(f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.pp} {par.pp} * "
                  f"{virtual} {per_virtual}: each rank needs whole chunks")
        par.virtual_stages = m.num_layers // (par.pp * per_virtual)
        if par.virtual_stages < 2:
            _fail(f"{virtual} {per_virtual} gives one chunk per rank "
                  f"({m.num_layers} layers / pp {par.pp}): use a smaller value or drop it")
        par.pipeline_schedule = "interleaved"
    elif par.pipeline_schedule == "interleaved":
        _fail(f"{FLAG.pipeline_schedule} interleaved needs {virtual}")
    if m.num_layers % par.pp:
        _fail(f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.pp} {par.pp}: "
              f"each pipeline stage needs the same number of layers")


def check_train(t: TrainConfig, par: ParallelConfig) -> None:
    """Batch sizes against the layout (``par.dp`` resolved); fills ``global_batch_size``."""
    _positive(t.micro_batch_size, "micro_batch_size")
    steps = t.gradient_accumulation_steps              # no flag: a DeepSpeed or Accelerate config sets it
    if steps is not None:
        if steps < 1:
            _fail(f"{setting('gradient_accumulation_steps')} must be a positive integer, got {steps}")
        implied = t.micro_batch_size * steps * par.dp
        if t.global_batch_size is None:
            t.global_batch_size = implied
        elif t.global_batch_size != implied:
            _fail(f"{FLAG.global_batch_size} {t.global_batch_size} is not micro-batch {t.micro_batch_size} x "
                  f"gradient accumulation steps {steps} x dp {par.dp} = {implied}: make them agree")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * par.dp * par.pp
    _positive(t.global_batch_size, "global_batch_size")
    per_step = t.micro_batch_size * par.dp
    if t.global_batch_size % per_step:
        _fail(f"{FLAG.global_batch_size} {t.global_batch_size} is not divisible by {FLAG.micro_batch_size} "
              f"{t.micro_batch_size} * dp {par.dp} = {per_step}: use a multiple of {per_step}")
    m = t.global_batch_size // per_step
    if par.pp > 1 and par.pipeline_schedule in ("1f1b", "interleaved") and m < par.pp:
        _fail(f"{m} micro-batches per step is fewer than {par.pp} pipeline stages, which leaves the "
              f"{par.pipeline_schedule} pipeline mostly idle: raise {FLAG.global_batch_size} to at least "
              f"{par.pp * per_step} (micro-batches = global / (micro * dp))")
    if par.pipeline_schedule == "interleaved" and m % par.pp:
        _fail(f"the interleaved schedule needs micro-batches ({m}) divisible by {FLAG.pp} {par.pp}: "
              f"make {FLAG.global_batch_size} a multiple of {par.pp * per_step}")
    _positive(t.train_iters, "train_iters")
    for name in ("eval_interval", "log_interval"):
        _positive(getattr(t, name), name)
    if t.eval_iters < 0:
        _fail(f"{FLAG.eval_iters} must be >= 0, got {t.eval_iters}")


def check_precision(pr: PrecisionConfig) -> None:
    """One of bf16 / fp16 / fp32, and fp16's loss scaling."""
    if pr.bf16 and pr.fp16:
        _fail(f"{FLAG.bf16} and {FLAG.fp16} are exclusive: pick one")
    for name in ("initial_loss_scale", "min_loss_scale"):
        _positive_float(getattr(pr, name), name)
    if pr.min_loss_scale > pr.initial_loss_scale:
        _fail(f"{FLAG.min_loss_scale} {pr.min_loss_scale} is above {FLAG.initial_loss_scale} {pr.initial_loss_scale}")
    for name in ("loss_scale_window", "hysteresis", "max_consecutive_skipped_steps"):
        _positive(getattr(pr, name), name)


def check_zero(z: ZeroConfig, par: ParallelConfig, world: int) -> None:
    """The ZeRO stage, and what each switch (stage-specific options, offload, ZeRO++) needs of it and
    of the layout. Changes nothing: an engine may call it on the config it is given."""
    stage, stages = z.zero_stage, choices("zero_stage")
    if stage not in stages:
        _fail(f"{FLAG.zero_stage} must be {', '.join(map(str, stages[:-1]))} or {stages[-1]}, got {stage}")
    _positive(z.bucket_size, "bucket_size")
    if z.prefetch_layers < 0:
        _fail(f"{FLAG.prefetch_layers} must be >= 0 (0: no prefetch), got {z.prefetch_layers}")
    if z.keep_params_gathered and stage != 3:
        _fail(f"{FLAG.keep_params_gathered} applies to {FLAG.zero_stage} 3 only (got {stage}): "
              f"drop the flag or use {FLAG.zero_stage} 3")
    if z.overlap_param_gather and stage not in (1, 2):
        _fail(f"{FLAG.overlap_param_gather} applies to {FLAG.zero_stage} 1 and 2 (got {stage}; stage 3 gathers "
              f"each layer ahead of its compute, see {FLAG.prefetch_layers}): drop the flag or use stage 1 or 2")
    if z.reduce_each_microbatch and stage != 2:
        _fail(f"{FLAG.reduce_each_microbatch} applies to {FLAG.zero_stage} 2 only (got {stage}): "
              f"drop the flag or use {FLAG.zero_stage} 2")
    _check_offload(z)
    _check_zeropp(z, par, world)


def _check_offload(z: ZeroConfig) -> None:
    for name in ("offload_optimizer", "offload_params"):
        _one_of(z, name)
    if z.offload_optimizer != "none" and z.zero_stage == 0:
        _fail(f"{FLAG.offload_optimizer} {z.offload_optimizer} moves the ZeRO optimizer shard: use "
              f"{FLAG.zero_stage} 1, 2 or 3 (or drop the flag)")
    if z.offload_params != "none" and z.zero_stage != 3:
        _fail(f"{FLAG.offload_params} {z.offload_params} applies to {FLAG.zero_stage} 3 only (got {z.zero_stage}): "
              f"use {FLAG.zero_stage} 3 or drop the flag")
    nvme = "nvme" in (z.offload_optimizer, z.offload_params)
    if nvme and not z.nvme_path:
        _fail(f"offloading to nvme needs {FLAG.nvme_path} DIR (a directory on a fast local drive for the swap files)")
    if z.nvme_path and not nvme:
        _fail(f"{FLAG.nvme_path} {z.nvme_path} is used only with {FLAG.offload_optimizer} nvme or "
              f"{FLAG.offload_params} nvme: add one or drop {FLAG.nvme_path}")
    if z.offload_sub_group_size is not None:
        _positive(z.offload_sub_group_size, "offload_sub_group_size")


def _check_zeropp(z: ZeroConfig, par: ParallelConfig, world: int) -> None:
    """ZeRO++'s switches: what stage each needs, and a node layout they can use."""
    if par.ranks_per_node is not None and (par.ranks_per_node < 1 or world % par.ranks_per_node):
        _fail(f"{FLAG.ranks_per_node} {par.ranks_per_node} must divide the world size {world}: "
              f"pick a divisor of {world}")
    if z.quantized_weights and z.zero_stage != 3:
        _fail(f"{FLAG.quantized_weights} quantizes ZeRO-3's parameter all-gathers: use {FLAG.zero_stage} 3 "
              f"(got {z.zero_stage}) or drop the flag")
    hpz = FLAG.hpz_partition_size
    if z.hpz_partition_size < 1:
        _fail(f"{hpz} must be >= 1 (1: off), got {z.hpz_partition_size}")
    if z.hpz_partition_size > 1:
        if z.zero_stage != 3:
            _fail(f"{hpz} applies to {FLAG.zero_stage} 3 only (got {z.zero_stage}): use stage 3 or drop the flag")
        if par.dp is not None and par.dp % z.hpz_partition_size:
            _fail(f"{hpz} {z.hpz_partition_size} must divide the data-parallel size {par.dp}: "
                  f"use the number of dp ranks per node")
        ep = par.expert_model_parallel_size
        if par.dp is not None and ep > 1 and (par.dp // ep) % z.hpz_partition_size:
            _fail(f"{hpz} {z.hpz_partition_size} must divide the expert-data-parallel size {par.dp // ep} (dp "
                  f"{par.dp} / {FLAG.expert_model_parallel_size} {ep}): the experts' secondary shards are cut "
                  f"from it; use a divisor of {par.dp // ep}")
    if z.quantized_gradients and z.zero_stage not in (2, 3):
        _fail(f"{FLAG.quantized_gradients} replaces the gradient reduce-scatter of {FLAG.zero_stage} 2 or 3 "
              f"(got {z.zero_stage}; DeepSpeed applies it to stage 3): use {FLAG.zero_stage} 2 or 3 or drop the flag")
    if (z.quantized_weights or z.quantized_gradients) and z.quantization_block_size < 1:
        _fail(f"{FLAG.quantization_block_size} must be >= 1, got {z.quantization_block_size}")


def fill_zero_defaults(job: JobConfig) -> None:
    """ZeRO settings whose defaults come from other sections: fp32 gradient buckets on with bf16
    (Megatron's main grads), and DeepSpeed's prefetch bucket (elements) as whole layers."""
    z, m = job.zero, job.model
    if z.accumulate_allreduce_grads_in_fp32 is None:
        z.accumulate_allreduce_grads_in_fp32 = job.precision.bf16
    if z.prefetch_bucket_elements is not None:
        per_layer = (4 * m.hidden_size ** 2 + 2 * m.hidden_size * m.ffn_hidden_size) // job.parallel.tp
        z.prefetch_layers = max(1, z.prefetch_bucket_elements // max(per_layer, 1))


def check_optimizer(opt: OptimizerConfig, t: TrainConfig) -> None:
    """AdamW's settings and the schedule; fills ``min_lr`` from ``min_lr_ratio`` (a DeepSpeed setting,
    no flag) and ``lr_decay_iters`` (default: the training iterations)."""
    if opt.min_lr_ratio is not None:
        if not 0 <= opt.min_lr_ratio <= 1:
            _fail(f"the minimum learning-rate ratio must be in [0, 1], got {opt.min_lr_ratio}")
        opt.min_lr = opt.min_lr_ratio * opt.lr
    _one_of(opt, "lr_decay_style")
    if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
        _fail(f"need 0 <= {FLAG.min_lr} ({opt.min_lr}) <= {FLAG.lr} ({opt.lr}) and {FLAG.lr} > 0")
    if opt.lr_decay_iters is None:
        opt.lr_decay_iters = t.train_iters
    if opt.lr_warmup_iters < 0 or opt.lr_warmup_iters > opt.lr_decay_iters:
        _fail(f"{FLAG.lr_warmup_iters} {opt.lr_warmup_iters} must be between 0 and {FLAG.lr_decay_iters} "
              f"{opt.lr_decay_iters}")
    if not (0 <= opt.adam_beta1 < 1 and 0 <= opt.adam_beta2 < 1):
        _fail(f"{FLAG.adam_beta1} and {FLAG.adam_beta2} must be in [0, 1)")
    if opt.clip_grad < 0 or opt.weight_decay < 0:
        _fail(f"{FLAG.clip_grad} and {FLAG.weight_decay} must be >= 0")
    _positive_float(opt.adam_eps, "adam_eps")


def check_data(d: DataConfig) -> None:
    """The split, the data paths (or mock data) and the tokenizer's files."""
    parts = d.split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        _fail(f"{FLAG.split} {d.split!r} must be up to three non-negative weights, the first (training) above 0, "
              f"like 969,30,1")
    path, tokenizer = FLAG.data_path, FLAG.tokenizer_type
    if d.mock_data and d.data_path:
        _fail(f"{FLAG.mock_data} and {path} are exclusive: drop one")
    if d.tokenizer_type is not None:
        _one_of(d, "tokenizer_type")
    if d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        _fail(f"{tokenizer} GPT2BPETokenizer needs {FLAG.vocab_file} and {FLAG.merge_file}")
    if d.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer") and not d.tokenizer_model:
        hf = d.tokenizer_type == "HuggingFaceTokenizer"
        _fail(f"{tokenizer} {d.tokenizer_type} needs {FLAG.tokenizer_model}"
              + (" (a directory with tokenizer.json, or the file)" if hf else ""))
    if len(d.data_path) > 1:
        if len(d.data_path) % 2:
            _fail(f"{path} with several datasets takes weight-prefix pairs: "
                  f"{path} 0.3 a_text_document 0.7 b_text_document")
        for w in d.data_path[0::2]:
            try:
                weight = float(w)
            except ValueError:
                _fail(f"{path} weight {w!r} is not a number (expected weight-prefix pairs)")
            if not (math.isfinite(weight) and weight > 0):
                _fail(f"{path} weight {w!r} must be a positive number (a dataset with no weight: leave it out)")
    if d.data_path and d.tokenizer_type is None:
        _fail(f"{path} needs {tokenizer} (with its {FLAG.vocab_file}/{FLAG.merge_file} or {FLAG.tokenizer_model}): "
              "the tokenizer sets the vocabulary size")


def check_checkpoint(ck: CheckpointConfig) -> None:
    """The save interval and finetuning have the directories they need."""
    if ck.save_interval is not None and ck.save_interval < 1:
        _fail(f"{FLAG.save_interval} must be a positive integer, got {ck.save_interval}")
    if ck.save_interval and not ck.save:
        _fail(f"{FLAG.save_interval} needs {FLAG.save} DIR (where to write the checkpoints)")
    if ck.async_save and not ck.save:
        _fail(f"{FLAG.async_save} needs {FLAG.save} DIR (where to write the checkpoints)")
    if ck.finetune and not ck.load:
        _fail(f"{FLAG.finetune} needs {FLAG.load} DIR (the checkpoint whose weights to start from)")


def check_logging(lg: LoggingConfig) -> None:
    """No rule between the logging settings; whether their paths can be written is the preflight's
    (:mod:`megazero.preflight`), which looks at the file system."""


def check_compile(c: CompileConfig) -> None:
    """A compile mode only with compilation on (whether torch can compile on this machine is the
    pre-launch check's: megazero/preflight.py)."""
    _one_of(c, "compile_mode")
    if c.compile_mode != "default" and not c.compile:
        _fail(f"{FLAG.compile_mode} {c.compile_mode} applies with {FLAG.compile}: add {FLAG.compile} or drop "
              f"{FLAG.compile_mode}")
