"""Trainer: what a user's run gets. ``pretrain_gpt.py`` itself (its data path, clipping, logging and
metrics, under torchrun) against peers written as their users write them (``bench/peers/``: a plain
FSDP2 script, DDP, DDP + ZeroRedundancyOptimizer, DeepSpeed's engine), every variant in its own
processes, alternated round by round, each row beside its physical floor.

Method, per shape and data-parallel size N:

1. Floors, measured in the same run. Compute: one process stepping the same per-rank batch
   (``pretrain_gpt.py`` at world 1), times the ranks sharing a core (N / cores, at least 1).
   Communication: the bytes the variant must send per rank and step (counted: ZeRO-3 gathers the
   parameters for forward and for backward and reduce-scatters the gradients, 3 x 4Ψ (N-1)/N per
   micro-batch; ZeRO-1/2 reduce-scatter and all-gather once per step, 2 x 4Ψ (N-1)/N; DDP's all-reduce
   the same 2 x 4Ψ (N-1)/N: ``common.dp_comm_bytes``; keep-gathered ZeRO-3 gathers once per step and
   reduce-scatters per micro-batch), over the best gloo rate ``peers/gloo_bandwidth.py`` measures on
   these N ranks (all-reduce, all-gather and reduce-scatter of bucket-size messages, one or several in
   flight: the fastest way this machine moves the bytes, which no variant can beat). Both are measured once per round, in the
   rotation with the variants, and their medians used. The floor is the larger of the two; a row says
   how far above it the measured step is.
2. Rounds: every variant of the group runs once per round, in rotated order, each a fresh torchrun of
   ``steps`` steps (the first ``warmup`` untimed); its figure for the round is the median of its timed
   steps. Ours: the trainer's own ``step_time_s`` from ``--metrics-file`` (rank 0's wall time per
   iteration, logging included). Peers: the slowest rank's time per step.
   The engine-only harness (``rows_scale``'s ZeRO-3 path: our engine on the GPT module in
   ``common.run_variants``, the way BENCHMARKS.md's scale section times it) runs alone as one more
   variant of the ZeRO-3 group, so the trainer's step is compared with it in the same run.
3. Ratio: median over rounds of ours / peer, both timed in the same round; likewise trainer / engine.
4. Memory: after its timed steps every variant runs two untimed steps, the last one's peak live tensor
   bytes counted alike on both sides (ours: ``pretrain_gpt.py --measure-live-bytes``; peers: the same
   probe in ``peers/plain.py``), the largest rank's; beside it the peak RSS over the timed steps.
   Tensors no Python object reaches are added where a peer holds them: DDP's gradient buckets, kept
   by its C++ reducer beside the ``.grad`` tensors (``peers.plain.ddp_bucket_bytes``).

The section closes with one line per acceptance item of the trainer comparison (met / not met /
incomplete, with the figures): :func:`acceptance`.

Ours runs with the trainer's defaults (a user's flags: ``--zero-stage S``, the shape, the batch, the
optimizer settings the peers use), which on CPU keep glibc's reuse of freed memory.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import subprocess
import tempfile
from dataclasses import dataclass

from bench.common import (
    REPO,
    Spec,
    Variant,
    cores,
    dp_comm_bytes,
    num_params,
    run_variants,
    spawn,
    step_batches,
    torchrun,
)
from bench.peers.plain import MEASURED_STEPS
from bench.rows_scale import PhaseClock, build_ours_phased
from megazero.config import ZeroConfig
from megazero.parallel.topology import Topology


@dataclass(frozen=True)
class TrainerShape:
    layers: int
    hidden: int
    heads: int
    seq: int = 64
    vocab: int = 8192
    micro_batch: int = 1
    micro_batches: int = 1
    steps: int = 7
    warmup: int = 2

    def spec(self) -> Spec:
        """The same model and batch as the benchmarks' common :class:`~common.Spec` (the engine-only
        harness runs it; its ``rounds`` are this shape's steps)."""
        return Spec(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq, vocab=self.vocab,
                    micro_batch=self.micro_batch, micro_batches=self.micro_batches, rounds=self.steps, lr=LR,
                    untied=True)

    def params(self) -> int:
        """Ψ, counted on the model (``common.num_params``)."""
        return _params(self.spec())

    def peer_flags(self) -> list[str]:
        return ["--layers", self.layers, "--hidden", self.hidden, "--heads", self.heads, "--seq", self.seq,
                "--vocab", self.vocab, "--micro-batch", self.micro_batch, "--micro-batches", self.micro_batches,
                "--steps", self.steps, "--warmup", self.warmup, "--lr", LR, "--weight-decay", WEIGHT_DECAY]

    def trainer_flags(self, world: int, iters: int) -> list[str]:
        return ["--mock-data", "--vocab-size", self.vocab, "--make-vocab-size-divisible-by", 128,
                "--num-layers", self.layers, "--hidden-size", self.hidden, "--num-attention-heads", self.heads,
                "--seq-length", self.seq, "--max-position-embeddings", self.seq,
                "--micro-batch-size", self.micro_batch,
                "--global-batch-size", self.micro_batch * self.micro_batches * world,
                "--untie-embeddings-and-output-weights", "--train-iters", iters, "--lr", LR,
                "--lr-decay-style", "constant", "--lr-warmup-iters", 0, "--weight-decay", WEIGHT_DECAY,
                "--clip-grad", 1.0, "--seed", 1234, "--log-interval", 1, "--eval-iters", 0,
                "--eval-interval", 10**6]

    def name(self) -> str:
        return f"{self.layers}x{self.hidden}"

    def describe(self) -> str:
        return (f"GPT {self.layers} layers x {self.hidden}, {self.heads} heads, seq {self.seq}, vocab {self.vocab} "
                f"untied ({self.params() / 1e6:.1f}M parameters), fp32, micro-batch {self.micro_batch} x "
                f"{self.micro_batches} per rank, {self.steps} steps per run ({self.warmup} untimed)")


@functools.cache
def _params(spec: Spec) -> int:
    return num_params(spec.model_cfg())


LR, WEIGHT_DECAY = 1e-4, 0.1
TRAINER_SHAPES = (TrainerShape(layers=8, hidden=768, heads=12), TrainerShape(layers=12, hidden=512, heads=8))
QUICK_TRAINER = (TrainerShape(layers=2, hidden=128, heads=4, vocab=1024, steps=4, warmup=1),)
ACCEPTANCE_WORLDS = (2, 4)
ENGINE, ENGINE_TARGET = "engine-zero3", 1.10      # the engine-only harness; trainer / engine at most this

# Our variants (extra trainer flags) and the peers each is compared with, with the ratio to reach.
OURS = {"ours-zero0": ["--zero-stage", 0], "ours-zero1": ["--zero-stage", 1], "ours-zero2": ["--zero-stage", 2],
        "ours-zero3": ["--zero-stage", 3], "ours-zero3-keep": ["--zero-stage", 3, "--zero3-keep-params-gathered"]}
PEER_SCRIPTS = {"torch-ddp": ["ddp"], "torch-ddp-zero": ["ddp", "--zero-redundancy"],
                "torch-fsdp2": ["fsdp2"], "torch-fsdp2-noreshard": ["fsdp2", "--no-reshard"],
                "ds-zero1": ["deepspeed_zero", "--stage", 1], "ds-zero2": ["deepspeed_zero", "--stage", 2],
                "ds-zero3": ["deepspeed_zero", "--stage", 3]}        # modules of bench/peers/ and their flags
GROUPS = {"ours-zero0": {"torch-ddp": 1.0}, "ours-zero1": {"torch-ddp-zero": 0.9, "ds-zero1": 0.9},
          "ours-zero2": {"torch-ddp-zero": 0.9, "ds-zero2": 0.9}, "ours-zero3": {"torch-fsdp2": 0.8, "ds-zero3": 0.8},
          "ours-zero3-keep": {"torch-fsdp2-noreshard": 0.8}}
# The ZeRO stage whose traffic each variant has (``common.dp_comm_bytes``); None: keep-gathered ZeRO-3.
STAGE_OF = {"ours-zero0": 0, "torch-ddp": 0, "ours-zero1": 1, "torch-ddp-zero": 1, "ds-zero1": 1, "ours-zero2": 2,
            "ds-zero2": 2, "ours-zero3": 3, "torch-fsdp2": 3, "ds-zero3": 3, ENGINE: 3, "ours-zero3-keep": None,
            "torch-fsdp2-noreshard": None}


def _torchrun(world: int, target: list[str], args: list, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``target`` (a script path, or ``-m`` and a module) under torchrun on ``world`` processes
    (:func:`bench.common.torchrun`). A failed run is run once more (a run that fails twice is reported;
    one transient failure, such as a rendezvous port taken by the previous run's teardown, once left a
    peer's row empty for the whole section): the retry's result is returned."""
    run = torchrun(world, target, args, timeout)
    if run.returncode != 0 and "No module named" not in run.stderr:
        print(f"  {os.path.basename(target[-1])} failed ({failure_line(run.stderr)}); once more", flush=True)
        run = torchrun(world, target, args, timeout)
    return run


def _peer(module: str) -> list[str]:
    """The torchrun target of the peer script ``bench/peers/<module>.py``."""
    return ["-m", f"bench.peers.{module}"]


def failure_line(stderr: str) -> str:
    """The line of a failed run's stderr that says why: the last raising an exception (``SomeError: ...``),
    else the last that is not part of torchrun's closing report (its rules of '=' or '-' and fields such
    as ``error_file: <N/A>``)."""
    lines = [x.strip() for x in stderr.strip().splitlines() if x.strip().strip("=-")]
    raised = [x for x in lines if re.search(r"\b[A-Z]\w*(Error|Exception|Interrupt)\b", x)
              and "ChildFailedError" not in x]                # torchrun's own, after the child's
    said = [x for x in lines if not re.match(r"^(error_file|traceback|exitcode|rank|host|time|root cause|"
                                             r"failures|<NO_OTHER_FAILURES>|\[\d+\]|\S+ FAILED)", x, re.IGNORECASE)]
    return ((raised or said or lines or ["failed"])[-1])[:200]


def run_ours(shape: TrainerShape, world: int, extra: list, measure_live: bool = True) -> dict:
    """``pretrain_gpt.py`` under torchrun: per-step seconds (timed steps), losses, peak RSS and bytes sent
    per step from its metrics file; ``measure_live``: :data:`MEASURED_STEPS` more iterations under
    ``--measure-live-bytes`` (untimed), whose last one's peak live bytes it returns as well."""
    more = MEASURED_STEPS if measure_live else 0
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        run = _torchrun(world, [os.path.join(REPO, "pretrain_gpt.py")],
                        shape.trainer_flags(world, shape.steps + more) + ["--dp", world, *extra, "--metrics-file",
                                                                           metrics]
                        + (["--measure-live-bytes"] if measure_live else []))
        if run.returncode != 0:
            return {"unavailable": failure_line(run.stderr)}
        rows = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    timed = rows[:shape.steps]
    out = {"step_s": [r["step_time_s"] for r in timed[shape.warmup:]], "losses": [r["loss"] for r in timed],
           "peak_rss_mib": max(r["peak_memory_bytes"] for r in timed) / 2**20,
           "dp_comm_bytes": statistics.median(r["dp_comm_bytes"] for r in timed)}
    if measure_live:
        out["peak_live_mib"] = rows[-1]["peak_live_bytes"] / 2**20
    return out


def run_peer(shape: TrainerShape, world: int, name: str, with_deepspeed: bool = True) -> dict:
    script, *flags = PEER_SCRIPTS[name]
    if script == "deepspeed_zero":
        if not with_deepspeed:
            return {"unavailable": "skipped (--no-deepspeed)"}
        flags += ["--bucket-size", ZeroConfig.bucket_size]
    run = _torchrun(world, _peer(script), [*flags, *shape.peer_flags()])
    lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
    if run.returncode != 0 or not lines:
        why = failure_line(run.stderr)
        return {"unavailable": "not installed" if "No module named 'deepspeed'" in run.stderr else why}
    return json.loads(lines[-1])


def engine_worker(rank: int, world: int, spec: Spec) -> dict:
    """One rank of the engine-only harness: ``rows_scale``'s ZeRO-3 engine alone in ``run_variants``."""
    topo = Topology(dp=world)
    res = run_variants([Variant(ENGINE, lambda: build_ours_phased(spec, topo, 3, PhaseClock()))],
                       step_batches(spec, spec.rounds, world, rank))
    return {"step_s": res[ENGINE]["times"], "losses": res[ENGINE]["losses"]}


def run_engine(shape: TrainerShape, world: int) -> dict:
    try:
        return spawn(world, engine_worker, shape.spec())[0]
    except RuntimeError as e:
        return {"unavailable": str(e).strip().splitlines()[-1][:200]}


def measure_floors(shape: TrainerShape, world: int) -> dict:
    """One round's floors: the one-process step time (the compute floor before sharing cores) and the
    best gloo rate on ``world`` ranks, with messages of the trainer's bucket size."""
    serial = run_ours(shape, 1, [], measure_live=False)
    bucket_mib = ZeroConfig.bucket_size * 4 / 2**20
    bw = _torchrun(world, _peer("gloo_bandwidth"), ["--mib", bucket_mib])
    rates = json.loads([x for x in bw.stdout.splitlines() if x.startswith("{")][-1])["bytes_per_s"]
    return {"serial_s": statistics.median(serial["step_s"]), "bytes_per_s": max(rates.values())}


def combine_floors(rounds: list[dict]) -> dict:
    """The floors of a (shape, world): the medians over its rounds, and the cores they share."""
    return {"serial_s": statistics.median(r["serial_s"] for r in rounds),
            "bytes_per_s": statistics.median(r["bytes_per_s"] for r in rounds), "rounds": len(rounds),
            "cores": cores()}


def comm_bytes(name: str, shape: TrainerShape, world: int) -> float:
    """Bytes each rank of variant ``name`` must send per step (ring): ``common.dp_comm_bytes`` at its
    stage; keep-gathered ZeRO-3 gathers the parameters once per step and reduce-scatters the gradients
    of every micro-batch."""
    stage, psi = STAGE_OF[name], shape.params()
    if stage is None:
        return (shape.micro_batches + 1) * 4.0 * psi * (world - 1) / world
    return dp_comm_bytes(psi, world, stage, micro=shape.micro_batches)


def floor_seconds(name: str, shape: TrainerShape, world: int, floors: dict) -> tuple[float, float]:
    """(compute floor, communication floor) of variant ``name``, in seconds per step."""
    compute = floors["serial_s"] * max(1.0, world / floors["cores"])
    return compute, comm_bytes(name, shape, world) / floors["bytes_per_s"]


def variant_names(only: list[str] | None = None) -> list[str]:
    """Our variants (``only`` those), their peers, and the engine-only harness beside ZeRO-3."""
    ours = [n for n in OURS if not only or n in only]
    peers = dict.fromkeys(p for n in ours for p in GROUPS[n])       # once each, though two groups share one
    return ours + list(peers) + ([ENGINE] if "ours-zero3" in ours else [])


FLOORS = "floors"     # measured once per round too, in the rotation: the machine's load drifts


def run_trainer(shapes, worlds, rounds: int, log, only: list[str] | None = None,
                with_deepspeed: bool = True) -> list[dict]:
    """Every (shape, world): ``rounds`` alternated rounds of every variant and of the floors'
    measurement. Returns one result per (shape, world): {"shape", "world", "floors" (medians over the
    rounds), "runs": {name: [per-round result]}}."""
    out = []
    for shape in shapes:
        for world in worlds:
            names = variant_names(only) + [FLOORS]
            runs = {n: [] for n in names}
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                log(f"trainer: round {r + 1}/{rounds}: {', '.join(order)}")
                for name in order:
                    if runs[name] and "unavailable" in runs[name][0]:     # not installed, skipped, failed
                        continue
                    runs[name].append(run_ours(shape, world, OURS[name]) if name in OURS
                                      else run_engine(shape, world) if name == ENGINE
                                      else measure_floors(shape, world) if name == FLOORS
                                      else run_peer(shape, world, name, with_deepspeed))
            floors = combine_floors(runs.pop(FLOORS))
            out.append({"shape": shape, "world": world, "floors": floors, "runs": runs})
    return out


# ---------------------------------------------------------------------------------------- report
def _ran(results: list[dict]) -> bool:
    return bool(results) and "unavailable" not in results[0]


def _median_step(results: list[dict]) -> float:
    """The median over rounds of each round's median step; a round whose run failed twice is left out."""
    steps = [statistics.median(r["step_s"]) for r in results if "step_s" in r]
    return statistics.median(steps) if steps else math.nan


def _median_of(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results) if results and key in results[0] else math.nan


def _ratio(ours: list[dict], peer: list[dict]) -> float:
    pairs = [statistics.median(a["step_s"]) / statistics.median(b["step_s"]) for a, b in zip(ours, peer)
             if "step_s" in a and "step_s" in b]                # a round where either failed twice: left out
    return statistics.median(pairs) if pairs else math.nan


def _why(results: list[dict]) -> str:
    return results[0]["unavailable"] if results else "not run"


def pair_rows(res: dict) -> list[dict]:
    """The figures of every (ours, peer) pair of one (shape, world) result that both ran."""
    shape, world, floors, runs = res["shape"], res["world"], res["floors"], res["runs"]
    out = []
    for ours, peers in GROUPS.items():
        for peer, target in peers.items():
            a, b = runs.get(ours, []), runs.get(peer, [])
            row = {"shape": shape.name(), "world": world, "ours": ours, "peer": peer, "target": target}
            if not (_ran(a) and _ran(b)):
                row["missing"] = _why(a) if not _ran(a) else _why(b)
                if ours in runs and peer in runs:
                    out.append(row)
                continue
            row.update(ours_ms=1e3 * _median_step(a), peer_ms=1e3 * _median_step(b), ratio=_ratio(a, b),
                       ours_floor=_median_step(a) / max(floor_seconds(ours, shape, world, floors)),
                       peer_floor=_median_step(b) / max(floor_seconds(peer, shape, world, floors)),
                       ours_live=_median_of(a, "peak_live_mib"), peer_live=_median_of(b, "peak_live_mib"),
                       ours_rss=_median_of(a, "peak_rss_mib"), peer_rss=_median_of(b, "peak_rss_mib"))
            out.append(row)
    return out


def engine_row(res: dict) -> dict | None:
    """Trainer / engine-only harness at ZeRO-3 for one (shape, world), or None where not run."""
    runs = res["runs"]
    if ENGINE not in runs or "ours-zero3" not in runs:
        return None
    a, b = runs["ours-zero3"], runs[ENGINE]
    row = {"shape": res["shape"].name(), "world": res["world"]}
    if not (_ran(a) and _ran(b)):
        return {**row, "missing": _why(a) if not _ran(a) else _why(b)}
    return {**row, "trainer_ms": 1e3 * _median_step(a), "engine_ms": 1e3 * _median_step(b), "ratio": _ratio(a, b)}


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or math.isnan(x) else format(x, spec)


def trainer_section(results: list[dict]) -> list[str]:
    """The BENCHMARKS.md section: per (shape, dp) a table of (ours, peer) pairs with floors and memory,
    the bytes ours sent beside the formula's, trainer / engine; then the acceptance lines."""
    out = ["## The trainer as users run it vs peers as their users write them", "",
           "`pretrain_gpt.py` under torchrun (its own `step_time_s`), against plain scripts in `bench/peers/`, "
           "each variant a separate torchrun, alternated per round; ratio = median over rounds of ours / peer "
           "(below 1: ours faster). Floor = max(compute: a one-process step x ranks per core, communication: "
           "counted bytes per rank / the best gloo rate measured in the same run: all-reduce, all-gather or "
           "reduce-scatter of bucket-size messages, 1, 2 or 4 in flight); 'x floor' = measured / floor. "
           "Live MiB: peak live tensor bytes of an untimed step after the timed ones, the largest rank's, counted "
           "alike on both sides (the profiler's allocation events; ours `--measure-live-bytes`); RSS MiB: peak "
           "resident set over the timed steps, glibc's default allocator settings on both sides. DeepSpeed's "
           "buckets are set to megazero's bucket size. `engine-zero3`: the engine-only harness "
           "(`rows_scale`'s ZeRO-3 path, what the scale section times), alone in its processes.", ""]
    for res in results:
        shape, world, floors, runs = res["shape"], res["world"], res["floors"], res["runs"]
        out += [f"### {shape.describe()}, dp {world}", "",
                f"One process: {1000 * floors['serial_s']:.0f} ms/step; gloo (best way): "
                f"{floors['bytes_per_s'] / 2**30:.2f} GiB/s per rank; {floors['cores']} cores (medians over "
                f"{floors.get('rounds', 1)} rounds, measured in the rotation with the variants).", "",
                "| ours | peer | ours ms | peer ms | ours/peer | target | ours x floor | peer x floor | ours live MiB "
                "| peer live MiB | ours RSS MiB | peer RSS MiB | live ours <= peer |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pair_rows(res):
            if "missing" in r:
                out.append(f"| {r['ours']} | {r['peer']} | {r['missing']} | | | {r['target']} | | | | | | | |")
                continue
            out.append(f"| {r['ours']} | {r['peer']} | {r['ours_ms']:.0f} | {r['peer_ms']:.0f} | "
                       f"{r['ratio']:.2f}x{'' if r['ratio'] <= r['target'] else ' (over)'} | {r['target']} | "
                       f"{r['ours_floor']:.2f} | {r['peer_floor']:.2f} | {_fmt(r['ours_live'], '.1f')} | "
                       f"{_fmt(r['peer_live'], '.1f')} | {_fmt(r['ours_rss'], '.0f')} | {_fmt(r['peer_rss'], '.0f')} | "
                       f"{'yes' if r['ours_live'] <= r['peer_live'] else 'no'} |")
        sent = [f"{n} {_median_of(runs[n], 'dp_comm_bytes') / 2**20:.2f} MiB (formula "
                f"{comm_bytes(n, shape, world) / 2**20:.2f})" for n in OURS if _ran(runs.get(n, []))]
        out += ["", "Bytes each rank sent per step (the trainer's count) beside the formula's: "
                + ("; ".join(sent) or "none ran") + "."]
        e = engine_row(res)
        if e is not None and "missing" in e:
            out.append(f"trainer / engine: not measured ({e['missing']}).")
        elif e is not None:
            out.append(f"trainer / engine = {e['ratio']:.2f} (target <= {ENGINE_TARGET:.2f}): ours-zero3 "
                       f"{e['trainer_ms']:.0f} ms, {ENGINE} {e['engine_ms']:.0f} ms, median of per-round ratios.")
        out.append("")
    return out + acceptance(results) + [""]


def _status(failed: bool, complete: bool) -> str:
    return "NOT MET" if failed else "met" if complete else "incomplete"


def _coverage(results: list[dict]) -> tuple[bool, str]:
    """(whether every acceptance shape and dp size was measured, what was)."""
    measured = {(r["shape"].name(), r["world"]) for r in results}
    wanted = {(s.name(), w) for s in TRAINER_SHAPES for w in ACCEPTANCE_WORLDS}
    said = ", ".join(f"{s} dp {w}" for s, w in sorted(measured))
    return wanted <= measured, said


def acceptance(results: list[dict]) -> list[str]:
    """One line per acceptance item of the trainer comparison: met / NOT MET / incomplete (not every
    shape, dp size or peer measured) with the figures it is judged on, all computed from the rows."""
    covered, measured = _coverage(results)
    rows = [r for res in results for r in pair_rows(res)]
    ran = [r for r in rows if "missing" not in r]
    complete = covered and len(ran) == len(rows) == len(results) * sum(map(len, GROUPS.values()))
    out = ["### Acceptance", "", f"Measured: {measured or 'nothing'}; the acceptance asks for "
           f"{', '.join(s.name() for s in TRAINER_SHAPES)} at dp {' and '.join(map(str, ACCEPTANCE_WORLDS))}." +
           (f" Not measured: {'; '.join(sorted({r['peer'] + ': ' + r['missing'] for r in rows if 'missing' in r}))}."
            if len(ran) < len(rows) else ""), ""]
    engines = [e for e in (engine_row(res) for res in results) if e is not None]
    timed = [e for e in engines if "missing" not in e]
    main = (TRAINER_SHAPES[0].name(), max(ACCEPTANCE_WORLDS))
    engine_complete = any((e["shape"], e["world"]) == main for e in timed)
    out.append(f"- Trainer at the engine's speed (ZeRO-3, trainer / engine-only harness <= {ENGINE_TARGET:.2f}, "
               f"{main[0]} dp {main[1]}): {_status(any(e['ratio'] > ENGINE_TARGET for e in timed), engine_complete)}"
               f" -- " + ("; ".join(f"{e['shape']} dp {e['world']}: {e['ratio']:.2f} ({e['trainer_ms']:.0f} / "
                                   f"{e['engine_ms']:.0f} ms)" for e in timed) or "not measured"))
    over = [r for r in ran if r["ratio"] > r["target"]]
    figures = "; ".join(f"{r['shape']} dp {r['world']} {r['ours']} vs {r['peer']} {r['ratio']:.2f}x (<= {r['target']})"
                        for r in ran)
    out.append(f"- Trainer-path step ratios (ZeRO-3 <= 0.8x FSDP2 and DeepSpeed ZeRO-3, keep-gathered <= 0.8x FSDP2 "
               f"without resharding, ZeRO-1/2 <= 0.9x DDP + ZeroRedundancyOptimizer and DeepSpeed ZeRO-1/2, ZeRO-0 "
               f"<= 1.0x DDP): {_status(bool(over), complete)}"
               + (f" -- over: {len(over)} of {len(ran)} pairs" if over else "") + f" -- {figures or 'none measured'}")
    live = [r for r in ran if not math.isnan(r["ours_live"]) and not math.isnan(r["peer_live"])]
    heavier = [r for r in live if r["ours_live"] > r["peer_live"]]
    out.append(f"- Peak live bytes at or below each peer's: {_status(bool(heavier), complete and len(live) == len(ran))}"
               + (f" -- above: {len(heavier)} of {len(live)} pairs" if heavier else "") + " -- "
               + ("; ".join(f"{r['shape']} dp {r['world']} {r['ours']} {r['ours_live']:.1f} vs {r['peer']} "
                            f"{r['peer_live']:.1f} MiB" for r in live) or "none measured"))
    sides = [(r["ours_floor"], r["ours"], r) for r in ran] + [(r["peer_floor"], r["peer"], r) for r in ran]
    if sides:
        x, name, r = max(sides, key=lambda s: s[0])
        res = next(res for res in results if res["shape"].name() == r["shape"] and res["world"] == r["world"])
        compute, comm = floor_seconds(name, res["shape"], r["world"], res["floors"])
        bound = "communication" if comm > compute else "compute"
        out.append(f"- Every row beside its floor: {_status(False, complete)} -- furthest: "
                   f"{name} at {r['shape']} dp {r['world']}, {x:.2f}x its floor ({bound}-bound: compute "
                   f"{1e3 * compute:.0f} ms, communication {1e3 * comm:.0f} ms)")
        below = [(x, name, r) for x, name, r in sides if x < 1.0]
        out.append("- No row below its floor (a floor beaten is a floor measured too low): "
                   + ("yes" if not below else f"NO -- {len(below)} of {len(sides)}: " + "; ".join(
                       f"{name} at {r['shape']} dp {r['world']} {x:.2f}x" for x, name, r in sorted(below)[:4])))
    else:
        out.append("- Every row beside its floor: incomplete -- no pair ran")
    out.append("- Capacity (ZeRO-3 fits at least FSDP2's layers): not measured here -- the capacity section's")
    return out
