"""torch.compile, region by region (``--compile``, ``--compile-mode``): what torchtitan calls regional
compilation, applied through the model spec.

The spec names the regions (``ModelSpec.compile_regions``; the GPT family: every transformer layer,
and an MoE layer's attention, whose expert dispatch has data-dependent shapes). Each region's
``forward`` is replaced by ``torch.compile(forward)``; its module, its parameters and their names stay
as they are, so checkpoints, ZeRO's bucket layout and the pipeline see the same model. Everything
around a region runs eagerly: the pipeline, ZeRO-3's gather and release hooks (on the layer module,
around its compiled forward), the gradient hooks, the MoE all-to-all. Repeated layers share one
compiled graph (their parameters are graph inputs, not constants), so compile time does not grow with
depth, and the persistent inductor cache serves a restarted run.

Worked example, a 4-layer GPT-2 chunk at tp 1: 4 regions, 1 graph compiled on the first forward (plus
its backward), 0 graph breaks; the log line after the first step says so and how long it took, and
every later log line the graphs compiled since (a run that recompiles every step is a bug the log
makes visible).

Modules inside a region carry no hooks of their own: :func:`compile_model` marks each region
(``compiled_region = True``) and code that would hook a module below a region (``--overlap-param-gather``)
hooks the region instead.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from megazero.config import CompileConfig


def compile_unavailable(device_type: str) -> str | None:
    """Why this torch cannot compile on ``device_type`` ("cpu" or "cuda"), or None when it can."""
    try:
        import torch._dynamo
    except ImportError as e:                                 # pragma: no cover - torch builds without dynamo
        return f"this torch has no torch._dynamo ({e})"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python / torch build"
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        compiler = cpp_builder.get_cpp_compiler()
        if shutil.which(compiler) is None:
            return f"inductor compiles CPU kernels with a C++ compiler and {compiler!r} is not on PATH"
    return None


def compile_model(chunks, regions_of, cfg: CompileConfig) -> list[nn.Module]:
    """Compile every region ``regions_of(chunk)`` names, in place; returns them (nothing when
    ``cfg.compile`` is off). Call before the ZeRO engine is built (compilation itself happens lazily,
    at the first forward)."""
    if not cfg.compile:
        return []
    mode = None if cfg.compile_mode == "default" else cfg.compile_mode
    regions = [r for chunk in chunks for r in regions_of(chunk)]
    for region in regions:
        region.forward = torch.compile(region.forward, mode=mode)
        region.compiled_region = True
    return regions


def in_compiled_region(module: nn.Module, parents: dict[int, nn.Module]) -> bool:
    """Is ``module`` strictly inside a region :func:`compile_model` compiled? (``parents``: id(child) ->
    parent, as :func:`parent_map` gives.)"""
    node = parents.get(id(module))
    while node is not None:
        if getattr(node, "compiled_region", False):
            return True
        node = parents.get(id(node))
    return False


def parent_map(root: nn.Module) -> dict[int, nn.Module]:
    """id(child) -> parent for every module below ``root``."""
    return {id(child): parent for parent in root.modules() for child in parent.children()}


@dataclass
class CompileStats:
    """What dynamo did so far in this process: graphs compiled, graph breaks (by reason), seconds spent."""

    graphs: int = 0
    graph_breaks: int = 0
    seconds: float = 0.0
    break_reasons: list[str] = field(default_factory=list)

    @classmethod
    def now(cls) -> "CompileStats":
        from torch._dynamo.utils import compilation_time_metrics, counters

        breaks = counters["graph_break"]
        seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
        return cls(int(counters["stats"].get("unique_graphs", 0)), int(sum(breaks.values())), float(seconds),
                   [reason.splitlines()[0] for reason in breaks])


@dataclass
class CompileLog:
    """The log's view of compilation: a summary after the first step, then the graphs compiled since the
    previous log line (``recompiles``)."""

    regions: int
    start: CompileStats = field(default_factory=CompileStats.now)
    last: CompileStats | None = None
    wall: float = field(default_factory=time.perf_counter)

    def metrics(self) -> dict:
        """``compile_graphs``, ``compile_graph_breaks``, ``compile_seconds`` so far, ``recompiles`` since the
        last call (0 at the first)."""
        now = CompileStats.now()
        recompiles = now.graphs - self.last.graphs if self.last is not None else 0
        self.last = now
        return {"compile_graphs": now.graphs - self.start.graphs,
                "compile_graph_breaks": now.graph_breaks - self.start.graph_breaks,
                "compile_seconds": now.seconds - self.start.seconds, "recompiles": recompiles}

    def describe_first(self, metrics: dict) -> str:
        """The line after the first step: regions, graphs, breaks (with their first reasons), seconds."""
        now = CompileStats.now()
        reasons = now.break_reasons[:3]
        why = f" ({'; '.join(reasons)})" if reasons else ""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return (f" compile: {self.regions} regions, {metrics['compile_graphs']} graphs, "
                f"{metrics['compile_graph_breaks']} graph breaks{why}, {metrics['compile_seconds']:.1f} s compiling "
                f"(inductor cache {cache_dir()})")


def describe_recompiles(metrics: dict) -> str:
    """The log line's part: `` | recompiles 2`` when graphs were compiled since the last line."""
    n = metrics.get("recompiles", 0)
    return f" | recompiles {n}" if n else ""
