"""Which kernels the layers and the optimizer run, and the line the trainer prints about it at start.

    normalisation   apex's FusedLayerNorm / FusedRMSNorm on CUDA when the real apex (NVIDIA's, with its
                    CUDA extensions) is importable; torch's everywhere else. Under ``--compile`` torch's:
                    inductor fuses a norm into its layer's graph, which apex's extension would break.
    AdamW           torch's fused kernel (``torch._fused_adamw_``) over the flat fp32 shards: one kernel for
                    the whole update, as apex's FusedAdam is (so apex's is not used).

PyPI's package named ``apex`` is unrelated to NVIDIA's: only an ``apex`` that provides
``apex.normalization.FusedLayerNorm`` counts.
"""
from __future__ import annotations

import torch
from torch import nn


def apex_norms():
    """(FusedLayerNorm, FusedRMSNorm) of NVIDIA's apex, or None when it is not importable."""
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except (ImportError, AttributeError, OSError):
        return None
    return FusedLayerNorm, FusedRMSNorm


def use_apex_norms(device: torch.device) -> bool:
    """Build the norms with apex's fused kernels? On CUDA, with the real apex only."""
    return torch.device(device).type == "cuda" and apex_norms() is not None


def apex_norm(kind: str, hidden: int, eps: float, dtype, device) -> nn.Module:
    """apex's fused LayerNorm or RMSNorm over ``hidden`` features, in ``dtype`` on ``device``."""
    fused_layer_norm, fused_rms_norm = apex_norms()
    norm = fused_layer_norm(hidden, eps=eps) if kind == "LayerNorm" else fused_rms_norm(hidden, eps=eps)
    return norm.to(dtype=dtype, device=device)


def describe_kernels(device: torch.device, compiling: bool, zero_centred_norms: bool = False) -> str:
    """The start-of-run line naming the kernels in use and why (``zero_centred_norms``: the model's norms
    scale by 1 + weight, which apex's modules do not, so they are torch's)."""
    if use_apex_norms(device) and zero_centred_norms:
        norms = "torch (zero-centred norm weights; apex's scale by the weight itself)"
    elif use_apex_norms(device) and not compiling:
        norms = "apex fused (FusedLayerNorm / FusedRMSNorm)"
    elif apex_norms() is not None and compiling:
        norms = "torch (compiled into each layer; apex's would break the graph)"
    else:
        norms = "torch" + ("" if torch.device(device).type == "cuda" else " (CPU)") + \
                ("" if apex_norms() is not None else ", apex not installed")
    return f" kernels: normalisation {norms} | AdamW torch fused (one kernel over the flat shards)"
