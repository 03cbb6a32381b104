"""The key/value cache of incremental decoding: each layer's keys and values of the tokens seen so far.

    cache = KVCache(max_length=cfg.max_position_embeddings)
    logits = model(prompt_ids, kv_cache=cache)          # prefill: positions 0 .. p-1
    logits = model(next_id[:, None], kv_cache=cache)    # one token at position p, attending to all p + 1

A layer stores its keys and values *before* grouped heads are expanded (``[b, kv_heads, max_length,
head_dim]``, preallocated on first use) and after RoPE, so a cached key is never rotated again. The
model advances :attr:`KVCache.length` once per forward, after every layer has appended.
"""
from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's keys and values: ``append`` writes new ones at the cache's length and returns all."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` [b, kv_heads, s_new, d], ``v`` [b, kv_heads, s_new, d_v] -> every cached key and value
        [b, kv_heads, length + s_new, d or d_v]."""
        start = self.owner.length
        end = start + k.shape[2]
        if end > self.owner.max_length:
            raise ValueError(f"the KV cache holds {self.owner.max_length} positions; {end} were asked for")
        if self.keys is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_length)
            self.keys, self.values = k.new_empty(*shape, k.shape[3]), v.new_empty(*shape, v.shape[3])
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every layer's :class:`LayerKVCache` (by global layer index) and the positions filled so far."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = 0
        self.layers: dict[int, LayerKVCache] = {}

    def layer(self, index: int) -> LayerKVCache:
        if index not in self.layers:
            self.layers[index] = LayerKVCache(self)
        return self.layers[index]

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def reset(self) -> None:
        """Forget every position (the buffers are kept and overwritten)."""
        self.length = 0
