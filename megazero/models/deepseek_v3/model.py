"""The DeepSeek-V3 decoder: GPT's decoder (:class:`megazero.models.gpt.GPT`: embedding, pre-norm layers,
final norm, untied head, pipeline chunks, ZeRO-3 units, layout-independent init) whose layers attend with
multi-head latent attention (:mod:`.attention`).

Parameter names are GPT's (``embedding.word_embeddings.weight``, ``layers.<i>.input_layernorm.weight``,
``layers.<i>.mlp...``, ``final_norm.weight``, ``output_layer.weight``) with MLA's projections under
``layers.<i>.attention.`` (:class:`~megazero.models.deepseek_v3.attention.MultiLatentAttention` lists them
and their tensor-parallel splits).
"""
from __future__ import annotations

from torch import nn

from megazero.models.deepseek_v3.attention import MultiLatentAttention
from megazero.models.gpt import GPT
from megazero.models.gpt.transformer import LayerContext, TransformerLayer


class DeepSeekV3Layer(TransformerLayer):
    """One pre-norm block (GPT's: norm, attention, norm, MLP or MoE layer) with latent attention."""

    def build_attention(self, ctx: LayerContext) -> nn.Module:
        return MultiLatentAttention(ctx)


class DeepSeekV3(GPT):
    """The DeepSeek-V3 model, or the chunk of it one pipeline stage owns (GPT's constructor and forward;
    see :class:`megazero.models.gpt.GPT`)."""

    def build_layer(self, ctx: LayerContext, layer_id: int) -> nn.Module:
        return DeepSeekV3Layer(ctx, layer_id)
