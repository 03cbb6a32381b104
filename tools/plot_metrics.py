"""Plot the metrics files of one or more runs (``pretrain_gpt.py --metrics-file``) into one PNG.

    python tools/plot_metrics.py run/metrics.jsonl                        # -> run/metrics.png
    python tools/plot_metrics.py a/metrics.jsonl b/metrics.jsonl --labels tp2 zero3 --output cmp.png
    python tools/plot_metrics.py run/metrics.jsonl --x elapsed             # against wall time, not iterations

Six panels: the training loss with the validation loss (dashed, dots), the learning rate, the
gradient norm, the throughput (tokens/s), the TFLOP/s per rank (MFU when the run knew its peak) and
the peak memory per rank. Several runs are overlaid, one colour each, with a legend; a run is
labelled by its file's name, or its directory's when the names are the same. A file a resumed run
appended to may repeat iterations: the last record of each iteration is plotted, so the curve is the
run that went on. Needs matplotlib (``pip install matplotlib``, or the ``plot`` extra).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "plot_metrics.py"
MATPLOTLIB_MISSING = f"{PROG}: error: matplotlib is not installed: pip install matplotlib"
X_AXES = {"iteration": ("iteration", "iteration"), "samples": ("consumed_samples", "consumed samples"),
          "elapsed": ("elapsed_s", "elapsed (hours)")}

# (title, the key plotted, its y label, a scale of the values)
PANELS = [
    ("loss", "loss", "loss", 1.0),
    ("learning rate", "lr", "lr", 1.0),
    ("gradient norm", "grad_norm", "global norm", 1.0),
    ("throughput", "tokens_per_sec", "tokens/s", 1.0),
    ("TFLOP/s per rank", "tflops_per_rank", "TFLOP/s", 1.0),
    ("peak memory per rank", "peak_memory_bytes", "GiB", 2.0 ** -30),
]


class MetricsFileError(ValueError):
    """A metrics file that cannot be read; the message names the file (and the line)."""


def read_runs(paths: list[str]) -> list[tuple[list[dict], list[dict]]]:
    """(training records, evaluation records) of each file, by iteration, the last record of an
    iteration kept (a resumed run's)."""
    runs = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise MetricsFileError(f"{path}: no such file")
        train, valid = {}, {}
        for number, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise MetricsFileError(f"{path}:{number}: not a JSON object ({e.msg}): is it a --metrics-file?") from None
            if not isinstance(record, dict) or "iteration" not in record:
                raise MetricsFileError(f"{path}:{number}: a record without an iteration: is it a --metrics-file?")
            if "loss" in record:
                train[record["iteration"]] = record
            elif "valid_loss" in record:
                valid[record["iteration"]] = record
        if not train and not valid:
            raise MetricsFileError(f"{path}: holds no training or validation record")
        runs.append(([train[i] for i in sorted(train)], [valid[i] for i in sorted(valid)]))
    return runs


def run_labels(paths: list[str]) -> list[str]:
    """Each file's name without its suffix, or its directory's name when those are not all different."""
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    parents = [Path(p).resolve().parent.name for p in paths]
    return parents if len(set(parents)) == len(parents) else [str(p) for p in paths]


def _series(records: list[dict], key: str, x_key: str, scale: float, x_scale: float) -> tuple[list, list]:
    """The (x, y) points of ``key`` in ``records``: records without it or with a null are left out."""
    points = [(r[x_key] * x_scale, r[key] * scale) for r in records
              if r.get(key) is not None and r.get(x_key) is not None]
    return [x for x, _ in points], [y for _, y in points]


def _validation(run: tuple[list[dict], list[dict]], x_key: str, x_scale: float) -> tuple[list, list]:
    """The (x, validation loss) points of a run. An evaluation carries its iteration only: on another x
    axis its x is that of the training record of the same iteration (left out where there is none)."""
    if x_key == "iteration":
        where = {r["iteration"]: r["iteration"] for r in run[1]}
    else:
        where = {r["iteration"]: r[x_key] for r in run[0] if r.get(x_key) is not None}
    points = [(where[r["iteration"]] * x_scale, r["valid_loss"]) for r in run[1]
              if r["iteration"] in where and r.get("valid_loss") is not None]
    return [x for x, _ in points], [y for _, y in points]


def plot(paths: list[str], output: str, labels: list[str] | None = None, x: str = "iteration") -> str:
    """Draw the runs of ``paths`` into the PNG ``output``; returns its path. Raises ImportError without
    matplotlib, :class:`MetricsFileError` for a file that is not a metrics file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs(paths)
    labels = labels or run_labels(paths)
    x_key, x_label = X_AXES[x]
    x_scale = 1 / 3600 if x == "elapsed" else 1.0
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    for (title, key, y_label, scale), ax in zip(PANELS, axes.flat):
        mfu = key == "tflops_per_rank" and all(any(r.get("mfu") is not None for r in run[0]) for run in runs)
        if mfu:
            title, key, y_label, scale = "MFU", "mfu", "% of peak", 100.0
        for colour, (run, label) in enumerate(zip(runs, labels)):
            xs, ys = _series(run[0], key, x_key, scale, x_scale)
            ax.plot(xs, ys, color=f"C{colour}", label=label)
            if key == "loss" and run[1]:
                ax.plot(*_validation(run, x_key, x_scale), color=f"C{colour}", linestyle="--", marker="o",
                        markersize=3, label=f"{label} (validation)")
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        if key in ("lr", "grad_norm"):
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(", ".join(labels) if len(labels) > 1 else labels[0])
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="METRICS_FILE", help="--metrics-file JSON lines of a run")
    parser.add_argument("--output", "-o", metavar="PNG",
                        help="the PNG to write (default: the first file with the suffix .png)")
    parser.add_argument("--labels", nargs="+", metavar="LABEL", help="one legend label per file")
    parser.add_argument("--x", choices=sorted(X_AXES), default="iteration",
                        help="the x axis: iteration (default), samples (consumed) or elapsed (wall-clock hours)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.files):
        parser.error(f"--labels gives {len(args.labels)} label(s) for {len(args.files)} file(s): give one per file")
    output = args.output or str(Path(args.files[0]).with_suffix(".png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(MATPLOTLIB_MISSING, file=sys.stderr)
        return 2
    try:
        print(plot(args.files, output, args.labels, args.x))
    except MetricsFileError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
