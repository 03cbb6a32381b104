"""The configuration sections: one dataclass per component, each field's flag declared on the field.
(The logging section, ``LoggingConfig``, lives in :mod:`megazero.config.logging_config`.)

Library components take their own section (``ModelConfig``, ``ZeroConfig``, ...); only entry points
parse command lines. A field that is a flag carries its spellings, help, help group and argparse kind
(:func:`~megazero.config.fields.flag_field`); the parser, config-file keys, error messages
(``flag("num_layers") == "--num-layers"``) and docs/flags.md all read them from here. Each section's
``check`` applies its rules (:mod:`megazero.config.checks`), e.g. ``zero_cfg.check(parallel, world_size)``.
"""
from __future__ import annotations

import dataclasses
import math
from argparse import BooleanOptionalAction
from dataclasses import dataclass, field

from megazero.config import checks, model_checks
from megazero.config.checkpoint_section import CheckpointConfig  # noqa: F401 - a section of JobConfig
from megazero.config.compile_section import COMPILE_MODES, CompileConfig  # noqa: F401 - a section of JobConfig
from megazero.config.fields import flag_field, register_job
from megazero.config.logging_config import LoggingConfig
from megazero.config.megatron_flags import MEGATRON_TOKENIZERS
from megazero.errors import ConfigError

# The allowed values of the choice flags: one source for the command line and the checks.
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")     # Megatron's --cp-comm-type values
DECAY_STYLES = ("constant", "linear", "cosine")
TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")
ACTIVATIONS = ("gelu_tanh", "gelu")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
BACKENDS = ("gloo", "nccl")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe_act", "layernorm")   # megazero/models/recompute.py says what each keeps

_MODEL, _MOE, _PAR, _OFFLOAD = "model", "mixture of experts", "parallelism", "offload"
_ACT = "activation memory"


@dataclass
class ModelConfig:
    """Shape of the decoder. ``vocab_size`` is the tokenizer's; the embedding is padded.

    The defaults are GPT-2 (learned positions, LayerNorm, GELU MLP, biases, tied embeddings) and,
    with the other sections, the embedded default run (`python pretrain_gpt.py`): a 1.3M-parameter GPT
    that learns the bundled sample corpus in about a minute on one CPU core. A Llama-family decoder is
    the same model with Megatron's flags: ``position_embedding_type="rope"``, ``normalization="RMSNorm"``,
    ``swiglu``, ``group_query_attention`` + ``num_query_groups``, ``add_bias_linear=False``,
    ``untie_embeddings_and_output_weights`` (see :mod:`megazero.models.gpt`).
    """

    num_layers: int = flag_field(4, "--num-layers", type=int, group=_MODEL, help="transformer layers")
    hidden_size: int = flag_field(128, "--hidden-size", type=int, group=_MODEL, help="model width")
    num_attention_heads: int = flag_field(4, "--num-attention-heads", type=int, group=_MODEL,
                                          help="attention heads per layer")
    ffn_hidden_size: int | None = flag_field(None, "--ffn-hidden-size", type=int, group=_MODEL,
                                             help="default 4 * hidden size")
    seq_length: int = flag_field(128, "--seq-length", type=int, group=_MODEL, help="tokens per training sequence")
    max_position_embeddings: int | None = flag_field(
        None, "--max-position-embeddings", type=int, group=_MODEL,
        help="positions the model can embed (default: the sequence length)")
    vocab_size: int = flag_field(512, "--vocab-size", type=int, group=_MODEL,
                                 help="with --mock-data; else the tokenizer's")
    make_vocab_size_divisible_by: int = flag_field(128, "--make-vocab-size-divisible-by", type=int, group=_MODEL,
                                                   help="the embedding is padded to a multiple of this x tp")
    untie_embeddings_and_output_weights: bool = flag_field(
        False, "--untie-embeddings-and-output-weights", action="store_true", group=_MODEL,
        help="an output layer of its own instead of the input embedding's weights")
    attention_dropout: float = flag_field(0.0, "--attention-dropout", type=float, group=_MODEL,
                                          help="dropout on the attention probabilities")
    hidden_dropout: float = flag_field(0.0, "--hidden-dropout", type=float, group=_MODEL,
                                       help="dropout on the embeddings and each attention and MLP output")
    init_method_std: float = flag_field(0.02, "--init-method-std", type=float, group=_MODEL,
                                        help="standard deviation of the normal weight initialisation")
    scaled_output_init: bool = flag_field(True, "--scaled-output-init", action=BooleanOptionalAction, group=_MODEL,
                                          help="GPT-2: output projections initialised with std / sqrt(2 * layers)")
    layernorm_epsilon: float = flag_field(1e-5, "--norm-epsilon", "--layernorm-epsilon", type=float, group=_MODEL,
                                          help="epsilon of the LayerNorm or RMSNorm")
    activation: str = flag_field("gelu_tanh", "--activation", choices=ACTIVATIONS, group=_MODEL,
                                 help="MLP activation: gelu_tanh (GPT-2/HF) or gelu (exact erf); not with swiglu")
    # Activation memory (Megatron-core's flag names and meanings; megazero/models/recompute.py, docs/memory.md).
    recompute_activations: bool = flag_field(
        False, "--recompute-activations", action="store_true", group=_ACT,
        help="full recompute of every layer: the same as --recompute-granularity full --recompute-method uniform "
             "--recompute-num-layers 1")
    recompute_granularity: str | None = flag_field(
        None, "--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, group=_ACT,
        help="full: layers keep only their input (with --recompute-method and --recompute-num-layers); "
             "selective: the --recompute-modules are recomputed")
    recompute_method: str | None = flag_field(
        None, "--recompute-method", choices=RECOMPUTE_METHODS, group=_ACT,
        help="full recompute: uniform (each chunk's layers in groups of --recompute-num-layers, a group keeping "
             "its input) or block (the first --recompute-num-layers layers of each chunk, the rest not)")
    recompute_num_layers: int | None = flag_field(None, "--recompute-num-layers", type=int, group=_ACT,
                                                  help="the group size (uniform) or layer count (block)")
    recompute_modules: list[str] | None = flag_field(
        None, "--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, group=_ACT,
        help="selective recompute: core_attn (default), mlp, moe_act, layernorm")
    cpu_offloading: bool = flag_field(False, "--cpu-offloading", "--offload-activations", action="store_true",
                                      group=_ACT, help="keep the saved activations of layers in host memory "
                                                       "between their forward and their backward")
    cpu_offloading_num_layers: int | None = flag_field(
        None, "--cpu-offloading-num-layers", type=int, group=_ACT,
        help="with --cpu-offloading: the first N layers of each model chunk (default: all of them)")
    # Llama family (Megatron's flag names); the defaults keep GPT-2.
    position_embedding_type: str = flag_field("learned_absolute", "--position-embedding-type",
                                              choices=POSITION_EMBEDDING_TYPES, group=_MODEL,
                                              help="rope: rotary embeddings, no position embedding table")
    rotary_base: float = flag_field(10000.0, "--rotary-base", type=float, group=_MODEL,
                                    help="RoPE theta (default 10000)")
    rotary_percent: float = flag_field(1.0, "--rotary-percent", type=float, group=_MODEL,
                                       help="fraction of head features rotated")
    use_rope_scaling: bool = flag_field(False, "--use-rope-scaling", action="store_true", group=_MODEL,
                                        help="Llama 3.1 RoPE frequency scaling")
    rope_scaling_factor: float = flag_field(8.0, "--rope-scaling-factor", type=float, group=_MODEL,
                                            help="the factor of Llama 3.1's RoPE scaling (default 8)")
    normalization: str = flag_field("LayerNorm", "--normalization", choices=NORMALIZATIONS, group=_MODEL,
                                    help="LayerNorm (GPT-2) or RMSNorm (Llama)")
    swiglu: bool = flag_field(False, "--swiglu", action="store_true", group=_MODEL, help=(
        "MLP silu(x W_gate) * (x W_up) instead of GELU; the ffn size then defaults to 8h/3 rounded down to 64"))
    group_query_attention: bool = flag_field(False, "--group-query-attention", action="store_true", group=_MODEL,
                                             help="grouped-query attention: query heads share key/value heads")
    num_query_groups: int | None = flag_field(None, "--num-query-groups", type=int, group=_MODEL,
                                              help="key/value heads (default 1)")
    add_bias_linear: bool = flag_field(True, "--disable-bias-linear", action="store_false", group=_MODEL,
                                       help="no biases in the linear layers")
    add_qkv_bias: bool = flag_field(False, "--add-qkv-bias", action="store_true", group=_MODEL,
                                    help="bias in the QKV projection only (Qwen2)")
    # Mixture of Experts (Megatron-core's flag names; megazero/models/moe.py). None: dense MLPs.
    num_experts: int | None = flag_field(None, "--num-experts", type=int, group=_MOE,
                                         help="experts per MoE layer (default: dense)")
    moe_router_topk: int = flag_field(2, "--moe-router-topk", type=int, group=_MOE,
                                      help="experts per token (default 2)")
    moe_layer_freq: int = flag_field(1, "--moe-layer-freq", type=int, group=_MOE,
                                     help="an MoE layer every N layers (default 1)")
    moe_aux_loss_coeff: float = flag_field(0.0, "--moe-aux-loss-coeff", type=float, group=_MOE,  # E * sum f_e P_e
                                           help="load-balancing loss weight")
    moe_z_loss_coeff: float = flag_field(0.0, "--moe-z-loss-coeff", type=float, group=_MOE,  # mean logsumexp^2
                                         help="router z-loss weight")
    moe_expert_capacity_factor: float | None = flag_field(
        None, "--moe-expert-capacity-factor", type=float, group=_MOE,
        help="drop tokens beyond this x the even share (default: dropless)")
    model_family: str = flag_field("gpt", "--model-family", group=_MODEL, metavar="NAME", help=(
        "the model family to build, by name (a registered model spec; default gpt: GPT-2 and the Llama family)"))

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:        # Megatron's defaults: SwiGLU's two input matrices keep ~8h^2
            self.ffn_hidden_size = (int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = 1
        if self.recompute_activations and self.recompute_granularity is None:    # Megatron's full recompute
            self.recompute_granularity = "full"
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
        if self.recompute_granularity == "selective" and self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]                                # Megatron's default

    def check(self, parallel: ParallelConfig) -> None:
        """The model against the layout: its shape over the tensor-parallel ranks (:func:`check_model`),
        its layers over the pipeline stages and virtual chunks (fills ``parallel.virtual_stages`` and
        the interleaved schedule)."""
        model_checks.check_model(self, parallel)
        model_checks.check_pipeline(self, parallel)
        model_checks.check_activation_memory(self)

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
        """Does global layer ``layer`` hold experts instead of a dense MLP (``moe_layer_freq``)?"""
        return bool(self.num_experts) and layer % self.moe_layer_freq == 0

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    """Layout of the tensor-, pipeline- and data-parallel dimensions."""

    tp: int = flag_field(1, "--tensor-model-parallel-size", "--tp", type=int, group=_PAR,
                         help="tensor-parallel size: ranks that split each layer's weight matrices")
    pp: int = flag_field(1, "--pipeline-model-parallel-size", "--pp", type=int, group=_PAR,
                         help="pipeline-parallel size: stages the layers are split into")
    dp: int | None = flag_field(None, "--data-parallel-size", "--dp", type=int, group=_PAR,
                                help="default: the world / (tp x cp x pp)")
    order: str = flag_field("tp-cp-dp-pp", "--parallel-order", group=_PAR, metavar="ORDER",
                            help="rank order, fastest first (default tp-cp-dp-pp; cp may be left out)")
    cp: int = flag_field(1, "--context-parallel-size", "--cp", type=int, group=_PAR,
                         help="context-parallel size: ranks that split each sequence (2 chunks each, causal "
                              "load balancing)")
    cp_comm_type: str = flag_field("p2p", "--cp-comm-type", choices=CP_COMM_TYPES, group=_PAR,
                                   help="context-parallel attention: p2p (ring), a2a (Ulysses all-to-all), "
                                        "allgather (gather keys/values)")
    num_layers_per_virtual_pipeline_stage: int | None = flag_field(
        None, "--num-layers-per-virtual-pipeline-stage", type=int, group=_PAR,
        help="interleaved 1F1B: layers per model chunk")
    pipeline_schedule: str = flag_field("1f1b", "--pipeline-schedule", choices=SCHEDULES, group=_PAR,
                                        help="interleaved is implied by virtual pipeline stages; zb-h1: zero-bubble ZB-H1 "
                                             "(1F1B's memory, a third of its bubble); zb-v: zero-bubble ZB-V "
                                             "(two chunks per rank in a V, 1F1B's memory, about half ZB-H1's "
                                             "bubble)")
    sequence_parallel: bool = flag_field(False, "--sequence-parallel", action="store_true", group=_PAR,
                                         help="split the activations outside the tensor-parallel regions "
                                              "along the sequence over the tp ranks")
    expert_model_parallel_size: int = flag_field(1, "--expert-model-parallel-size", type=int, group=_MOE,
                                                 help="experts split over this many dp ranks (default 1)")
    virtual_stages: int = 1                     # model chunks per rank (v); derived by validate()
    distributed_timeout_minutes: float = flag_field(
        10.0, "--distributed-timeout-minutes", type=float, group=_PAR,
        help="a collective waiting longer ends the job with an error (default 10)")
    ranks_per_node: int | None = flag_field(
        None, "--ranks-per-node", type=int, group=_PAR,
        help="ranks on each node (default: torchrun's LOCAL_WORLD_SIZE); lets one machine act as several nodes")

    @property
    def dp_x_cp(self) -> int:
        """Ranks holding the same weights (dp x cp): the dense parameters' gradients are reduced and their
        ZeRO states sharded over them, and expert-parallel groups are carved out of them (ep must divide it).
        Needs ``dp`` (filled by :meth:`check`)."""
        return self.dp * self.cp

    def check(self, world_size: int) -> None:
        """tp x pp x dp against the world size; fills ``dp`` when it is None."""
        checks.check_parallel(self, world_size)


@dataclass
class ZeroConfig:
    """Data-parallel gradient reduction and ZeRO sharding."""

    zero_stage: int = flag_field(0, "--zero-stage", type=int, choices=ZERO_STAGES, group=_PAR,
                                 help="0: data parallel; 1: optimizer state sharded; 2: and gradients; "
                                      "3: and parameters")
    bucket_size: int = flag_field(4_000_000, "--bucket-size", type=int, group=_PAR,
                                  help="elements per gradient bucket")
    overlap_grad_reduce: bool = flag_field(True, "--overlap-grad-reduce", action=BooleanOptionalAction, group=_PAR,
                                           help="reduce each gradient bucket behind the backward (default on)")
    overlap_param_gather: bool = flag_field(
        False, "--overlap-param-gather", action="store_true", group=_PAR,
        help="ZeRO-1/2: the updated parameters' all-gathers finish behind the next forward")
    prefetch_layers: int = flag_field(1, "--zero3-prefetch-layers", type=int, group=_PAR,
                                      help="ZeRO-3: layers gathered ahead of compute (default 1; 0: none)")
    prefetch_bucket_elements: int | None = None  # DeepSpeed's stage3_prefetch_bucket_size -> prefetch_layers
    max_live_elements: int | None = None         # DeepSpeed's stage3_max_live_parameters: caps prefetch_layers
    keep_params_gathered: bool = flag_field(
        False, "--zero3-keep-params-gathered", action="store_true", group=_PAR,
        help="ZeRO-3: gather each layer once per step and keep it until its backward in the last micro-batch")
    reduce_each_microbatch: bool = flag_field(
        False, "--zero2-reduce-each-microbatch", action="store_true", group=_PAR,
        help="stage 2: reduce gradients every micro-batch (less memory, m x the gradient traffic)")
    sharded_init: bool = flag_field(
        True, "--sharded-init", action=BooleanOptionalAction, group=_PAR,
        help="build the model on the meta device and give each parameter its values where it lives "
             "(ZeRO-3: shard by shard); default on")
    accumulate_allreduce_grads_in_fp32: bool | None = flag_field(
        None, "--accumulate-allreduce-grads-in-fp32", action=BooleanOptionalAction, group=_PAR,
        help="accumulate and reduce gradients in fp32 (default: on with --bf16)")
    offload_optimizer: str = flag_field(
        "none", "--offload-optimizer", choices=OFFLOAD_DEVICES, group=_OFFLOAD,
        help="ZeRO 1-3: fp32 masters, Adam moments and the update on the host (cpu) or in swap files (nvme)")
    offload_params: str = flag_field(
        "none", "--offload-params", choices=OFFLOAD_DEVICES, group=_OFFLOAD,
        help="ZeRO-3: parameter shards on the host (cpu) or in swap files (nvme)")
    nvme_path: str | None = flag_field(None, "--nvme-path", group=_OFFLOAD, metavar="DIR",
                                       help="directory for the swap files of nvme offloading")
    offload_pin_memory: bool = flag_field(True, "--offload-pin-memory", action=BooleanOptionalAction,
                                          group=_OFFLOAD, help="page-locked host buffers on CUDA (default on)")
    offload_sub_group_size: int | None = flag_field(   # None: offload.sub_group_elements
        None, "--offload-sub-group-size", type=int, group=_OFFLOAD,
        help="elements updated (and swapped) at a time on the host (default: 1/32 of the rank's shard, at most 4M)")
    quantized_weights: bool = flag_field(False, "--zero-quantized-weights", action="store_true", group=_PAR,
                                         help="ZeRO++ qwZ (stage 3): int8 parameter all-gathers")
    quantization_block_size: int = flag_field(4096, "--zero-quantization-block-size", type=int, group=_PAR,
                                              help="elements per int8 block of qwZ and qgZ (one fp32 scale each)")
    hpz_partition_size: int = flag_field(
        1, "--zero-hpz-partition-size", type=int, group=_PAR,
        help="ZeRO++ hpZ (stage 3): backward gathers over K dp ranks (K = dp ranks per node)")
    quantized_gradients: bool = flag_field(
        False, "--zero-quantized-gradients", action="store_true", group=_PAR,
        help="ZeRO++ qgZ (stage 2/3): hierarchical int8 all-to-all gradient reduce")

    def check(self, parallel: ParallelConfig, world_size: int) -> None:
        """The stage and the switches that need one (offload, ZeRO++), against the layout."""
        checks.check_zero(self, parallel, world_size)


@dataclass
class PrecisionConfig:
    """Mixed precision and fp16's dynamic loss scaling."""

    bf16: bool = flag_field(False, "--bf16", action="store_true", group="mixed precision",
                            help="bf16 parameters and compute, fp32 master weights in the optimizer")
    fp16: bool = flag_field(False, "--fp16", action="store_true", group="mixed precision",
                            help="fp16 parameters and compute with dynamic loss scaling, fp32 master weights")
    initial_loss_scale: float = flag_field(2.0 ** 16, "--initial-loss-scale", type=float, group="mixed precision",
                                           help="fp16: the first loss scale")
    min_loss_scale: float = flag_field(1.0, "--min-loss-scale", type=float, group="mixed precision",
                                       help="fp16: the scale is never lowered below this")
    loss_scale_window: int = flag_field(1000, "--loss-scale-window", type=int, group="mixed precision",
                                        help="fp16: steps without an overflow before the scale doubles")
    hysteresis: int = flag_field(2, "--hysteresis", type=int, group="mixed precision",
                                 help="fp16: overflows before the scale is halved")
    max_consecutive_skipped_steps: int = flag_field(
        20, "--max-consecutive-skipped-steps", type=int, group="mixed precision",
        help="stop after this many skipped (overflowed) steps in a row (default 20)")

    def check(self) -> None:
        checks.check_precision(self)

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = flag_field(1.5e-3, "--lr", type=float, group="optimizer", help="the peak learning rate", metavar="LR")
    min_lr: float = flag_field(0.0, "--min-lr", type=float, group="optimizer", metavar="LR",
                               help="the learning rate at the end of the decay")
    lr_warmup_iters: int = flag_field(0, "--lr-warmup-iters", type=int, group="optimizer",
                                      help="iterations of linear warmup from 0")
    lr_warmup_fraction: float | None = flag_field(
        None, "--lr-warmup-fraction", type=float, group="optimizer", metavar="F",
        help="warmup over this fraction of the decay iterations (or samples), rounded up to whole iterations")
    lr_warmup_samples: int | None = flag_field(
        None, "--lr-warmup-samples", type=int, group="optimizer",
        help="with --train-samples: warmup samples, as iterations of --global-batch-size (rounded up)")
    lr_decay_iters: int | None = flag_field(
        None, "--lr-decay-iters", type=int, group="optimizer",
        help="iterations to the end of the decay (default: the training iterations)")
    lr_decay_samples: int | None = flag_field(
        None, "--lr-decay-samples", type=int, group="optimizer",
        help="with --train-samples: samples to the end of the decay (default: all), as iterations (rounded up)")
    lr_decay_style: str = flag_field("cosine", "--lr-decay-style", choices=DECAY_STYLES, group="optimizer",
                                     help="the decay after the warmup")
    min_lr_ratio: float | None = None           # (DeepSpeed's cos_min_ratio) min_lr = this * lr
    lr_warmup_style: str = "linear"             # or "log" (DeepSpeed's default warmup_type): megazero.lr_schedule
    weight_decay: float = flag_field(0.01, "--weight-decay", type=float, group="optimizer",
                                     help="AdamW's decoupled weight decay")
    adam_beta1: float = flag_field(0.9, "--adam-beta1", type=float, group="optimizer", help="AdamW's beta1")
    adam_beta2: float = flag_field(0.999, "--adam-beta2", type=float, group="optimizer", help="AdamW's beta2")
    adam_eps: float = flag_field(1e-8, "--adam-eps", type=float, group="optimizer", help="AdamW's epsilon")
    clip_grad: float = flag_field(1.0, "--clip-grad", type=float, group="optimizer", help="gradient norm clip (0: none)")

    def check(self, train: TrainConfig) -> None:
        """The schedule against the training length; fills ``lr_decay_iters`` and (from ``min_lr_ratio``)
        ``min_lr``."""
        checks.check_optimizer(self, train)


@dataclass
class DataConfig:
    """The training data and its tokenizer."""

    data_path: list[str] = flag_field([], "--data-path", nargs="+", group="data", metavar="PREFIX",
                                      help="the dataset's path prefix (PREFIX.bin, PREFIX.idx), or weight prefix pairs")
    split: str = flag_field("969,30,1", "--split", group="data", metavar="T,V,T",
                            help="train, validation and test weights over the documents")
    mock_data: bool = flag_field(False, "--mock-data", action="store_true", group="data",
                                 help="synthetic tokens, no files")
    tokenizer_type: str | None = flag_field(
        None, "--tokenizer-type", choices=TOKENIZERS + tuple(MEGATRON_TOKENIZERS), group="data",
        metavar="NAME", help=f"{', '.join(TOKENIZERS)} (more: docs/megatron-flags.md); sets the vocabulary size")
    vocab_file: str | None = flag_field(None, "--vocab-file", group="data", help="GPT2BPETokenizer's vocab.json",
                                        metavar="PATH")
    merge_file: str | None = flag_field(None, "--merge-file", group="data", help="GPT2BPETokenizer's merges.txt",
                                        metavar="PATH")
    tokenizer_model: str | None = flag_field(
        None, "--tokenizer-model", group="data", metavar="PATH",
        help="a SentencePiece model, or a tokenizer.json or the directory holding it")
    data_cache_path: str | None = flag_field(None, "--data-cache-path", group="data", metavar="DIR",
                                             help="directory of the index caches (default: beside the data)")
    eod_mask_loss: bool = flag_field(False, "--eod-mask-loss", action="store_true", group="data",
                                     help="no loss on the end-of-document token")

    def check(self) -> None:
        checks.check_data(self)


@dataclass
class TrainConfig:
    """Batch sizes, iterations and the evaluation and logging rhythm."""

    micro_batch_size: int = flag_field(8, "--micro-batch-size", type=int, group="training",
                                       help="sequences per micro-batch on each rank")
    global_batch_size: int | None = flag_field(None, "--global-batch-size", type=int, group="training",
                                               help="sequences per step (default micro x dp x pp)")
    gradient_accumulation_steps: int | None = None   # (DeepSpeed / Accelerate configs) global = micro * this * dp
    train_iters: int | None = flag_field(None, "--train-iters", type=int, group="training",
                                         help="training iterations (default 400, or from --train-samples)")
    train_samples: int | None = flag_field(
        None, "--train-samples", type=int, group="training",
        help="train this many samples: that // --global-batch-size iterations (a sample-based run)")
    seed: int = flag_field(1234, "--seed", type=int, group="training", help="the random seed")
    eval_interval: int = flag_field(100, "--eval-interval", type=int, group="training",
                                    help="iterations between evaluations")
    eval_iters: int = flag_field(10, "--eval-iters", type=int, group="training",
                                 help="batches per evaluation (0: none)")
    log_interval: int = flag_field(10, "--log-interval", type=int, group="training",
                                   help="iterations between log lines")
    memory_budget_gib: float | None = flag_field(
        None, "--memory-budget-gib", type=float, group=_ACT,
        help="let the memory planner pick the cheapest recompute / offload plan whose estimated peak per rank fits "
             "this many GiB (megazero/memory/planner.py); not with the recompute and offload flags")
    check_for_nan_in_loss_and_grad: bool = flag_field(
        True, "--check-for-nan-in-loss-and-grad", action=BooleanOptionalAction, group="training",
        help="stop the run on a non-finite loss or gradient (default on; off: such steps are skipped)")

    def check(self, parallel: ParallelConfig) -> None:
        """Batch sizes against the layout; fills ``global_batch_size``."""
        checks.check_train(self, parallel)


@register_job
@dataclass
class JobConfig:
    """Every section of a run; :func:`megazero.config.validate` checks and completes it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    compilation: CompileConfig = field(default_factory=CompileConfig)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation steps)."""
        assert self.parallel.dp is not None, "validate() resolves dp first"
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, sections: dict, *, strict: bool = True) -> JobConfig:
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
