"""The GPT family's configuration: :class:`GPTConfig`, the model section of ``--model-family gpt``.

GPT-2 by default (learned positions, LayerNorm, GELU MLP, biases, tied embeddings); a Llama-family
decoder is the same model with Megatron's flags (``--position-embedding-type rope --normalization
RMSNorm --swiglu --group-query-attention --num-query-groups G --disable-bias-linear
--untie-embeddings-and-output-weights``), and Mixture of Experts with ``--num-experts`` (Megatron-core's
MoE flags). Its rules extend :meth:`megazero.config.ModelConfig.check` (the sizes any family has):
RoPE, grouped-query attention over the tensor-parallel ranks, the MoE flags::

    validate(JobConfig(model=GPTConfig(num_experts=2, moe_router_topk=3)), 1)
    # ConfigError: --moe-router-topk 3 exceeds --num-experts 2: a token cannot pick more experts than there are
"""
from __future__ import annotations

import dataclasses
from argparse import BooleanOptionalAction
from dataclasses import dataclass
from typing import ClassVar

from megazero.config import FLAG, ModelConfig, ParallelConfig, flag, flag_field
from megazero.config.rules import fail, one_of, positive, positive_float

ACTIVATIONS = ("gelu_tanh", "gelu")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
MOE_FIELDS = ("moe_router_topk", "moe_layer_freq", "moe_aux_loss_coeff", "moe_z_loss_coeff",
              "moe_expert_capacity_factor", "moe_grouped_gemm")

_MODEL, _MOE = "model", "mixture of experts"


@dataclass
class GPTConfig(ModelConfig):
    """The GPT family's shape (see the module docstring); the sizes every family has are
    :class:`~megazero.config.ModelConfig`'s."""

    scaled_output_init: bool = flag_field(True, "--scaled-output-init", action=BooleanOptionalAction, group=_MODEL,
                                          help="GPT-2: output projections initialised with std / sqrt(2 * layers)")
    layernorm_epsilon: float = flag_field(1e-5, "--norm-epsilon", "--layernorm-epsilon", type=float, group=_MODEL,
                                          help="epsilon of the LayerNorm or RMSNorm")
    activation: str = flag_field("gelu_tanh", "--activation", choices=ACTIVATIONS, group=_MODEL,
                                 help="MLP activation: gelu_tanh (GPT-2/HF) or gelu (exact erf); not with swiglu")
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
    apply_layernorm_1p: bool = flag_field(False, "--apply-layernorm-1p", action="store_true", group=_MODEL, help=(
        "zero-centred norm weights (Megatron's): every norm stores weight - 1, initialised to 0, and scales by "
        "1 + weight (LayerNorm and RMSNorm); checkpoints hold the stored value, HF exports the scale"))
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
    cross_entropy_loss_fusion: bool = flag_field(False, "--cross-entropy-loss-fusion", action="store_true",
                                                 group=_MODEL, help=(
        "the output layer and the loss in chunks of tokens: the whole logits never exist in training "
        "(one more product of the output layer in backward); an output layer run in FP8 keeps the unfused loss"))
    # Mixture of Experts (Megatron-core's flag names; megazero/models/gpt/moe.py). None: dense MLPs.
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
    moe_grouped_gemm: bool = flag_field(False, "--moe-grouped-gemm", action="store_true", group=_MOE, help=(
        "each MoE layer's local experts as one grouped GEMM for fc1 and one for fc2 (torch._grouped_mm), "
        "equal to the per-expert loop; the loop still runs under FP8 and where torch._grouped_mm refuses "
        "the dtype or device (fp64; CUDA other than bf16)"))

    experts_field: ClassVar[str | None] = "num_experts"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and self.swiglu:   # Megatron's default: SwiGLU's two inputs keep ~8h^2
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
        if self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = 1
        super().__post_init__()

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

    @property
    def layer_period(self) -> int:
        return self.moe_layer_freq if self.num_experts else 1

    def check(self, parallel: ParallelConfig) -> None:
        """The sizes any family has (:meth:`ModelConfig.check`), then the GPT family's: norm epsilon, the
        activation and the norm, RoPE, grouped-query attention over tp, the MoE flags."""
        if self.num_experts is not None and not self.num_experts >= 1:
            fail(f"{FLAG.num_experts} must be a positive integer, got {self.num_experts}: leave it unset for "
                 f"dense MLPs")
        super().check(parallel)
        positive_float(self.layernorm_epsilon, "layernorm_epsilon")
        one_of(self, "activation")
        one_of(self, "normalization")
        self._check_rope()
        self._check_query_groups(parallel.tp)
        self._check_moe()

    def _check_rope(self) -> None:
        one_of(self, "position_embedding_type")
        rope = self.position_embedding_type == "rope"
        if not rope and (self.use_rope_scaling or self.rotary_percent != 1.0):
            fail(f"{FLAG.use_rope_scaling} and {FLAG.rotary_percent} apply to rotary embeddings only: add "
                 f"{FLAG.position_embedding_type} rope or drop them")
        if not rope:
            return
        if not 0.0 < self.rotary_percent <= 1.0:
            fail(f"{FLAG.rotary_percent} must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            fail(f"{FLAG.rotary_percent} {self.rotary_percent} rotates {self.rotary_dim} of the {self.head_dim} "
                 f"features of a head: RoPE needs an even number, at least 2; change {FLAG.rotary_percent}")
        if not self.rotary_base > 0 or (self.use_rope_scaling and not self.rope_scaling_factor >= 1.0):
            fail(f"{FLAG.rotary_base} must be > 0 (got {self.rotary_base}) and {FLAG.rope_scaling_factor} >= 1 "
                 f"(got {self.rope_scaling_factor})")

    def _check_query_groups(self, tp: int) -> None:
        """Megatron's rule: each tp rank holds whole key/value groups when there are at least tp of them
        (G % tp == 0); with fewer, the groups are replicated (tp % G == 0), each rank using one."""
        if not self.group_query_attention:
            if self.num_query_groups is not None:
                fail(f"{FLAG.num_query_groups} {self.num_query_groups} needs {FLAG.group_query_attention}: add it, "
                     f"or drop {FLAG.num_query_groups} for multi-head attention")
            return
        g, heads = self.num_query_groups, self.num_attention_heads
        positive(g, "num_query_groups")
        if heads % g:
            fail(f"{FLAG.num_attention_heads} {heads} is not divisible by {FLAG.num_query_groups} {g}: every group "
                 f"needs the same number of query heads; choose a group count that divides the heads")
        if g >= tp and g % tp:
            fail(f"{FLAG.num_query_groups} {g} is not divisible by {FLAG.tp} {tp}: each tensor-parallel rank "
                 f"needs whole key/value groups; use a tp that divides {g}")
        if g < tp and tp % g:
            fail(f"{FLAG.tp} {tp} is not a multiple of {FLAG.num_query_groups} {g}: with fewer groups than tp "
                 f"ranks each group is replicated over tp / groups ranks; use a tp that {g} divides")

    def _check_moe(self) -> None:
        """The Mixture-of-Experts flags against each other (expert parallelism against the experts is
        :meth:`ModelConfig.check`'s)."""
        if not self.num_experts:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in MOE_FIELDS:
                if getattr(self, name) != defaults[name]:
                    fail(f"{flag(name)} {getattr(self, name)} applies to Mixture-of-Experts layers and this model "
                         f"has none: add {FLAG.num_experts} N, or drop {flag(name)}")
            return
        positive(self.moe_router_topk, "moe_router_topk")
        positive(self.moe_layer_freq, "moe_layer_freq")
        if self.moe_router_topk > self.num_experts:
            fail(f"{FLAG.moe_router_topk} {self.moe_router_topk} exceeds {FLAG.num_experts} {self.num_experts}: "
                 f"a token cannot pick more experts than there are")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                fail(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            fail(f"{FLAG.moe_expert_capacity_factor} must be > 0, got {self.moe_expert_capacity_factor}: "
                 f"leave it unset for dropless routing")
