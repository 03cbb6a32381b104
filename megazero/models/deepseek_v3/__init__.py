"""The DeepSeek-V3 family (``--model-family deepseek_v3``): GPT's decoder with multi-head latent attention,
by Megatron-LM's flags. Importing the package registers its spec.

==================  =====================================================================================
module              what
==================  =====================================================================================
``config``          :class:`DeepSeekV3Config`: the family's flags, defaults and rules
``attention``       multi-head latent attention, its heads split over tensor-parallel ranks
``model``           :class:`DeepSeekV3`: the decoder, or the chunk one pipeline stage owns
``spec``            its :class:`~megazero.spec.ModelSpec` (chunks, FLOPs, hooks, HF adapter)
``hf``              HuggingFace's ``DeepseekV3ForCausalLM`` format (config and key map)
``memory``          its activation model for the memory estimator (latent attention, MTP modules)
==================  =====================================================================================
"""
from megazero.models.deepseek_v3.config import DeepSeekV3Config
from megazero.models.deepseek_v3.model import DeepSeekV3
from megazero.models.deepseek_v3.spec import DEEPSEEK_V3_SPEC

__all__ = ["DEEPSEEK_V3_SPEC", "DeepSeekV3", "DeepSeekV3Config"]
