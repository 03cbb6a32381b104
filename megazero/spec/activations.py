"""Activation memory of a transformer, as the memory estimator asks a model spec for it.

A model spec's ``activation_bytes`` is an object with three methods (bytes, for one rank of a layout;
``e`` bytes per activation element, ``mask`` bytes per dropout-mask element: 1 for CUDA's fused dropout,
``e`` on a CPU, whose dropout keeps its noise tensor):

    held(job, placement, e, mask)          what one micro-batch leaves held in a chunk after its forward
    working(job, placements, e, mask, device)
                                           the transient of a backward: gradients passing between layers,
                                           what recompute brings back, offloaded layers copied back
                                           (net of what the last chunk's held bytes already counted)
    offloaded(job, placement, e, mask)     what one micro-batch leaves in host memory (--cpu-offloading)
    weight_grad_held(job, placement, e, mask)
                                           what it still holds between a zero-bubble schedule's I and W
                                           (megazero/parallel/pipeline/split_backward.py); optional, a
                                           model without it is taken to hold everything until W
    logits(job, e)                         the current micro-batch's logits (and their fp32 copy)
    head_backward(job, e)                  the head's backward transient (the logits' gradient)

:class:`TransformerActivations` is the default, for a model that brings none: Korthikanti et al. 2022's
per-layer count for a standard transformer layer (no knowledge of an implementation), in units of
s b h elements (s sequence, b micro-batch, h hidden, a heads, t tp)::

    without sequence parallelism   sbh (10 + 24/t) * e/2 + 5 a s^2 b / t * e/2
    with sequence parallelism      sbh (34 / t)    * e/2 + 5 a s^2 b / t * e/2

(the paper counts 2-byte activations; ``e/2`` scales it). The GPT family counts its own implementation
exactly (:mod:`megazero.models.gpt.memory`).
"""
from __future__ import annotations

from typing import Protocol

from megazero.spec.recompute import full_recompute_groups, selective_modules


class ActivationModel(Protocol):
    """What the estimator asks of a model's activations (see the module docstring; ``weight_grad_held``
    is optional and read with ``getattr``)."""

    def held(self, job, placement, e: int, mask: int) -> int: ...

    def working(self, job, placements, e: int, mask: int, device: str) -> int: ...

    def offloaded(self, job, placement, e: int, mask: int) -> int: ...

    def logits(self, job, e: int) -> int: ...

    def head_backward(self, job, e: int) -> int: ...


class TransformerActivations:
    """The default activation model (see the module docstring). Recompute: a fully recomputed group
    keeps its input; selective core_attn drops the s^2 term (Korthikanti et al.'s selective recompute);
    the other modules are not modelled. Offloaded layers keep nothing on the device."""

    def layer(self, job, e: int, mask: int) -> tuple[int, int]:
        """(bytes one layer keeps for backward, bytes of its input) per micro-batch."""
        cfg, par = job.model, job.parallel
        s, b, h, t, a = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp, cfg.num_attention_heads
        sp = par.sequence_parallel and t > 1
        core = 0 if "core_attn" in selective_modules(cfg) else 5 * a * s * s * b / t
        per = s * b * h * (34 / t if sp else 10 + 24 / t) + core
        rows = s * b // t if sp else s * b
        return int(per * e / 2), e * rows * h

    def _layers(self, job, placement, e: int, mask: int) -> tuple[int, int]:
        """(device bytes, host bytes) the chunk's layers keep per micro-batch."""
        layer, layer_input = self.layer(job, e, mask)
        cfg, n = job.model, len(placement.layer_ids)
        offloaded = min(cfg.cpu_offloading_num_layers or n, n) if cfg.cpu_offloading else 0
        device = host = position = 0
        for indices, recomputed in full_recompute_groups(cfg, n):
            if recomputed:
                device += layer_input
            elif position >= offloaded:
                device += layer
            else:
                host += layer
            position += len(indices)
        return device, host

    def offloaded(self, job, placement, e: int, mask: int) -> int:
        """Bytes one micro-batch leaves in host memory (``--cpu-offloading``)."""
        return self._layers(job, placement, e, mask)[1]

    def held(self, job, placement, e: int, mask: int) -> int:
        cfg, par = job.model, job.parallel
        s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
        out = self._layers(job, placement, e, mask)[0]
        rows = s * b // t if par.sequence_parallel and t > 1 else s * b
        if placement.pre_process:
            out += 2 * 8 * s * b                                       # token and position ids
        if placement.post_process:
            out += 2 * e * rows * h + 4 * s * b * cfg.padded_vocab_size(t) // t + 9 * s * b   # head, softmax
        else:
            out += e * rows * h                                        # the output, held for backward
        return out

    def working(self, job, placements, e: int, mask: int, device: str = "cpu") -> int:
        cfg, par = job.model, job.parallel
        s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
        rows = s * b // t if par.sequence_parallel and t > 1 else s * b
        layer, _ = self.layer(job, e, mask)
        out = e * (2 * rows * h + s * b * cfg.ffn_hidden_size // t)
        groups = [len(g) for pl in placements for g, on in full_recompute_groups(cfg, len(pl.layer_ids)) if on]
        out += max(groups, default=0) * layer
        return out + (2 * layer if cfg.cpu_offloading and device == "cuda" else 0)

    def head_backward(self, job, e: int) -> int:
        """The head's backward transient on top of the held activations: one more logits-sized tensor (the
        loss's backward turns the held softmax into the logits' gradient; the padded vocabulary's in-place
        -inf fill then allocates a second one)."""
        cfg, s, b, t = job.model, job.model.seq_length, job.train.micro_batch_size, job.parallel.tp
        return e * s * b * cfg.padded_vocab_size(t) // t

    def logits(self, job, e: int) -> int:
        cfg, s, b, t = job.model, job.model.seq_length, job.train.micro_batch_size, job.parallel.tp
        return (e + (4 if e < 4 else 0)) * s * b * cfg.padded_vocab_size(t) // t
