"""The rules of each config section: one ``check_<section>`` function each, called by the section's
``check`` method (and, in order, by :func:`megazero.config.validate`); the model's are in
:mod:`megazero.config.model_checks`.

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

# The --cp-comm-type values (of Megatron's, sections.CP_COMM_TYPES) built here; a2a+p2p is refused by name.
BUILT_CP_COMM_TYPES = ("p2p", "a2a", "allgather")


class _Flags:
    """``FLAG.name`` is ``flag("name")``: a flag's spelling inside an f-string."""

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        return flag(name)


FLAG = _Flags()


def fail(msg: str) -> None:
    raise ConfigError(msg)


def positive(value, name: str) -> None:
    if value is None or value < 1:
        fail(f"{flag(name)} must be a positive integer, got {value}")


def positive_float(value: float, name: str) -> None:
    if not value > 0:
        fail(f"{flag(name)} must be > 0, got {value}")


def one_of(section, name: str) -> None:
    """The field's value is one of its flag's choices."""
    value, allowed = getattr(section, name), choices(name)
    if value not in allowed:
        fail(f"{flag(name)} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def check_finite(job: JobConfig) -> None:
    """Every float setting of every section is a real number: nan and inf pass every comparison check
    (comparisons with nan are false), so they are refused first, by name."""
    for section in dataclasses.fields(job):
        for f in dataclasses.fields(getattr(job, section.name)):
            value = getattr(getattr(job, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                fail(f"{setting(f.name)} must be a finite number, got {value}")


def check_parallel(par: ParallelConfig, world: int) -> None:
    """tp x cp x pp x dp is the world size; fills ``dp`` (world // (tp * cp * pp)) when it is None."""
    positive(par.tp, "tp")
    positive(par.pp, "pp")
    positive(par.cp, "cp")
    one_of(par, "cp_comm_type")
    mp = par.tp * par.cp * par.pp
    sizes = f"tp*cp*pp = {par.tp}*{par.cp}*{par.pp}" if par.cp > 1 else f"tp*pp = {par.tp}*{par.pp}"
    if par.dp is None:
        if world % mp:
            fail(f"world size {world} is not divisible by {sizes} = {mp}: "
                  f"launch a multiple of {mp} processes (e.g. --nproc-per-node {mp * max(1, world // mp)}) "
                  f"or change {FLAG.tp} / {FLAG.pp}" + (f" / {FLAG.cp}" if par.cp > 1 else ""))
        par.dp = world // mp
    positive(par.dp, "dp")
    if mp * par.dp != world:
        fail(f"{sizes}*dp = {mp * par.dp} (dp {par.dp}) does not equal the "
              f"world size {world}: launch {mp * par.dp} processes or change "
              f"{FLAG.dp} (or leave it out to infer it)")
    if not par.distributed_timeout_minutes > 0:
        fail(f"{FLAG.distributed_timeout_minutes} must be > 0, got {par.distributed_timeout_minutes}")
    from megazero.parallel.topology import parse_order       # the rank order's one reading

    try:
        parse_order(par.order)
    except ValueError:
        fail(f"{FLAG.order} {par.order!r} must name tp, dp and pp once each (and cp at most once), e.g. "
              f"'tp-cp-dp-pp'")
    if par.sequence_parallel and par.tp < 2:
        fail(f"{FLAG.sequence_parallel} splits activations over the tensor-parallel ranks and does nothing at "
              f"{FLAG.tp} {par.tp}: drop it, or use {FLAG.tp} 2 or more")
    if par.cp_comm_type not in BUILT_CP_COMM_TYPES:
        fail(f"{FLAG.cp_comm_type} {par.cp_comm_type} is not built: use p2p (ring), a2a (Ulysses) or allgather")


def check_context_parallel(job: JobConfig) -> None:
    """What context parallelism does not compose with yet, refused by name (the model's rules are in
    :mod:`megazero.config.model_checks`)."""
    cp, z = job.parallel.cp, job.zero
    if cp == 1:
        return
    if z.hpz_partition_size > 1 or z.quantized_weights or z.quantized_gradients:
        fail(f"{FLAG.cp} {cp} with ZeRO++ ({FLAG.hpz_partition_size}, {FLAG.quantized_weights}, "
              f"{FLAG.quantized_gradients}) is not built: drop the ZeRO++ flags or {FLAG.cp}")
    if job.compilation.compile:
        fail(f"{FLAG.cp} {cp} with {FLAG.compile} is not built (the attention's collectives sit inside the "
              f"compiled layers): drop {FLAG.compile}")


def check_train(t: TrainConfig, par: ParallelConfig) -> None:
    """Batch sizes against the layout (``par.dp`` resolved); fills ``global_batch_size``."""
    positive(t.micro_batch_size, "micro_batch_size")
    if t.memory_budget_gib is not None:
        positive_float(t.memory_budget_gib, "memory_budget_gib")
    steps = t.gradient_accumulation_steps              # no flag: a DeepSpeed or Accelerate config sets it
    if steps is not None:
        if steps < 1:
            fail(f"{setting('gradient_accumulation_steps')} must be a positive integer, got {steps}")
        implied = t.micro_batch_size * steps * par.dp
        if t.global_batch_size is None:
            t.global_batch_size = implied
        elif t.global_batch_size != implied:
            fail(f"{FLAG.global_batch_size} {t.global_batch_size} is not micro-batch {t.micro_batch_size} x "
                  f"gradient accumulation steps {steps} x dp {par.dp} = {implied}: make them agree")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * par.dp * par.pp
    positive(t.global_batch_size, "global_batch_size")
    per_step = t.micro_batch_size * par.dp
    if t.global_batch_size % per_step:
        fail(f"{FLAG.global_batch_size} {t.global_batch_size} is not divisible by {FLAG.micro_batch_size} "
              f"{t.micro_batch_size} * dp {par.dp} = {per_step}: use a multiple of {per_step}")
    m = t.global_batch_size // per_step
    if par.pp > 1 and par.pipeline_schedule in ("1f1b", "interleaved", "zb-h1", "zb-v") and m < par.pp:
        fail(f"{m} micro-batches per step is fewer than {par.pp} pipeline stages, which leaves the "
              f"{par.pipeline_schedule} pipeline mostly idle: raise {FLAG.global_batch_size} to at least "
              f"{par.pp * per_step} (micro-batches = global / (micro * dp))")
    if par.pipeline_schedule == "interleaved" and m % par.pp:
        fail(f"the interleaved schedule needs micro-batches ({m}) divisible by {FLAG.pp} {par.pp}: "
              f"make {FLAG.global_batch_size} a multiple of {par.pp * per_step}")
    _fill_train_iters(t)
    if not 0 <= t.seed < 2 ** 32:
        fail(f"{FLAG.seed} must be in [0, 2**32), got {t.seed}: the data order and the initial weights are "
              f"drawn from it; pick a non-negative seed")
    for name in ("eval_interval", "log_interval"):
        positive(getattr(t, name), name)
    if t.eval_iters < 0:
        fail(f"{FLAG.eval_iters} must be >= 0, got {t.eval_iters}")


def _fill_train_iters(t: TrainConfig) -> None:
    """The training length: ``--train-iters`` (default 400), or ``--train-samples`` // the global batch (a
    sample-based run, as Megatron counts it); not both."""
    if t.train_samples is None:
        t.train_iters = 400 if t.train_iters is None else t.train_iters
        positive(t.train_iters, "train_iters")
        return
    if t.train_iters is not None:
        fail(f"{FLAG.train_iters} and {FLAG.train_samples} are exclusive (iteration- or sample-based): keep one")
    positive(t.train_samples, "train_samples")
    t.train_iters = t.train_samples // t.global_batch_size
    if t.train_iters < 1:
        fail(f"{FLAG.train_samples} {t.train_samples} is less than one {FLAG.global_batch_size} "
             f"({t.global_batch_size}): no iteration to train")


def iterations_of(samples: float, global_batch_size: int) -> int:
    """The iterations ``samples`` samples last at ``global_batch_size`` a step, rounded up: the iteration at
    which Megatron's sample-counting schedule reaches that point (a float's last bit never adds one)."""
    return math.ceil(round(samples / global_batch_size, 9))


def check_precision(pr: PrecisionConfig) -> None:
    """One of bf16 / fp16 / fp32, and fp16's loss scaling."""
    if pr.bf16 and pr.fp16:
        fail(f"{FLAG.bf16} and {FLAG.fp16} are exclusive: pick one")
    for name in ("initial_loss_scale", "min_loss_scale"):
        positive_float(getattr(pr, name), name)
    if pr.min_loss_scale > pr.initial_loss_scale:
        fail(f"{FLAG.min_loss_scale} {pr.min_loss_scale} is above {FLAG.initial_loss_scale} {pr.initial_loss_scale}")
    for name in ("loss_scale_window", "hysteresis", "max_consecutive_skipped_steps"):
        positive(getattr(pr, name), name)


def check_zero(z: ZeroConfig, par: ParallelConfig, world: int) -> None:
    """The ZeRO stage, and what each switch (stage-specific options, offload, ZeRO++) needs of it and
    of the layout. Changes nothing. Run by :func:`megazero.config.validate`; the ZeRO engine trusts
    the validated job and does not run it again."""
    stage, stages = z.zero_stage, choices("zero_stage")
    if stage not in stages:
        fail(f"{FLAG.zero_stage} must be {', '.join(map(str, stages[:-1]))} or {stages[-1]}, got {stage}")
    positive(z.bucket_size, "bucket_size")
    if z.prefetch_layers < 0:
        fail(f"{FLAG.prefetch_layers} must be >= 0 (0: no prefetch), got {z.prefetch_layers}")
    if z.keep_params_gathered and stage != 3:
        fail(f"{FLAG.keep_params_gathered} applies to {FLAG.zero_stage} 3 only (got {stage}): "
              f"drop the flag or use {FLAG.zero_stage} 3")
    if z.overlap_param_gather and stage not in (1, 2):
        fail(f"{FLAG.overlap_param_gather} applies to {FLAG.zero_stage} 1 and 2 (got {stage}; stage 3 gathers "
              f"each layer ahead of its compute, see {FLAG.prefetch_layers}): drop the flag or use stage 1 or 2")
    if z.reduce_each_microbatch and stage != 2:
        fail(f"{FLAG.reduce_each_microbatch} applies to {FLAG.zero_stage} 2 only (got {stage}): "
              f"drop the flag or use {FLAG.zero_stage} 2")
    _check_offload(z)
    _check_zeropp(z, par, world)


def _check_offload(z: ZeroConfig) -> None:
    for name in ("offload_optimizer", "offload_params"):
        one_of(z, name)
    if z.offload_optimizer != "none" and z.zero_stage == 0:
        fail(f"{FLAG.offload_optimizer} {z.offload_optimizer} moves the ZeRO optimizer shard: use "
              f"{FLAG.zero_stage} 1, 2 or 3 (or drop the flag)")
    if z.offload_params != "none" and z.zero_stage != 3:
        fail(f"{FLAG.offload_params} {z.offload_params} applies to {FLAG.zero_stage} 3 only (got {z.zero_stage}): "
              f"use {FLAG.zero_stage} 3 or drop the flag")
    nvme = "nvme" in (z.offload_optimizer, z.offload_params)
    if nvme and not z.nvme_path:
        fail(f"offloading to nvme needs {FLAG.nvme_path} DIR (a directory on a fast local drive for the swap files)")
    if z.nvme_path and not nvme:
        fail(f"{FLAG.nvme_path} {z.nvme_path} is used only with {FLAG.offload_optimizer} nvme or "
              f"{FLAG.offload_params} nvme: add one or drop {FLAG.nvme_path}")
    if z.offload_sub_group_size is not None:
        positive(z.offload_sub_group_size, "offload_sub_group_size")


def _check_zeropp(z: ZeroConfig, par: ParallelConfig, world: int) -> None:
    """ZeRO++'s switches: what stage each needs, and a node layout they can use."""
    if par.ranks_per_node is not None and (par.ranks_per_node < 1 or world % par.ranks_per_node):
        fail(f"{FLAG.ranks_per_node} {par.ranks_per_node} must divide the world size {world}: "
              f"pick a divisor of {world}")
    if z.quantized_weights and z.zero_stage != 3:
        fail(f"{FLAG.quantized_weights} quantizes ZeRO-3's parameter all-gathers: use {FLAG.zero_stage} 3 "
              f"(got {z.zero_stage}) or drop the flag")
    hpz = FLAG.hpz_partition_size
    if z.hpz_partition_size < 1:
        fail(f"{hpz} must be >= 1 (1: off), got {z.hpz_partition_size}")
    if z.hpz_partition_size > 1:
        if z.zero_stage != 3:
            fail(f"{hpz} applies to {FLAG.zero_stage} 3 only (got {z.zero_stage}): use stage 3 or drop the flag")
        if par.dp is not None and par.dp % z.hpz_partition_size:
            fail(f"{hpz} {z.hpz_partition_size} must divide the data-parallel size {par.dp}: "
                  f"use the number of dp ranks per node")
        ep = par.expert_model_parallel_size
        if par.dp is not None and ep > 1 and (par.dp // ep) % z.hpz_partition_size:
            fail(f"{hpz} {z.hpz_partition_size} must divide the expert-data-parallel size {par.dp // ep} (dp "
                  f"{par.dp} / {FLAG.expert_model_parallel_size} {ep}): the experts' secondary shards are cut "
                  f"from it; use a divisor of {par.dp // ep}")
    if z.quantized_gradients and z.zero_stage not in (2, 3):
        fail(f"{FLAG.quantized_gradients} replaces the gradient reduce-scatter of {FLAG.zero_stage} 2 or 3 "
              f"(got {z.zero_stage}; DeepSpeed applies it to stage 3): use {FLAG.zero_stage} 2 or 3 or drop the flag")
    if z.quantization_block_size < 1:
        fail(f"{FLAG.quantization_block_size} must be >= 1, got {z.quantization_block_size}")
    if z.hpz_partition_size > 1 and par.dp is not None and not par.dp % z.hpz_partition_size:
        _check_hpz_nodes(z, par, world)


def _check_hpz_nodes(z: ZeroConfig, par: ParallelConfig, world: int) -> None:
    """hpZ's secondary partitions (K consecutive dp ranks) each lie on one node: that is what makes its
    backward gathers cheap. Nodes are blocks of --ranks-per-node (default torchrun's LOCAL_WORLD_SIZE)."""
    from megazero.parallel.topology import dp_partitions, local_world_size, rank_grid

    rpn = par.ranks_per_node or local_world_size() or world
    if world % rpn:
        return                                  # the topology refuses this layout, naming the ranks per node
    try:
        grid = rank_grid(world, par.tp, par.pp, par.dp, par.order, rpn, par.expert_model_parallel_size)
    except ValueError:
        return                                  # a layout the parallel checks refuse, naming their flag
    for part in dp_partitions(grid, z.hpz_partition_size):
        if len({r // rpn for r in part}) > 1:
            fail(f"{FLAG.hpz_partition_size} {z.hpz_partition_size} puts ranks {part} of nodes of {rpn} ranks in "
                  f"one secondary partition, which spans nodes: use the number of dp ranks per node "
                  f"(or fewer), or drop the flag")


def fill_zero_defaults(job: JobConfig) -> None:
    """ZeRO settings whose defaults come from other sections: fp32 gradient buckets on with bf16
    (Megatron's main grads), and DeepSpeed's prefetch bucket and live-parameter cap (elements) as whole
    layers."""
    z, m = job.zero, job.model
    if z.accumulate_allreduce_grads_in_fp32 is None:
        z.accumulate_allreduce_grads_in_fp32 = job.precision.bf16
    per_layer = max(1, (4 * m.hidden_size ** 2 + 2 * m.hidden_size * m.ffn_hidden_size) // job.parallel.tp)
    if z.prefetch_bucket_elements is not None:
        z.prefetch_layers = max(1, z.prefetch_bucket_elements // per_layer)
    if z.max_live_elements is not None:          # gathered at once: the layer computing and the prefetched ones
        z.prefetch_layers = min(z.prefetch_layers, max(0, z.max_live_elements // per_layer - 1))


def check_optimizer(opt: OptimizerConfig, t: TrainConfig) -> None:
    """AdamW's settings and the schedule; fills ``min_lr`` from ``min_lr_ratio`` (a DeepSpeed setting,
    no flag) and ``lr_decay_iters`` (default: the training iterations)."""
    if opt.min_lr_ratio is not None:
        if not 0 <= opt.min_lr_ratio <= 1:
            fail(f"the minimum learning-rate ratio must be in [0, 1], got {opt.min_lr_ratio}")
        opt.min_lr = opt.min_lr_ratio * opt.lr
    one_of(opt, "lr_decay_style")
    if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
        fail(f"need 0 <= {FLAG.min_lr} ({opt.min_lr}) <= {FLAG.lr} ({opt.lr}) and {FLAG.lr} > 0")
    if opt.lr_warmup_fraction is not None and not 0 <= opt.lr_warmup_fraction <= 1:
        fail(f"{FLAG.lr_warmup_fraction} must be in [0, 1], got {opt.lr_warmup_fraction}")
    _samples_to_iterations(opt, t)
    if opt.lr_decay_iters is None:
        opt.lr_decay_iters = t.train_iters
    if opt.lr_warmup_fraction is not None and t.train_samples is None:    # the warmup's share of the decay
        opt.lr_warmup_iters = iterations_of(opt.lr_warmup_fraction * opt.lr_decay_iters, 1)
    if opt.lr_decay_iters < 1:
        fail(f"{FLAG.lr_decay_iters} must be a positive integer, got {opt.lr_decay_iters}: leave it out to decay "
              f"over the training iterations ({FLAG.lr_decay_style} constant for no decay)")
    if opt.lr_warmup_iters < 0 or opt.lr_warmup_iters > opt.lr_decay_iters:
        fail(f"{FLAG.lr_warmup_iters} {opt.lr_warmup_iters} must be between 0 and {FLAG.lr_decay_iters} "
              f"{opt.lr_decay_iters}")
    if not (0 <= opt.adam_beta1 < 1 and 0 <= opt.adam_beta2 < 1):
        fail(f"{FLAG.adam_beta1} and {FLAG.adam_beta2} must be in [0, 1)")
    if opt.clip_grad < 0 or opt.weight_decay < 0:
        fail(f"{FLAG.clip_grad} and {FLAG.weight_decay} must be >= 0")
    positive_float(opt.adam_eps, "adam_eps")


def _samples_to_iterations(opt: OptimizerConfig, t: TrainConfig) -> None:
    """Megatron's rules for the schedule's units: a sample-based run (``--train-samples``) gives its decay and
    warmup in samples, an iteration-based one in iterations, and a warmup fraction excludes a warmup length.
    Samples become iterations of the global batch (:func:`iterations_of`)."""
    if opt.lr_warmup_fraction is not None and (opt.lr_warmup_iters or opt.lr_warmup_samples):
        given = FLAG.lr_warmup_iters if opt.lr_warmup_iters else FLAG.lr_warmup_samples
        fail(f"{FLAG.lr_warmup_fraction} and {given} both set the warmup: keep one")
    if t.train_samples is None:
        for name, instead in (("lr_decay_samples", "lr_decay_iters"), ("lr_warmup_samples", "lr_warmup_iters")):
            if getattr(opt, name) is not None:
                fail(f"{flag(name)} belongs to a sample-based run ({FLAG.train_samples}); with iterations "
                     f"({FLAG.train_iters}) use {flag(instead)}")
        return
    for name, instead in (("lr_decay_iters", "lr_decay_samples"), ("lr_warmup_iters", "lr_warmup_samples")):
        if getattr(opt, name):
            fail(f"{flag(name)} belongs to an iteration-based run; with {FLAG.train_samples} use {flag(instead)}")
    for name in ("lr_decay_samples", "lr_warmup_samples"):
        if getattr(opt, name) is not None and getattr(opt, name) < 0:
            fail(f"{flag(name)} must be >= 0, got {getattr(opt, name)}")
    decay = opt.lr_decay_samples if opt.lr_decay_samples is not None else t.train_samples
    opt.lr_decay_iters = iterations_of(decay, t.global_batch_size)
    warmup = decay * opt.lr_warmup_fraction if opt.lr_warmup_fraction is not None else opt.lr_warmup_samples or 0
    opt.lr_warmup_iters = iterations_of(warmup, t.global_batch_size)


def check_data(d: DataConfig) -> None:
    """The split, the data paths (or mock data) and the tokenizer's files."""
    parts = d.split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        fail(f"{FLAG.split} {d.split!r} must be up to three non-negative weights, the first (training) above 0, "
              f"like 969,30,1")
    path, tokenizer = FLAG.data_path, FLAG.tokenizer_type
    if d.mock_data and d.data_path:
        fail(f"{FLAG.mock_data} and {path} are exclusive: drop one")
    if d.tokenizer_type is not None:
        one_of(d, "tokenizer_type")
    if d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        fail(f"{tokenizer} GPT2BPETokenizer needs {FLAG.vocab_file} and {FLAG.merge_file}")
    if d.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer") and not d.tokenizer_model:
        hf = d.tokenizer_type == "HuggingFaceTokenizer"
        fail(f"{tokenizer} {d.tokenizer_type} needs {FLAG.tokenizer_model}"
              + (" (a directory with tokenizer.json, or the file)" if hf else ""))
    if len(d.data_path) > 1:
        if len(d.data_path) % 2:
            fail(f"{path} with several datasets takes weight-prefix pairs: "
                  f"{path} 0.3 a_text_document 0.7 b_text_document")
        for w in d.data_path[0::2]:
            try:
                weight = float(w)
            except ValueError:
                fail(f"{path} weight {w!r} is not a number (expected weight-prefix pairs)")
            if not (math.isfinite(weight) and weight > 0):
                fail(f"{path} weight {w!r} must be a positive number (a dataset with no weight: leave it out)")
    if d.data_path and d.tokenizer_type is None:
        fail(f"{path} needs {tokenizer} (with its {FLAG.vocab_file}/{FLAG.merge_file} or {FLAG.tokenizer_model}): "
              "the tokenizer sets the vocabulary size")


def check_checkpoint(ck: CheckpointConfig) -> None:
    """The save interval and finetuning have the directories they need."""
    if ck.save_interval is not None and ck.save_interval < 1:
        fail(f"{FLAG.save_interval} must be a positive integer, got {ck.save_interval}")
    if ck.save_interval and not ck.save:
        fail(f"{FLAG.save_interval} needs {FLAG.save} DIR (where to write the checkpoints)")
    if ck.async_save and not ck.save:
        fail(f"{FLAG.async_save} needs {FLAG.save} DIR (where to write the checkpoints)")
    if ck.finetune and not ck.load:
        fail(f"{FLAG.finetune} needs {FLAG.load} DIR (the checkpoint whose weights to start from)")


PROFILE_DEFAULTS = {"profile_step_start": 10, "profile_step_end": 12, "profile_ranks": [0]}   # Megatron's


def check_logging(lg: LoggingConfig, train: TrainConfig | None = None, world_size: int | None = None) -> None:
    """The profiler's settings apply with ``--profile`` and W&B's with ``--wandb-project``; with
    ``--profile``, fills Megatron's defaults (steps 10 to 12, rank 0) and checks that a step of the
    window is trained (against ``train``), that the ranks exist (against ``world_size``) and that it leaves
    the last two iterations to ``--measure-live-bytes`` (one profiler at a time). Whether the
    paths can be written and wandb is installed is the preflight's (:mod:`megazero.preflight`)."""
    if lg.peak_tflops is not None:
        positive_float(lg.peak_tflops, "peak_tflops")
    for name in ("wandb_exp_name", "wandb_save_dir"):
        if getattr(lg, name) and not lg.wandb_project:
            fail(f"{flag(name)} applies with {FLAG.wandb_project}: add {FLAG.wandb_project} NAME or drop {flag(name)}")
    if not lg.profile:
        for name in (*PROFILE_DEFAULTS, "profile_dir"):
            if getattr(lg, name) is not None:
                fail(f"{flag(name)} applies with {FLAG.profile}: add {FLAG.profile} or drop {flag(name)}")
        return
    for name, default in PROFILE_DEFAULTS.items():
        if getattr(lg, name) is None:
            setattr(lg, name, list(default) if isinstance(default, list) else default)
    start, end = lg.profile_step_start, lg.profile_step_end
    if start < 0:
        fail(f"{FLAG.profile_step_start} must be >= 0, got {start}")
    if end <= start:
        fail(f"{FLAG.profile_step_end} {end} must be above {FLAG.profile_step_start} {start}: the steps after "
             f"iteration {start} up to iteration {end} are profiled")
    if train is not None and start >= train.train_iters:
        fail(f"{FLAG.profile_step_start} {start} is not below {FLAG.train_iters} {train.train_iters}: nothing would "
             f"be profiled; choose a smaller {FLAG.profile_step_start} (and {FLAG.profile_step_end})")
    if world_size is not None:
        outside = [r for r in lg.profile_ranks if not 0 <= r < world_size]
        if outside:
            fail(f"{FLAG.profile_ranks} {' '.join(map(str, lg.profile_ranks))}: rank(s) {', '.join(map(str, outside))} "
                 f"not in this world of {world_size} (ranks 0-{world_size - 1})")
    if lg.measure_live_bytes and train is not None and start < train.train_iters and end > train.train_iters - 2:
        fail(f"{FLAG.measure_live_bytes} and {FLAG.profile} would both run torch's profiler over iterations "
             f"{train.train_iters - 1}-{train.train_iters} (live bytes: the last two; profiled: {start + 1}-{end}): "
             f"end the profiled window before iteration {train.train_iters - 1} or drop one of them")


def check_compile(c: CompileConfig, m: ModelConfig | None = None) -> None:
    """A compile mode only with compilation on (whether torch can compile on this machine is the
    pre-launch check's: megazero/preflight.py); with the model, the activation-memory choices a compiled
    layer can hold (full recompute wraps the compiled layers; selective recompute and offload hook into
    the layer's inside, which dynamo would break into pieces)."""
    one_of(c, "compile_mode")
    if c.compile_mode != "default" and not c.compile:
        fail(f"{FLAG.compile_mode} {c.compile_mode} applies with {FLAG.compile}: add {FLAG.compile} or drop "
              f"{FLAG.compile_mode}")
    if c.compile and m is not None and (m.recompute_granularity == "selective" or m.cpu_offloading):
        fail(f"{FLAG.compile} compiles whole layers, which {FLAG.recompute_granularity} selective and "
              f"{FLAG.cpu_offloading} reach inside: use full recompute ({FLAG.recompute_granularity} full) with "
              f"{FLAG.compile}, or drop {FLAG.compile}")
