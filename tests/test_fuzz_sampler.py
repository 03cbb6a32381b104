"""tools/fuzz/sampler.py: seeded draws, valid by the trainer's own rules only, as one-line commands."""
import shlex

import pytest

import megazero.config
from megazero.config.fp8 import FP8_RECIPES
from megazero.errors import ConfigError
from tools.fuzz.sampler import AXES, COMMON, MAX_WORLD, NOT_APPLICABLE, draw, parse_and_validate

LAYOUT_FLAGS = ("--tp", "--pp", "--dp", "--zero-stage", "--sequence-parallel", "--expert-model-parallel-size",
                "--recompute-granularity", "--cpu-offloading", "--offload-optimizer")


def test_the_same_seed_gives_the_same_draw_and_seeds_differ():
    assert draw(5) == draw(5)
    assert len({tuple(draw(s).args) for s in range(12)}) == 12


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_every_layout_of_a_draw_is_accepted_at_its_world_size(seed):
    d = draw(seed)
    for args, world, axes in ((d.args, d.world, d.axes), (d.resume_args, d.resume_world, d.resume_axes)):
        job = parse_and_validate(args, world)
        assert world <= MAX_WORLD and (job.parallel.tp, job.parallel.cp, job.parallel.pp, job.parallel.dp) == \
            (axes["tp"], axes["cp"], axes["pp"], axes["dp"])
        if axes["cp"] > 1:
            assert job.parallel.cp_comm_type == axes["cp_comm"]
        assert (job.zero.offload_optimizer, job.zero.offload_params) == (axes["offload_optimizer"],
                                                                         axes["offload_params"])
        assert job.zero.zero_stage == axes["zero"] and job.parallel.sequence_parallel == axes["sp"]
        if axes["schedule"] == "interleaved":
            assert job.parallel.virtual_stages == axes["virtual"] > 1
    assert parse_and_validate(d.serial_args, 1).parallel.dp == 1
    assert not set(LAYOUT_FLAGS) & set(d.serial_args)
    assert d.axes["precision"] == d.resume_axes["precision"] and d.model_args == d.model_args


def test_validity_comes_from_validate_alone(monkeypatch):
    """A rule added to validate() (here: no ZeRO-3, no tp 2) narrows the draws with no change to the sampler."""
    real = megazero.config.validate

    def stricter(job, world_size):
        job = real(job, world_size)
        if job.zero.zero_stage == 3 or job.parallel.tp == 2:
            raise ConfigError("refused by the test")
        return job

    monkeypatch.setattr(megazero.config, "validate", stricter)
    draws = [draw(s) for s in range(15)]
    assert all(a["zero"] != 3 and a["tp"] != 2 for d in draws for a in (d.axes, d.resume_axes))
    with pytest.raises(ConfigError):
        parse_and_validate(["--zero-stage", "3", "--dp", "2"], 2)


def test_fp8_is_never_drawn_without_torchao_and_leaves_the_other_axes_as_they_were(monkeypatch):
    """FP8Config.check refuses FP8 without torchao, so the sampler draws none; FP8's own random stream
    leaves every other axis of a seed as drawn without it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    for seed in (1, 3, 24):                                            # FP8 draws where torchao is present
        d = draw(seed, families=False)
        assert not d.fp8 and d == draw(seed, fp8=False, families=False)
    monkeypatch.undo()
    d, plain = draw(24, families=False), draw(24, fp8=False, families=False)
    assert d.fp8 and not plain.fp8
    assert {k: v for k, v in d.axes.items() if not k.startswith("fp8")} == \
        {k: v for k, v in plain.axes.items() if not k.startswith("fp8")}


def test_the_command_is_one_line_that_parses_back_to_the_same_job():
    d = draw(11)
    line = d.command()
    assert "\n" not in line and line.startswith(f"torchrun --standalone --nproc-per-node {d.world} pretrain_gpt.py")
    argv = shlex.split(line)[5:]
    assert parse_and_validate(argv, d.world) == parse_and_validate(d.args, d.world)
    assert d.command("serial").startswith("python pretrain_gpt.py " + " ".join(COMMON[:2]))


def test_axes_without_meaning_read_not_applicable():
    draws = [draw(s) for s in range(40)]
    for a in (x for d in draws for x in (d.axes, d.resume_axes)):
        assert set(a) == set(AXES)
        assert (a["schedule"] == NOT_APPLICABLE) == (a["pp"] == 1)
        assert (a["topk"] == NOT_APPLICABLE) == (not a["experts"])
        assert (a["recompute_modules"] == NOT_APPLICABLE) == (a["recompute"] != "selective")
        assert (a["cp_comm"] == NOT_APPLICABLE) == (a["cp"] == 1)
        assert (a["capacity"] == NOT_APPLICABLE) == (not a["experts"])
        if a["fp8"] == "off":
            assert a["fp8_recipe"] == a["fp8_head"] == a["fp8_param_gather"] == NOT_APPLICABLE
        elif a["fp8_param_gather"] is not NOT_APPLICABLE:                # the rules allow it there
            assert a["zero"] >= 1 and a["fp8_recipe"] != "rowwise" and not a["qwz"]
    for d in draws:
        assert d.fp8 == ("--fp8-format" in d.serial_args) and d.axes["fp8"] == d.resume_axes["fp8"]
        assert all(("--fp8-param-gather" in args) == (a["fp8_param_gather"] is True)
                   for args, a in ((d.args, d.axes), (d.resume_args, d.resume_axes)))
    fp8 = [a for d in draws for a in (d.axes, d.resume_axes) if a["fp8"] != "off"]
    assert {a["fp8"] for a in fp8} == {"e4m3", "hybrid"} and {a["fp8_recipe"] for a in fp8} == set(FP8_RECIPES)
    assert {a["fp8_param_gather"] for a in fp8} == {True, False, NOT_APPLICABLE}
    assert any(d.world != d.resume_world for d in draws)           # resumes cross world sizes
    assert {a["cp"] for d in draws for a in (d.axes, d.resume_axes)} == {1, 2, 4}
    assert any("--nvme-path" in d.args + d.resume_args for d in draws)


def test_muon_is_drawn_with_its_settings_where_the_configuration_accepts_it():
    """The optimizer comes from its own stream of the seed; a layout that refuses it (Muon with
    --offload-optimizer) keeps AdamW; the serial twin and the resumed layout step with the draw's optimizer."""
    from tools.fuzz.sampler import OPTIMIZERS

    drawn = {s: draw(s) for s in range(0, 40, 3)}
    assert {d.optimizer for d in drawn.values()} == set(OPTIMIZERS)
    for d in drawn.values():
        n = len(OPTIMIZERS[d.optimizer])
        assert d.model_args[len(d.model_args) - n:] == OPTIMIZERS[d.optimizer] == d.serial_args[len(d.serial_args) - n:]
        jobs = [parse_and_validate(args, world) for args, world in
                ((d.args, d.world), (d.resume_args, d.resume_world), (d.serial_args, 1))]
        assert {job.optimizer.muon for job in jobs} == {d.optimizer != "adamw"}
        if d.optimizer != "adamw":
            assert "none" == d.axes["offload_optimizer"] == d.resume_axes["offload_optimizer"]
    assert drawn[15].optimizer == "adamw" and drawn[15].axes["offload_optimizer"] == "cpu"    # drew Muon: refused
    plain = parse_and_validate(drawn[24].serial_args, 1).optimizer
    assert (plain.muon_nesterov, plain.muon_momentum, plain.muon_ns_steps, plain.muon_adjust_lr) == \
        (False, 0.9, 3, "original")


def test_every_built_in_family_is_drawn_and_other_seeds_keep_their_draw():
    """The family comes from the registry (each built-in family's tiny models, from its spec), from the seed's
    own stream: a seed that keeps the default family draws exactly what it drew before other families joined."""
    from tools.fuzz.sampler import other_families

    assert other_families() and all(flags[:2] == ("--model-family", value.split("+")[0])
                                    for value, flags in other_families().items())
    for flags in other_families().values():                          # the family's rules accept its tiny models
        assert parse_and_validate(COMMON + ["--num-layers", "4", *flags], 1).model.model_family == flags[1]
    drawn = set()
    for seed in range(0, 40, 2):
        d = draw(seed)
        drawn.add(d.axes["family"])
        assert d.axes["family"] == d.resume_axes["family"]
        if d.axes["family"] in ("gpt", "llama"):
            assert d == draw(seed, families=False)
        else:
            family = other_families()[d.axes["family"]][1]
            assert all(parse_and_validate(args, world).model.model_family == family for args, world in
                       ((d.args, d.world), (d.resume_args, d.resume_world), (d.serial_args, 1)))
    assert drawn == {"gpt", "llama", *other_families()}
