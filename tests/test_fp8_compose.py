"""FP8 training (megazero/parallel/fp8.py) composed with the rest of the step: every pipeline schedule
(1F1B, interleaved, zero-bubble's split backward in ZB-H1 and ZB-V) equals the serial FP8 run, under
the tensor-wise and the delayed recipes; full and selective recompute and activation offload equal the
FP8 run that keeps everything; --compile with FP8 is refused (not built)."""
import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_CFG, GPT_OPT, SEED, trainer_steps

from megazero.compile import compile_model
from megazero.config import (
    CompileConfig,
    FP8Config,
    JobConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
    validate,
)
from megazero.models.gpt import GPTConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec

STEPS = 3
RECIPES = ("tensorwise", "delayed")


def _run(world_size, case):
    """STEPS trainer steps of one case on these ranks: (tp rank, tp, losses, clipped norms, tp-local
    parameters), what :func:`_check_equal` compares. ``case``: tp, pp, schedule, recipe, model keywords,
    compile; the FP8 section e4m3 with ``recipe``, the delayed recipe over 2 steps of history."""
    tp, pp, schedule, recipe, model_kw, compiled = case
    topo = Topology(tp=tp, pp=pp)
    cfg = GPTConfig(**{**GPT_CFG, **model_kw})
    par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, pipeline_schedule=schedule,
                         num_layers_per_virtual_pipeline_stage=1 if schedule == "interleaved" else None)
    fp8 = FP8Config(fp8_format="e4m3", fp8_recipe=recipe,
                    fp8_amax_history_len=2 if recipe == "delayed" else None)
    compilation = CompileConfig(compile=compiled)
    job = validate(JobConfig(model=cfg, parallel=par, fp8=fp8, compilation=compilation,
                             train=TrainConfig(micro_batch_size=2, seed=SEED)), world_size)
    spec = get_model_spec("gpt")
    chunks = build_model_chunks(spec, job, topo, device="meta")
    assert all(c._fp8.linears for c in chunks), "every chunk has FP8 linears"
    compile_model(chunks, spec.compile_regions, compilation)
    engine = build_engine(chunks, topo, ZeroConfig(), GPT_OPT)
    losses, norms, params = trainer_steps(chunks, topo, engine, job, STEPS)
    return topo.tp_rank, tp, losses, norms, params


def _cases_body(rank, world_size, cases):
    return [_run(world_size, case) for case in cases]


def _check_equal(got, want, what, rtol=1e-5, atol=1e-6):
    """One rank's run against the reference run's rank holding the same tp shard: losses and norms to
    ``rtol``, every parameter this rank holds to ``rtol`` (absolute floor ``atol``: Adam moves an entry
    whose true gradient is ~0 by rounding noise: 1e-5 under the pipeline, whose last stage's loss and
    gradients sum in another order, as tests/test_llama.py allows)."""
    _, _, losses, norms, params = got
    _, _, ref_losses, ref_norms, ref_params = want
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0, msg=what)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=0, msg=what)
    assert params, what
    for name, (value, _) in params.items():
        torch.testing.assert_close(value, ref_params[name][0], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


@pytest.fixture(scope="module")
def serial():
    """The serial FP8 runs, by recipe (one process, the same model, init and micro-batches)."""
    cases = [(1, 1, "1f1b", recipe, {}, False) for recipe in RECIPES]
    return dict(zip(RECIPES, run_on_ranks(1, _cases_body, cases)[0]))


SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")


def test_every_pipeline_schedule_equals_the_serial_fp8_run(serial):
    """pp 2 under each schedule (zero-bubble's I and W split each FP8 linear's backward: its weight half
    is computed in I, see split_backward.py), tensor-wise and delayed: the serial FP8 run's losses,
    norms and parameters (1e-5)."""
    cases = [(1, 2, schedule, recipe, {}, False) for recipe in RECIPES for schedule in SCHEDULES]
    results = run_on_ranks(2, _cases_body, cases, timeout=600)
    for i, (*_, schedule, recipe, _, _) in enumerate(cases):
        for r in results:
            _check_equal(r[i], serial[recipe], f"pp2 {schedule} {recipe}", atol=1e-5)


ACTIVATION_CHOICES = {                                   # name: model keywords
    "full-uniform-1": dict(recompute_activations=True),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "core_attn": dict(recompute_granularity="selective"),
    "mlp+layernorm": dict(recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]),
    "offload": dict(cpu_offloading=True),
}


def test_recompute_and_offload_equal_keeping_everything(serial):
    """Each recompute choice and activation offload, one process, both recipes: the FP8 run that keeps
    everything (1e-6; the recomputed forward casts the same values with the same scales)."""
    cases = [(1, 1, "1f1b", recipe, kw, False) for recipe in RECIPES for kw in ACTIVATION_CHOICES.values()]
    (results,) = run_on_ranks(1, _cases_body, cases, timeout=600)
    for result, (*_, recipe, _, _), name in zip(results, cases, list(ACTIVATION_CHOICES) * len(RECIPES)):
        _check_equal(result, serial[recipe], f"{name} {recipe}", rtol=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_compile_with_fp8_is_refused(recipe):
    from megazero.errors import ConfigError

    job = JobConfig(model=GPTConfig(**GPT_CFG), fp8=FP8Config(fp8_format="e4m3", fp8_recipe=recipe),
                    compilation=CompileConfig(compile=True))
    with pytest.raises(ConfigError, match="--fp8-format with --compile is not built"):
        validate(job, 1)
