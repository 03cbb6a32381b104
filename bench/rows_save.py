"""Save: how long a checkpoint save blocks the training loop, synchronous vs ``--async-save``.

Both variants train the same GPT (fp32, ZeRO-1, ``SaveSpec``: 63M parameters by default) through
megazero's trainer step and its checkpoint saver (:class:`megazero.checkpoint.resume.CheckpointSaver`,
what ``pretrain_gpt.py`` calls), one untimed step, then ``saves`` rounds of ``steps_between`` steps
followed by a save into a temporary directory. Reported, rank 0: the seconds each save blocked the
loop (the figure the trainer records as ``save_blocked_seconds``: for a synchronous save the whole
write and commit; for ``--async-save`` the wait for the previous background save, the copy to host
memory and the finiteness check), the step time (steps that run while a background write goes on
share the CPU with it), the wait for the last background save at the end, and the checkpoint's size.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

from bench.common import TrainerRun, num_params, spawn, trainer_engine
from megazero.checkpoint import checkpoint_saver
from megazero.checkpoint.format import checkpoint_dir
from megazero.cli.job import parse_job
from megazero.parallel.topology import Topology
from megazero.state import TrainState
from megazero.training import train_step


@dataclass(frozen=True)
class SaveSpec(TrainerRun):
    stage: int = 1
    saves: int = 3
    steps_between: int = 2

    def argv(self, save_dir: str, async_save: bool) -> list[str]:
        return self.trainer_flags("--zero-stage", self.stage, "--save", save_dir,
                                  *(["--async-save"] if async_save else []))

    def describe(self) -> str:
        return (f"{self.model()}, fp32, ZeRO-{self.stage}, dp = {self.dp} CPU ranks, {self.micro_batches} "
                f"micro-batches of {self.micro_batch} per rank; 1 untimed step, then {self.saves} x "
                f"({self.steps_between} steps + a save)")


QUICK_SAVE = SaveSpec(layers=2, hidden=64, heads=4, seq=32, vocab=512, saves=2)
VARIANTS = {"sync": False, "async": True}


def worker(rank: int, world: int, spec: SaveSpec, async_save: bool, save_dir: str) -> dict:
    job, _ = parse_job(spec.argv(save_dir, async_save), world)
    topo = Topology(dp=world)
    chunks, engine = trainer_engine(job, topo)
    saver = checkpoint_saver(job, chunks, engine, topo, say=lambda msg: None)
    state, times, blocked, losses = TrainState(), [], [], []

    def step() -> float:
        t0 = time.perf_counter()
        losses.append(train_step(chunks, spec.batch(state.iteration, rank), topo, engine, job,
                                 iteration=state.iteration + 1).loss)
        state.iteration += 1
        return time.perf_counter() - t0

    step()                                            # untimed: allocations, first-touch
    for _ in range(spec.saves):
        times += [step() for _ in range(spec.steps_between)]
        blocked.append(saver(state))
    t0 = time.perf_counter()
    saver.finish()
    final_wait = time.perf_counter() - t0
    last = checkpoint_dir(save_dir, state.iteration)
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file()) if rank == 0 else 0
    engine.close()
    return {"blocked": blocked, "times": times, "final_wait": final_wait, "bytes": size, "loss": losses[-1],
            "params": num_params(job.model)}


def run_save(spec: SaveSpec, log=print) -> dict:
    """Each variant's rank-0 result (a fresh set of ranks and a fresh directory per variant)."""
    out = {}
    for name, async_save in VARIANTS.items():
        save_dir = tempfile.mkdtemp(prefix="megazero_save_bench_")
        try:
            out[name] = spawn(spec.dp, worker, spec, async_save, save_dir)[0]
        finally:
            shutil.rmtree(save_dir, ignore_errors=True)
        log(f"  {name}: {1000 * statistics.median(out[name]['blocked']):.0f} ms blocked per save")
    return out


def save_section(spec: SaveSpec, res: dict) -> list[str]:
    """The BENCHMARKS.md section."""
    rows = []
    sync_blocked = statistics.median(res["sync"]["blocked"])
    for name, r in res.items():
        b = statistics.median(r["blocked"])
        rows.append(f"| {name} | {1000 * b:.0f} | {1000 * max(r['blocked']):.0f} | {b / sync_blocked:.2f}x | "
                    f"{1000 * statistics.median(r['times']):.0f} | {1000 * r['final_wait']:.0f} | "
                    f"{r['bytes'] / 2**20:.0f} | {r['loss']:.4f} |")
    params = res["sync"]["params"]
    return ["## Checkpoint saves: time the training loop is blocked, synchronous vs --async-save", "",
            f"{spec.describe()}; {params / 1e6:.1f}M parameters. 'blocked' is what the trainer records as "
            "`save_blocked_seconds`: the whole write and commit for a synchronous save; for `--async-save` "
            "the wait for the previous background save, the copy to host memory and the finiteness check. "
            "'ms/step' is the median step: with `--async-save` the steps after a save share the CPU with "
            "the writing thread. 'final wait': the end of the run waiting for the last background save. "
            "Timings on this shared 2-core machine move by up to ~30% between runs.", "",
            "| saves | blocked per save, median ms | max ms | vs sync | ms/step | final wait ms | "
            "checkpoint MiB | loss |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


__all__ = ["QUICK_SAVE", "SaveSpec", "VARIANTS", "run_save", "save_section"]
