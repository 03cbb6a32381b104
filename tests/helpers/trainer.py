"""End-to-end helpers: pretrain_gpt.main on n ranks, its metrics files, and loss comparisons."""
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))                    # pretrain_gpt.py lives at the repository root

TINY = ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "16", "--num-layers", "4",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-2", "--lr-warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "2", "--seed", "7"]


# The Llama-family flags (Megatron's names), on top of TINY: ffn defaults to Megatron's SwiGLU size (64).
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights"]


def main_body(rank, world, argv):
    import pretrain_gpt

    return pretrain_gpt.main(argv)


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a metrics file."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "valid_loss" in r]


def assert_same_losses(got: list[dict], want: list[dict], key: str) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        assert math.isclose(g[key], w[key], rel_tol=1e-5), f"iteration {g['iteration']}: {g[key]} vs {w[key]}"


def main_in_dir_body(rank, world, argv, cwd, patch=None):
    """pretrain_gpt.main run in directory ``cwd`` (relative paths land there), with ``patch`` (a
    module-level function returning an undo function) applied for the run only: workers are reused."""
    import os

    import pretrain_gpt

    undo, here = patch() if patch else None, os.getcwd()
    os.chdir(cwd)
    try:
        return pretrain_gpt.main(argv)
    finally:
        os.chdir(here)
        if undo:
            undo()


def pooled_launcher(patch=None, timeout: float = 300):
    """A launcher for megazero.fuzz.checker.check that runs pretrain_gpt.main on the test harness's
    reused worker processes (no interpreter start per run), optionally with ``patch`` applied."""
    from helpers import run_on_ranks

    from megazero.fuzz.checker import RunFailed

    def launch(world, argv, cwd):
        try:
            status = run_on_ranks(world, main_in_dir_body, [str(a) for a in argv], str(cwd), patch, timeout=timeout)
        except (AssertionError, RuntimeError, TimeoutError) as e:
            raise RunFailed(str(e)[-3000:]) from e
        if status != [0] * world:
            raise RunFailed(f"exit statuses {status}")
    return launch
