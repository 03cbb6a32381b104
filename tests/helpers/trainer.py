"""End-to-end helpers: the trainer (megazero.cli.main) on n ranks, its metrics files, and loss comparisons."""
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "16", "--num-layers", "4",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-2", "--lr-warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "2", "--seed", "7"]


# The Llama-family flags (Megatron's names), on top of TINY: ffn defaults to Megatron's SwiGLU size (64).
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights"]


def main_body(rank, world, argv):
    from megazero.cli import main as cli

    return cli.main(argv)


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a metrics file."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "valid_loss" in r]


def assert_same_losses(got: list[dict], want: list[dict], key: str) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        assert math.isclose(g[key], w[key], rel_tol=1e-5), f"iteration {g['iteration']}: {g[key]} vs {w[key]}"


def fuzz_launcher(patch=None):
    """The fuzzer's default launcher (ranks forked from this process, tools.fuzz.launch), optionally
    with ``patch`` (a function that patches the trainer and returns an undo function) applied here while
    the ranks run: they inherit it, this process gets it back undone."""
    from tools.fuzz.launch import forked_launcher as launch_forked

    def launch(world, argv, cwd):
        undo = patch() if patch else None
        try:
            launch_forked(world, argv, cwd, timeout=300)
        finally:
            if undo:
                undo()
    return launch


# Trainer parity with parameters: a run of PARITY_ITERS iterations saves a checkpoint at its end, and every
# tensor of it (parameters and Adam moments, read layout-free by name) is compared with the serial run's
# under the project's fp32 rule (tools.fuzz.checker.TOLERANCES, the fuzzer's): losses and gradient norms
# within 1e-5 relative, each parameter element within 1e-4 of its value + 1e-5 of its tensor's largest +
# 2e-3 lr (Adam moves an element whose gradient is rounding noise by up to that much, either sign).
PARITY_ITERS = 5


def parity_argv(out_dir) -> list[str]:
    """TINY for PARITY_ITERS iterations (one evaluation at the end), with its metrics file and one
    checkpoint at the last iteration in ``out_dir``."""
    return TINY + ["--train-iters", str(PARITY_ITERS), "--eval-interval", str(PARITY_ITERS), "--eval-iters", "1",
                   "--metrics-file", str(Path(out_dir) / "metrics.jsonl"), "--save", str(Path(out_dir) / "ckpt"),
                   "--save-interval", str(PARITY_ITERS)]


def serial_parity_runs(tmp_path_factory):
    """A getter ``get(shape_flags) -> directory`` of the single-process run of TINY + ``shape_flags``
    (a tuple), run with :func:`parity_argv` on first use and cached (use it in a module fixture)."""
    from helpers import run_on_ranks

    cache = {}

    def get(shape: tuple = ()):
        if shape not in cache:
            where = tmp_path_factory.mktemp("serial")
            assert run_on_ranks(1, main_body, parity_argv(where) + list(shape), timeout=120) == [0]
            cache[shape] = where
        return cache[shape]
    return get


def assert_same_checkpoints(got_dir, want_dir, iteration: int, lr: float) -> int:
    """Every tensor of checkpoint ``got_dir`` equals ``want_dir``'s (same names, fp32 rule above); returns
    how many were compared."""
    from tools.fuzz.checker import TOLERANCES, Report, compare_checkpoints

    report = Report(draw=None, tolerance=TOLERANCES["fp32"])
    compare_checkpoints(Path(got_dir), Path(want_dir), iteration, TOLERANCES["fp32"], lr, report)
    assert report.tensors_compared and not report.differences, "\n".join(str(d) for d in report.differences[:8])
    return report.tensors_compared


def assert_matches_serial(world: int, flags: list, out_dir, serial_dir) -> None:
    """pretrain_gpt.main with :func:`parity_argv` + ``flags`` on ``world`` ranks: every iteration's loss and
    gradient norm, the evaluation loss, and every parameter and optimizer moment after the last iteration
    equal the serial run's in ``serial_dir``."""
    from helpers import run_on_ranks

    assert run_on_ranks(world, main_body, parity_argv(out_dir) + list(flags), timeout=300) == [0] * world
    train, valid = read_metrics(Path(out_dir) / "metrics.jsonl")
    want_train, want_valid = read_metrics(Path(serial_dir) / "metrics.jsonl")
    assert len(train) == PARITY_ITERS and len(valid) == 1
    for key in ("loss", "grad_norm"):
        assert_same_losses(train, want_train, key)
    assert_same_losses(valid, want_valid, "valid_loss")
    step = f"iter_{PARITY_ITERS:07d}"
    assert_same_checkpoints(Path(out_dir) / "ckpt" / step, Path(serial_dir) / "ckpt" / step, PARITY_ITERS,
                            lr=float(TINY[TINY.index("--lr") + 1]))
