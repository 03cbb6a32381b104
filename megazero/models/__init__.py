"""Models built from megazero's parallel layers."""
from megazero.models.gpt import GPT, masked_mean

__all__ = ["GPT", "masked_mean"]
