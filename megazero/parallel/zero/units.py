"""ZeRO-3 gather units: what a model declares so that stage 3 knows when each parameter is used.

A *unit* is a set of parameters gathered and released together (a transformer layer, the
embedding, the head). A *use* is a module whose forward needs some units whole: its forward
pre-hook gathers them (and prefetches the next uses' units), its forward hook releases them.
Uses are listed in forward order; backward walks them in reverse.

A model chunk declares its plan with a method ``zero3_plan() -> Zero3Plan`` (see
:meth:`megazero.models.gpt.GPT.zero3_plan`); a module without one is a single unit used once
(:func:`whole_module_plan`). Every trainable parameter must belong to exactly one unit.

Worked example, a GPT chunk with both ends and tied embeddings (pp = 1)::

    units  word_embeddings: [embedding.word_embeddings.weight]
           embedding:       [embedding.position_embeddings.weight]
           layers.0 ... layers.L-1, head: [final_norm.*]
    uses   embedding (pre/post: the embedding module)  -> units embedding, word_embeddings
           layers.i  (pre/post: layer i)               -> units layers.i
           head      (pre: final_norm, post: the chunk) -> units head, word_embeddings
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megazero.config import FLAG


@dataclass
class UnitUse:
    """A module whose forward needs ``units`` gathered: ``pre_module``'s forward pre-hook gathers,
    ``post_module``'s forward hook releases (they differ when the units stay in use after the
    module that first needs them, e.g. the output weight after the final norm)."""

    name: str
    pre_module: nn.Module
    post_module: nn.Module
    units: list[str]


@dataclass
class Zero3Plan:
    """``units``: unit name -> [(parameter name in the chunk, parameter)]; ``uses`` in forward order."""

    units: dict[str, list[tuple[str, nn.Parameter]]] = field(default_factory=dict)
    uses: list[UnitUse] = field(default_factory=list)


def in_backward() -> bool:
    """True while autograd runs a backward (a use's forward then is activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


def trainable(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that require gradients, named with ``prefix``."""
    return [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]


def whole_module_plan(module: nn.Module) -> Zero3Plan:
    """The plan of a module that declares none: all of it is one unit, used by its forward."""
    return Zero3Plan({"module": trainable(module)}, [UnitUse("module", module, module, ["module"])])


def plan_of(chunk: nn.Module) -> Zero3Plan:
    """The chunk's declared plan (``zero3_plan()``), or :func:`whole_module_plan`; checks coverage."""
    declared = getattr(chunk, "zero3_plan", None)
    plan = declared() if callable(declared) else whole_module_plan(chunk)
    covered = {id(p) for members in plan.units.values() for _, p in members}
    missing = [n for n, p in chunk.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise ValueError(f"ZeRO-3 does not know when parameters {missing} are used: the model's "
                         f"zero3_plan() must put every trainable parameter in a unit ({FLAG.zero_stage} 3)")
    return plan


class ParamSubset:
    """A model chunk seen through a filter: only the parameters for which ``keep(p)`` holds, and only
    the ZeRO-3 units made of them. Everything else (``initial_value``, ``get_submodule``) is the chunk's,
    so a grad sync builds its buckets over the subset as over a whole chunk: what one bucket group of
    the ZeRO engine holds (dense parameters, or experts)."""

    def __init__(self, chunk, keep):
        self.chunk, self.keep = chunk, keep

    def named_parameters(self):
        return [(n, p) for n, p in self.chunk.named_parameters() if self.keep(p)]

    def modules(self):
        return self.chunk.modules()

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def initial_value(self, name: str) -> torch.Tensor:
        return self.chunk.initial_value(name)

    def get_submodule(self, name: str):
        return self.chunk.get_submodule(name)

    def zero3_plan(self):
        plan = plan_of(self.chunk)
        for name, members in list(plan.units.items()):
            kept = [m for m in members if self.keep(m[1])]
            if kept and len(kept) != len(members):
                raise ValueError(f"ZeRO-3 unit {name!r} mixes expert and dense parameters: the model's "
                                 f"zero3_plan() must put experts in units of their own")
            if not kept:
                del plan.units[name]
        for use in plan.uses:
            use.units = [u for u in use.units if u in plan.units]
        plan.uses = [use for use in plan.uses if use.units]
        return plan
