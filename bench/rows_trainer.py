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
   the same 2 x 4Ψ (N-1)/N; keep-gathered ZeRO-3 gathers once), over the gloo bandwidth
   ``peers/gloo_bandwidth.py`` measures on these N ranks. The floor is the larger of the two; a row
   says how far above it the measured step is.
2. Rounds: every variant of the group runs once per round, in rotated order, each a fresh torchrun of
   ``steps`` steps (the first ``warmup`` untimed); its figure for the round is the median of its timed
   steps. Ours: the trainer's own ``step_time_s`` from ``--metrics-file`` (rank 0's wall time per
   iteration, logging included). Peers: the slowest rank's time per step.
3. Ratio: median over rounds of ours / peer, both timed in the same round.

Ours runs with the trainer's defaults (a user's flags: ``--zero-stage S``, the shape, the batch, the
optimizer settings the peers use), which on CPU keep glibc's reuse of freed memory.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = os.path.join(HERE, "peers")


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

    def params(self) -> int:
        """Ψ of the untied GPT-2 shape (embeddings, positions, layers, final norm, output layer)."""
        h = self.hidden
        layer = 4 * h * h + 4 * h + 8 * h * h + 5 * h + 4 * h
        return self.vocab * h + self.seq * h + self.layers * layer + 2 * h + self.vocab * h

    def peer_flags(self) -> list[str]:
        return ["--layers", self.layers, "--hidden", self.hidden, "--heads", self.heads, "--seq", self.seq,
                "--vocab", self.vocab, "--micro-batch", self.micro_batch, "--micro-batches", self.micro_batches,
                "--steps", self.steps, "--warmup", self.warmup, "--lr", LR, "--weight-decay", WEIGHT_DECAY]

    def trainer_flags(self, world: int) -> list[str]:
        return ["--mock-data", "--vocab-size", self.vocab, "--make-vocab-size-divisible-by", 128,
                "--num-layers", self.layers, "--hidden-size", self.hidden, "--num-attention-heads", self.heads,
                "--seq-length", self.seq, "--max-position-embeddings", self.seq,
                "--micro-batch-size", self.micro_batch,
                "--global-batch-size", self.micro_batch * self.micro_batches * world,
                "--untie-embeddings-and-output-weights", "--train-iters", self.steps, "--lr", LR,
                "--lr-decay-style", "constant", "--lr-warmup-iters", 0, "--weight-decay", WEIGHT_DECAY,
                "--clip-grad", 1.0, "--seed", 1234, "--log-interval", 1, "--eval-iters", 0,
                "--eval-interval", 10**6]

    def describe(self) -> str:
        return (f"GPT {self.layers} layers x {self.hidden}, {self.heads} heads, seq {self.seq}, vocab {self.vocab} "
                f"untied ({self.params() / 1e6:.1f}M parameters), fp32, micro-batch {self.micro_batch} x "
                f"{self.micro_batches} per rank, {self.steps} steps per run ({self.warmup} untimed)")


LR, WEIGHT_DECAY = 1e-4, 0.1
TRAINER_SHAPES = (TrainerShape(layers=8, hidden=768, heads=12), TrainerShape(layers=12, hidden=512, heads=8))
QUICK_TRAINER = (TrainerShape(layers=2, hidden=128, heads=4, vocab=1024, steps=4, warmup=1),)

# Our variants (extra trainer flags) and the peers each is compared with, with the ratio to reach.
OURS = {"ours-zero0": ["--zero-stage", 0], "ours-zero1": ["--zero-stage", 1], "ours-zero2": ["--zero-stage", 2],
        "ours-zero3": ["--zero-stage", 3], "ours-zero3-keep": ["--zero-stage", 3, "--zero3-keep-params-gathered"]}
PEER_SCRIPTS = {"torch-ddp": ["ddp.py"], "torch-ddp-zero": ["ddp.py", "--zero-redundancy"],
                "torch-fsdp2": ["fsdp2.py"], "torch-fsdp2-noreshard": ["fsdp2.py", "--no-reshard"],
                "ds-zero1": ["deepspeed_zero.py", "--stage", 1], "ds-zero2": ["deepspeed_zero.py", "--stage", 2],
                "ds-zero3": ["deepspeed_zero.py", "--stage", 3]}
GROUPS = {"ours-zero0": {"torch-ddp": 1.0}, "ours-zero1": {"torch-ddp-zero": 0.9, "ds-zero1": 0.9},
          "ours-zero2": {"torch-ddp-zero": 0.9, "ds-zero2": 0.9}, "ours-zero3": {"torch-fsdp2": 0.8, "ds-zero3": 0.8},
          "ours-zero3-keep": {"torch-fsdp2-noreshard": 0.8}}
# Bytes each rank sends per step, in units of 4Ψ(N-1)/N: (per micro-batch, per step).
COMM_UNITS = {"ours-zero0": (0, 2), "torch-ddp": (0, 2), "ours-zero1": (0, 2), "ours-zero2": (0, 2),
              "torch-ddp-zero": (0, 2), "ds-zero1": (0, 2), "ds-zero2": (0, 2), "ours-zero3": (3, 0),
              "ds-zero3": (3, 0), "torch-fsdp2": (3, 0), "ours-zero3-keep": (1, 1), "torch-fsdp2-noreshard": (1, 1)}


def _torchrun(world: int, script: str, args: list, timeout: float = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), script,
           *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def run_ours(shape: TrainerShape, world: int, extra: list) -> dict:
    """``pretrain_gpt.py`` under torchrun: per-step seconds (timed steps) and losses from its metrics file."""
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        run = _torchrun(world, os.path.join(ROOT, "pretrain_gpt.py"),
                        shape.trainer_flags(world) + ["--dp", world, *extra, "--metrics-file", metrics])
        if run.returncode != 0:
            return {"unavailable": (run.stderr.strip().splitlines() or ["failed"])[-1][:200]}
        rows = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    return {"step_s": [r["step_time_s"] for r in rows[shape.warmup:]], "losses": [r["loss"] for r in rows],
            "peak_rss_mib": max(r["peak_memory_bytes"] for r in rows) / 2**20,
            "dp_comm_bytes": statistics.median(r["dp_comm_bytes"] for r in rows)}


def run_peer(shape: TrainerShape, world: int, name: str) -> dict:
    script, *flags = PEER_SCRIPTS[name]
    run = _torchrun(world, os.path.join(PEERS, script), [*flags, *shape.peer_flags()])
    lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
    if run.returncode != 0 or not lines:
        why = (run.stderr.strip().splitlines() or ["failed"])[-1][:200]
        return {"unavailable": "not installed" if "No module named 'deepspeed'" in run.stderr else why}
    return json.loads(lines[-1])


def measure_floors(shape: TrainerShape, world: int) -> dict:
    """One-process step time (compute floor before sharing cores) and the gloo bandwidth on ``world`` ranks."""
    serial = run_ours(shape, 1, [])
    bw = _torchrun(world, os.path.join(PEERS, "gloo_bandwidth.py"), ["--mib", 64])
    rates = json.loads([x for x in bw.stdout.splitlines() if x.startswith("{")][-1])["bytes_per_s"]
    return {"serial_s": statistics.median(serial["step_s"]), "bytes_per_s": min(rates.values()),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def floor_seconds(name: str, shape: TrainerShape, world: int, floors: dict) -> tuple[float, float]:
    """(compute floor, communication floor) of variant ``name``, in seconds per step."""
    compute = floors["serial_s"] * max(1.0, world / floors["cores"])
    per_micro, per_step = COMM_UNITS[name]
    units = per_micro * shape.micro_batches + per_step
    comm = units * 4 * shape.params() * (world - 1) / world / floors["bytes_per_s"]
    return compute, comm


def run_trainer(shapes, worlds, rounds: int, log, only: list[str] | None = None) -> list[dict]:
    """Every (shape, world): floors, then ``rounds`` alternated rounds of every variant. Returns one
    result per (shape, world): {"shape", "world", "floors", "runs": {name: [per-round result]}}."""
    out = []
    for shape in shapes:
        for world in worlds:
            log(f"trainer: {shape.layers} x {shape.hidden}, dp {world}: floors")
            floors = measure_floors(shape, world)
            names = [n for n in OURS if not only or n in only]
            names += list(dict.fromkeys(p for n in names for p in GROUPS[n]))    # each peer once
            runs = {n: [] for n in names}
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                log(f"trainer: round {r + 1}/{rounds}: {', '.join(order)}")
                for name in order:
                    if runs[name] and "unavailable" in runs[name][0]:
                        continue
                    runs[name].append(run_ours(shape, world, OURS[name]) if name in OURS
                                      else run_peer(shape, world, name))
            out.append({"shape": shape, "world": world, "floors": floors, "runs": runs})
    return out


def _median_step(results: list[dict]) -> float:
    return statistics.median(statistics.median(r["step_s"]) for r in results) if results else math.nan


def _ratio(ours: list[dict], peer: list[dict]) -> float:
    pairs = [statistics.median(a["step_s"]) / statistics.median(b["step_s"]) for a, b in zip(ours, peer)]
    return statistics.median(pairs) if pairs else math.nan


def trainer_section(results: list[dict]) -> list[str]:
    """The BENCHMARKS.md section: one row per (ours, peer) pair, and each variant's floor."""
    out = ["## The trainer as users run it vs peers as their users write them", "",
           "`pretrain_gpt.py` under torchrun (its own `step_time_s`), against plain scripts in `bench/peers/`, "
           "each variant a separate torchrun, alternated per round; ratio = median over rounds of ours / peer "
           "(below 1: ours faster). Floor = max(compute: a one-process step x ranks per core, communication: "
           "counted bytes per rank / gloo bandwidth measured in the same run); 'x floor' = measured / floor.", ""]
    for res in results:
        shape, world, floors, runs = res["shape"], res["world"], res["floors"], res["runs"]
        out += [f"### {shape.describe()}, dp {world}", "",
                f"One process: {1000 * floors['serial_s']:.0f} ms/step; gloo: "
                f"{floors['bytes_per_s'] / 2**30:.2f} GiB/s per rank; {floors['cores']} cores.", "",
                "| ours | peer | ours ms | peer ms | ours/peer | target | ours x floor | peer x floor |",
                "|---|---|---|---|---|---|---|---|"]
        for ours, peers in GROUPS.items():
            if ours not in runs:
                continue
            for peer, target in peers.items():
                a, b = runs[ours], runs.get(peer, [])
                if not a or "unavailable" in a[0]:
                    out.append(f"| {ours} | {peer} | {a[0]['unavailable'] if a else 'not run'} | | | | | |")
                    continue
                fa = max(floor_seconds(ours, shape, world, floors))
                if not b or "unavailable" in b[0]:
                    out.append(f"| {ours} | {peer} | {1000 * _median_step(a):.0f} | "
                               f"{b[0]['unavailable'] if b else 'not run'} | | {target} | "
                               f"{_median_step(a) / fa:.2f} | |")
                    continue
                fb = max(floor_seconds(peer, shape, world, floors))
                ratio = _ratio(a, b)
                out.append(f"| {ours} | {peer} | {1000 * _median_step(a):.0f} | {1000 * _median_step(b):.0f} | "
                           f"{ratio:.2f}x{'' if ratio <= target else ' (over)'} | {target} | "
                           f"{_median_step(a) / fa:.2f} | {_median_step(b) / fb:.2f} |")
        out.append("")
    return out
