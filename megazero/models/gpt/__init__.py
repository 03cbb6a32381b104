"""The GPT family (``--model-family gpt``, the default): GPT-2, and by Megatron's flags the Llama family
and Mixture of Experts, as Megatron's GPTModel. Importing the package registers its spec.

==================  =====================================================================================
module              what
==================  =====================================================================================
``config``          :class:`GPTConfig`: the family's flags and rules
``model``           :class:`GPT`: the decoder, or the chunk one pipeline stage owns
``transformer``     its layers: norms, attention (fused QKV or grouped-query), MLP (GELU or SwiGLU)
``rotary``          RoPE's cos/sin table
``moe``             Mixture of Experts: router, losses, capacity, experts, the expert-parallel all-to-all
``memory``          its activation memory, counted for the estimator
``spec``            its :class:`~megazero.spec.ModelSpec` (chunks, FLOPs, hooks, HF adapter)
``hf_gpt2``,        HuggingFace's GPT-2 and Llama / Qwen2 / Mixtral formats (key maps)
``hf_llama``
==================  =====================================================================================
"""
from megazero.models.gpt.config import GPTConfig
from megazero.models.gpt.model import GPT, activation_shape, masked_mean
from megazero.models.gpt.spec import GPT_SPEC, build_model_chunks

__all__ = ["GPT", "GPTConfig", "GPT_SPEC", "activation_shape", "build_model_chunks", "masked_mean"]
