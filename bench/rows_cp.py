"""Context parallelism: one long sequence split over cp = 1, 2, 4 CPU ranks, for each ``--cp-comm-type``
(p2p ring attention, a2a Ulysses, allgather), beside the memory estimator and the single-process run.

Every variant trains the same GPT (``CPShape``: a long sequence, a small hidden size, two layers, heads
divisible by 4 so that Ulysses runs at cp 4) on one sequence per step; cp 1 is the single process.

* **Step time: the trainer itself.** ``pretrain_gpt.py`` under torchrun with ``--cp N --cp-comm-type T``,
  its own ``step_time_s`` from ``--metrics-file`` (rank 0's wall time per iteration); each variant a fresh
  torchrun, every variant once per round in a rotated order (a load change on the shared machine hits them
  alike); a variant's figure for a round is the median of its timed steps (the first ``warmup`` untimed),
  the row gives the median over rounds and the median of the per-round ratios to cp 1. Its losses must
  equal cp 1's (mock data, same seed: 1e-5 relative, the parity tests' tolerance), else the row says so.
  The trainer's own ``peak_memory_bytes`` is the resident set (largest rank, glibc keeping freed memory),
  not live tensor bytes: shown, but not what the estimator is set against.
* **Memory: live tensor bytes of the trainer's step.** The estimator counts tensors, so it is set against
  live tensor bytes, measured in separate processes (a fresh set per variant: what one variant leaves
  behind would blur the next one's count) through the trainer's own path (``parse_job`` on the same flags,
  ``build_model_chunks``, ``build_engine``, ``train_step`` on the rank's load-balanced slice of the
  sequence): the peak of the second
  step counted by :class:`~megazero.memory.measure.LiveTensorBytes` (opened a step early and marked, as in
  the recompute section), the largest rank; model states = the tensors still reachable after the step; the
  rest (peak - states) is activations and transients. Beside it ``estimate_memory(job, "cpu")`` for the same
  flags: total, and activations + buffers. Also counted there: the bytes each rank sends in the attention's
  collectives per step (the model's comm log, tag "cp").
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
from dataclasses import dataclass

from bench.common import REPO, cores, median, random_micro_batches, reachable_tensor_bytes, spawn, table, torchrun
from megazero.cli.job import parse_job
from megazero.memory.estimate import estimate_memory
from megazero.memory.measure import LiveTensorBytes

MIB = 2**20
LOSS_RTOL = 1e-5           # the parity tests' tolerance: a cp run trains as the single process does
ESTIMATE_TOL = 0.20        # measured / estimated beyond 1 +- this is flagged


@dataclass(frozen=True)
class CPShape:
    """The model, the cp sizes and comm types, and how long each variant runs."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    seq: int = 4096
    vocab: int = 1024
    micro_batch: int = 1
    cps: tuple[int, ...] = (1, 2, 4)
    comm_types: tuple[str, ...] = ("p2p", "a2a", "allgather")
    rounds: int = 2            # rounds of torchruns (every variant once per round)
    steps: int = 3             # steps per torchrun, the first ``warmup`` untimed
    warmup: int = 1

    def argv(self, cp: int, comm_type: str | None) -> list[str]:
        """The trainer's flags for cp ``cp`` (``comm_type`` None at cp 1)."""
        flags = ["--mock-data", "--vocab-size", self.vocab, "--make-vocab-size-divisible-by", 128,
                 "--num-layers", self.layers, "--hidden-size", self.hidden, "--num-attention-heads", self.heads,
                 "--seq-length", self.seq, "--max-position-embeddings", self.seq,
                 "--micro-batch-size", self.micro_batch, "--global-batch-size", self.micro_batch,
                 "--untie-embeddings-and-output-weights", "--lr", 1e-4, "--lr-decay-style", "constant",
                 "--lr-warmup-iters", 0, "--weight-decay", 0.1, "--clip-grad", 1.0, "--seed", 1234]
        if cp > 1:
            flags += ["--cp", cp, "--cp-comm-type", comm_type]
        return [str(f) for f in flags]

    def variants(self, only: list[str] | None = None) -> list[tuple[str, int, str | None]]:
        """(name, cp, comm type) of every variant: ``cp1``, then ``cp2-p2p``, ... (``only``: these names)."""
        out = [("cp1", 1, None)] if 1 in self.cps else []
        out += [(f"cp{cp}-{t}", cp, t) for cp in self.cps if cp > 1 for t in self.comm_types]
        return [v for v in out if not only or v[0] in only]

    def describe(self) -> str:
        return (f"GPT-2 {self.layers} layers x {self.hidden} hidden, {self.heads} heads, seq {self.seq}, vocab "
                f"{self.vocab} untied, micro-batch {self.micro_batch} (one sequence per step), fp32")


CP_SHAPE = CPShape()
QUICK_CP = CPShape(hidden=64, seq=256, vocab=512, cps=(1, 2), rounds=1)


# ------------------------------------------------------------------------------------------- estimate
def estimate(shape: CPShape, cp: int, comm_type: str | None) -> dict:
    """The estimator's figures per rank (bytes) for the variant's flags."""
    job, _ = parse_job(shape.argv(cp, comm_type), cp)
    e = max(estimate_memory(job, "cpu"), key=lambda s: s.total)
    return {"total": e.total, "model_states": e.model_states, "activations": e.activations, "buffers": e.buffers}


# --------------------------------------------------------------------------------------------- memory
def _cp_bytes(chunks) -> float:
    """Bytes this rank's attention sent in its cp collectives since the last reset (the model's comm log)."""
    return sum(c.ctx.comm_log.bytes().get("cp", 0.0) for c in chunks)


def memory_worker(rank: int, world: int, shape: CPShape, comm_type: str | None) -> dict:
    """This rank's peak live bytes of a step (the second), its model states after it and the cp bytes it sent
    in it, through the trainer's path (see the module docstring)."""
    from megazero.parallel.context_layout import rank_slice
    from megazero.parallel.topology import Topology
    from megazero.parallel.zero import build_engine
    from megazero.spec import build_model_chunks, get_model_spec
    from megazero.training import train_step

    job, _ = parse_job(shape.argv(world, comm_type), world)
    par = job.parallel
    topo = Topology(par.tp, par.pp, par.dp, order=par.order, cp=par.cp)
    micro = [[{k: rank_slice(t, 1, topo.cp_rank, topo.cp_size) for k, t in mb.items()}
              for mb in random_micro_batches(shape.vocab, shape.micro_batch, shape.seq, 1, step, 0)]
             for step in range(2)]
    gc.collect()
    base = reachable_tensor_bytes()
    spec = get_model_spec(job.model.model_family)
    chunks = build_model_chunks(spec, job, topo, device="meta" if job.zero.sharded_init else None)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    with LiveTensorBytes() as probe:       # opened a step early: the second step frees what the first left
        train_step(chunks, micro[0], topo, engine, job, spec)
        for c in chunks:
            c.ctx.comm_log.reset()
        probe.mark(reachable_tensor_bytes() - base)
        train_step(chunks, micro[1], topo, engine, job, spec)
    return {"peak": probe.peak, "states": reachable_tensor_bytes() - base, "cp_bytes": _cp_bytes(chunks)}


def run_memory(shape: CPShape, cp: int, comm_type: str | None) -> dict:
    """The variant's figures in its own processes: the largest rank's peak and states, rank 0's cp bytes
    (every rank sends alike)."""
    per_rank = spawn(cp, memory_worker, shape, comm_type)
    return {"peak": max(r["peak"] for r in per_rank), "states": max(r["states"] for r in per_rank),
            "cp_bytes": per_rank[0]["cp_bytes"]}


# ----------------------------------------------------------------------------------------------- time
def run_trainer(shape: CPShape, cp: int, comm_type: str | None) -> dict:
    """One torchrun of ``pretrain_gpt.py``: its timed steps' ``step_time_s``, every step's loss, its peak RSS."""
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "metrics.jsonl")
        flags = shape.argv(cp, comm_type) + ["--train-iters", str(shape.steps), "--log-interval", "1", "--eval-iters",
                                             "0", "--eval-interval", str(10**6), "--metrics-file", metrics]
        run = torchrun(cp, [os.path.join(REPO, "pretrain_gpt.py")], flags)
        if run.returncode != 0:
            return {"unavailable": (run.stderr.strip().splitlines() or ["failed"])[-1][:200]}
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if '"loss"' in line]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[shape.warmup:]),
            "losses": [r["loss"] for r in rows], "rss": max(r["peak_memory_bytes"] for r in rows)}


def run_cp(shape: CPShape, only: list[str] | None = None, log=print) -> dict:
    """Every variant: its estimate, its live-byte figures and its trainer runs (one per round).
    Returns {name: {"cp", "comm_type", "estimate", "memory", "runs"}}."""
    variants = shape.variants(only)
    out = {name: {"cp": cp, "comm_type": t, "estimate": estimate(shape, cp, t), "runs": []} for name, cp, t in variants}
    for name, cp, t in variants:
        log(f"cp: live bytes of {name}")
        out[name]["memory"] = run_memory(shape, cp, t)
    for r in range(shape.rounds):
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        log(f"cp: round {r + 1}/{shape.rounds}: {', '.join(name for name, _, _ in order)}")
        for name, cp, t in order:
            out[name]["runs"].append(run_trainer(shape, cp, t))
    return out


# --------------------------------------------------------------------------------------------- report
def _ratio(x: float, y: float) -> str:
    if not y:
        return "-"
    flag = " **>20%**" if abs(x / y - 1) > ESTIMATE_TOL else ""
    return f"{x / y:.2f}{flag}"


def _mib(x: float) -> str:
    return f"{x / MIB:.1f}" if abs(x) < 100 * MIB else f"{x / MIB:.0f}"


def _loss_diff(runs: list[dict], base: list[dict]) -> float:
    """Largest relative difference of any step's loss to cp 1's (same round's runs)."""
    return max((abs(a - b) / abs(b) for x, y in zip(runs, base) for a, b in zip(x["losses"], y["losses"])),
               default=float("nan"))


def _row(name: str, res: dict, base: dict, n_cores: int) -> list[str]:
    cp, mem, est = res["cp"], res["memory"], res["estimate"]
    runs = [r for r in res["runs"] if "unavailable" not in r]
    base_runs = [r for r in base["runs"] if "unavailable" not in r] if base else []
    acts = mem["peak"] - mem["states"]
    est_acts = est["activations"] + est["buffers"]
    memory = [_mib(mem["peak"]), _mib(est["total"]), _ratio(mem["peak"], est["total"]), _mib(acts),
              _mib(est["activations"]), _mib(est_acts), _ratio(acts, est_acts),
              "-" if not base else f"{mem['peak'] / base['memory']['peak']:.2f}",
              _mib(mem["cp_bytes"]) if cp > 1 else "-"]
    if not runs:
        why = res["runs"][0]["unavailable"] if res["runs"] else "not run"
        return [name, f"{cp / n_cores:g}", *memory, why, "", "", "", ""]
    ms = 1e3 * median([r["step_s"] for r in runs])
    if base_runs and name != "cp1":
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(res["runs"], base["runs"])
                  if "unavailable" not in a and "unavailable" not in b]
        vs = f"{median(ratios):.2f}x"
        diff = _loss_diff(res["runs"], base["runs"])
        same = f"{diff:.1e}" + ("" if diff <= LOSS_RTOL else " **DIFFERS**")
    else:
        vs, same = ("1.00x", "-") if name == "cp1" else ("-", "-")
    ideal = "-"
    if base_runs:
        ideal = f"{1e3 * median([r['step_s'] for r in base_runs]) * max(1.0, cp / n_cores) / cp:.0f}"
    return [name, f"{cp / n_cores:g}", *memory, f"{ms:.0f}", vs, ideal,
            f"{max(r['rss'] for r in runs) / MIB:.0f}", same]


def cp_section(shape: CPShape, results: dict) -> list[str]:
    """BENCHMARKS.md lines from :func:`run_cp`."""
    n_cores = cores()
    base = results.get("cp1")
    rows = [_row(name, res, base, n_cores) for name, res in results.items()]
    sizes = ", ".join(map(str, shape.cps))
    out = [f"## Context parallelism: one long sequence over cp {sizes} ranks, each comm type, beside the estimator",
           "", f"- {shape.describe()}; {n_cores} cores (ranks per core: cp / {n_cores}); trainer runs of "
               f"{shape.steps} steps ({shape.warmup} untimed), {shape.rounds} round{'s' if shape.rounds > 1 else ''}.",
           "", "Memory (per rank, largest rank): peak live tensor bytes of a step through the trainer's own path, "
               "beside `estimate_memory(job, \"cpu\")` for the same flags; `peak - states` is the step's activations "
               "and transients (peak less the model states held after it), set against the estimator's activations "
               "+ buffers; ratios are measured / estimated, flagged beyond "
               f"{ESTIMATE_TOL:.0%}. `vs cp1` (memory): the peak over the single process's. cp MiB: bytes this rank "
               "sends in the attention's collectives per step, forward and backward. Time: `pretrain_gpt.py` under "
               "torchrun, its `step_time_s`, each variant a fresh torchrun per round, rotated; `vs cp1` the median of "
               "the per-round ratios; ideal = cp 1's step x max(1, ranks per core) / cp (the attention's work split "
               "evenly, ranks sharing cores); RSS: the trainer's own `peak_memory_bytes` (resident set, glibc "
               f"keeping freed memory), not live bytes. Loss diff: largest relative difference to cp 1's loss at any "
               f"step (must be <= {LOSS_RTOL:g}).", ""]
    out += table("| variant | ranks/core | peak live MiB | estimated total MiB | measured/est. | peak - states MiB "
                 "| est. activations MiB | est. activations + buffers MiB | measured/est. | peak vs cp1 "
                 "| cp MiB/step | ms/step | vs cp1 | ideal ms | RSS MiB | loss diff vs cp1 |", rows)
    return out + [""]


__all__ = ["CPShape", "CP_SHAPE", "QUICK_CP", "estimate", "run_memory", "run_trainer", "run_cp", "cp_section"]
