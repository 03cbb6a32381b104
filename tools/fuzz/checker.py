"""Check one draw: its layouts train, save and resume exactly as the serial twin does.

    report = check(draw(17), Path("/tmp/fuzz"))          # CPU processes forked from this one, gloo
    report.ok, report.first_difference, print(report.summary())

For a :class:`~tools.fuzz.sampler.Draw` the checker runs ``pretrain_gpt.py`` three times:

1. the serial twin (the same model, data, seed and batch on one process, no layout flags) for
   ``2 * STEPS_PER_LEG`` iterations (cached per model: draws share it);
2. the first layout for ``STEPS_PER_LEG`` iterations;
3. the resume layout, loading the first one's last checkpoint and training to ``2 * STEPS_PER_LEG``.

Every run saves after every iteration.

Each iteration's loss and gradient norm (from ``--metrics-file``) are compared with the serial run's,
and every tensor of each checkpoint (parameters and optimizer state, read layout-free by
:class:`~megazero.checkpoint.CheckpointReader`) with the serial checkpoint of the same iteration, at
the tolerance of the draw's precision (:data:`TOLERANCES`). ``launch`` runs one command on its ranks
(:mod:`tools.fuzz.launch`): by default, on Linux, forked from this process; or under torchrun.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megazero.checkpoint import CheckpointReader
from megazero.checkpoint.format import checkpoint_dir
from tools.fuzz.launch import DEFAULT_LAUNCHER, LAUNCHERS, Launcher, RunFailed
from tools.fuzz.sampler import STEPS_PER_LEG, Draw, parse_and_validate


@dataclass(frozen=True)
class Tolerance:
    """How close a layout must be to its serial twin. Losses and gradient norms pass when
    ``|got - want| <= rtol * |want|``. A tensor's element passes when it is within its bound:
    ``tensor_rtol * |want| + tensor_atol * max|want| + param_lr * lr`` for parameters (Adam normalises each
    update, so an element whose true gradient is ~0 steps by rounding noise of either sign: up to 4e-4 lr
    in fp32) and ``moment_rtol * |want| + moment_atol * max|want|`` for the optimizer moments
    (``optim.exp_avg``, ``optim.exp_avg_sq``: the gradients' images, no lr floor). In fp32 every element must
    pass, and each moment tensor's norm must be within ``moment_norm_rtol`` of serial besides (``exp_avg``,
    the gradients' image: a clipping factor 5e-6 off, within the gradient norm's 1e-5, moves every element by
    5e-6; a small tensor whose gradient is a sum of terms of both signs, as attention's key/value weights',
    moves by more: 2.3e-5 at draw 11080), twice that for ``exp_avg_sq``, which squares the gradients and so
    doubles their relative difference (seed 38: 1e-5 from that clipping factor; draw 11080: 1.3e-5 to 4.7e-5
    for one key/value weight over five equivalent layouts, cp 2/4, ring or all-gather, dp 1/2, with the
    loss within 1e-7); ``moment_atol`` 1e-4 because an element near zero is a sum of large terms of both
    signs, added in another order by tp, SP and pp over eight micro-batches (2.4e-5 of the largest measured
    at seeds 3 and 4, on 2 of 3072 and 1 of 96 elements, with the loss, gradient norm and parameters within
    1e-5).

    In 16 bits Adam's first step moves an element by ±lr whatever its gradient's size, so an element whose
    gradient is below the precision's rounding steps the other way: a whole lr, 5-30% of a small tensor's
    norm. There a tensor passes when at most ``out_fraction`` of a parameter's elements
    (``moment_out_fraction`` of a moment's) are outside their bound, and the others, together, are within
    ``rest_rtol`` of the tensor's norm. ZeRO++'s int8 moves every element (:data:`TOLERANCES`)."""

    name: str
    loss_rtol: float
    norm_rtol: float
    tensor_rtol: float
    tensor_atol: float
    param_lr: float
    moment_rtol: float | None = None       # None: tensor_rtol
    moment_atol: float = 1e-4               # of the moment tensor's largest element
    moment_norm_rtol: float | None = 3e-5   # the whole moment tensor (None: not checked as a whole)
    out_fraction: float = 0.0               # share of a parameter's elements allowed outside their bound
    moment_out_fraction: float = 0.0        # ... of a moment tensor's
    rest_rtol: float | None = None          # the elements within bound, in norm, relative to the tensor's norm


# fp32: every layout sums the same numbers in another order: ~1e-7 per operation, 1e-5 after a few steps.
# bf16/fp16: the loss within 5e-3 (as tests/test_pretrain_gpt.py's mixed-precision layouts), the gradient norm
# within 3e-2. Their tensors by measurement (docs/fuzzing.md, "16-bit and int8 tensors": the 55 16-bit and int8
# campaign draws rerun as drawn; 53 runs of the 28 with sequence parallelism with its tp sum of norm and bias
# gradients skipped or averaged): a parameter element is out beyond 1e-2 of itself + lr / 2, a moment element
# beyond 0.2 of itself + 0.1 of its tensor's largest. Dense models (11 draws): rounding put at most 6.2% of a
# tensor's elements out, parameters and moments alike, the rest within 0.145 of its norm; every broken run (8)
# had a moment tensor 56-88% out (a halved gradient moves no parameter differently: Adam's step is blind to
# its scale), the rest 0.28-0.60 off. Limits: 15% (parameters), 25% (moments), 0.2 (the rest).
# With experts (23 draws), top-k routing is a step function: rounding sends some tokens to another expert, and
# the router, those experts and the layers after them differ by whole tokens: up to 38% of a parameter's and
# 69% of a moment's elements out, the rest within 0.391; the broken runs (14) went 62-91%, 0.33-0.66. Limits
# 50%, 80%, 0.4 pass every measured rounding and caught 9 of the 14 (the loss or gradient norm 2 more).
# ZeRO++ qwZ/qgZ move int8 values by design: loss within 2e-2, gradient norm 1e-1; as drawn (21 draws) up to
# 100% of a tensor's elements out (qwZ's norm weights), as many as the broken runs (31), so no element rule
# tells them apart: every parameter element within Adam's reach of serial (8 lr: two legs of two steps of at
# most lr each way; 5.9 lr measured), the moments not compared; the records caught 4 of the 31.
TOLERANCES = {
    "fp32": Tolerance("fp32", 1e-5, 1e-5, 1e-4, 1e-5, 2e-3),
    "bf16": Tolerance("bf16", 5e-3, 3e-2, 1e-2, 0.0, 0.5, moment_rtol=0.2, moment_atol=0.1, moment_norm_rtol=None,
                      out_fraction=0.15, moment_out_fraction=0.25, rest_rtol=0.2),
    "moe16": Tolerance("bf16/fp16 with experts", 5e-3, 3e-2, 1e-2, 0.0, 0.5, moment_rtol=0.2, moment_atol=0.1,
                       moment_norm_rtol=None, out_fraction=0.5, moment_out_fraction=0.8, rest_rtol=0.4),
    "quantized": Tolerance("quantized (ZeRO++ int8)", 2e-2, 1e-1, 0.0, 0.0, 4.0 * STEPS_PER_LEG,
                           moment_rtol=math.inf, moment_norm_rtol=None),
}
TOLERANCES["fp16"] = replace(TOLERANCES["bf16"], name="fp16")
# FP8 (docs/fp8.md, "Parallel FP8 equals serial FP8"): each amax is agreed over the ranks that split its tensor,
# so the FP8 values are the serial run's; but where a parallel fp32 value differs from serial by rounding (a sum
# in another order) and sits at an FP8 rounding boundary, the casts differ by one FP8 step (1/8 of a binade in
# e4m3, 1/4 in e5m2) and the difference cascades into the layers below. tests/test_fp8.py bounds whole runs by
# this: the loss within 3e-4 (measured up to 1e-4 at cp 2 over five steps), each parameter within a quarter of
# its movement (at most 4 steps of lr here: one lr). A gradient element, and so a moment element, may differ by
# a whole e5m2 step (0.25 of itself) where a cast flipped. The gradient norm within 3e-2 (bf16's): at draw 24
# (Llama, hybrid, rowwise, resumed at cp 2) iteration 4's norm was 4.7e-3 and 1.2e-2 off in two checks, its
# loss within 1.4e-5 and every tensor within the bounds above; the serial FP8 twin's own norm there moved by
# 7.8e-3 (0.9873, 0.9797; iteration 2 already 4e-9 apart) between two runs of the same command whose
# environments differed (one under tests/conftest.py's ONEDNN_MAX_CPU_ISA cap): fp32 rounding alone, grown
# by FP8 casts. Draws 31 and 109 (delayed) within 1.9e-4 and 6.8e-5. Applied only with FP8 on, as the looser of this and
# the draw's own rule, field by field (:func:`tolerance_for`).
TOLERANCES["fp8"] = Tolerance("fp8", 3e-4, 3e-2, 1e-2, 0.0, 1.0, moment_rtol=0.25, moment_atol=0.1,
                              moment_norm_rtol=None)


def _looser(a: Tolerance, b: Tolerance) -> Tolerance:
    """Each bound the larger of ``a``'s and ``b``'s (None, no whole-tensor check, is the loosest)."""
    def pick(x, y):
        return None if x is None or y is None else max(x, y)
    merged = {f.name: pick(getattr(a, f.name), getattr(b, f.name))
              for f in dataclasses.fields(Tolerance) if f.name != "name"}
    merged["moment_rtol"] = max(a.tensor_rtol if a.moment_rtol is None else a.moment_rtol,
                                b.tensor_rtol if b.moment_rtol is None else b.moment_rtol)
    return Tolerance(f"{a.name} + {b.name}", **merged)


def tolerance_for(d: Draw) -> Tolerance:
    """The draw's rule: ZeRO++ int8 first, then 16 bits with experts, then the precision's own; with FP8 on,
    the looser of that and :data:`TOLERANCES` ``["fp8"]``."""
    if d.lossy:
        own = TOLERANCES["quantized"]
    elif d.axes["precision"] != "fp32" and (d.axes.get("experts") or 0) > 1:
        own = TOLERANCES["moe16"]
    else:
        own = TOLERANCES[d.axes["precision"]]
    return _looser(own, TOLERANCES["fp8"]) if d.fp8 else own


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
    got, want = CheckpointReader(got_dir), CheckpointReader(want_dir)
    try:
        missing = sorted(set(want.tensors) ^ set(got.tensors))
        for name in missing:
            report.differences.append(Difference(iteration, f"tensor {name} (in one checkpoint only)", 0.0, 0.0))
        for name in sorted(set(want.tensors) & set(got.tensors)):
            a, b = got.read_full(name, torch.float64), want.read_full(name, torch.float64)
            if name.startswith(AMAX_HISTORY):
                a = history_at_serial_dp(a, got.index["layout"]["dp"], want.index["layout"]["dp"])
            report.tensors_compared += 1
            if a.shape != b.shape:
                report.differences.append(Difference(iteration, f"tensor {name} shape {list(a.shape)}", 0.0, 0.0,
                                                     f"(serial {list(b.shape)})"))
                continue
            detail = tensor_difference(name, a, b, tol, lr)
            if detail:
                report.differences.append(Difference(iteration, f"tensor {name}{detail[0]}", *detail[1:]))
    finally:
        got.close()
        want.close()


AMAX_HISTORY = "fp8.amax_history/"     # FP8 delayed recipe: [3, history] amaxes of input, weight, output gradient


def history_at_serial_dp(history: torch.Tensor, dp: int, serial_dp: int) -> torch.Tensor:
    """A saved amax history as the serial run records it. At dp d each rank back-propagates its losses
    divided by its own micro-batch count, so the output gradients' amaxes (row 2) are d times the serial
    run's (the FP8 values are the same: the scale's inverse is d times too); the loader rescales that row
    by ``dp / saved dp`` (:func:`megazero.parallel.fp8.load_history_state`), and so does this comparison."""
    if dp == serial_dp:
        return history
    history = history.clone()
    history[2] *= serial_dp / dp
    return history


def tensor_difference(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance,
                      lr: float) -> tuple[str, float, float, str] | None:
    """Why tensor ``name`` is out of tolerance, as (index suffix, got, want, detail), or None when it passes."""
    moment = name.startswith("optim.exp_avg")
    diff = (got - want).abs()
    norm = max(float(want.norm()), 1e-30)
    if moment and tol.moment_norm_rtol is not None:   # the whole moment tensor about as tight as the gradient norm
        rel = float(diff.norm()) / norm
        limit = tol.moment_norm_rtol * (2 if name.startswith("optim.exp_avg_sq") else 1)   # g^2: twice g's
        if rel > limit:
            return "", float(got.norm()), float(want.norm()), \
                f"(norms; relative difference {rel:.1e} > {limit:g})"
    if moment and tol.moment_rtol == math.inf:        # int8: the moments are not compared
        return None
    largest = float(want.abs().max()) if want.numel() else 0.0
    if moment:
        rtol = tol.tensor_rtol if tol.moment_rtol is None else tol.moment_rtol
        bound = rtol * want.abs() + tol.moment_atol * largest
    else:
        bound = tol.tensor_rtol * want.abs() + tol.tensor_atol * largest + tol.param_lr * lr
    out = diff > bound
    fraction = tol.moment_out_fraction if moment else tol.out_fraction
    n_out, allowed = int(out.sum()), int(fraction * want.numel())
    if n_out > allowed:
        i = int((diff - bound).argmax())
        limit = f" (at most {allowed} allowed: {fraction:.0%})" if fraction else ""
        return f"[{i}]", float(got.flatten()[i]), float(want.flatten()[i]), \
            f"({n_out} of {want.numel()} elements out of tolerance{limit}; max abs diff {float(diff.max()):.2e})"
    if tol.rest_rtol is not None:
        rest = float(diff[~out].norm()) / norm
        if rest > tol.rest_rtol:
            return "", float(got.norm()), float(want.norm()), \
                f"(norms; the {want.numel() - n_out} elements within bound differ by {rest:.1e} > {tol.rest_rtol:g})"
    return None


def unusable_workdir(workdir: str | None) -> str | None:
    """Why ``--workdir`` cannot hold the runs (a file, or a directory that cannot be created or written),
    said before any draw trains; None when it can (or is not given: a temporary directory is made)."""
    if workdir is None:
        return None
    path = Path(workdir)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"--workdir {workdir}: {existing} is a file, not a directory: give a directory (made when missing)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--workdir {workdir}: {existing} is not writable: give a directory you can write"
    return None


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
    report.reproduce = reproduce or (f"python -m tools.fuzz_layouts --seed {d.seed} --draws 1   # or by hand, in an "
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
