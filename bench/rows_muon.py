"""Muon convergence: validation curves of Muon beside AdamW on the bundled corpus, each at its best of three lrs.

Each run is ``pretrain_gpt.py`` itself, a separate process on one CPU thread, on the embedded default
(the bundled sample corpus with its own tokenizer, no data flags), in fp32, with the default GPT-2 model
(4 layers x 128 hidden, 4 heads, learned positions, LayerNorm, GELU, tied output layer) and the default
schedule (cosine decay to 0 over the run, no warmup, weight decay 0.01, gradient clipping 1.0). The two
optimizers differ in ``--optimizer`` and ``--lr`` only:

    adamw   --optimizer adamw --lr LR      for LR in :data:`LR_GRID` (betas 0.9, 0.999)
    muon    --optimizer muon  --lr LR      for LR in :data:`LR_GRID` (momentum 0.95, Nesterov, 5 Newton-Schulz
                                           steps in fp32, --muon-adjust-lr match_rms_adamw: the same lr and
                                           weight decay as AdamW; the embeddings, norms and biases keep AdamW)

Muon's ``match_rms_adamw`` scaling makes its update as large as AdamW's at the same lr, so one grid around
the default ``--lr`` (1.5e-3) serves both. Each optimizer's best lr is the one with the lowest final
validation loss. Then two controls, not counted: each best run again from another seed
(:attr:`MuonCurves.control_seed`, another initialisation); their distances from the best runs are what the
seed alone moves the final loss at this length, the noise floor to read the Muon-vs-AdamW gap against.

Acceptance of the Muon work: Muon's best final validation loss below AdamW's best. Runs go
:attr:`MuonCurves.jobs` at a time (the wall and ms/iter columns are then those of a shared machine).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from bench.common import REPO, median, table

OPTIMIZERS = ("adamw", "muon")
LR_GRID = (1e-3, 2e-3, 4e-3)
COLORS = {"adamw": "tab:blue", "muon": "tab:red"}


@dataclass(frozen=True)
class MuonCurves:
    """The model, run length, batch and evaluation every run shares, the lr grid and the controls' seed."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    micro_batch: int = 16
    global_batch: int = 16
    iters: int = 400
    eval_interval: int = 50
    eval_iters: int = 10
    lrs: tuple = LR_GRID
    seed: int = 1234
    control_seed: int = 1235
    jobs: int = 2

    def argv(self, optimizer: str, lr: float, seed: int, metrics_file: str) -> list[str]:
        """``pretrain_gpt.py``'s flags for one run."""
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.global_batch),
                "--train-iters", str(self.iters), "--eval-interval", str(self.eval_interval),
                "--eval-iters", str(self.eval_iters), "--log-interval", str(self.eval_interval),
                "--optimizer", optimizer, "--lr", f"{lr:g}", "--seed", str(seed), "--metrics-file", metrics_file]

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.hidden} hidden, {self.heads} heads, seq {self.seq}, fp32, "
                f"global batch {self.global_batch} (micro-batch {self.micro_batch}), {self.iters} iterations, "
                f"validation every {self.eval_interval} ({self.eval_iters} batches of {self.micro_batch})")


MUON_CURVES = MuonCurves()
QUICK_MUON = replace(MUON_CURVES, hidden=64, seq=32, micro_batch=2, global_batch=2, iters=6, eval_interval=3,
                     eval_iters=1, lrs=(1e-3, 4e-3))


@dataclass(frozen=True)
class RunKey:
    """One run of the section: the optimizer, its lr and the seed."""

    optimizer: str
    lr: float
    seed: int

    def label(self) -> str:
        return f"{self.optimizer} lr {self.lr:g}" + ("" if self.seed == MUON_CURVES.seed else f" seed {self.seed}")


def run_one(curves: MuonCurves, key: RunKey, timeout: float = 3600) -> dict:
    """One ``pretrain_gpt.py`` run: its validation curve {iteration: loss}, final training loss, median
    ``step_time_s`` and wall time; ``unavailable`` with the last lines of its output if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
                               *curves.argv(key.optimizer, key.lr, key.seed, metrics)],
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


def final_loss(r: dict) -> float | None:
    """The validation loss of the run's last evaluation (None if the run failed)."""
    return r["curve"][max(r["curve"])] if r.get("curve") else None


def best_of(results: dict, optimizer: str, seed: int) -> RunKey | None:
    """The run of ``optimizer`` at ``seed`` with the lowest final validation loss (None if all failed)."""
    done = [(final_loss(r), k) for k, r in results.items()
            if k.optimizer == optimizer and k.seed == seed and final_loss(r) is not None]
    return min(done, key=lambda x: x[0])[1] if done else None


def run_muon(curves: MuonCurves, log=print) -> dict:
    """{RunKey: run_one(...)}: both optimizers at every lr of the grid, then each best lr from the control
    seed, ``curves.jobs`` runs at a time."""
    def go(key: RunKey) -> tuple[RunKey, dict]:
        log(f"muon curves: {key.label()}, {curves.iters} iterations")
        return key, run_one(curves, key)

    grid = [RunKey(opt, lr, curves.seed) for opt in OPTIMIZERS for lr in curves.lrs]
    with ThreadPoolExecutor(max_workers=curves.jobs) as pool:
        results = dict(pool.map(go, grid))
        best = [best_of(results, opt, curves.seed) for opt in OPTIMIZERS]
        controls = [RunKey(b.optimizer, b.lr, curves.control_seed) for b in best if b is not None]
        results.update(pool.map(go, controls))
    return results


def verdict(results: dict, curves: MuonCurves) -> dict:
    """The two best runs, Muon's best over AdamW's best minus 1 (``gap``), whether Muon's is lower, and each
    control's final loss over its best run's minus 1 (``noise``: {optimizer: relative difference})."""
    best = {opt: best_of(results, opt, curves.seed) for opt in OPTIMIZERS}
    if None in best.values():
        return {"best": best}
    adamw, muon = (final_loss(results[best[opt]]) for opt in OPTIMIZERS)
    noise = {}
    for opt, key in best.items():
        control = results.get(RunKey(opt, key.lr, curves.control_seed))
        if control and final_loss(control) is not None:
            noise[opt] = final_loss(control) / final_loss(results[key]) - 1
    return {"best": best, "gap": muon / adamw - 1, "met": muon < adamw, "noise": noise}


def muon_section(results: dict, curves: MuonCurves, plot: dict) -> list[str]:
    """BENCHMARKS.md lines from ``run_muon(...)`` and ``muon_plot(...)``."""
    v = verdict(results, curves)
    best = v["best"]
    ref = final_loss(results[best["adamw"]]) if best.get("adamw") else None
    evals = sorted({i for r in results.values() for i in r.get("curve", {})})
    rows = []
    for key in sorted(results, key=lambda k: (OPTIMIZERS.index(k.optimizer), k.seed, k.lr)):
        r = results[key]
        if "unavailable" in r:
            rows.append([key.optimizer, f"{key.lr:g}", str(key.seed)] + ["-"] * 6 + [r["unavailable"]])
            continue
        role = ("control" if key.seed == curves.control_seed else
                "**best**" if best.get(key.optimizer) == key else "-")
        rows.append([key.optimizer, f"{key.lr:g}", str(key.seed), role, f"{final_loss(r):.4f}",
                     "-" if ref is None else f"{100 * (final_loss(r) / ref - 1):+.2f}%",
                     f"{r['train_loss']:.4f}" if r["train_loss"] is not None else "-",
                     f"{r['step_ms']:.0f}" if r["step_ms"] is not None else "-", f"{r['wall_s']:.0f}",
                     " ".join(f"{r['curve'][i]:.3f}" for i in sorted(r["curve"]))])
    if "gap" in v:
        said = (f"**{'Met' if v['met'] else 'MISSED'}: Muon's best (lr {best['muon'].lr:g}) ends "
                f"{100 * abs(v['gap']):.2f}% {'below' if v['gap'] < 0 else 'above'} AdamW's best "
                f"(lr {best['adamw'].lr:g})**")
        if v["noise"]:
            worst = max(abs(x) for x in v["noise"].values())
            said += (" against a seed-to-seed difference of "
                     + ", ".join(f"{100 * x:+.2f}% ({opt})" for opt, x in v["noise"].items())
                     + f": the gap is {abs(v['gap']) / worst:.1f}x the larger control" if worst > 0 else "")
        said += "."
        edge = [opt for opt, k in best.items() if k.lr in (min(curves.lrs), max(curves.lrs))]
        winner = "muon" if v["met"] else "adamw"
        for opt in edge:
            said += (f" {opt}'s best lr is at the edge of the grid: a wider grid could only lower its best, which "
                     + ("would widen the gap." if opt == winner else "might narrow the gap."))
    else:
        said = "**Not measured**: every run of one optimizer failed (see the table)."
    out = ["## Muon convergence: validation curves of Muon beside AdamW on the bundled corpus", "",
           f"- {curves.describe()}; the embedded default's corpus and tokenizer (vocab 4000), the default "
           "schedule (cosine to 0, no warmup), weight decay 0.01, gradient clipping 1.0.",
           f"- Learning rates, both optimizers: {', '.join(f'{lr:g}' for lr in curves.lrs)} (the default `--lr` is "
           "1.5e-3); Muon with its defaults (`--muon-momentum 0.95 --muon-nesterov --muon-ns-steps 5 "
           "--muon-ns-dtype fp32 --muon-adjust-lr match_rms_adamw`: AdamW's lr and weight decay carry over; the "
           "embeddings, norms and biases keep AdamW).",
           f"- Controls (not counted): each optimizer's best lr again with `--seed {curves.control_seed}`.", "",
           "Target: Muon's final validation loss below AdamW's, each at its best of the three learning rates. "
           + said, "",
           "Each run is `pretrain_gpt.py` in its own process on one CPU thread, "
           f"{curves.jobs} at a time; the curve is its `--metrics-file` `valid_loss` records (the same held-out "
           "batches for every run). vs AdamW best: the final validation loss over AdamW's best run's, minus 1. "
           "ms/iter: the median `step_time_s` (CPU, beside another run; Muon's Newton-Schulz iterations cost "
           "more than AdamW's elementwise step at this size).", ""]
    out += table("| optimizer | lr | seed | run | final valid loss | vs AdamW best | final train loss | ms/iter | "
                 f"wall s | valid loss at iterations {', '.join(map(str, evals))} |", rows)
    if "curves" in plot:
        out += ["", f"![Muon vs AdamW validation curves]({plot['curves']})"]
    elif "missing" in plot:
        out += ["", f"Plot {plot['missing']}."]
    return out + [""]


def muon_plot(results: dict, curves: MuonCurves, outdir: str, filename: str = "bench_muon_curves.png") -> dict:
    """The validation curves (left: every run; right: the two best and their controls), saved in
    bench/results/ and linked relative to ``outdir``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"missing": "not drawn: matplotlib is not installed (pip install matplotlib, an optional extra)"}
    from bench.report import RESULTS

    best = verdict(results, curves)["best"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, r in sorted(results.items(), key=lambda kr: (kr[0].optimizer, kr[0].seed, kr[0].lr)):
        if not r.get("curve"):
            continue
        its = sorted(r["curve"])
        losses = [r["curve"][i] for i in its]
        control = key.seed == curves.control_seed
        shade = 0.35 + 0.65 * (curves.lrs.index(key.lr) + 1) / len(curves.lrs) if key.lr in curves.lrs else 1.0
        if not control:
            axes[0].plot(its, losses, "-" if best.get(key.optimizer) == key else "--", marker=".",
                         color=COLORS[key.optimizer], alpha=shade, label=key.label())
        if control or best.get(key.optimizer) == key:
            axes[1].plot(its, losses, ":" if control else "-", marker=".", color=COLORS[key.optimizer],
                         label=key.label() + ("" if control else " (best)"))
    titles = ("every learning rate (solid: the best)", "the best of each, beside its other seed")
    for ax, title in zip(axes, titles):
        ax.set_title(f"{curves.layers} x {curves.hidden}, seq {curves.seq}, batch {curves.global_batch}: {title}",
                     fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(RESULTS, filename)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"curves": os.path.relpath(path, outdir).replace(os.sep, "/")}


__all__ = ["MUON_CURVES", "QUICK_MUON", "LR_GRID", "OPTIMIZERS", "MuonCurves", "RunKey", "run_one", "final_loss",
           "best_of", "run_muon", "verdict", "muon_section", "muon_plot"]
