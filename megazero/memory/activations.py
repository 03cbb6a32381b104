"""Activation memory of a transformer, as the memory estimator asks a model spec for it.

A model spec's ``activation_bytes`` is an object with three methods (bytes, for one rank of a layout;
``e`` bytes per activation element, ``mask`` bytes per dropout-mask element: 1 for CUDA's fused dropout,
``e`` on a CPU, whose dropout keeps its noise tensor):

    held(job, placement, e, mask)          what one micro-batch leaves held in a chunk after its forward
    working(job, placements, e, mask)      the transient of a backward: gradients passing between layers,
                                           a recomputed layer (net of what the last chunk's held bytes
                                           already counted)
    logits(job, e)                         the current micro-batch's logits (and their fp32 copy)

:class:`TransformerActivations` is the default, for a model that brings none: Korthikanti et al. 2022's
per-layer count for a standard transformer layer (no knowledge of an implementation), in units of
s b h elements (s sequence, b micro-batch, h hidden, a heads, t tp)::

    without sequence parallelism   sbh (10 + 24/t) * e/2 + 5 a s^2 b / t * e/2
    with sequence parallelism      sbh (34 / t)    * e/2 + 5 a s^2 b / t * e/2

(the paper counts 2-byte activations; ``e/2`` scales it). The GPT family counts its own implementation
exactly (:mod:`megazero.models.gpt_memory`).
"""
from __future__ import annotations


class TransformerActivations:
    """The default activation model (see the module docstring)."""

    def layer(self, job, e: int, mask: int) -> tuple[int, int]:
        """(bytes one layer keeps for backward, bytes of its input) per micro-batch."""
        cfg, par = job.model, job.parallel
        s, b, h, t, a = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp, cfg.num_attention_heads
        sp = par.sequence_parallel and t > 1
        per = s * b * h * (34 / t if sp else 10 + 24 / t) + 5 * a * s * s * b / t
        rows = s * b // t if sp else s * b
        return int(per * e / 2), e * rows * h

    def held(self, job, placement, e: int, mask: int) -> int:
        cfg, par = job.model, job.parallel
        s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
        layer, layer_input = self.layer(job, e, mask)
        out = len(placement.layer_ids) * (layer_input if cfg.recompute_activations else layer)
        rows = s * b // t if par.sequence_parallel and t > 1 else s * b
        if placement.pre_process:
            out += 2 * 8 * s * b                                       # token and position ids
        if placement.post_process:
            out += 2 * e * rows * h + 4 * s * b * cfg.padded_vocab_size(t) // t + 9 * s * b   # head, softmax
        else:
            out += e * rows * h                                        # the output, held for backward
        return out

    def working(self, job, placements, e: int, mask: int) -> int:
        cfg, par = job.model, job.parallel
        s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
        rows = s * b // t if par.sequence_parallel and t > 1 else s * b
        layer, _ = self.layer(job, e, mask)
        out = e * (2 * rows * h + s * b * cfg.ffn_hidden_size // t)
        return out + (layer if cfg.recompute_activations else 0)

    def logits(self, job, e: int) -> int:
        cfg, s, b, t = job.model, job.model.seq_length, job.train.micro_batch_size, job.parallel.tp
        return (e + (4 if e < 4 else 0)) * s * b * cfg.padded_vocab_size(t) // t
