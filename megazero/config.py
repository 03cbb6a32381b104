"""Configuration dataclasses and the one `validate` that rejects bad combinations before any work.

Library components take their own sub-config (``ModelConfig``, ``ParallelConfig``, ...); only entry
points parse command lines. Field names are Megatron's flag names with ``-`` turned into ``_``, so an
error can name the flag a user typed (``flag('num_attention_heads') == '--num-attention-heads'``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """An invalid configuration; the message names the flag and the fix."""


# The allowed values of the choice flags: one source for the command line and validate().
SCHEDULES = ("1f1b", "gpipe", "interleaved")
DECAY_STYLES = ("constant", "linear", "cosine")
TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer")
ACTIVATIONS = ("gelu_tanh", "gelu")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
BACKENDS = ("gloo", "nccl")

FLAG_ALIASES = {
    "tp": "--tensor-model-parallel-size/--tp",
    "pp": "--pipeline-model-parallel-size/--pp",
    "dp": "--data-parallel-size/--dp",
    "zero_stage": "--zero-stage",
    "layernorm_epsilon": "--norm-epsilon",
    "add_bias_linear": "--disable-bias-linear",
}


def flag(name: str) -> str:
    """The command-line spelling of a config field."""
    return FLAG_ALIASES.get(name, "--" + name.replace("_", "-"))


@dataclass
class ModelConfig:
    """Shape of the decoder. ``vocab_size`` is the tokenizer's; the embedding is padded.

    The defaults are GPT-2 (learned positions, LayerNorm, GELU MLP, biases, tied embeddings) and,
    with the other sections, the embedded default run (`python pretrain_gpt.py`): a 1.3M-parameter GPT
    that learns the bundled sample corpus in about a minute on one CPU core. A Llama-family decoder is
    the same model with Megatron's flags: ``position_embedding_type="rope"``, ``normalization="RMSNorm"``,
    ``swiglu``, ``group_query_attention`` + ``num_query_groups``, ``add_bias_linear=False``
    (--disable-bias-linear), ``untie_embeddings_and_output_weights`` (see :mod:`megazero.models.gpt`).
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None          # default 4 * hidden_size
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 512
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    scaled_output_init: bool = True             # GPT-2: output projections std / sqrt(2 * layers)
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu_tanh"               # "gelu_tanh" (GPT-2/HF) or "gelu" (exact erf); not with swiglu
    recompute_activations: bool = False
    # Llama family (Megatron's flag names); the defaults keep GPT-2.
    position_embedding_type: str = "learned_absolute"   # or "rope" (rotary, no position embedding table)
    rotary_base: float = 10000.0                # RoPE theta
    rotary_percent: float = 1.0                 # fraction of each head's features rotated
    use_rope_scaling: bool = False              # Llama 3.1's frequency scaling of RoPE
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"            # or "RMSNorm"; epsilon: layernorm_epsilon (--norm-epsilon)
    swiglu: bool = False                        # MLP silu(x W_gate) * (x W_up) instead of GELU
    group_query_attention: bool = False
    num_query_groups: int | None = None         # KV heads with group_query_attention (default 1)
    add_bias_linear: bool = True                # False: --disable-bias-linear
    add_qkv_bias: bool = False                  # bias in the QKV projection even without add_bias_linear
    # Mixture of Experts (Megatron-core's flag names; megazero/models/moe.py). None: dense MLPs.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_layer_freq: int = 1                     # an MoE layer every N-th layer, from layer 0
    moe_aux_loss_coeff: float = 0.0             # load balancing, E * sum_e f_e * P_e
    moe_z_loss_coeff: float = 0.0               # router z-loss, mean logsumexp(logits)^2
    moe_expert_capacity_factor: float | None = None   # None: dropless

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:        # Megatron's defaults: SwiGLU's two input matrices keep ~8h^2
            self.ffn_hidden_size = (int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: the query groups under grouped-query attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def rotary_dim(self) -> int:
        """Features of each query/key head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.rotary_percent)

    def is_moe_layer(self, layer: int) -> bool:
        """Does global layer ``layer`` hold experts instead of a dense MLP (``--moe-layer-freq``)?"""
        return bool(self.num_experts) and layer % self.moe_layer_freq == 0

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    """Layout of the tensor-, pipeline- and data-parallel dimensions."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None                       # inferred as world // (tp * pp) when None
    order: str = "tp-dp-pp"
    num_layers_per_virtual_pipeline_stage: int | None = None
    pipeline_schedule: str = "1f1b"             # 1f1b | gpipe | interleaved (implied by virtual stages)
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1         # EP: experts split over EP consecutive dp ranks
    virtual_stages: int = 1                     # model chunks per rank (v); derived by validate()
    distributed_timeout_minutes: float = 10.0   # every collective of every group ends by then
    ranks_per_node: int | None = None           # None: torchrun's LOCAL_WORLD_SIZE (ZeRO++'s node hierarchy)


@dataclass
class ZeroConfig:
    """Data-parallel gradient reduction and ZeRO sharding."""

    zero_stage: int = 0
    bucket_size: int = 4_000_000                # elements per gradient bucket
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False          # stages 1-2: parameter all-gathers finish behind the next forward
    prefetch_layers: int = 1                    # stage 3: gathered layers in flight ahead of compute
    prefetch_bucket_elements: int | None = None  # DeepSpeed's stage3_prefetch_bucket_size -> prefetch_layers
    keep_params_gathered: bool = False          # stage 3 with pp: gathered once, kept into the last backward
    reduce_each_microbatch: bool = False        # stage 2: reduce-scatter after every micro-batch
    sharded_init: bool = True                   # build on the meta device; materialise shard by shard
    accumulate_allreduce_grads_in_fp32: bool | None = None   # fp32 gradient buckets; None: on for bf16
    offload_optimizer: str = "none"             # none | cpu | nvme: fp32 masters, Adam moments, the update on the host
    offload_params: str = "none"                # none | cpu | nvme (stage 3): parameter shards on the host
    nvme_path: str | None = None                # directory of the swap files (with nvme)
    offload_pin_memory: bool = True             # page-locked host buffers (only with CUDA)
    offload_sub_group_size: int | None = None   # elements stepped (and swapped) at a time on the host; None:
                                                # 1/32 of the rank's shard, at most 4M (offload.sub_group_elements)
    quantized_weights: bool = False             # ZeRO++ qwZ (stage 3): int8 parameter all-gathers
    quantization_block_size: int = 4096         # elements per int8 block (one fp32 scale each), qwZ and qgZ
    hpz_partition_size: int = 1                 # ZeRO++ hpZ (stage 3): secondary shard over K dp ranks (1: off)
    quantized_gradients: bool = False           # ZeRO++ qgZ (stages 2, 3): hierarchical int8 all-to-all reduce


@dataclass
class PrecisionConfig:
    bf16: bool = False
    fp16: bool = False
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000               # growth interval
    hysteresis: int = 2
    max_consecutive_skipped_steps: int = 20     # a run that skips more steps in a row stops

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class OptimizerConfig:
    lr: float = 1.5e-3
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None           # default train_iters
    lr_decay_style: str = "cosine"              # constant | linear | cosine
    min_lr_ratio: float | None = None           # (DeepSpeed's cos_min_ratio) min_lr = this * lr
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0                      # 0 disables clipping


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)   # [prefix] or [w1, prefix1, w2, prefix2, ...]
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str | None = None           # one of TOKENIZERS
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    data_cache_path: str | None = None
    eod_mask_loss: bool = False                 # loss 0 where the input token is the end-of-document id


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    global_batch_size: int | None = None        # default micro_batch_size * dp * pp (m = pp micro-batches)
    gradient_accumulation_steps: int | None = None   # (DeepSpeed / Accelerate configs) global = micro * this * dp
    train_iters: int = 400
    seed: int = 1234
    eval_interval: int = 100
    eval_iters: int = 10
    log_interval: int = 10
    check_for_nan_in_loss_and_grad: bool = True  # a non-finite loss or gradient stops the run


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    finetune: bool = False                      # load weights only: no optimizer, iteration 0


@dataclass
class LoggingConfig:
    tensorboard_dir: str | None = None
    metrics_file: str | None = None


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation steps)."""
        assert self.parallel.dp is not None, "validate() resolves dp first"
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, sections: dict, *, strict: bool = True) -> "JobConfig":
        """A JobConfig from ``{section: {field: value}}`` (what :meth:`to_dict` gives), starting from the
        dataclass defaults. Each section is constructed afresh, so derived defaults such as
        ``ffn_hidden_size = 4 * hidden_size`` follow the given values. ``strict=False`` drops unknown
        sections and fields (a config saved by a newer version); otherwise they are an error."""
        kinds = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        unknown = set(sections) - set(kinds)
        if unknown and strict:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)}: expected {sorted(kinds)}")
        built = {}
        for name, kind in kinds.items():
            values = dict(sections.get(name) or {})
            known = {f.name for f in dataclasses.fields(kind)}
            extra = set(values) - known
            if extra and strict:
                raise ConfigError(f"unknown {name} setting(s) {sorted(extra)}")
            built[name] = kind(**{k: v for k, v in values.items() if k in known})
        return cls(**built)


def validate(job: JobConfig, world_size: int) -> JobConfig:
    """Check every field and combination; return the config with derived values filled in.

    Raises :class:`ConfigError` naming the offending flag and the fix. Call before creating any
    process group, model or dataset. Derived values: ``parallel.dp`` (when None), the pipeline
    schedule and ``parallel.virtual_stages`` (interleaved when
    --num-layers-per-virtual-pipeline-stage is given), ``train.global_batch_size`` (when None),
    ``optimizer.lr_decay_iters`` (when None).
    """
    job = _copy(job)
    _check_finite(job)
    _check_layout(job.parallel, world_size)
    check_model(job.model, job.parallel)
    _check_pipeline(job.model, job.parallel)
    _check_batches(job)
    _check_precision_and_optimizer(job)
    _check_offload(job.zero)
    _check_zeropp(job.zero, job.parallel, world_size)
    _check_data(job.data)
    _check_checkpoint(job.checkpoint)
    return job


def _copy(job: JobConfig) -> JobConfig:
    return JobConfig(**{f.name: dataclasses.replace(getattr(job, f.name)) for f in dataclasses.fields(job)})


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def _check_finite(job: JobConfig) -> None:
    """Every float setting is a real number: nan and inf pass every comparison check below
    (comparisons with nan are false), so they are refused here, by name."""
    for section in dataclasses.fields(job):
        for f in dataclasses.fields(getattr(job, section.name)):
            value = getattr(getattr(job, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                _fail(f"{flag(f.name)} must be a finite number, got {value}")


def _positive_float(value: float, name: str) -> None:
    if not value > 0:
        _fail(f"{flag(name)} must be > 0, got {value}")


def _positive(value, name: str) -> None:
    if value is None or value < 1:
        _fail(f"{flag(name)} must be a positive integer, got {value}")


def _check_layout(par: ParallelConfig, world: int) -> None:
    _positive(par.tp, "tp")
    _positive(par.pp, "pp")
    mp = par.tp * par.pp
    if par.dp is None:
        if world % mp:
            _fail(f"world size {world} is not divisible by tp*pp = {par.tp}*{par.pp} = {mp}: "
                  f"launch a multiple of {mp} processes (e.g. --nproc-per-node {mp * max(1, world // mp)}) "
                  f"or change {flag('tp')} / {flag('pp')}")
        par.dp = world // mp
    _positive(par.dp, "dp")
    if par.tp * par.pp * par.dp != world:
        _fail(f"tp*pp*dp = {par.tp}*{par.pp}*{par.dp} = {par.tp * par.pp * par.dp} does not equal the "
              f"world size {world}: launch {par.tp * par.pp * par.dp} processes or change "
              f"{flag('dp')} (or leave it out to infer it)")
    if not par.distributed_timeout_minutes > 0:
        _fail(f"--distributed-timeout-minutes must be > 0, got {par.distributed_timeout_minutes}")
    if sorted(par.order.split("-")) != ["dp", "pp", "tp"]:
        _fail(f"--parallel-order {par.order!r} must name tp, dp and pp once each, e.g. 'tp-dp-pp'")


def check_model(m: ModelConfig, par: ParallelConfig) -> None:
    """The model's shape against the tensor-parallel layout (also used by tools that reshard)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                 "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by"):
        _positive(getattr(m, name), name)
    if m.hidden_size % m.num_attention_heads:
        _fail(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
              f"{m.num_attention_heads}: choose a head count that divides the hidden size")
    if m.num_attention_heads % par.tp:
        _fail(f"--num-attention-heads {m.num_attention_heads} is not divisible by {flag('tp')} {par.tp}: "
              f"each tensor-parallel rank needs whole heads; use a tp that divides the head count")
    if m.ffn_hidden_size % par.tp:
        _fail(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by {flag('tp')} {par.tp}: "
              f"choose an ffn size that is a multiple of tp")
    if m.padded_vocab_size(par.tp) % par.tp:
        _fail(f"padded vocab {m.padded_vocab_size(par.tp)} is not divisible by {flag('tp')} {par.tp}: "
              f"set --make-vocab-size-divisible-by to a multiple of tp")
    if m.max_position_embeddings < m.seq_length:
        _fail(f"--max-position-embeddings {m.max_position_embeddings} is smaller than --seq-length "
              f"{m.seq_length}: raise it to at least the sequence length")
    if par.sequence_parallel and m.seq_length % par.tp:
        _fail(f"--sequence-parallel needs --seq-length ({m.seq_length}) divisible by {flag('tp')} "
              f"{par.tp}: change the sequence length or drop --sequence-parallel")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            _fail(f"{flag(name)} must be in [0, 1), got {getattr(m, name)}")
    for name in ("layernorm_epsilon", "init_method_std"):
        _positive_float(getattr(m, name), name)
    if m.activation not in ACTIVATIONS:
        _fail(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {m.activation!r}")
    if not m.layernorm_epsilon > 0:
        _fail(f"{flag('layernorm_epsilon')} must be > 0, got {m.layernorm_epsilon}")
    if m.normalization not in NORMALIZATIONS:
        _fail(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got {m.normalization!r}")
    _check_rope(m)
    _check_query_groups(m, par.tp)
    _check_moe(m, par)


def _check_moe(m: ModelConfig, par: ParallelConfig) -> None:
    """Mixture-of-Experts flags against each other and the expert-parallel layout."""
    ep = par.expert_model_parallel_size
    _positive(ep, "expert_model_parallel_size")
    if not m.num_experts:
        if m.num_experts is not None:
            _fail(f"--num-experts must be a positive integer, got {m.num_experts}: leave it unset for dense MLPs")
        if ep > 1:
            _fail(f"--expert-model-parallel-size {ep} needs --num-experts: there are no experts to split")
        return
    _positive(m.moe_router_topk, "moe_router_topk")
    _positive(m.moe_layer_freq, "moe_layer_freq")
    if m.moe_router_topk > m.num_experts:
        _fail(f"--moe-router-topk {m.moe_router_topk} exceeds --num-experts {m.num_experts}: "
              f"a token cannot pick more experts than there are")
    if m.num_experts % ep:
        _fail(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}: "
              f"each expert-parallel rank holds the same number of whole experts")
    if par.dp is not None and par.dp % ep:
        _fail(f"data-parallel size {par.dp} is not divisible by --expert-model-parallel-size {ep}: "
              f"expert groups are carved out of the data-parallel group; choose EP dividing dp")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(m, name) < 0:
            _fail(f"{flag(name)} must be >= 0, got {getattr(m, name)}")
    if m.moe_expert_capacity_factor is not None and not m.moe_expert_capacity_factor > 0:
        _fail(f"--moe-expert-capacity-factor must be > 0, got {m.moe_expert_capacity_factor}: "
              f"leave it unset for dropless routing")


def _check_rope(m: ModelConfig) -> None:
    if m.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        _fail(f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDING_TYPES)}, "
              f"got {m.position_embedding_type!r}")
    rope = m.position_embedding_type == "rope"
    if not rope and (m.use_rope_scaling or m.rotary_percent != 1.0):
        _fail("--use-rope-scaling and --rotary-percent apply to rotary embeddings only: add "
              "--position-embedding-type rope or drop them")
    if not rope:
        return
    if not 0.0 < m.rotary_percent <= 1.0:
        _fail(f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
    if m.rotary_dim < 2 or m.rotary_dim % 2:
        _fail(f"--rotary-percent {m.rotary_percent} rotates {m.rotary_dim} of the {m.head_dim} features of "
              f"a head: RoPE needs an even number, at least 2; change --rotary-percent")
    if not m.rotary_base > 0 or (m.use_rope_scaling and not m.rope_scaling_factor >= 1.0):
        _fail(f"--rotary-base must be > 0 (got {m.rotary_base}) and --rope-scaling-factor >= 1 "
              f"(got {m.rope_scaling_factor})")


def _check_query_groups(m: ModelConfig, tp: int) -> None:
    """Megatron's rule: each tp rank holds whole key/value groups when there are at least tp of them
    (G % tp == 0); with fewer, the groups are replicated (tp % G == 0), each rank using one."""
    if not m.group_query_attention:
        if m.num_query_groups is not None:
            _fail(f"--num-query-groups {m.num_query_groups} needs --group-query-attention: add it, or drop "
                  f"--num-query-groups for multi-head attention")
        return
    g, heads = m.num_query_groups, m.num_attention_heads
    _positive(g, "num_query_groups")
    if heads % g:
        _fail(f"--num-attention-heads {heads} is not divisible by --num-query-groups {g}: every group "
              f"needs the same number of query heads; choose a group count that divides the heads")
    if g >= tp and g % tp:
        _fail(f"--num-query-groups {g} is not divisible by {flag('tp')} {tp}: each tensor-parallel rank "
              f"needs whole key/value groups; use a tp that divides {g}")
    if g < tp and tp % g:
        _fail(f"{flag('tp')} {tp} is not a multiple of --num-query-groups {g}: with fewer groups than tp "
              f"ranks each group is replicated over tp / groups ranks; use a tp that {g} divides")


def _check_pipeline(m: ModelConfig, par: ParallelConfig) -> None:
    if par.pipeline_schedule not in SCHEDULES:
        _fail(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got {par.pipeline_schedule!r}")
    per_virtual = par.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None:
        _positive(per_virtual, "num_layers_per_virtual_pipeline_stage")
        if par.pp < 2:
            _fail(f"--num-layers-per-virtual-pipeline-stage needs {flag('pp')} >= 2 (got {par.pp}): "
                  f"drop it or use pipeline parallelism")
        if m.num_layers % (par.pp * per_virtual):
            _fail(f"--num-layers {m.num_layers} is not divisible by {flag('pp')} {par.pp} * "
                  f"--num-layers-per-virtual-pipeline-stage {per_virtual}: each rank needs whole chunks")
        par.virtual_stages = m.num_layers // (par.pp * per_virtual)
        if par.virtual_stages < 2:
            _fail(f"--num-layers-per-virtual-pipeline-stage {per_virtual} gives one chunk per rank "
                  f"({m.num_layers} layers / pp {par.pp}): use a smaller value or drop it")
        par.pipeline_schedule = "interleaved"
    elif par.pipeline_schedule == "interleaved":
        _fail("--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage")
    if m.num_layers % par.pp:
        _fail(f"--num-layers {m.num_layers} is not divisible by {flag('pp')} {par.pp}: "
              f"each pipeline stage needs the same number of layers")


def _check_batches(job: JobConfig) -> None:
    t, par = job.train, job.parallel
    _positive(t.micro_batch_size, "micro_batch_size")
    if t.gradient_accumulation_steps is not None:
        _positive(t.gradient_accumulation_steps, "gradient_accumulation_steps")
        implied = t.micro_batch_size * t.gradient_accumulation_steps * par.dp
        if t.global_batch_size is None:
            t.global_batch_size = implied
        elif t.global_batch_size != implied:
            _fail(f"--global-batch-size {t.global_batch_size} is not micro-batch {t.micro_batch_size} x gradient "
                  f"accumulation steps {t.gradient_accumulation_steps} x dp {par.dp} = {implied}: make them agree")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * par.dp * par.pp
    _positive(t.global_batch_size, "global_batch_size")
    per_step = t.micro_batch_size * par.dp
    if t.global_batch_size % per_step:
        _fail(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
              f"{t.micro_batch_size} * dp {par.dp} = {per_step}: use a multiple of {per_step}")
    m = job.num_micro_batches
    if par.pp > 1 and par.pipeline_schedule in ("1f1b", "interleaved") and m < par.pp:
        _fail(f"{m} micro-batches per step is fewer than {par.pp} pipeline stages, which leaves the "
              f"{par.pipeline_schedule} pipeline mostly idle: raise --global-batch-size to at least "
              f"{par.pp * per_step} (micro-batches = global / (micro * dp))")
    if par.pipeline_schedule == "interleaved" and m % par.pp:
        _fail(f"the interleaved schedule needs micro-batches ({m}) divisible by {flag('pp')} {par.pp}: "
              f"make --global-batch-size a multiple of {par.pp * per_step}")
    _positive(t.train_iters, "train_iters")
    for name in ("eval_interval", "log_interval"):
        _positive(getattr(t, name), name)
    if t.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0, got {t.eval_iters}")


def _check_precision_and_optimizer(job: JobConfig) -> None:
    pr, opt, z = job.precision, job.optimizer, job.zero
    if pr.bf16 and pr.fp16:
        _fail("--bf16 and --fp16 are exclusive: pick one")
    if z.accumulate_allreduce_grads_in_fp32 is None:     # Megatron's main grads: on for bf16
        z.accumulate_allreduce_grads_in_fp32 = pr.bf16
    if pr.fp16 and job.parallel.expert_model_parallel_size > 1:
        _fail("--fp16 with --expert-model-parallel-size > 1 is not supported (one loss scaler over two "
              "optimizers): use --bf16 or fp32")
    if z.zero_stage not in ZERO_STAGES:
        _fail(f"--zero-stage must be {', '.join(map(str, ZERO_STAGES[:-1]))} or {ZERO_STAGES[-1]}, got {z.zero_stage}")
    _positive(z.bucket_size, "bucket_size")
    if z.prefetch_layers < 0:
        _fail(f"--zero3-prefetch-layers must be >= 0 (0: no prefetch), got {z.prefetch_layers}")
    if z.keep_params_gathered and z.zero_stage != 3:
        _fail(f"--zero3-keep-params-gathered applies to --zero-stage 3 only (got {z.zero_stage}): "
              f"drop the flag or use --zero-stage 3")
    if z.overlap_param_gather and z.zero_stage not in (1, 2):
        _fail(f"--overlap-param-gather applies to --zero-stage 1 and 2 (got {z.zero_stage}; stage 3 gathers "
              "each layer ahead of its compute, see --zero3-prefetch-layers): drop the flag or use stage 1 or 2")
    if z.reduce_each_microbatch and z.zero_stage != 2:
        _fail(f"--zero2-reduce-each-microbatch applies to --zero-stage 2 only (got {z.zero_stage}): "
              f"drop the flag or use --zero-stage 2")
    if opt.min_lr_ratio is not None:
        if not 0 <= opt.min_lr_ratio <= 1:
            _fail(f"the minimum learning-rate ratio must be in [0, 1], got {opt.min_lr_ratio}")
        opt.min_lr = opt.min_lr_ratio * opt.lr
    if z.prefetch_bucket_elements is not None:           # DeepSpeed counts elements, we count layers
        m = job.model
        per_layer = (4 * m.hidden_size ** 2 + 2 * m.hidden_size * m.ffn_hidden_size) // job.parallel.tp
        z.prefetch_layers = max(1, z.prefetch_bucket_elements // max(per_layer, 1))
    if opt.lr_decay_style not in DECAY_STYLES:
        _fail(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {opt.lr_decay_style!r}")
    if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
        _fail(f"need 0 <= --min-lr ({opt.min_lr}) <= --lr ({opt.lr}) and --lr > 0")
    if opt.lr_decay_iters is None:
        opt.lr_decay_iters = job.train.train_iters
    if opt.lr_warmup_iters < 0 or opt.lr_warmup_iters > opt.lr_decay_iters:
        _fail(f"--lr-warmup-iters {opt.lr_warmup_iters} must be between 0 and --lr-decay-iters "
              f"{opt.lr_decay_iters}")
    if not (0 <= opt.adam_beta1 < 1 and 0 <= opt.adam_beta2 < 1):
        _fail("--adam-beta1 and --adam-beta2 must be in [0, 1)")
    if opt.clip_grad < 0 or opt.weight_decay < 0:
        _fail("--clip-grad and --weight-decay must be >= 0")
    _positive_float(opt.adam_eps, "adam_eps")
    for name in ("initial_loss_scale", "min_loss_scale"):
        _positive_float(getattr(pr, name), name)
    if pr.min_loss_scale > pr.initial_loss_scale:
        _fail(f"--min-loss-scale {pr.min_loss_scale} is above --initial-loss-scale {pr.initial_loss_scale}")
    for name in ("loss_scale_window", "hysteresis", "max_consecutive_skipped_steps"):
        _positive(getattr(pr, name), name)


def _check_zeropp(z: ZeroConfig, par: ParallelConfig, world: int) -> None:
    """ZeRO++'s switches: what stage each needs, and a node layout they can use."""
    if par.ranks_per_node is not None and (par.ranks_per_node < 1 or world % par.ranks_per_node):
        _fail(f"--ranks-per-node {par.ranks_per_node} must divide the world size {world}: pick a divisor of {world}")
    if z.quantized_weights and z.zero_stage != 3:
        _fail(f"--zero-quantized-weights quantizes ZeRO-3's parameter all-gathers: use --zero-stage 3 "
              f"(got {z.zero_stage}) or drop the flag")
    if z.hpz_partition_size < 1:
        _fail(f"--zero-hpz-partition-size must be >= 1 (1: off), got {z.hpz_partition_size}")
    if z.hpz_partition_size > 1:
        if z.zero_stage != 3:
            _fail(f"--zero-hpz-partition-size applies to --zero-stage 3 only (got {z.zero_stage}): use stage 3 "
                  f"or drop the flag")
        if par.dp % z.hpz_partition_size:
            _fail(f"--zero-hpz-partition-size {z.hpz_partition_size} must divide the data-parallel size "
                  f"{par.dp}: use the number of dp ranks per node")
    if z.quantized_gradients and z.zero_stage not in (2, 3):
        _fail(f"--zero-quantized-gradients replaces the gradient reduce-scatter of --zero-stage 2 or 3 "
              f"(got {z.zero_stage}; DeepSpeed applies it to stage 3): use --zero-stage 2 or 3 or drop the flag")
    if (z.quantized_weights or z.quantized_gradients) and z.quantization_block_size < 1:
        _fail(f"--zero-quantization-block-size must be >= 1, got {z.quantization_block_size}")


def _check_offload(z: ZeroConfig) -> None:
    for name in ("offload_optimizer", "offload_params"):
        if getattr(z, name) not in OFFLOAD_DEVICES:
            _fail(f"{flag(name)} must be one of {', '.join(OFFLOAD_DEVICES)}, got {getattr(z, name)!r}")
    if z.offload_optimizer != "none" and z.zero_stage == 0:
        _fail(f"--offload-optimizer {z.offload_optimizer} moves the ZeRO optimizer shard: use --zero-stage 1, 2 or 3 "
              f"(or drop the flag)")
    if z.offload_params != "none" and z.zero_stage != 3:
        _fail(f"--offload-params {z.offload_params} applies to --zero-stage 3 only (got {z.zero_stage}): "
              f"use --zero-stage 3 or drop the flag")
    nvme = "nvme" in (z.offload_optimizer, z.offload_params)
    if nvme and not z.nvme_path:
        _fail("offloading to nvme needs --nvme-path DIR (a directory on a fast local drive for the swap files)")
    if z.nvme_path and not nvme:
        _fail(f"--nvme-path {z.nvme_path} is used only with --offload-optimizer nvme or --offload-params nvme: "
              f"add one or drop --nvme-path")
    if z.offload_sub_group_size is not None:
        _positive(z.offload_sub_group_size, "offload_sub_group_size")


def _check_data(d: DataConfig) -> None:
    parts = d.split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        _fail(f"--split {d.split!r} must be up to three non-negative weights, the first (training) above 0, "
              f"like 969,30,1")
    if d.mock_data and d.data_path:
        _fail("--mock-data and --data-path are exclusive: drop one")
    if d.tokenizer_type is not None and d.tokenizer_type not in TOKENIZERS:
        _fail(f"--tokenizer-type must be one of {', '.join(TOKENIZERS)}, got {d.tokenizer_type!r}")
    if d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        _fail("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if d.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer") and not d.tokenizer_model:
        _fail(f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model"
              + (" (a directory with tokenizer.json, or the file)" if d.tokenizer_type == "HuggingFaceTokenizer" else ""))
    if len(d.data_path) > 1:
        if len(d.data_path) % 2:
            _fail("--data-path with several datasets takes weight-prefix pairs: "
                  "--data-path 0.3 a_text_document 0.7 b_text_document")
        for w in d.data_path[0::2]:
            try:
                weight = float(w)
            except ValueError:
                _fail(f"--data-path weight {w!r} is not a number (expected weight-prefix pairs)")
            if not (math.isfinite(weight) and weight > 0):
                _fail(f"--data-path weight {w!r} must be a positive number (a dataset with no weight: leave it out)")
    if d.data_path and d.tokenizer_type is None:
        _fail("--data-path needs --tokenizer-type (with its --vocab-file/--merge-file or --tokenizer-model): "
              "the tokenizer sets the vocabulary size")


def _check_checkpoint(ck: CheckpointConfig) -> None:
    if ck.save_interval is not None and ck.save_interval < 1:
        _fail(f"--save-interval must be a positive integer, got {ck.save_interval}")
    if ck.save_interval and not ck.save:
        _fail("--save-interval needs --save DIR (where to write the checkpoints)")
    if ck.finetune and not ck.load:
        _fail("--finetune needs --load DIR (the checkpoint whose weights to start from)")
