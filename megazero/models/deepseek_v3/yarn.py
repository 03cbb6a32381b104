"""YaRN RoPE scaling (Peng et al. 2023) of the rotated query/key part, as DeepSeek-V2/V3's checkpoints and HF's
``rope_type`` yarn compute it (``--rope-type yarn``).

With D_r = ``--qk-pos-emb-head-dim``, base = ``--rotary-base``, F = ``--rotary-scaling-factor``, L0 =
``--original-max-position-embeddings``::

    inv_freq[i]  = base ** (-2i / D_r)                               plain RoPE, i < D_r / 2
    dim(r)       = D_r log(L0 / (2 pi r)) / (2 log base)               the pair that turns r times over L0
    low, high    = max(floor(dim(beta_fast)), 0), min(ceil(dim(beta_slow)), D_r - 1)
    keep[i]      = 1 - clamp((i - low) / (high - low), 0, 1)          fast pairs kept, slow ones interpolated
    yarn[i]      = inv_freq[i] / F * (1 - keep[i]) + inv_freq[i] * keep[i]
    mscale(F, m) = 0.1 m ln F + 1  (1 when F <= 1)
    cos, sin     scaled by mscale(F, --mscale) / mscale(F, --mscale-all-dim)   (mscale(F, 1) when either is 0)
    softmax      scale 1 / sqrt(D_nope + D_r) multiplied by mscale(F, --mscale-all-dim) ** 2 (when it is not 0)

Only the table's values change: positions (context-parallel chunks, the generation cache's offset) are
RoPE's, so every layout and the latent KV cache rotate as with plain RoPE.
"""
from __future__ import annotations

import math

import torch

from megazero.models.deepseek_v3.config import DeepSeekV3Config
from megazero.models.gpt.rotary import inverse_frequencies


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended ``factor`` times."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, cfg: DeepSeekV3Config) -> float:
    """The (fractional) pair index whose wavelength turns ``rotations`` times over the original context."""
    dim, base = cfg.rotary_dim, cfg.rotary_base
    return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inverse_frequencies(cfg: DeepSeekV3Config) -> torch.Tensor:
    """float32 [D_r / 2]: plain RoPE's rotation speeds, those slower than ``--beta-slow`` turns over the original
    context divided by the factor, those faster than ``--beta-fast`` kept, a linear ramp between."""
    inv_freq = inverse_frequencies(cfg)
    low = max(math.floor(_correction_dim(cfg.beta_fast, cfg)), 0)
    high = min(math.ceil(_correction_dim(cfg.beta_slow, cfg)), cfg.rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(cfg.rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / cfg.rotary_scaling_factor * (1 - keep) + inv_freq * keep


def yarn_attention_factor(cfg: DeepSeekV3Config) -> float:
    """The factor on the cos/sin table (HF's ``attention_factor``)."""
    factor = cfg.rotary_scaling_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale_factor(cfg: DeepSeekV3Config) -> float:
    """What multiplies MLA's softmax scale 1 / sqrt(D_nope + D_r): 1 for plain RoPE."""
    if cfg.rope_type != "yarn" or not cfg.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2
