"""FP8 convergence: validation curves of FP8 training (each recipe) beside bf16 on the bundled corpus.

Each run is ``pretrain_gpt.py`` itself, a separate process on one CPU thread, on the embedded default
(the bundled sample corpus with its own tokenizer, no data flags): a GPT-2 shape (the default model:
4 layers x 128 hidden, 4 heads, learned positions, LayerNorm, GELU, tied output layer) and a Llama
shape (the same size with RoPE, RMSNorm, SwiGLU, 2 key/value groups, no biases, an untied output
layer: docs/training.md's Llama flags). Every local dimension of every transformer linear is a
multiple of 16, so every one of them runs in FP8 (the output layer stays in bf16, as without
``--fp8-head``). Per shape, four runs with the same seed, data and schedule:

    bf16            --bf16
    fp8-tensorwise  --bf16 --fp8-format hybrid --fp8-recipe tensorwise
    fp8-rowwise     --bf16 --fp8-format hybrid --fp8-recipe rowwise
    fp8-delayed     --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16
                    --fp8-amax-compute-algo max
    bf16-seed1235   --bf16 --seed 1235 (a control: bf16 from another initialisation, not counted)

:data:`CURVES` trains :attr:`CurveShape.iters` iterations and evaluates every
:attr:`CurveShape.eval_interval` and at the end (``--eval-iters`` batches of the held-out documents);
the curves are the ``valid_loss`` records of each run's ``--metrics-file``. Target (acceptance of the
FP8 work): each recipe's final validation loss within :data:`TARGET` (relative) of bf16's; the control's
distance from bf16 says how much of a difference the seed alone makes at this length.
On a CPU the FP8 products are computed exactly as on a GPU up to fp32 summation order (see
``megazero.parallel.fp8``), so the curves are the FP8 arithmetic's; the step times are not a GPU's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

from bench.common import REPO, median, table

TARGET = 0.015              # FP8's final validation loss at most 1.5% from bf16's
BASE = "bf16"
FP8 = ["--bf16", "--fp8-format", "hybrid"]
VARIANTS = {
    BASE: ["--bf16"],
    "fp8-tensorwise": [*FP8, "--fp8-recipe", "tensorwise"],
    "fp8-rowwise": [*FP8, "--fp8-recipe", "rowwise"],
    "fp8-delayed": [*FP8, "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"],
    "bf16-seed1235": ["--bf16", "--seed", "1235"],
}
CONTROL = "bf16-seed1235"   # bf16 from another seed: how far a run moves without FP8 (shown, not counted)
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


@dataclass(frozen=True)
class CurveShape:
    """One model trained by every variant: its name, its model flags (beside the default run's) and the
    run's length, evaluation and batch."""

    name: str
    model_flags: tuple = ()
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    micro_batch: int = 4
    iters: int = 400
    eval_interval: int = 50
    eval_iters: int = 10

    def argv(self, variant: str, metrics_file: str) -> list[str]:
        """``pretrain_gpt.py``'s flags for ``variant`` of this shape."""
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.micro_batch),
                "--train-iters", str(self.iters), "--eval-interval", str(self.eval_interval),
                "--eval-iters", str(self.eval_iters), "--log-interval", str(self.eval_interval),
                *self.model_flags, *VARIANTS[variant], "--metrics-file", metrics_file]

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.hidden} hidden, {self.heads} heads, seq {self.seq}, "
                f"micro-batch = global batch {self.micro_batch}, {self.iters} iterations, validation every "
                f"{self.eval_interval} ({self.eval_iters} batches)")


CURVES = [CurveShape("gpt2"), CurveShape("llama", tuple(LLAMA))]
QUICK_CURVES = [replace(s, hidden=64, seq=32, micro_batch=2, iters=6, eval_interval=3, eval_iters=1) for s in CURVES]


def run_one(shape: CurveShape, variant: str, timeout: float = 3600) -> dict:
    """One ``pretrain_gpt.py`` run of ``variant``: its validation curve {iteration: loss}, final training
    loss, median ``step_time_s`` and wall time; ``unavailable`` with the last lines of its output if it
    failed."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *shape.argv(variant, metrics)],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(metrics):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return {"unavailable": f"exit {proc.returncode}: {' / '.join(tail)}"}
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    curve = {r["iteration"]: r["valid_loss"] for r in records if "valid_loss" in r}
    steps = [r for r in records if "step_time_s" in r]
    return {"curve": curve, "train_loss": steps[-1]["loss"] if steps else None,
            "step_ms": 1e3 * median([r["step_time_s"] for r in steps]) if steps else None, "wall_s": wall}


def run_fp8(shapes: list[CurveShape], log=print) -> list:
    """[(shape, {variant: run_one(...)}), ...]: every variant of every shape, one after another."""
    out = []
    for shape in shapes:
        res = {}
        for variant in VARIANTS:
            log(f"fp8 curves: {shape.name} {variant}, {shape.iters} iterations")
            res[variant] = run_one(shape, variant)
        out.append((shape, res))
    return out


def final_loss(r: dict) -> float | None:
    """The validation loss of the run's last evaluation."""
    return r["curve"][max(r["curve"])] if r.get("curve") else None


def compare(r: dict, base: dict) -> tuple[float | None, bool | None]:
    """(``r``'s final validation loss relative to ``base``'s, minus 1; whether within :data:`TARGET`)."""
    a, b = final_loss(r), final_loss(base)
    if a is None or b is None:
        return None, None
    rel = a / b - 1
    return rel, abs(rel) <= TARGET


def _row(shape: CurveShape, name: str, r: dict, base: dict, met: list) -> list[str]:
    if "unavailable" in r:
        return [shape.name, name] + ["-"] * 6 + [r["unavailable"]]
    rel, ok = compare(r, base)
    if name not in (BASE, CONTROL) and ok is not None:
        met.append((shape.name, name, ok))
    curve = " ".join(f"{r['curve'][i]:.3f}" for i in sorted(r["curve"]))
    verdict = "-" if name == BASE or ok is None else ("met" if ok else "**MISSED**")
    if name == CONTROL and ok is not None:
        verdict = f"(control: {'within' if ok else 'beyond'})"
    return [shape.name, name, f"{final_loss(r):.4f}", "-" if name == BASE or rel is None else f"{100 * rel:+.2f}%",
            verdict, f"{r['train_loss']:.4f}" if r["train_loss"] is not None else "-",
            f"{r['step_ms']:.0f}" if r["step_ms"] is not None else "-", f"{r['wall_s']:.0f}", curve]


def fp8_section(results: list, plot: dict) -> list[str]:
    """BENCHMARKS.md lines from ``run_fp8(...)`` and ``fp8_plot(...)``."""
    shapes = [s for s, _ in results] or CURVES
    met: list = []
    rows = [_row(shape, name, res[name], res[BASE], met) for shape, res in results for name in VARIANTS
            if name in res and BASE in res]
    evals = sorted({i for _, res in results for r in res.values() for i in r.get("curve", {})})
    missed = [f"{s} {n}" for s, n, ok in met if not ok]
    out = ["## FP8 convergence: validation curves of each recipe beside bf16 on the bundled corpus", "",
           f"- {shapes[0].describe()}; the embedded default's corpus and tokenizer (vocab 4000).",
           "- Shapes: " + "; ".join(f"`{s.name}`: {' '.join(s.model_flags) or 'the default GPT-2 model'}"
                                     for s in shapes) + ".",
           "- Variants: " + "; ".join(f"`{n}`: `{' '.join(f)}`" for n, f in VARIANTS.items()) + ".", "",
           f"Target: each FP8 recipe's final validation loss within {100 * TARGET:g}% of bf16's. "
           f"**Met on {sum(ok for *_, ok in met)} of {len(met)} runs**"
           + (f" (missed: {', '.join(missed)})." if missed else "."), "",
           "Each run is `pretrain_gpt.py` in its own process on one CPU thread, same seed, data and schedule; "
           "the curve is its `--metrics-file` `valid_loss` records. vs bf16: the final validation loss over "
           "bf16's, minus 1. ms/iter: the median `step_time_s` (CPU; FP8's casts and amaxes cost more than its "
           "products save here, where the products are fp32 ones over the widened FP8 values). Every transformer "
           "linear runs in FP8 (all local dimensions are multiples of 16); the output layer stays bf16. "
           f"`{CONTROL}` is bf16 from another seed (initialisation), not counted: its distance from `bf16` is what "
           "the seed alone moves the final loss at this length, the noise floor to read the FP8 rows against.", ""]
    out += table("| shape | variant | final valid loss | vs bf16 | within 1.5% | final train loss | ms/iter | wall s "
                 f"| valid loss at iterations {', '.join(map(str, evals))} |", rows)
    if "curves" in plot:
        out += ["", f"![FP8 validation curves]({plot['curves']})"]
    elif "missing" in plot:
        out += ["", f"Plot {plot['missing']}."]
    return out + [""]


def fp8_plot(results: list, outdir: str, filename: str = "bench_fp8_curves.png") -> dict:
    """The validation curves, one panel per shape, saved in bench/results/ and linked relative to ``outdir``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"missing": "not drawn: matplotlib is not installed (pip install matplotlib, an optional extra)"}
    from bench.report import RESULTS

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (shape, res) in zip(axes[0], results):
        for name, r in res.items():
            if r.get("curve"):
                its = sorted(r["curve"])
                ax.plot(its, [r["curve"][i] for i in its], "-" if name == BASE else "--", marker=".", label=name)
        ax.set_title(f"{shape.name}: {shape.layers} x {shape.hidden}, seq {shape.seq}", fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(RESULTS, filename)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"curves": os.path.relpath(path, outdir).replace(os.sep, "/")}


__all__ = ["CURVES", "QUICK_CURVES", "VARIANTS", "CONTROL", "TARGET", "CurveShape", "run_one", "run_fp8", "final_loss",
           "compare", "fp8_section", "fp8_plot"]
