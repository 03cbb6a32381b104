"""tools/fuzz/scale.py and tools/check_layout.py (python -m tools.check_layout): a planned run scaled down keeps every axis > 1, and a
broken reduction in the scaled copy is reported as not equal, naming the first iteration and tensor."""
import shlex

import pytest
from helpers.trainer import ROOT, fuzz_launcher

from megazero.errors import ConfigError
from tools import check_layout
from tools.fuzz.scale import scale_down


def llama3_8b_32gpu_plan() -> list[str]:
    """The plan flags of docs/training.md's Llama-3-8B 32-GPU block (the check_layout command users copy)."""
    text = (ROOT / "docs" / "training.md").read_text().split("<!-- llama3-8b-32gpu -->")[1]
    argv = shlex.split(text.split("```bash")[1].split("```")[0].replace("\\\n", " "))
    assert argv[:4] == ["python", "-m", "tools.check_layout", "--"]
    return argv[4:]


LLAMA3_8B_32GPU = llama3_8b_32gpu_plan()


def test_the_llama3_plan_keeps_every_axis_and_switch_on_eight_ranks():
    d, notes = scale_down(LLAMA3_8B_32GPU)
    a = d.axes
    assert d.world == 8 and (a["tp"], a["pp"], a["dp"], a["virtual"]) == (2, 2, 2, 2)
    assert a["sp"] and a["zero"] == 1 and a["overlap_param_gather"] and a["precision"] == "bf16"
    assert a["family"] == "llama" and a["recompute"] == "full-uniform" and a["schedule"] == "interleaved"
    assert "--data-path" not in d.args and "--save" not in d.args and "--mock-data" in d.serial_args
    assert not {"--tensor-model-parallel-size", "--sequence-parallel", "--zero-stage"} & set(d.serial_args)
    assert any("32 ranks (tp 4, pp 2, dp 4)" in n for n in notes) and any("data_path" in n for n in notes)


@pytest.mark.slow
def test_check_layout_on_the_docs_llama3_8b_32gpu_command_reports_equal(tmp_path, capsys):
    """The documented Llama-3-8B plan (tp 4, SP, pp 2 interleaved, dp 4, ZeRO-1, bf16, full recompute)
    scaled to 8 ranks equals its serial twin: 50 s on 2 shared cores."""
    assert check_layout.main(["--workdir", str(tmp_path), "--", *LLAMA3_8B_32GPU], launch=fuzz_launcher()) == 0
    out = capsys.readouterr().out
    assert "plan: 32 ranks (tp 4, pp 2, dp 4)" in out and "scaled: 8 ranks (tp 2, pp 2, dp 2)" in out
    assert "layout check: equal (bf16 tolerance; 4 iterations" in out


def test_megatron_spellings_in_a_plan_mean_what_they_mean_to_the_trainer():
    """A plan written with Megatron-LM's flags is checked at the layout the trainer would run."""
    d, _ = scale_down(["--tensor-model-parallel-size", "2", "--data-parallel-size", "2", "--use-distributed-optimizer",
                       "--checkpoint-activations", "--num-layers", "4", "--hidden-size", "64",
                       "--num-attention-heads", "4"])
    assert d.axes["zero"] == 1 and d.axes["recompute"].startswith("full") and "--zero-stage" in d.args


def test_hpz_with_experts_keeps_a_secondary_shard_of_the_experts():
    """hpZ cuts the experts' secondary shards from dp / ep: dp 8, ep 2, hpZ 4 scales to dp 4 (ep 2, hpZ 2),
    not dp 2, where dp / ep = 1 has no room for a partition of 2 and the copy of a valid plan was refused."""
    d, notes = scale_down(["--dp", "8", "--expert-model-parallel-size", "2", "--num-experts", "8",
                           "--moe-router-topk", "2", "--zero-stage", "3", "--zero-hpz-partition-size", "4",
                           "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"])
    assert (d.axes["dp"], d.axes["ep"], d.axes["hpz"], d.world) == (4, 2, 2, 4), notes


def test_a_plan_the_rules_refuse_is_refused():
    with pytest.raises(ConfigError, match="--num-attention-heads"):
        scale_down(["--tp", "3", "--dp", "1"])


def skip_tp_sum_of_sequence_parallel_grads():
    """The deliberately broken reduction: sequence-parallel norm weights' gradients are not summed over tp."""
    from megazero.parallel.zero.grad_sync import BucketedGradSync

    real = BucketedGradSync._sum_segments

    def broken(self, slots, group, tag):
        if tag != "tp":
            real(self, slots, group, tag)
    BucketedGradSync._sum_segments = broken
    return lambda: setattr(BucketedGradSync, "_sum_segments", real)


PLAN = ["--tp", "4", "--dp", "1", "--sequence-parallel", "--num-layers", "12", "--hidden-size", "768", "--num-attention-heads",
        "12", "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "64", "--train-iters", "1000"]


def test_check_layout_reports_equal_and_a_broken_reduction_as_not_equal(tmp_path, capsys):
    assert check_layout.main(["--workdir", str(tmp_path / "ok"), "--", *PLAN], launch=fuzz_launcher()) == 0
    out = capsys.readouterr().out
    assert "layout check: equal" in out and "scaled: 2 ranks (tp 2, pp 1, dp 1)" in out
    broken = fuzz_launcher(patch=skip_tp_sum_of_sequence_parallel_grads)
    assert check_layout.main(["--workdir", str(tmp_path / "broken"), "--", *PLAN], launch=broken) == 1
    out = capsys.readouterr().out
    assert "layout check: NOT EQUAL" in out
    assert "first difference: iteration 1: grad_norm" in out
    assert "first tensor that differs: iteration 1: tensor model/" in out     # a sequence-parallel tensor


def test_an_fp8_plan_keeps_fp8_in_the_serial_twin_and_the_param_gather_in_the_layout():
    """FP8 is the model's (the serial twin runs it); --fp8-param-gather needs ZeRO, so it stays with the
    layout; the scaled copy is checked at the FP8 tolerance."""
    from tools.fuzz.checker import tolerance_for

    d, _ = scale_down(["--tp", "2", "--dp", "2", "--zero-stage", "1", "--bf16", "--num-layers", "4", "--hidden-size",
                       "256", "--num-attention-heads", "8", "--fp8-format", "hybrid", "--fp8-param-gather"], 4)
    assert d.fp8 and d.axes["fp8_recipe"] == "delayed" and d.axes["fp8_param_gather"] is True
    assert "--fp8-format" in d.serial_args and "--fp8-param-gather" not in d.serial_args
    assert "--fp8-param-gather" in d.args and tolerance_for(d).name == "bf16 + fp8"


def test_the_fuzzing_tools_run_as_files_say_how_to_run_them(tmp_path):
    """``python tools/check_layout.py`` (or fuzz_layouts.py), where the ``tools`` package does not import, ends in
    one line giving the ``python -m`` command instead of an import traceback."""
    import subprocess
    import sys

    for script in ("check_layout", "fuzz_layouts"):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / f"{script}.py"), "--help"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (script, done.stderr[-500:])
        assert done.stderr.strip().endswith(f"run it from the repository root as python -m tools.{script} ..."), \
            done.stderr
