"""The memory planner (megazero/memory/planner.py): plans in the documented order, the chosen plan run
for real peaks within the budget while the cheaper plan it rejected is measured over it, a budget
nothing meets names the layout change that would, and the trainer's --memory-budget-gib."""
import pytest
from helpers import run_on_ranks
from helpers.memory import BASE, LLAMA, measure_body

from megazero.cli.job import parse_job
from megazero.memory.planner import (
    GIB,
    NoPlanFits,
    candidate_plans,
    evaluate,
    fit,
    with_plan,
)

# (world size, flags) from the memory tests' layouts, at a longer sequence: activations dominate
PLANNED = [
    (1, ["--seq-length", "256", "--zero-stage", "0"]),
    (2, ["--seq-length", "256", "--tp", "2", "--sequence-parallel", "--zero-stage", "1"]),
    (2, LLAMA + ["--seq-length", "256", "--pp", "2", "--zero-stage", "0", "--global-batch-size", "8"]),
]


def test_plans_come_cheapest_first():
    job, _ = parse_job(BASE, 1)
    names = [p.name for p in candidate_plans(job, "cpu")]
    assert names == ["no recompute", "selective layernorm", "selective layernorm core_attn",
                     "selective layernorm core_attn mlp", "full recompute, block 1", "full recompute, block 2",
                     "full recompute, block 3", "full recompute"]
    cuda = [p.name for p in candidate_plans(job, "cuda")]
    assert cuda[-5:] == [f"offload {n} layers + selective layernorm" for n in range(1, 5)] + ["full recompute"]


def _pair(job, world):
    """A budget 10% above a plan's estimate that the plan just before it misses by more than 20%."""
    plans = [evaluate(job, p, world, "cpu") for p in candidate_plans(job, "cpu")]
    for cheaper, plan in zip(plans, plans[1:]):
        if cheaper.peak > 1.25 * plan.peak:
            return plan.peak * 1.1
    raise AssertionError([(p.name, p.peak) for p in plans])


@pytest.mark.parametrize("world,flags", [*PLANNED[:2], pytest.param(*PLANNED[2], marks=pytest.mark.slow)],
                         ids=["serial", "tp2-sp-zero1", "llama-pp2"])
def test_the_chosen_plan_fits_when_run_and_the_rejected_one_does_not(world, flags):
    """Measured: live tensor bytes of construction and one training step, largest rank."""
    argv = BASE + flags
    job, _ = parse_job(argv, world)
    budget = _pair(job, world)
    chosen, rejected = fit(job, budget, world, "cpu")
    peaks = {}
    for plan in (chosen, rejected[-1]):
        planned = with_plan(job, plan, world)
        plan_argv = argv + plan.flags.split() if plan.fields else argv
        assert parse_job(plan_argv, world)[0].model == planned.model
        # Live bytes at tp > 1 are an upper bound (a buffer whose last reference dies in gloo's thread
        # stays counted, +-0.6 MiB here between runs of the same plan); the step is deterministic, so
        # the least of three runs is the tightest upper bound of its peak.
        peaks[plan.name] = min(max(peak for _, peak, _ in run_on_ranks(world, measure_body, plan_argv))
                               for _ in range(1 if world == 1 else 3))
    print(f"budget {budget / 2**20:.2f} MiB:", {n: f"{p / 2**20:.2f} MiB" for n, p in peaks.items()})
    assert peaks[chosen.name] <= budget
    assert peaks[rejected[-1].name] > budget


def test_a_budget_nothing_meets_names_the_layout_change_that_would():
    job, _ = parse_job(BASE + ["--zero-stage", "0", "--seq-length", "256"], 2)
    least = evaluate(job, candidate_plans(job, "cpu")[-1], 2, "cpu").peak
    with pytest.raises(NoPlanFits, match=r"the least, full recompute, needs .* GiB; these fit: --zero-stage 3"):
        fit(job, least * 0.97, 2, "cpu")
    with pytest.raises(NoPlanFits, match="no single change of ZeRO stage, tp or pp fits either"):
        fit(job, least * 0.1, 2, "cpu")


def test_the_trainer_takes_a_budget_and_refuses_it_beside_recompute_flags(capsys):
    from megazero.cli.arguments import build_parser
    from megazero.cli.job import job_from_args
    from megazero.cli.plan import plan_memory

    argv = BASE + ["--seq-length", "256", "--zero-stage", "0"]
    job, _ = parse_job(argv, 1)
    budget = _pair(job, 1)
    parser = build_parser("pretrain_gpt.py", "")
    planned = plan_memory(job_from_args(parser, parser.parse_args(argv + ["--memory-budget-gib", str(budget / GIB)]),
                                        1), 1)
    assert planned.model.recompute_granularity is not None
    assert "memory plan for" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        job_from_args(parser, parser.parse_args(argv + ["--memory-budget-gib", "1", "--recompute-activations"]), 1)
    assert "--memory-budget-gib lets the planner choose recompute and offload; --recompute-activations" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_job(argv + ["--memory-budget-gib", "0"], 1)
    assert "--memory-budget-gib must be > 0, got 0.0" in capsys.readouterr().err
