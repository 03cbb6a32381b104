"""Activation recompute: which layers and modules keep less for the backward, and how they get it back.

Megatron-core's choices (``--recompute-*``, :class:`megazero.config.ModelConfig`), for one model chunk
of L layers (chunk-local indices 0..L-1; every pipeline chunk decides on its own layers) and
N = ``--recompute-num-layers``:

``--recompute-granularity full``: a recomputed layer keeps only its input; its backward runs its
forward again first (one more forward of that layer per step).

* ``--recompute-method uniform``: the layers go in groups of N consecutive layers, each group
  keeping only the group's input; the backward of a group re-runs the whole group, so N layers'
  activations exist at once then. N = 1 is ``--recompute-activations``.
* ``--recompute-method block``: the first N layers keep only their inputs, the others everything.

Worked example, L = 5, N = 2 (the groups :func:`full_recompute_groups` returns)::

    uniform   [0, 1] recomputed, [2, 3] recomputed, [4] recomputed    (holds 3 inputs)
    block     [0] recomputed, [1] recomputed, [2] kept, [3] kept, [4] kept

``--recompute-granularity selective``, ``--recompute-modules`` (per layer, every layer):

==========  ===========================================================================  ==============
module      what it stops keeping (recomputed in the backward)                           extra compute
==========  ===========================================================================  ==============
core_attn   everything inside attention between the projections: RoPE's rotated          attention's
            queries and keys, the softmax statistics (and with attention dropout the      core forward
            s x s probabilities and mask); the projections' outputs stay
mlp         the dense MLP's inner activations (fc1's output, the GELU or SwiGLU            the MLP forward
            products; under sequence parallelism also fc1's gathered input): keeps
            only its input
moe_act     each expert's activation output (GELU, or silu(gate) * up), freed once fc2     the activation
            has saved it and recomputed just before fc2's backward (SwiGLU's gate and     (twice for
            up stay: the activation is checkpointed on them)                              SwiGLU)
layernorm   the two norms' outputs, freed once the next linear layer has saved them       the norm
            (the norms' statistics stay: a few bytes per token)
            (without sequence parallelism; under it the next layer keeps its gathered
            input instead, and nothing is saved) and recomputed before that layer's
            backward
==========  ===========================================================================  ==============

The memory estimator counts each choice (:mod:`megazero.models.gpt.memory`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megazero.parallel.rng import TensorParallelRNG


def full_recompute_groups(cfg, num_layers: int) -> list[tuple[list[int], bool]]:
    """The chunk's layers 0..num_layers-1 in running order, grouped: ``[(indices, recomputed), ...]``
    (see the module docstring's example). Without full recompute, one kept group per layer."""
    n = cfg.recompute_num_layers
    if cfg.recompute_granularity != "full":
        return [([i], False) for i in range(num_layers)]
    if cfg.recompute_method == "uniform":
        return [(list(range(i, min(i + n, num_layers))), True) for i in range(0, num_layers, n)]
    return [([i], i < n) for i in range(num_layers)]


def selective_modules(cfg) -> frozenset[str]:
    """The modules recomputed inside every layer (empty unless ``--recompute-granularity selective``)."""
    return frozenset(cfg.recompute_modules or ()) if cfg.recompute_granularity == "selective" else frozenset()


def checkpointed(fn: Callable, rng: TensorParallelRNG | None, *args):
    """``fn(*args)`` keeping only ``args`` for the backward, which runs ``fn`` again with the same dropout
    masks (torch's global generator by checkpoint's ``preserve_rng_state``, the tensor-parallel streams
    of ``rng`` by replaying their states). The forward's streams end where an uncheckpointed run's would.
    ``rng=None``: ``fn`` draws no random numbers, and no generator state is kept (about 5 KB each on a CPU)."""
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    saved = rng.get_states()
    calls = []

    def run(*inputs):
        if not calls:                      # the real forward
            calls.append(1)
            return fn(*inputs)
        after = rng.get_states()           # the recomputation in backward: replay the streams
        rng.set_states(saved)
        try:
            return fn(*inputs)
        finally:
            rng.set_states(after)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def free_until_backward(output: torch.Tensor, consumer_output: torch.Tensor,
                        recompute: Callable[[], torch.Tensor]) -> None:
    """Free ``output``'s storage now that the module consuming it has saved it, and refill it with
    ``recompute()`` (run without a graph) when ``consumer_output``'s gradient arrives, which is before
    the consumer's backward reads it (what Megatron-core calls a checkpoint without output). For a
    tensor whose only keeper is the next layer, e.g. a norm's output feeding a linear layer, which
    keeps its input for the weight gradient::

        y = norm(x)
        out = attention(y)                                  # the projections keep y
        free_until_backward(y, out, lambda: norm(x))        # y's bytes are gone until out's backward

    ``output`` must be a fresh contiguous tensor (an op's result, not a view) and ``recompute`` must
    give it bitwise again (no randomness). Nothing happens when ``consumer_output`` has no gradient."""
    if not consumer_output.requires_grad:
        return
    storage = output.untyped_storage()
    size = storage.size()
    storage.resize_(0)

    def refill(grad: torch.Tensor) -> None:
        with torch.no_grad():
            value = recompute()
        storage.resize_(size)
        storage.copy_(value.untyped_storage())

    consumer_output.register_hook(refill)
