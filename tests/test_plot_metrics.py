"""tools/plot_metrics.py: metrics files of tiny runs -> one PNG, runs overlaid; one line when it cannot."""
import importlib.util
import json
import sys

import pytest
from helpers import run_on_ranks
from helpers.trainer import ROOT, TINY, main_body

_spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "tools" / "plot_metrics.py")
plot_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_metrics)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Metrics files of two tiny runs (two learning rates), each in its own directory."""
    paths = []
    for name, lr in (("lr-high", "1e-2"), ("lr-low", "1e-3")):
        path = tmp_path_factory.mktemp(name) / "metrics.jsonl"
        argv = TINY + ["--train-iters", "6", "--eval-interval", "3", "--lr", lr, "--metrics-file", str(path)]
        assert run_on_ranks(1, main_body, argv, timeout=120) == [0]
        paths.append(path)
    return paths


@pytest.mark.parametrize("x", ["iteration", "elapsed"])
def test_a_png_of_two_runs_opens(runs, tmp_path, x, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install matplotlib")
    from PIL import Image

    out = tmp_path / "plots" / "both.png"
    assert plot_metrics.main([*map(str, runs), "--output", str(out), "--x", x]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1500, 800)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50        # drawn, not blank
    assert plot_metrics.run_labels([str(p) for p in runs]) == [p.parent.name for p in runs]


def test_the_default_output_sits_beside_the_first_file(runs, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install matplotlib")
    single = tmp_path / "run.jsonl"
    single.write_text(runs[0].read_text())
    assert plot_metrics.main([str(single), "--labels", "high"]) == 0
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_a_resumed_run_s_repeated_iterations_keep_the_last_record(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"iteration": 1, "loss": 5.0}, {"iteration": 2, "loss": 4.0}, {"iteration": 2, "valid_loss": 4.5},
            {"iteration": 2, "loss": 3.0}, {"iteration": 3, "loss": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [(train, valid)] = plot_metrics.read_runs([str(path)])
    assert [(r["iteration"], r["loss"]) for r in train] == [(1, 5.0), (2, 3.0), (3, 2.0)]
    assert valid == [{"iteration": 2, "valid_loss": 4.5}]


@pytest.mark.parametrize("text, message", [
    ("{\"iteration\": 1, \"loss\": 2}\nnot json\n", "m.jsonl:2: not a JSON object"),
    ("{\"loss\": 2}\n", "m.jsonl:1: a record without an iteration"),
    ("", "m.jsonl: holds no training or validation record"),
])
def test_a_file_that_is_not_a_metrics_file_is_one_line(tmp_path, capsys, text, message):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install matplotlib")
    (tmp_path / "m.jsonl").write_text(text)
    assert plot_metrics.main([str(tmp_path / "m.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plot_metrics.py: error: ") and message in err[0]


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    (tmp_path / "m.jsonl").write_text("{\"iteration\": 1, \"loss\": 2}\n")
    assert plot_metrics.main([str(tmp_path / "m.jsonl")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "plot_metrics.py: error: matplotlib is not installed: pip install matplotlib"]
    assert not (tmp_path / "m.png").exists()
