"""--profile: a torch profiler trace of the chosen steps on the chosen ranks (megazero/profiling.py)."""
import contextlib
import io
import json
from types import SimpleNamespace

import torch
from helpers import run_on_ranks
from helpers.trainer import TINY, main_body

from megazero.config import JobConfig, LoggingConfig, validate
from megazero.metrics import MetricsLog
from megazero.profiling import trace_dir
from megazero.state import TrainState
from megazero.training import train


def _iterations_in(trace_file) -> set[str]:
    """The ``iteration <n>`` ranges of a chrome trace."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("iteration ")}


def test_the_trace_holds_the_window_s_steps_of_the_chosen_rank_only(tmp_path):
    """Megatron's meaning: steps after iteration 2 up to iteration 4 (the log's 3 and 4), on rank 1 of two."""
    argv = TINY + ["--train-iters", "5", "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                   "--profile-ranks", "1", "--profile-dir", str(tmp_path / "traces")]
    assert run_on_ranks(2, main_body, argv, timeout=180) == [0, 0]
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["rank1.iter3-4.pt.trace.json"]
    trace = tmp_path / "traces" / "rank1.iter3-4.pt.trace.json"
    assert _iterations_in(trace) == {"iteration 3", "iteration 4"}
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("cat") == "cpu_op" for e in events) > 100          # the steps' operators, not just the ranges


def test_a_run_that_ends_inside_the_window_writes_what_it_profiled_under_save(tmp_path):
    """Without --profile-dir or --tensorboard-dir the trace goes to SAVE/profile; a window past the run's
    last iteration is cut there, and the trace is still written."""
    save = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "3", "--profile", "--profile-step-start", "1", "--save", str(save)]
    assert run_on_ranks(1, main_body, argv, timeout=120) == [0]
    assert _iterations_in(save / "profile" / "rank0.iter2-3.pt.trace.json") == {"iteration 2", "iteration 3"}


def test_the_trace_directory_follows_megatron_then_save():
    assert trace_dir(LoggingConfig(profile_dir="p", tensorboard_dir="tb"), "ckpt") == "p"
    assert trace_dir(LoggingConfig(tensorboard_dir="tb"), "ckpt") == "tb"          # Megatron-LM's choice
    assert trace_dir(LoggingConfig(), "ckpt") == "ckpt/profile"
    assert trace_dir(LoggingConfig(), None) == "./profile"


def test_a_run_resumed_past_the_window_says_nothing_is_profiled():
    """A resumed run whose first iteration is past --profile-step-end profiles nothing, and says so."""
    job = validate(JobConfig.from_dict({"logging": {"profile": True, "profile_step_start": 1,
                                                    "profile_step_end": 2}, "train": {"train_iters": 4}}), 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(job, SimpleNamespace(rank=0, device=torch.device("cpu")), [], None, lambda consumed: iter(()), None,
              MetricsLog(None, None, True), TrainState(iteration=4))
    assert (" profiler: this run resumes at iteration 4, past the profiled iterations (up to 2): nothing is "
            "profiled") in out.getvalue().splitlines()
