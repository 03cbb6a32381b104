"""The DeepSeek-V3 family's configuration: :class:`DeepSeekV3Config`, the model section of
``--model-family deepseek_v3``.

A GPT-family decoder (:class:`~megazero.models.gpt.config.GPTConfig`: its sizes, norms, MLP and MoE flags)
whose attention is multi-head latent attention (MLA, DeepSeek-V2), with Megatron-LM's flags for it::

    --q-lora-rank R_q          queries through a rank-R_q bottleneck (q_a_proj -> norm -> q_b_proj); unset:
                               one plain projection (q_proj), as DeepSeek-V2-Lite
    --kv-lora-rank R_kv        keys and values from one compressed latent of R_kv features per token
    --qk-head-dim D_nope       the part of each query/key head without position information
    --qk-pos-emb-head-dim D_r  the part rotated by RoPE (the key's is one head shared by all query heads)
    --v-head-dim D_v           value features per head (the output projection takes heads * D_v)
    --mtp-num-layers D         multi-token prediction modules after the decoder (DeepSeek-V3's MTP)
    --mtp-loss-scaling-factor  their losses' weight: loss = main + factor / D * sum_d CE_d
    --rope-type yarn           YaRN scaling of the rotated part (DeepSeek-V3's long-context checkpoints), with
                               --rotary-scaling-factor, --original-max-position-embeddings, --beta-fast,
                               --beta-slow, --mscale, --mscale-all-dim (:mod:`.yarn`)

The family's defaults are DeepSeek-V3's shape (RoPE, RMSNorm with epsilon 1e-6, SwiGLU, an untied output
layer, no biases); the sizes default to the GPT family's tiny model and Megatron's MLA defaults.
"""
from __future__ import annotations

import dataclasses
from argparse import BooleanOptionalAction
from dataclasses import dataclass

from megazero.config import FLAG, ParallelConfig, flag, flag_field
from megazero.config.fields import flag_off
from megazero.config.rules import fail, positive
from megazero.models.gpt.config import GPTConfig

FAMILY = "deepseek_v3"
_MODEL, _MTP = "model", "model"
_INHERITED = {f.name: f for f in dataclasses.fields(GPTConfig)}


def _family_default(name: str, value):
    """GPTConfig's field ``name`` (the same flag) with this family's default."""
    return dataclasses.field(default=value, metadata=_INHERITED[name].metadata)


@dataclass
class DeepSeekV3Config(GPTConfig):
    """DeepSeek-V3's shape (see the module docstring): the GPT family's fields with this family's defaults,
    and multi-head latent attention's and multi-token prediction's own."""

    model_family: str = _family_default("model_family", FAMILY)
    layernorm_epsilon: float = _family_default("layernorm_epsilon", 1e-6)
    position_embedding_type: str = _family_default("position_embedding_type", "rope")
    normalization: str = _family_default("normalization", "RMSNorm")
    swiglu: bool = _family_default("swiglu", True)
    add_bias_linear: bool = _family_default("add_bias_linear", False)
    untie_embeddings_and_output_weights: bool = _family_default("untie_embeddings_and_output_weights", True)

    multi_latent_attention: bool = flag_field(
        True, "--multi-latent-attention", action=BooleanOptionalAction, group=_MODEL,
        help="multi-head latent attention (always on in the deepseek_v3 family, whose attention it is)")
    q_lora_rank: int | None = flag_field(None, "--q-lora-rank", type=int, group=_MODEL, help=(
        "MLA: queries through a low-rank bottleneck of this many features (q_a_proj, norm, q_b_proj); "
        "default: one plain query projection"))
    kv_lora_rank: int = flag_field(32, "--kv-lora-rank", type=int, group=_MODEL,
                                   help="MLA: features of the compressed key/value latent of each token")
    qk_head_dim: int = flag_field(128, "--qk-head-dim", type=int, group=_MODEL,
                                  help="MLA: features of each query/key head without RoPE")
    qk_pos_emb_head_dim: int = flag_field(64, "--qk-pos-emb-head-dim", type=int, group=_MODEL,
                                          help="MLA: features of each query/key head rotated by RoPE")
    v_head_dim: int = flag_field(128, "--v-head-dim", type=int, group=_MODEL,
                                 help="MLA: value features of each head")
    mtp_num_layers: int | None = flag_field(None, "--mtp-num-layers", type=int, group=_MTP, help=(
        "multi-token prediction: this many modules after the decoder, module d predicting token t+d+1"))
    mtp_loss_scaling_factor: float = flag_field(0.1, "--mtp-loss-scaling-factor", type=float, group=_MTP,
                                                help="weight of the multi-token prediction losses (default 0.1)")
    rope_type: str = flag_field("rope", "--rope-type", choices=("rope", "yarn"), group=_MODEL, help=(
        "MLA: plain RoPE, or YaRN-scaled RoPE for a context longer than the original one (default rope)"))
    rotary_scaling_factor: float = flag_field(1.0, "--rotary-scaling-factor", type=float, group=_MODEL,
                                              help="YaRN: context extension factor (default 1.0)")
    original_max_position_embeddings: int = flag_field(
        4096, "--original-max-position-embeddings", type=int, group=_MODEL,
        help="YaRN: the context length the model was pretrained with (default 4096)")
    beta_fast: float = flag_field(32.0, "--beta-fast", type=float, group=_MODEL,
                                  help="YaRN: rotations within the original context above which a pair is kept")
    beta_slow: float = flag_field(1.0, "--beta-slow", type=float, group=_MODEL,
                                  help="YaRN: rotations below which a pair is interpolated by the factor")
    mscale: float = flag_field(1.0, "--mscale", type=float, group=_MODEL,
                               help="YaRN: the cos/sin magnitude is mscale(factor, mscale) / mscale(factor, "
                                    "mscale-all-dim) (default 1.0)")
    mscale_all_dim: float = flag_field(0.0, "--mscale-all-dim", type=float, group=_MODEL,
                                       help="YaRN: the softmax scale is multiplied by mscale(factor, this)^2 "
                                            "(default 0: unchanged)")

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates the ``--qk-pos-emb-head-dim`` part of each query and key head."""
        return self.qk_pos_emb_head_dim

    @property
    def query_head_dim(self) -> int:
        """Features of each query (and key) head: the part without and the part with RoPE."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """GPT's rule for the decoder's layers; the MTP modules' layers (global index >= ``num_layers``) have
        a dense MLP."""
        return layer < self.num_layers and super().is_moe_layer(layer)

    @property
    def mtp_depth(self) -> int:
        """Multi-token prediction modules (0: none)."""
        return self.mtp_num_layers or 0

    def check(self, parallel: ParallelConfig) -> None:
        """Latent attention's sizes, GPT's rules (:meth:`GPTConfig.check`: sizes, RoPE, MoE), then what this
        family's attention and MTP ask of them."""
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            positive(getattr(self, name), name)
        if self.q_lora_rank is not None:
            positive(self.q_lora_rank, "q_lora_rank")
        if self.qk_pos_emb_head_dim % 2:
            fail(f"{FLAG.qk_pos_emb_head_dim} {self.qk_pos_emb_head_dim} must be even: RoPE rotates pairs of features")
        super().check(parallel)
        if not self.multi_latent_attention:
            fail(f"{FLAG.model_family} {FAMILY} has multi-head latent attention only: drop "
                 f"{flag_off('multi_latent_attention')}, or use {FLAG.model_family} gpt for standard attention")
        if self.position_embedding_type != "rope" or self.rotary_percent != 1.0 or self.use_rope_scaling:
            fail(f"{FLAG.model_family} {FAMILY} rotates the {FLAG.qk_pos_emb_head_dim} part of each head with plain "
                 f"RoPE: keep {FLAG.position_embedding_type} rope and drop {FLAG.rotary_percent} and "
                 f"{FLAG.use_rope_scaling} (for a longer context: {FLAG.rope_type} yarn)")
        self._check_yarn()
        if self.group_query_attention:
            fail(f"{FLAG.group_query_attention} with {FLAG.model_family} {FAMILY}: latent attention derives every "
                 f"head's key and value from one shared latent ({FLAG.kv_lora_rank}); drop it")
        if self.apply_layernorm_1p:
            fail(f"{FLAG.apply_layernorm_1p} with {FLAG.model_family} {FAMILY}: its latent norms store the scale "
                 f"itself; drop it")
        self._check_mtp(parallel)

    def _check_yarn(self) -> None:
        if self.rope_type != "yarn":
            return
        if not self.rotary_scaling_factor >= 1.0:
            fail(f"{FLAG.rotary_scaling_factor} must be >= 1 with {FLAG.rope_type} yarn, got "
                 f"{self.rotary_scaling_factor}: set it to the context extension factor")
        if not self.beta_fast > self.beta_slow > 0:
            fail(f"{FLAG.beta_fast} {self.beta_fast} must be > {FLAG.beta_slow} {self.beta_slow} > 0 with "
                 f"{FLAG.rope_type} yarn: pass e.g. {FLAG.beta_fast} 32 {FLAG.beta_slow} 1")
        positive(self.original_max_position_embeddings, "original_max_position_embeddings")

    def _check_mtp(self, parallel: ParallelConfig) -> None:
        if self.mtp_num_layers is None:
            return
        positive(self.mtp_num_layers, "mtp_num_layers")
        if parallel.cp > 1:
            fail(f"{FLAG.mtp_num_layers} with {FLAG.cp} {parallel.cp}: the MTP modules read tokens shifted along the "
                 f"whole sequence, which context parallelism splits; drop one of them")
        if not self.mtp_loss_scaling_factor >= 0:
            fail(f"{flag('mtp_loss_scaling_factor')} must be >= 0, got {self.mtp_loss_scaling_factor}")
