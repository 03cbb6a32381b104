"""Check one draw: its layouts train, save and resume exactly as the serial twin does.

    report = check(draw(17), Path("/tmp/fuzz"))          # CPU processes forked from this one, gloo
    report.ok, report.first_difference, print(report.summary())

For a :class:`~megazero.fuzz.sampler.Draw` the checker runs ``pretrain_gpt.py`` three times:

1. the serial twin (the same model, data, seed and batch on one process, no layout flags) for
   ``2 * STEPS_PER_LEG`` iterations (cached per model: draws share it);
2. the first layout for ``STEPS_PER_LEG`` iterations;
3. the resume layout, loading the first one's last checkpoint and training to ``2 * STEPS_PER_LEG``.

Every run saves after every iteration.

Each iteration's loss and gradient norm (from ``--metrics-file``) are compared with the serial run's,
and every tensor of each checkpoint (parameters and optimizer state, read layout-free by
:class:`~megazero.checkpoint.CheckpointReader`) with the serial checkpoint of the same iteration, at
the tolerance of the draw's precision (:data:`TOLERANCES`). ``launch`` runs one command on its ranks
(:mod:`megazero.fuzz.launch`): by default, on Linux, forked from this process; or under torchrun.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megazero.checkpoint.format import checkpoint_dir
from megazero.fuzz.launch import DEFAULT_LAUNCHER, LAUNCHERS, Launcher, RunFailed
from megazero.fuzz.sampler import STEPS_PER_LEG, Draw, parse_and_validate


@dataclass(frozen=True)
class Tolerance:
    """How close a layout must be to its serial twin. A value passes when ``|got - want| <= rtol * |want|``
    (losses, gradient norms) or, for tensors, ``<= rtol * |want| + atol * max|want|`` elementwise, and
    for parameters ``+ param_lr * lr`` besides: Adam normalises each update, so an element whose true
    gradient is ~0 steps by rounding noise of either sign (measured up to 4e-4 lr in fp32). The optimizer
    moments (``optim.exp_avg``, ``optim.exp_avg_sq``) are the gradients' images and get no such floor:
    their norm must be within ``moment_norm_rtol`` of serial (``exp_avg_sq`` squares the gradients, so a
    clipping factor 5e-6 off, within the gradient norm's 1e-5, moves every one of them by 1e-5: seed 38),
    each element within ``moment_atol`` of the
    tensor's largest (an element near zero is a sum of large terms of both signs, added in another order
    by tp, SP and pp over eight micro-batches: 2.4e-5 of the largest was measured at seeds 3 and 4, on
    2 of 3072 and 1 of 96 elements, with the loss, gradient norm and parameters within 1e-5).
    In 16 bits such an element can step the other way (a whole lr), so bf16, fp16 and ZeRO++'s int8
    compare each tensor as a whole (its relative difference in norm) instead of element by element."""

    name: str
    loss_rtol: float
    norm_rtol: float
    tensor_rtol: float
    tensor_atol: float
    param_lr: float
    elementwise: bool = True      # False: a tensor passes when ||got - want|| <= tensor_rtol * ||want||
    moment_atol: float = 1e-4     # fp32 Adam moments, element by element, of the tensor's largest
    moment_norm_rtol: float = 3e-5  # ... and as a whole: exp_avg_sq squares the gradients, doubling their error


# fp32: every layout sums the same numbers in another order: ~1e-7 per operation, 1e-5 after a few steps.
# bf16/fp16: the 16-bit parameters round differently per layout (one bf16 ulp is 0.4%): the loss within
# 5e-3 (as tests/test_pretrain_gpt.py's mixed-precision layouts), the tensors within a few ulps.
# ZeRO++ qwZ/qgZ move int8 values by design: within 2% of serial after a few steps.
TOLERANCES = {
    "fp32": Tolerance("fp32", 1e-5, 1e-5, 1e-4, 1e-5, 2e-3),
    "bf16": Tolerance("bf16", 5e-3, 3e-2, 5e-2, 0.0, 0.0, elementwise=False),
    "fp16": Tolerance("fp16", 5e-3, 3e-2, 5e-2, 0.0, 0.0, elementwise=False),
    "quantized": Tolerance("quantized (ZeRO++ int8)", 2e-2, 1e-1, 1.5e-1, 0.0, 0.0, elementwise=False),
}


def tolerance_for(d: Draw) -> Tolerance:
    return TOLERANCES["quantized" if d.lossy else d.axes["precision"]]


@dataclass(frozen=True)
class Difference:
    """One value out of tolerance: at ``iteration``, ``what`` (loss, grad_norm or a tensor's name)."""

    iteration: int
    what: str
    got: float
    want: float
    detail: str = ""

    def __str__(self) -> str:
        return f"iteration {self.iteration}: {self.what} {self.got:.8g} vs serial {self.want:.8g} {self.detail}".rstrip()


@dataclass
class Report:
    """The outcome of one check: per-iteration rows, the differences found, or the error of a run."""

    draw: Draw
    tolerance: Tolerance
    rows: list = field(default_factory=list)          # (iteration, leg, loss, serial loss, grad norm, serial norm)
    differences: list = field(default_factory=list)
    tensors_compared: int = 0
    error: str | None = None
    reproduce: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.differences

    @property
    def first_difference(self) -> Difference | None:
        return min(self.differences, key=lambda d: d.iteration) if self.differences else None

    @property
    def first_tensor_difference(self) -> Difference | None:
        """The first tensor out of tolerance, at the first iteration that has one (names in sorted order)."""
        tensors = [d for d in self.differences if d.what.startswith("tensor ")]
        return min(tensors, key=lambda d: d.iteration) if tensors else None

    def step_table(self) -> str:
        lines = ["  iter leg     loss            serial loss     rel diff   grad norm       serial norm     rel diff"]
        for it, leg, loss, sloss, norm, snorm in self.rows:
            lines.append(f"  {it:4d} {leg:6s}  {loss:<15.9g} {sloss:<15.9g} {_rel(loss, sloss):8.1e}   "
                         f"{norm:<15.9g} {snorm:<15.9g} {_rel(norm, snorm):8.1e}")
        return "\n".join(lines)

    def summary(self) -> str:
        d = self.draw
        head = (f"draw {d.seed}: {'equal' if self.ok else 'NOT EQUAL' if self.differences else 'ERROR'} "
                f"({self.tolerance.name} tolerance; {len(self.rows)} iterations, {self.tensors_compared} "
                f"tensors compared)")
        lines = [head, f"  layout ({d.world} ranks): {d.describe()}",
                 f"  resumed on ({d.resume_world} ranks): {d.describe('resume')}"]
        if self.error:
            lines.append(f"  error: {self.error}")
        if self.differences:
            first = self.first_difference
            lines.append(f"  first difference: {first}")
            if self.first_tensor_difference not in (None, first):
                lines.append(f"  first tensor that differs: {self.first_tensor_difference}")
            lines += [f"    {x}" for x in self.differences[1:6]]
            if len(self.differences) > 6:
                lines.append(f"    ... {len(self.differences) - 6} more")
        if not self.ok:
            lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def read_records(path: Path) -> dict[int, dict]:
    """The training records of a metrics file by iteration (the last record of an iteration wins)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["iteration"]] = record
    return out


def compare_records(got: dict, want: dict, iterations, tol: Tolerance, leg: str, report: Report) -> None:
    """Loss, gradient norm and the skipped flag of each iteration against the serial run's."""
    for it in iterations:
        if it not in got:
            report.differences.append(Difference(it, "missing record", float("nan"), want[it]["loss"]))
            continue
        g, w = got[it], want[it]
        report.rows.append((it, leg, g["loss"], w["loss"], g["grad_norm"], w["grad_norm"]))
        for key, rtol in (("loss", tol.loss_rtol), ("grad_norm", tol.norm_rtol)):
            if not _rel(g[key], w[key]) <= rtol:
                report.differences.append(Difference(it, key, g[key], w[key],
                                                     f"(rel {_rel(g[key], w[key]):.1e} > {rtol:g})"))
        if g.get("skipped") != w.get("skipped"):
            report.differences.append(Difference(it, "skipped", float(g.get("skipped")), float(w.get("skipped"))))


def compare_checkpoints(got_dir: Path, want_dir: Path, iteration: int, tol: Tolerance, lr: float,
                        report: Report) -> None:
    """Every tensor (parameters and optimizer state) of two checkpoints, by name, layout-free."""
    from megazero.checkpoint import CheckpointReader

    got, want = CheckpointReader(got_dir), CheckpointReader(want_dir)
    try:
        missing = sorted(set(want.tensors) ^ set(got.tensors))
        for name in missing:
            report.differences.append(Difference(iteration, f"tensor {name} (in one checkpoint only)", 0.0, 0.0))
        for name in sorted(set(want.tensors) & set(got.tensors)):
            a, b = got.read_full(name, torch.float64), want.read_full(name, torch.float64)
            report.tensors_compared += 1
            if a.shape != b.shape:
                report.differences.append(Difference(iteration, f"tensor {name} shape {list(a.shape)}", 0.0, 0.0,
                                                     f"(serial {list(b.shape)})"))
                continue
            if not tol.elementwise:
                rel = float((a - b).norm()) / max(float(b.norm()), 1e-30)
                if rel > tol.tensor_rtol:
                    report.differences.append(Difference(iteration, f"tensor {name}", float(a.norm()), float(b.norm()),
                                                         f"(norms; relative difference {rel:.1e} > {tol.tensor_rtol:g})"))
                continue
            moment = name.startswith("optim.exp_avg")
            if moment:          # the whole moment tensor about as tight as the gradient norm
                rel = float((a - b).norm()) / max(float(b.norm()), 1e-30)
                if rel > tol.moment_norm_rtol:
                    report.differences.append(Difference(iteration, f"tensor {name}", float(a.norm()), float(b.norm()),
                                                         f"(norms; relative difference {rel:.1e} > {tol.moment_norm_rtol:g})"))
                    continue
            floor = 0.0 if moment else tol.param_lr * lr
            atol = tol.moment_atol if moment else tol.tensor_atol
            bound = tol.tensor_rtol * b.abs() + atol * float(b.abs().max()) + floor
            excess = (a - b).abs() - bound
            if excess.numel() and float(excess.max()) > 0:
                i = int(excess.argmax())
                report.differences.append(Difference(
                    iteration, f"tensor {name}[{i}]", float(a.flatten()[i]), float(b.flatten()[i]),
                    f"({int((excess > 0).sum())} of {b.numel()} elements out of tolerance; max abs diff "
                    f"{float((a - b).abs().max()):.2e})"))
    finally:
        got.close()
        want.close()


def serial_run(d: Draw, cache: Path, launch: Launcher) -> Path:
    """The serial twin's directory (metrics.jsonl, ckpt/ at both legs' ends), run once per model."""
    key = hashlib.sha1(json.dumps(d.serial_args).encode()).hexdigest()[:16]
    where = cache / f"serial-{key}"
    if (where / "done").exists():
        return where
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    launch(1, d.serial_args + ["--train-iters", str(2 * STEPS_PER_LEG), "--save-interval", "1",
                               "--save", "ckpt", "--metrics-file", "metrics.jsonl"], where)
    (where / "done").write_text(d.command("serial"))
    return where


def leg_args(d: Draw) -> tuple[list[str], list[str]]:
    """The extra flags of the first layout's run and of the resumed run (paths relative to their directory)."""
    k = str(STEPS_PER_LEG)
    first = ["--train-iters", k, "--save", "ckpt", "--save-interval", "1", "--metrics-file", "first.jsonl"]
    second = ["--train-iters", str(2 * STEPS_PER_LEG), "--load", "ckpt", "--save", "ckpt", "--save-interval", "1",
              "--metrics-file", "resumed.jsonl"]
    return first, second


def check(d: Draw, workdir: Path, launch: Launcher = LAUNCHERS[DEFAULT_LAUNCHER], cache: Path | None = None,
          reproduce: str | None = None) -> Report:
    """Run and compare draw ``d`` in ``workdir/draw-<seed>`` (removed when the draw passes)."""
    report = Report(d, tolerance_for(d))
    first, second = leg_args(d)
    report.reproduce = reproduce or (f"python tools/fuzz_layouts.py --seed {d.seed} --draws 1   # or by hand, in an "
                                     f"empty directory: {d.command('first', first)} && "
                                     f"{d.command('resume', second)}; then compare with: "
                                     f"{d.command('serial', ['--train-iters', str(2 * STEPS_PER_LEG)])}")
    where = Path(workdir) / f"draw-{d.seed}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    k, phase = STEPS_PER_LEG, "serial twin"
    lr = parse_and_validate(d.serial_args, 1).optimizer.lr
    try:
        serial = serial_run(d, Path(cache or workdir), launch)
        want = read_records(serial / "metrics.jsonl")
        phase = "first layout"
        launch(d.world, d.args + first, where)
        compare_records(read_records(where / "first.jsonl"), want, range(1, k + 1), report.tolerance, "first", report)
        for it in range(1, k + 1):
            compare_checkpoints(checkpoint_dir(where / "ckpt", it), checkpoint_dir(serial / "ckpt", it), it,
                                report.tolerance, lr, report)
        phase = "resumed layout"
        launch(d.resume_world, d.resume_args + second, where)
        compare_records(read_records(where / "resumed.jsonl"), want, range(k + 1, 2 * k + 1), report.tolerance,
                        "resume", report)
        for it in range(k + 1, 2 * k + 1):
            compare_checkpoints(checkpoint_dir(where / "ckpt", it), checkpoint_dir(serial / "ckpt", it), it,
                                report.tolerance, lr, report)
    except (RunFailed, OSError, ValueError, KeyError) as e:
        report.error = f"{phase}: {type(e).__name__}: {e}"
    if report.ok:
        shutil.rmtree(where, ignore_errors=True)
    return report
