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

from torch import nn


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
                         f"zero3_plan() must put every trainable parameter in a unit (--zero-stage 3)")
    return plan
