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
import re
from argparse import BooleanOptionalAction
from dataclasses import dataclass
from typing import ClassVar

from megazero.config import FLAG, ModelConfig, ParallelConfig, flag, flag_field
from megazero.config.rules import fail, one_of, positive, positive_float

ACTIVATIONS = ("gelu_tanh", "gelu")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
MOE_FIELDS = ("moe_router_topk", "moe_layer_freq", "moe_aux_loss_coeff", "moe_z_loss_coeff",
              "moe_expert_capacity_factor", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_num_groups",
              "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
              "moe_router_load_balancing_type", "moe_grouped_gemm")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")

_MODEL, _MOE = "model", "mixture of experts"


_PATTERN_TOKEN = re.compile(r"\s*(\d+|[\[\]()*+,])")


def moe_layer_freq_value(text: str) -> int | str:
    """``--moe-layer-freq``'s value as typed: an integer, else the pattern text (parsed by
    :class:`GPTConfig`, refused by its check when it is not one)."""
    text = str(text).strip()
    return int(text) if text.lstrip("-").isdigit() else text


def parse_layer_pattern(text: str) -> list[int]:
    """Megatron's layer pattern without eval: lists of integers, ``*`` by an integer, ``+`` to concatenate,
    parentheses. ``"([0]*1+[1]*3)"`` -> [0, 1, 1, 1]; ``"([1]*1+[0]*1)*2"`` -> [1, 0, 1, 0]. ValueError
    for anything else."""
    tokens, pos = [], 0
    while pos < len(text.rstrip()):
        match = _PATTERN_TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"unexpected {text[pos:]!r}")
        tokens.append(match.group(1))
        pos = match.end()
    tokens.append("")
    at = 0

    def take(expected: str | None = None) -> str:
        nonlocal at
        token = tokens[at]
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, got {token!r}")
        at += 1
        return token

    def number() -> int:
        token = take()
        if not token.isdigit():
            raise ValueError(f"expected an integer, got {token!r}")
        return int(token)

    def atom() -> list[int]:
        if tokens[at] == "(":
            take("(")
            value = expr()
            take(")")
            return value
        take("[")
        items = [number()]
        while tokens[at] == ",":
            take(",")
            items.append(number())
        take("]")
        return items

    def term() -> list[int]:
        value = atom()
        while tokens[at] == "*":
            take("*")
            value = value * number()
        return value

    def expr() -> list[int]:
        value = term()
        while tokens[at] == "+":
            take("+")
            value = value + term()
        return value

    result = expr()
    take("")
    return result


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
    moe_layer_freq: int | list[int] = flag_field(
        1, "--moe-layer-freq", type=moe_layer_freq_value, group=_MOE, metavar="N|PATTERN",
        help="an MoE layer every N layers (default 1), or Megatron's pattern of one 0 (dense) or 1 (MoE) per "
             "layer, e.g. \"([0]*1+[1]*3)\" or \"[0,1,1,1]\"")
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

    moe_ffn_hidden_size: int | None = flag_field(None, "--moe-ffn-hidden-size", type=int, group=_MOE,
                                                 help="each routed expert's ffn width (default: the dense MLP's)")
    moe_shared_expert_intermediate_size: int | None = flag_field(
        None, "--moe-shared-expert-intermediate-size", type=int, group=_MOE,
        help="width of an always-on shared-expert MLP beside the routed experts, added to their output, "
             "tensor-split like a dense MLP (default: none)")
    moe_router_score_function: str = flag_field(
        "softmax", "--moe-router-score-function", choices=SCORE_FUNCTIONS, group=_MOE,
        help="router scores: softmax over the experts, or each expert's sigmoid (DeepSeek-V3)")
    moe_router_topk_scaling_factor: float | None = flag_field(
        None, "--moe-router-topk-scaling-factor", type=float, group=_MOE,
        help="the gates multiplied by this (DeepSeek-V3's routed_scaling_factor; default 1)")
    moe_router_num_groups: int | None = flag_field(
        None, "--moe-router-num-groups", type=int, group=_MOE,
        help="group-limited routing: the experts in this many equal groups (default: no groups)")
    moe_router_group_topk: int | None = flag_field(
        None, "--moe-router-group-topk", type=int, group=_MOE,
        help="group-limited routing: a token picks its experts from its best this-many groups (a group's "
             "score is the sum of its two best choice scores)")
    moe_router_enable_expert_bias: bool = flag_field(
        False, "--moe-router-enable-expert-bias", action="store_true", group=_MOE,
        help="auxiliary-loss-free balancing: a per-expert bias added to the scores for choosing only, "
             "moved after each step towards the even load (needs sigmoid scores)")
    moe_router_bias_update_rate: float = flag_field(
        1e-3, "--moe-router-bias-update-rate", type=float, group=_MOE,
        help="the expert bias' step: bias += rate * sign(mean load - load) after each step (default 1e-3)")
    moe_router_load_balancing_type: str = flag_field(
        "aux_loss", "--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, group=_MOE,
        help="aux_loss: the load-balancing loss over the micro-batch; seq_aux_loss: per sequence, averaged "
             "(DeepSeek-V3), both weighted by the aux loss coefficient; none: no balancing loss")

    experts_field: ClassVar[str | None] = "num_experts"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and self.swiglu:   # Megatron's default: SwiGLU's two inputs keep ~8h^2
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
        if self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = 1
        if isinstance(self.moe_layer_freq, str):
            self.moe_layer_freq = moe_layer_freq_value(self.moe_layer_freq)
        if isinstance(self.moe_layer_freq, str):
            try:
                self.moe_layer_freq = parse_layer_pattern(self.moe_layer_freq)
            except ValueError:
                pass                       # check() refuses it in one line
        elif isinstance(self.moe_layer_freq, tuple):
            self.moe_layer_freq = list(self.moe_layer_freq)
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
        """Does global layer ``layer`` hold experts instead of a dense MLP (``moe_layer_freq``: every N-th
        layer from layer 0, or the pattern's 1s)?"""
        if not self.num_experts:
            return False
        if isinstance(self.moe_layer_freq, list):
            return self.moe_layer_freq[layer] == 1
        return layer % self.moe_layer_freq == 0

    @property
    def layer_period(self) -> int:
        if not self.num_experts:
            return 1
        return len(self.moe_layer_freq) if isinstance(self.moe_layer_freq, list) else self.moe_layer_freq

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each routed expert's ffn width: ``--moe-ffn-hidden-size``, else ``--ffn-hidden-size``."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

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
        self._check_layer_freq()
        if self.moe_router_topk > self.num_experts:
            fail(f"{FLAG.moe_router_topk} {self.moe_router_topk} exceeds {FLAG.num_experts} {self.num_experts}: "
                 f"a token cannot pick more experts than there are")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                fail(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        self._check_routing()
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            fail(f"{FLAG.moe_expert_capacity_factor} must be > 0, got {self.moe_expert_capacity_factor}: "
                 f"leave it unset for dropless routing")

    def _check_layer_freq(self) -> None:
        """``--moe-layer-freq``: a positive integer, or a pattern of num_layers 0s and 1s."""
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            positive(freq, "moe_layer_freq")
            return
        if isinstance(freq, str):
            fail(f"{FLAG.moe_layer_freq} {freq!r} is neither an integer nor a layer pattern: write N, or one 0 "
                 f"(dense) or 1 (MoE) per layer as \"[0,1,1,1]\" or \"([0]*1+[1]*3)\"")
        if len(freq) != self.num_layers or set(freq) - {0, 1}:
            fail(f"{FLAG.moe_layer_freq} pattern {freq} must hold one 0 (dense) or 1 (MoE) per layer, "
                 f"{self.num_layers} of them ({FLAG.num_layers}): got {len(freq)} entries")

    def _check_routing(self) -> None:
        """Score function, group-limited top-k, the expert bias, the balancing loss, the expert widths."""
        one_of(self, "moe_router_score_function")
        one_of(self, "moe_router_load_balancing_type")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_num_groups",
                     "moe_router_group_topk"):
            if getattr(self, name) is not None:
                positive(getattr(self, name), name)
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and not factor > 0:
            fail(f"{FLAG.moe_router_topk_scaling_factor} must be > 0, got {factor}: leave it unset for 1")
        self._check_groups()
        sigmoid = self.moe_router_score_function == "sigmoid"
        if self.moe_router_enable_expert_bias and not sigmoid:
            fail(f"{FLAG.moe_router_enable_expert_bias} needs {FLAG.moe_router_score_function} sigmoid (the bias "
                 f"shifts each expert's own score): add it, or drop the bias")
        if not self.moe_router_bias_update_rate >= 0:
            fail(f"{FLAG.moe_router_bias_update_rate} must be >= 0, got {self.moe_router_bias_update_rate}")
        if self.moe_router_bias_update_rate != 1e-3 and not self.moe_router_enable_expert_bias:
            fail(f"{FLAG.moe_router_bias_update_rate} moves the expert bias: add "
                 f"{FLAG.moe_router_enable_expert_bias}, or drop {FLAG.moe_router_bias_update_rate}")
        if self.moe_router_load_balancing_type == "none" and self.moe_aux_loss_coeff > 0:
            fail(f"{FLAG.moe_router_load_balancing_type} none adds no balancing loss, yet {FLAG.moe_aux_loss_coeff} "
                 f"is {self.moe_aux_loss_coeff}: drop one of them")

    def _check_groups(self) -> None:
        """Group-limited routing: both group flags or neither; E in whole groups of at least two experts
        (a group's score sums its two best); the kept groups hold at least top-k experts."""
        groups, keep, e = self.moe_router_num_groups, self.moe_router_group_topk, self.num_experts
        if (groups is None) != (keep is None):
            fail(f"{FLAG.moe_router_num_groups} and {FLAG.moe_router_group_topk} go together: give both, or neither "
                 f"for routing over all experts")
        if groups is None:
            return
        if e % groups or e // groups < 2:
            fail(f"{FLAG.num_experts} {e} must split into {FLAG.moe_router_num_groups} {groups} equal groups of at "
                 f"least 2 experts: choose a group count dividing {e} at most {e // 2}")
        if keep > groups or keep * (e // groups) < self.moe_router_topk:
            fail(f"{FLAG.moe_router_group_topk} {keep} must be <= {FLAG.moe_router_num_groups} {groups} and keep at "
                 f"least {FLAG.moe_router_topk} {self.moe_router_topk} experts ({e // groups} per group): raise it")

