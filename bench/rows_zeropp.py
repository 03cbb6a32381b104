"""ZeRO++: step time and bytes per rank (intra- and inter-node) of ZeRO-3 and of each ZeRO++ switch
(qwZ, hpZ, qgZ) and all three, at dp = 8 CPU ranks on 2 simulated nodes of 4 (``--ranks-per-node 4``).

All variants train the same GPT (fp32) through megazero's trainer step on the same batches, in one
group of 8 processes: every variant's engine is built up front and the variants take turns, one step
each per round (so load changes on this shared machine hit all of them alike); the first round is
untimed; medians of the rest. Bytes are megazero's own count (:mod:`megazero.parallel.counted_comm`:
per rank, ring accounting, split by link). Loopback gloo on one machine has no slow inter-node link:
the step times show the cost of quantizing and the extra all-to-all rounds, not the saving a real
cluster sees; the inter-node bytes are the figure that carries over.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from bench.common import TrainerRun, spawn, trainer_engine
from megazero.cli.job import parse_job
from megazero.parallel.topology import Topology
from megazero.training import train_step


@dataclass(frozen=True)
class ZeroPPSpec(TrainerRun):
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 4096
    dp: int = 8
    ranks_per_node: int = 4
    rounds: int = 6

    def describe(self) -> str:
        return (f"{self.model()}, fp32, {self.micro_batches} micro-batches of {self.micro_batch} per rank; dp = "
                f"{self.dp} CPU ranks as {self.dp // self.ranks_per_node} nodes of {self.ranks_per_node}; "
                f"{self.rounds} rounds, the first untimed")


QUICK_ZEROPP = ZeroPPSpec(layers=2, hidden=64, vocab=512, seq=32, rounds=3)

VARIANTS = {
    "zero3": (),
    "qwZ": ("--zero-quantized-weights",),
    "hpZ": ("--zero-hpz-partition-size", "4"),
    "qgZ": ("--zero-quantized-gradients",),
    "qwZ+hpZ+qgZ": ("--zero-quantized-weights", "--zero-hpz-partition-size", "4", "--zero-quantized-gradients"),
}


def worker(rank: int, world: int, spec: ZeroPPSpec) -> dict:
    runs = {}
    for name, flags in VARIANTS.items():
        job, _ = parse_job(spec.trainer_flags("--zero-stage", 3, "--ranks-per-node", spec.ranks_per_node, *flags),
                           world)
        topo = Topology(dp=world, ranks_per_node=spec.ranks_per_node)
        runs[name] = (job, topo, *trainer_engine(job, topo))
    out = {name: {"times": [], "losses": []} for name in VARIANTS}
    for step in range(spec.rounds):
        batches = spec.batch(step, rank)
        for name, (job, topo, chunks, engine) in runs.items():
            engine.comm_log.reset()
            t0 = time.perf_counter()
            loss = train_step(chunks, batches, topo, engine, job).loss
            if step:
                out[name]["times"].append(time.perf_counter() - t0)
            out[name]["losses"].append(loss)
            out[name]["links"] = engine.comm_log.link_bytes()
    return out


def run_zeropp(spec: ZeroPPSpec, log=print) -> dict:
    res = spawn(spec.dp, worker, spec)[0]
    for name, r in res.items():
        log(f"  {name}: {1000 * statistics.median(r['times']):.0f} ms/step, inter-node "
            f"{r['links']['inter'] / 2**20:.2f} MiB/step")
    return res


def zeropp_section(spec: ZeroPPSpec, res: dict) -> list[str]:
    """The BENCHMARKS.md section."""
    base = res["zero3"]
    t0 = statistics.median(base["times"])
    rows = []
    for name, r in res.items():
        t = statistics.median(r["times"])
        intra, inter = r["links"]["intra"], r["links"]["inter"]
        rows.append(f"| {name} | {1000 * t:.0f} | {t / t0:.2f}x | {intra / 2**20:.2f} | {inter / 2**20:.2f} | "
                    f"{inter / base['links']['inter']:.2f}x | {r['losses'][-1]:.4f} |")
    return ["## ZeRO++ on 2 simulated nodes (bytes per rank and step, intra / inter node)", "",
            f"{spec.describe()}. Bytes per rank and step as counted by megazero (ring accounting, "
            "the inter-node share by the convention in megazero/parallel/counted_comm.py). Loopback gloo on "
            "one machine has no slow link between the simulated nodes: the step times show what quantizing and "
            "the extra all-to-all rounds cost on CPU, not what a real cluster saves; the inter-node bytes are the "
            "figure that transfers. Timings on this shared 2-core machine move by up to ~30% between runs.", "",
            "| variant | ms/step | vs ZeRO-3 | intra MiB | inter MiB | inter vs ZeRO-3 | loss (last round) |",
            "|---|---|---|---|---|---|---|", *rows, ""]


__all__ = ["QUICK_ZEROPP", "VARIANTS", "ZeroPPSpec", "run_zeropp", "zeropp_section"]
