"""The op census: every kernel one training step runs besides the matrix products, counted on a CPU.

On a GPU the matrix products (GEMMs) run at the hardware's speed, and what a step loses goes to the glue
around them: each other kernel costs a launch (a few microseconds of host time) and a trip through memory
(its bytes read and written). A CPU runs the same aten ops in the same order, so counting them here tells,
without a GPU, how much glue a change adds or removes. :class:`OpCensus` is a dispatch mode that sees every
aten op of the step (forward, backward, gradient sync, optimizer) and sorts it:

    gemm        mm, addmm, bmm, baddbmm, _scaled_mm, _grouped_mm: their FLOPs (2 M N K each)
    attention   the fused scaled-dot-product attention kernels (forward and backward)
    free        no kernel: views (``func.is_view``), allocations, metadata (``_unsafe_view``, ``empty``, ...),
                queries with no tensor out (``promote_types``)
    sync        a value read back by the host (``.item()``: ``_local_scalar_dense``), a GPU stall
    collective  a torch.distributed collective (c10d)
    other       every other op: one kernel, its input and output bytes (an op returning nothing, as the fused
                AdamW, writes its in-place arguments); copies (``copy_``, ``_to_copy``, ``clone``) counted
                apart, and among them casts (a copy that changes the dtype)
    fused       a region :func:`megazero.kernels.one_kernel` marks (RMSNorm, SwiGLU, ...), which CUDA runs as one
                kernel (Liger's, torch's fused norm or one compiled kernel) and a CPU as several ops: counted as
                the one kernel, by its name, its tensor arguments read and results written

:func:`layer_census` runs the trainer's own step (``megazero.training.train_step``, one process) at two
depths and two micro-batch counts and splits the counts into what each layer adds per micro-batch, what each
layer adds once per step (its share of the gradient sync and optimizer), and the rest (embedding, head, loss,
the step's fixed work): the figures a test pins (tests/test_census.py) so that a change adding copies
fails on CPU, and ``tools/op_census.py`` prints.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megazero.config import FLAG, validate
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train_step

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
GEMM_NAMES = ("_scaled_mm", "_grouped_mm")
COPIES = {aten.copy_.default, aten._to_copy.default, aten.clone.default}
FREE = {aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
        aten.new_empty_strided.default, aten.lift_fresh.default, aten.empty_like.default, aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset, aten.resize_.default}


@dataclass
class Census:
    """What one step (or a share of it) ran: GEMMs and their FLOPs, attention kernels, the other kernels and
    their bytes read + written, copies and casts among them, host syncs; ``by_op``: the other kernels by name."""

    gemms: int = 0
    gemm_flops: int = 0
    attention: int = 0
    attention_flops: int = 0
    ops: int = 0
    bytes: int = 0
    copies: int = 0
    casts: int = 0
    cast_bytes: int = 0
    syncs: int = 0
    collectives: int = 0
    by_op: Counter = field(default_factory=Counter)

    def __sub__(self, other: Census) -> Census:
        return self + other / -1

    def __add__(self, other: Census) -> Census:
        return Census(*(_add(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)))

    def __truediv__(self, k: int) -> Census:
        """Each figure divided by ``k`` (a difference over ``k`` layers or micro-batches): whole numbers when the
        step repeats the same ops per layer, as a check that the split is exact."""
        return Census(*(_divide(getattr(self, f.name), k) for f in dataclasses.fields(self)))

    def line(self) -> str:
        return (f"{self.ops} ops ({self.copies} copies, {self.casts} casts), {self.bytes / 2**20:.2f} MiB moved, "
                f"{self.gemms} GEMMs ({self.gemm_flops / 1e9:.3g} GFLOP), {self.attention} attention "
                f"({self.attention_flops / 1e9:.3g} GFLOP), "
                f"{self.syncs} host syncs, {self.collectives} collectives")


def _add(a, b):
    """``a + b``, for counts and for per-op counters (negative entries kept: a difference of two steps)."""
    if isinstance(a, Counter):
        out = Counter(a)
        for name, n in b.items():
            out[name] += n
        return Counter({name: n for name, n in out.items() if n})
    return a + b


def _divide(value, k: float):
    if isinstance(value, Counter):
        return Counter({name: n / k for name, n in value.items() if n})
    return value / k


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class OpCensus(TorchDispatchMode):
    """Counts every aten op run inside it into :attr:`census` (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.census = Census()
        self._fused = 0                     # depth of one_kernel regions being run

    def count_one_kernel(self, name: str, fn, args):
        """Run ``fn(*args)``, a region :func:`megazero.kernels.one_kernel` marks as one fused kernel on CUDA, and
        count it as that kernel (``name`` in ``by_op``): its tensor arguments read, its tensor results written.
        A region holding a GEMM is that GEMM (its epilogue fused): only the GEMM is counted."""
        gemms = self.census.gemms
        self._fused += 1
        try:
            out = fn(*args)
        finally:
            self._fused -= 1
        if self.census.gemms == gemms and not self._fused:
            c = self.census
            c.ops += 1
            c.bytes += _nbytes(tree_leaves(args)) + _nbytes(tree_leaves(out))
            c.by_op[name] += 1
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.census
        if self._fused and not (func in GEMMS or func.__name__.split(".")[0] in GEMM_NAMES
                                or func.namespace == "c10d" or func is aten._local_scalar_dense.default):
            return out                      # inside a fused region: counted at its end, as one kernel
        if func in GEMMS or func.__name__.split(".")[0] in GEMM_NAMES:
            c.gemms += 1
            c.gemm_flops += _gemm_flops(func, args, out)
        elif "scaled_dot_product" in func.__name__ or "flash_attention" in func.__name__:
            c.attention += 1
            c.attention_flops += _attention_flops(func, args)
        elif func is aten._local_scalar_dense.default:
            c.syncs += 1
        elif func.namespace == "c10d":
            c.collectives += 1
        elif not (func.is_view or func in FREE or func.namespace == "prim"):
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)] or _written(func, args, kwargs)
            if not outputs:                     # a query (promote_types, ...): no kernel
                return out
            moved = _nbytes(inputs) + _nbytes(outputs)
            c.ops += 1
            c.bytes += moved
            c.by_op[func.__name__] += 1
            if func in COPIES:
                c.copies += 1
                dtypes = {t.dtype for t in inputs + outputs}
                if len(dtypes) > 1:
                    c.casts += 1
                    c.cast_bytes += moved
        return out


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op that returns nothing writes in place (the fused AdamW's parameters and moments, a
    ``_foreach_*_`` op's list): its schema's arguments marked as written."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _attention_flops(func, args) -> int:
    """FLOPs of a fused attention kernel: forward 4 b h s s_k d (its two products; half when causal), backward
    2.5 times that (FlashAttention's count: the scores made again, then four products)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    backward = func.__name__.split(".")[0].endswith("backward")
    q, k = tensors[1:3] if backward else tensors[:2]
    causal = any(a is True for a in args)
    forward = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] // (2 if causal else 1)
    return int(forward * 2.5) if backward else forward


def _gemm_flops(func, args, out) -> int:
    """2 M N K of a matrix product (batched: times the batch), from its output and its contracted size."""
    a = args[1] if func in (aten.addmm.default, aten.baddbmm.default) else args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    return 2 * out.numel() * a.shape[-1]


@dataclass
class LayerCensus:
    """A step's census split by where it comes from: ``per_layer_micro`` each transformer layer adds per
    micro-batch (forward and backward), ``per_layer_step`` each layer adds once per step (its parameters'
    gradient sync and optimizer update), ``rest`` everything else of a step of ``micro`` micro-batches at
    ``layers`` layers (embedding, head and loss per micro-batch; the step's fixed work), itself split into
    ``rest_micro`` (what the embedding, head and loss add per micro-batch) and ``rest_step`` (once a step)."""

    per_layer_micro: Census
    per_layer_step: Census
    rest: Census
    layers: int
    micro: int
    rest_micro: Census = field(default_factory=Census)
    rest_step: Census = field(default_factory=Census)

    def step(self, layers: int, micro: int) -> Census:
        """The census of a step of ``micro`` micro-batches at ``layers`` layers, from the parts."""
        return (_times(self.per_layer_micro, layers * micro) + _times(self.per_layer_step, layers)
                + _times(self.rest_micro, micro) + self.rest_step)


def step_census(job, micro_batches: int, steps: int = 2) -> Census:
    """The census of the last of ``steps`` trainer steps (the first ones allocate what later steps reuse) of
    ``job`` on this single process (``torch.distributed`` initialised, world 1), ``micro_batches`` micro-batches
    of random tokens."""

    job = validate(dataclasses.replace(job, train=dataclasses.replace(
        job.train, global_batch_size=job.train.micro_batch_size * micro_batches)), 1)
    topo = Topology()
    p = job.precision
    dtype = torch.bfloat16 if p.bf16 else torch.float16 if p.fp16 else torch.float32
    torch.manual_seed(job.train.seed)
    chunks = build_model_chunks(get_model_spec(job.model.model_family), job, topo, dtype=dtype)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    g = torch.Generator().manual_seed(0)
    b, s, v = job.train.micro_batch_size, job.model.seq_length, job.model.vocab_size
    batches = [{"tokens": torch.randint(0, v, (b, s), generator=g), "labels": torch.randint(0, v, (b, s), generator=g),
                "loss_mask": torch.ones(b, s)} for _ in range(micro_batches)]
    try:
        for _ in range(steps - 1):
            train_step(chunks, batches, topo, engine, job)
        with OpCensus() as counted:
            train_step(chunks, batches, topo, engine, job)
    finally:
        engine.close()
    return counted.census


def layer_census(job, layers: int = 2, micro: int = 1) -> LayerCensus:
    """:class:`LayerCensus` of ``job``'s model from four steps: at ``layers`` and ``2 layers`` layers, each with
    ``micro`` and ``2 micro`` micro-batches (one process)."""
    runs = {}
    for n in (layers, 2 * layers):
        for m in (micro, 2 * micro):
            shaped = dataclasses.replace(job, model=dataclasses.replace(job.model, num_layers=n))
            runs[n, m] = step_census(shaped, m)
    per_layer_micro = (runs[2 * layers, 2 * micro] - runs[2 * layers, micro] - runs[layers, 2 * micro]
                       + runs[layers, micro]) / (layers * micro)
    per_layer = (runs[2 * layers, micro] - runs[layers, micro]) / layers
    per_layer_step = per_layer - _times(per_layer_micro, micro)
    rest = runs[layers, micro] - _times(per_layer, layers)
    rest_micro = (runs[layers, 2 * micro] - runs[layers, micro]) / micro - _times(per_layer_micro, layers)
    rest_step = rest - _times(rest_micro, micro)
    return LayerCensus(per_layer_micro, per_layer_step, rest, layers, micro, rest_micro, rest_step)


def _times(c: Census, k: int) -> Census:
    return c / (1 / k)


# ----------------------------------------------------------------------------- a shape too large to run here

def shape_census(job, probe_seq: tuple[int, int] = (16, 32),
                 probe_vocab: tuple[int, int] = (512, 1024)) -> LayerCensus:
    """The census of one step of ``job`` at its own shape (its parts; ``.step(layers, micro)`` the whole), which
    may be far too large to run on this CPU (the GPU issue's GPT-2 350M and Llama 1.5B shapes), extrapolated
    from small runs at the job's own widths.

    Everything a step runs is linear in the tokens of a micro-batch at fixed widths (per-token activations; a
    per-parameter kernel or a weight-sized gradient fold adds a constant), and the embedding, head and loss are
    in addition linear in the vocabulary (the logits: tokens x vocab). So :func:`layer_census` runs at the job's
    hidden, ffn and head sizes, one sequence of each of ``probe_seq`` tokens and each of ``probe_vocab`` vocabulary
    sizes (four censuses), and each figure is read off the bilinear function through them at the job's tokens
    (micro-batch x sequence) and vocabulary, then composed for its layers and micro-batches
    (:meth:`LayerCensus.step`). Op counts come out exact where they do not depend on the shape; attention FLOPs
    (quadratic in the sequence) are taken per micro-batch from the formula at the job's sequence instead.

        probe (1 x 16 tokens, vocab 512) ... (1 x 32, 1024)  ->  Llama 1.5B: 4 x 2048 tokens, vocab 128256

    Takes the job's widths, so a probe of a wide model needs its memory: the 1.5B shape's layers at hidden 2048
    hold about 1.2 GB each with fp32 masters and Adam state (the probe runs 1 and 2 layers)."""
    cfg = job.model
    if getattr(cfg, "cross_entropy_loss_fusion", False):
        raise ValueError(f"the census of a whole shape assumes a step linear in its tokens and vocabulary; "
                         f"{FLAG.cross_entropy_loss_fusion}'s chunks of tokens are not: census it without the flag")
    tokens, vocab = job.train.micro_batch_size * cfg.seq_length, cfg.padded_vocab_size(1)
    micro = job.train.global_batch_size // job.train.micro_batch_size
    probes = {}
    for s in probe_seq:
        for v in probe_vocab:
            small = dataclasses.replace(job, model=dataclasses.replace(cfg, seq_length=s, vocab_size=v),
                                        train=dataclasses.replace(job.train, micro_batch_size=1, global_batch_size=1))
            probes[s, v] = layer_census(small, layers=1, micro=1)
    (s1, s2), (v1, v2) = probe_seq, probe_vocab
    t, u = (tokens - s1) / (s2 - s1), (vocab - v1) / (v2 - v1)

    def at_shape(part: str) -> Census:
        c11, c12 = getattr(probes[s1, v1], part), getattr(probes[s1, v2], part)
        c21, c22 = getattr(probes[s2, v1], part), getattr(probes[s2, v2], part)
        return c11 + _times(c21 - c11, t) + _times(c12 - c11, u) + _times(c22 - c21 - c12 + c11, t * u)

    per_layer_micro = at_shape("per_layer_micro")
    per_layer_micro.attention_flops = layer_attention_flops(cfg, job.train.micro_batch_size)
    rest_micro, rest_step = at_shape("rest_micro"), at_shape("rest_step")
    return LayerCensus(per_layer_micro, at_shape("per_layer_step"), _times(rest_micro, micro) + rest_step,
                       cfg.num_layers, micro, rest_micro, rest_step)


def layer_attention_flops(cfg, micro_batch: int) -> int:
    """A layer's causal attention FLOPs for one micro-batch, forward and backward (:func:`_attention_flops`'s
    count: 3.5 x 4 b h s^2 d / 2)."""
    return int(3.5 * 4 * micro_batch * cfg.num_attention_heads * cfg.seq_length ** 2 * cfg.head_dim / 2)


@dataclass(frozen=True)
class TimeModel:
    """A GPU step's time from its census: GEMM FLOPs at the GEMMs' rate, attention FLOPs at flash attention's,
    every other kernel's bytes at the memory's bandwidth plus a fixed cost per kernel (its launch and the host's
    Python around it). The defaults are one H200 in bf16, from the profile of the Llama 1.5B shape's eager step
    at fcda14e (200.3 ms): GEMMs ran at ~820 TFLOP/s, flash attention ~11 ms for its 3.85 TFLOP (~350 TFLOP/s),
    5 us a kernel; the bandwidth is calibrated so that fcda14e's census at that shape (2821 kernels, 309 GiB
    moved: ``python -m tools.op_census --shape llama-1.5B`` on that checkout) predicts the measured step: its
    kernels, many of them small, reach 3.34 TB/s of the HBM's 4.8. The GPT-2 350M step (71.2 ms measured at
    fcda14e) is bound by the host, not the GPU: the model predicts 64.1 ms for it.
    """

    gemm_flops_per_s: float = 800e12
    attention_flops_per_s: float = 350e12
    bytes_per_s: float = 3.34e12
    seconds_per_kernel: float = 5e-6

    def seconds(self, c: Census) -> dict[str, float]:
        """The step's predicted seconds by part (``gemm``, ``attention``, ``bytes``, ``kernels``) and ``total``."""
        parts = {"gemm": c.gemm_flops / self.gemm_flops_per_s,
                 "attention": c.attention_flops / self.attention_flops_per_s,
                 "bytes": c.bytes / self.bytes_per_s,
                 "kernels": c.ops * self.seconds_per_kernel}
        return {**parts, "total": sum(parts.values())}
