"""The memory planner: the cheapest recompute / offload plan whose estimate fits a per-rank budget
(``tools/estimate_memory.py --fit-gib X``, ``pretrain_gpt.py --memory-budget-gib X``).

Plans are tried cheapest first, and the first whose estimated peak on every pipeline stage
(:func:`megazero.memory.estimate.estimate_memory`) is at most the budget is chosen:

1. keep everything;
2. selective recompute, by the extra compute of the modules (:func:`selective_plans`): the norms and
   the experts' activation first (elementwise: almost free), then the attention core, then the MLPs;
3. full recompute of more and more layers of each chunk (``--recompute-method block``, N = 1, 2, ...);
4. activation offload of more and more layers (CUDA only: on a CPU the host is the device), with the
   cheapest selective set;
5. full recompute of every layer (``--recompute-activations``).

Worked example: a budget that the run keeping everything misses by one layer's activations is met by
``block 1`` unless a selective set saves as much first. When nothing fits, :class:`NoPlanFits` names
the layout changes that would (a higher ZeRO stage, more tp, more pp), each checked with the same
estimator at full recompute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megazero.config import FLAG, JobConfig, validate
from megazero.config.model import ACTIVATION_MEMORY_FIELDS
from megazero.errors import ConfigError
from megazero.memory.estimate import StageEstimate, estimate_memory
from megazero.spec import get_model_spec

GIB = 2 ** 30


class NoPlanFits(ConfigError):
    """No recompute or offload plan fits the budget; the message names the layout changes that would."""


@dataclass
class Plan:
    """A recompute / offload choice: its model fields, its flags, its estimate (the binding stage), and
    the extra compute (the share of the layers' forward the backward runs again)."""

    name: str
    fields: dict
    flags: str
    peak: int = 0
    stage: StageEstimate | None = None
    extra_compute: float = 0.0


def selective_plans(job: JobConfig) -> list[Plan]:
    """The selective module sets, cheapest first (see the module docstring)."""
    cheap = ["layernorm"] + (["moe_act"] if job.model.routed_experts else [])
    sets = [cheap, cheap + ["core_attn"], cheap + ["core_attn", "mlp"]]
    return [Plan(f"selective {' '.join(s)}", dict(recompute_granularity="selective", recompute_modules=s),
                 f"{FLAG.recompute_granularity} selective {FLAG.recompute_modules} {' '.join(s)}") for s in sets]


def full_recompute() -> Plan:
    """The last resort: every layer keeps only its input."""
    return Plan("full recompute", dict(recompute_activations=True), FLAG.recompute_activations)


def candidate_plans(job: JobConfig, device: str) -> list[Plan]:
    """Every plan, cheapest first (see the module docstring)."""
    layers = _most_layers_per_chunk(job)
    plans = [Plan("no recompute", {}, "(no recompute flags)")] + selective_plans(job)
    plans += [Plan(f"full recompute, block {n}", dict(recompute_granularity="full", recompute_method="block",
                                                       recompute_num_layers=n),
                   f"{FLAG.recompute_granularity} full {FLAG.recompute_method} block {FLAG.recompute_num_layers} {n}")
              for n in range(1, layers)]
    if device == "cuda":
        base = selective_plans(job)[0]
        plans += [Plan(f"offload {n} layers + {base.name}", dict(base.fields, cpu_offloading=True,
                                                                  cpu_offloading_num_layers=n),
                       f"{base.flags} {FLAG.cpu_offloading} {FLAG.cpu_offloading_num_layers} {n}")
                  for n in range(1, layers + 1)]
    plans.append(full_recompute())
    return plans


def _most_layers_per_chunk(job: JobConfig) -> int:
    par = job.parallel
    return -(-job.model.num_layers // (par.pp * par.virtual_stages))


def with_plan(job: JobConfig, plan: Plan, world_size: int) -> JobConfig:
    """``job`` with the plan's recompute / offload fields (the others cleared) in place of the budget,
    validated."""
    cleared = {f.name: f.default for f in dataclasses.fields(job.model) if f.name in ACTIVATION_MEMORY_FIELDS}
    model = dataclasses.replace(job.model, **{**cleared, **plan.fields})   # __post_init__ derives the rest
    train = dataclasses.replace(job.train, memory_budget_gib=None)        # the plan says what the budget chose
    return validate(dataclasses.replace(job, model=model, train=train), world_size)


def evaluate(job: JobConfig, plan: Plan, world_size: int, device: str) -> Plan:
    """Fill in the plan's estimate and extra compute."""
    planned = with_plan(job, plan, world_size)
    stages = estimate_memory(planned, device)
    plan.stage = max(stages, key=lambda s: s.total)
    plan.peak = plan.stage.total
    plan.extra_compute = get_model_spec(planned.model.model_family).recomputed_share(planned.model, planned.parallel)
    return plan


def fit(job: JobConfig, budget_bytes: float, world_size: int, device: str) -> tuple[Plan, list[Plan]]:
    """(the chosen plan, the cheaper plans it rejected, each evaluated). Raises :class:`NoPlanFits`."""
    rejected = []
    for plan in candidate_plans(job, device):
        evaluate(job, plan, world_size, device)
        if plan.peak <= budget_bytes:
            return plan, rejected
        rejected.append(plan)
    raise NoPlanFits(_nothing_fits(job, budget_bytes, world_size, device, rejected[-1]))


def _nothing_fits(job: JobConfig, budget: float, world_size: int, device: str, least: Plan) -> str:
    par, zero = job.parallel, job.zero
    changes = []
    if zero.zero_stage < 3:
        changes.append((f"{FLAG.zero_stage} 3", dict(zero=dataclasses.replace(zero, zero_stage=3))))
    if par.tp * 2 * par.pp <= world_size:
        changes.append((f"{FLAG.tp} {par.tp * 2}", dict(parallel=dataclasses.replace(par, tp=par.tp * 2, dp=None))))
    if par.pp * 2 * par.tp <= world_size and par.pp * 2 <= job.model.num_layers:
        changes.append((f"{FLAG.pp} {par.pp * 2}", dict(parallel=dataclasses.replace(par, pp=par.pp * 2, dp=None))))
    fits = []
    for flag, change in changes:
        try:
            other = validate(dataclasses.replace(job, **change), world_size)
            plan = evaluate(other, full_recompute(), world_size, device)
        except ConfigError:
            continue
        if plan.peak <= budget:
            fits.append(f"{flag} ({plan.peak / GIB:.2f} GiB with full recompute)")
    cp = f" x cp {par.cp}" if par.cp > 1 else ""
    where = f"tp {par.tp}{cp} x pp {par.pp} x dp {par.dp}, ZeRO-{zero.zero_stage}"
    hint = ("; these fit: " + ", ".join(fits)) if fits else "; no single change of ZeRO stage, tp or pp fits either"
    return (f"no recompute or offload plan fits {budget / GIB:.2f} GiB per rank at {where}: the least, "
            f"{least.name}, needs {least.peak / GIB:.2f} GiB{hint}")


def describe(plan: Plan, budget: float) -> str:
    """The chosen plan in a few lines: its flags, its estimated peak per term and its extra compute."""
    s = plan.stage
    mib = 2 ** 20
    host = f", host {s.host / mib:.1f}" if s.host else ""
    return (f"memory plan for {budget / GIB:.2f} GiB per rank: {plan.name} ({plan.flags})\n"
            f"  estimated peak {plan.peak / mib:.1f} MiB (pipeline stage {s.pp_rank}): model states "
            f"{s.model_states / mib:.1f}, activations {s.activations / mib:.1f}, buffers {s.buffers / mib:.1f}"
            f"{host}; extra compute {plan.extra_compute:.0%} of the layers' forward")


def plan_for_budget(job: JobConfig, world_size: int, device: str) -> tuple[JobConfig, str]:
    """``--memory-budget-gib``: the job with the chosen plan, and the lines that say so (the job is
    validated: the budget comes without recompute or offload flags, :meth:`TrainConfig.check`)."""
    budget = job.train.memory_budget_gib
    plan, _ = fit(job, budget * GIB, world_size, device)
    return with_plan(job, plan, world_size), describe(plan, budget * GIB)
