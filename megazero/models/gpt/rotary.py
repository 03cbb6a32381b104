"""Rotary position embeddings (RoPE, Su et al. 2021) as Llama, Megatron-core and HF apply them.

Each query and key head's first ``rotary_dim`` features are rotated by an angle proportional to the
token's position; the remaining ``head_dim - rotary_dim`` features (``--rotary-percent`` < 1) pass
through. Pairs are formed the "rotate half" way (feature ``j`` with feature ``j + rotary_dim/2``), as
in HF's ``LlamaAttention`` and Megatron's default (not the interleaved ``2j, 2j+1`` pairing): HF
``q_proj``/``k_proj`` weights therefore load without any permutation.

    inv_freq[i] = base ** (-2i / rotary_dim)                 i < rotary_dim / 2  (Llama 3.1 scaling optional)
    angle[p, j] = p * inv_freq[j mod rotary_dim/2]           p: the token's position
    rope(x)     = x * cos(angle) + rotate_half(x) * sin(angle),   rotate_half([x1, x2]) = [-x2, x1]

The rotation itself is :func:`megazero.kernels.rope` (one fused kernel each way on CUDA); this module holds
the table and where positions come from.

Where positions come from, per layout:

- **tensor / sequence parallel**: the attention runs on the whole sequence on every tp rank (under
  sequence parallelism the column-parallel QKV projection all-gathers the sequence chunks first),
  so positions are ``0 .. s-1`` on every rank; only learned position embeddings, added to a
  sequence chunk before the first layer, need the chunk's offset ``tp_rank * s / tp``.
- **pipeline stages**: each chunk computes the same table from the config; nothing crosses the stage
  boundary but the hidden states.
- **generation with a KV cache**: new tokens start at the cache's length (``offset``).
- **context parallel**: a cp rank holds two chunks of the sequence (:mod:`megazero.parallel.context`);
  its positions are :func:`megazero.parallel.context_layout.rank_positions`, passed as ``positions``.

The cos/sin table is not a parameter and not in the state dict: it is computed on first use, per
device and dtype, for the training sequence length (longer when generation asks for more positions,
up to ``max_position_embeddings``; every position's values are the same whatever the table's length).
A model built on the meta device (the ZeRO engine materialises parameters only) therefore needs
nothing materialised here.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megazero.config import FLAG
from megazero.kernels import rope
from megazero.models.gpt.config import GPTConfig

# Llama 3.1's scaling constants (Megatron's ``apply_rope_scaling`` fixes the same values).
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_MAX_POSITIONS = 1.0, 4.0, 8192


def inverse_frequencies(cfg: GPTConfig) -> torch.Tensor:
    """float32 [rotary_dim / 2]: the rotation speed of each feature pair (Llama 3.1-scaled if asked)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return llama3_scaled(inv_freq, cfg.rope_scaling_factor) if cfg.use_rope_scaling else inv_freq


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths beyond the original context are slowed by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    low_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_MAX_POSITIONS / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of a model chunk, shared by its layers (holds no parameters).

    ``frequencies`` gives the rotation speeds from the config (default: :func:`inverse_frequencies`) and
    ``magnitude`` multiplies cos and sin (a family's RoPE scaling, e.g. YaRN's, passes both)."""

    def __init__(self, cfg: GPTConfig, frequencies: Callable[[GPTConfig], torch.Tensor] = inverse_frequencies,
                 magnitude: float = 1.0):
        super().__init__()
        self.cfg, self.frequencies, self.magnitude = cfg, frequencies, magnitude
        self.rotary_dim = cfg.rotary_dim
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, device: torch.device, dtype: torch.dtype, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [>= length, 1, 1, rotary_dim] in ``dtype``, computed in float32."""
        key = (device, dtype)
        if key not in self._tables or self._tables[key][0].shape[0] < length:
            rows = min(max(length, self.cfg.seq_length), self.cfg.max_position_embeddings)
            inv_freq = self.frequencies(self.cfg).to(device)
            positions = torch.arange(rows, device=device, dtype=torch.int64).float()
            angles = torch.outer(positions, inv_freq)
            angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
            cos, sin = angles.cos(), angles.sin()
            if self.magnitude != 1.0:
                cos, sin = cos * self.magnitude, sin * self.magnitude
            self._tables[key] = (cos.to(dtype), sin.to(dtype))
        return self._tables[key]

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` [s, b, heads, head_dim] whose token ``i`` sits at position ``offset + i``, or at
        ``positions[i]`` when given (a context-parallel rank's two chunks)."""
        s = x.shape[0]
        end = int(positions.max()) + 1 if positions is not None else offset + s
        if end > self.cfg.max_position_embeddings:
            raise ValueError(f"positions up to {end} exceed {FLAG.max_position_embeddings} "
                             f"{self.cfg.max_position_embeddings}")
        cos, sin = self.table(x.device, x.dtype, end)
        if positions is not None:
            cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        else:
            cos, sin = cos[offset:offset + s], sin[offset:offset + s]
        return rope(x, cos, sin)
