"""The parameter attribute contract: what a parameter says about itself, who sets it, who reads it.

Every parameter of a model chunk carries these attributes. The parallel layers set the first three
(:func:`set_tp_attributes`, :mod:`megazero.parallel.tensor`); the model sets the rest where they
apply (:mod:`megazero.models.gpt`); a parameter without them is replicated and plain (the defaults).

=========================  ======================================================  ==========================
attribute (default)        meaning                                                 read by
=========================  ======================================================  ==========================
``tensor_parallel``        this tp rank holds a distinct shard of the full         :func:`counts_once`,
(False)                    tensor (the shards together make it)                    checkpoints, tools
``partition_dim`` (-1)     the dim of the full tensor split into contiguous        checkpoints, conversion,
                           chunks in tp-rank order; -1 when replicated             gather_full
``sequence_parallel_grad`` replicated over tp, but under sequence parallelism      the gradient finalisation
(False)                    each tp rank's gradient is partial (a sum over its      (ZeRO grad sync)
                           sequence chunk): summed over tp after backward
``shared_embedding``       the tied word embedding: used by the first pipeline     bucket layout (a bucket of
(False)                    stage (input) and the last (output); with pp > 1 each   its own), the gradient
                           holds a copy whose gradients are summed over the        finalisation
                           embedding group every step
``tied_copy`` (False)      this tensor duplicates one that another pipeline stage  :func:`counts_once`
                           owns (the last stage's copy of a tied embedding): not
                           counted in norms or parameter counts, not saved
``vocab_padded`` (False)   dim 0 is the vocabulary padded to a multiple of         checkpoints, conversion
                           ``make_vocab_size_divisible_by * tp``; rows at or
                           beyond the real vocabulary size are zero and are not
                           stored in checkpoints
``embedding_or_output``    the input word embedding or the output layer's weight   the ZeRO optimizer (its own
(False)                    (Megatron-LM's ``is_embedding_or_output_parameter``;   learning rate under
                           a tied weight is both, one parameter)                   ``--decoupled-lr``)
``layer_matrix`` (False)   a 2-D weight of a transformer layer (a linear layer's,  the ZeRO optimizer (Muon
                           the router's, an expert's): what ``--optimizer muon``   steps it, AdamW the rest:
                           orthogonalises                                          :mod:`...zero.muon`)
``expert_parallel``        an expert of an MoE layer (:mod:`megazero.models.gpt.moe`):  the ZeRO engine (expert
(False)                    ep ranks hold different experts; reduced and sharded    buckets), norms
                           over the expert-data-parallel group
=========================  ======================================================  ==========================

Worked example, GPT at tp=2 pp=2 with tied embeddings, rank (tp 1, pp 1)::

    layers.3.mlp.dense_h_to_4h.weight   tensor_parallel, partition_dim 0         counts_once: yes
    layers.3.mlp.dense_4h_to_h.bias     replicated                               counts_once: no (tp rank 0 counts it)
    embedding.word_embeddings.weight    tensor_parallel, partition_dim 0, shared_embedding, tied_copy,
                                        vocab_padded                             counts_once: no (stage 0 counts it)
"""
from __future__ import annotations

import torch
from torch import nn

ATTRIBUTES = {"tensor_parallel": False, "partition_dim": -1, "sequence_parallel_grad": False,
              "shared_embedding": False, "tied_copy": False, "vocab_padded": False,
              "embedding_or_output": False, "expert_parallel": False,
              "layer_matrix": False}


def set_tp_attributes(p: nn.Parameter, tensor_parallel: bool, partition_dim: int = -1,
                      sequence_parallel_grad: bool = False) -> nn.Parameter:
    """Stamp the tensor-parallel attributes on ``p``, and the model's ones at their defaults when unset."""
    p.tensor_parallel = tensor_parallel
    p.partition_dim = partition_dim if tensor_parallel else -1
    p.sequence_parallel_grad = sequence_parallel_grad
    for name, default in ATTRIBUTES.items():
        if not hasattr(p, name):
            setattr(p, name, default)
    return p


def attribute(p: torch.Tensor, name: str):
    """``p``'s contract attribute ``name``, or its default when the parameter does not carry it."""
    return getattr(p, name, ATTRIBUTES[name])


def split_dim(p: torch.Tensor) -> int:
    """The dim tensor parallelism splits (-1: replicated)."""
    return attribute(p, "partition_dim") if attribute(p, "tensor_parallel") else -1


def whole_shape(p: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The shape of the whole tensor of which ``p`` is this tp rank's shard (its own shape when replicated)."""
    shape, dim = list(p.shape), split_dim(p)
    if dim >= 0:
        shape[dim] *= tp_size
    return tuple(shape)


def counts_once(p: torch.Tensor, tp_rank: int) -> bool:
    """True on exactly one rank of each model replica for every element of the model: what a norm,
    a parameter count or a checkpoint writer sums or writes.

    A tensor-parallel shard counts on every tp rank (the shards are distinct), a replicated
    parameter on tp rank 0 only, a ``tied_copy`` nowhere (its original counts). Data-parallel
    replicas are the caller's business (sum over one replica, or divide by dp).
    """
    if attribute(p, "tied_copy"):
        return False
    return bool(attribute(p, "tensor_parallel")) or tp_rank == 0
