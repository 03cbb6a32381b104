"""Offload: step time of one model with and without each offload (ZeRO-Offload / ZeRO-Infinity) on
dp CPU ranks, and where the offloaded step spends its time.

Every variant trains the same GPT (fp32, ``OffloadSpec``) through megazero's trainer step on the same
batches: ZeRO-1 resident, ``--offload-optimizer cpu`` and ``nvme``; ZeRO-3 resident,
``--offload-params cpu`` and ``nvme``, and both offloads to nvme. Each variant is a fresh set of ranks:
build, ``warmup`` untimed steps, then ``steps`` timed ones (median reported). The offloaded optimizer
reports (``OffloadStats``, summed over the timed steps, rank 0): the host AdamW update, the copies of
new parameter values to the device, and the time the step waited for swap-file reads and writes. The
swap directory is a temporary directory (on this machine's disk: the page cache absorbs much of it).
Resident memory is not reported here: tests/test_offload.py measures the live bytes offload frees.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

from bench.common import TrainerRun, deepspeed_config, deepspeed_param_groups, num_params, spawn, trainer_engine
from bench.steps import as_tuples, deepspeed_step
from megazero.cli.job import parse_job
from megazero.models.gpt import GPT
from megazero.parallel.topology import Topology
from megazero.training import train_step


@dataclass(frozen=True)
class OffloadSpec(TrainerRun):
    warmup: int = 1
    steps: int = 4

    def argv(self, stage: int, flags: tuple[str, ...]) -> list[str]:
        return self.trainer_flags("--zero-stage", stage, *flags)

    def describe(self) -> str:
        return (f"{self.model()}, {self.micro_batches} micro-batches of {self.micro_batch} per rank, fp32, dp = "
                f"{self.dp} CPU ranks; {self.warmup} untimed step{'s' if self.warmup != 1 else ''}, then "
                f"{self.steps} timed")


QUICK_OFFLOAD = OffloadSpec(layers=2, hidden=64, heads=4, seq=32, vocab=512, steps=2)

VARIANTS = {     # name: (ZeRO stage, flags)
    "zero1": (1, ()),
    "zero1-optimizer-cpu": (1, ("--offload-optimizer", "cpu")),
    "zero1-optimizer-nvme": (1, ("--offload-optimizer", "nvme")),
    "zero3": (3, ()),
    "zero3-params-cpu": (3, ("--offload-params", "cpu")),
    "zero3-params-nvme": (3, ("--offload-params", "nvme")),
    "zero3-both-nvme": (3, ("--offload-optimizer", "nvme", "--offload-params", "nvme")),
}


def worker(rank: int, world: int, spec: OffloadSpec, stage: int, flags: tuple, swap_dir: str) -> dict:
    argv = spec.argv(stage, flags) + (["--nvme-path", swap_dir] if "nvme" in flags else [])
    job, _ = parse_job(argv, world)
    topo = Topology(dp=world)
    chunks, engine = trainer_engine(job, topo)
    stats = getattr(engine.optimizer, "offload_stats", None)
    times, losses = [], []
    for step in range(spec.warmup + spec.steps):
        if step == spec.warmup and stats is not None:
            stats.reset()
        t0 = time.perf_counter()
        losses.append(train_step(chunks, spec.batch(step, rank), topo, engine, job).loss)
        times.append(time.perf_counter() - t0)
    out = {"times": times[spec.warmup:], "loss": losses[-1], "params": num_params(job.model)}
    if stats is not None:
        out["stats"] = {k: getattr(stats, k) for k in ("update_s", "to_device_s", "io_wait_s", "bytes_read",
                                                       "bytes_written")}
    engine.close()
    return out


def deepspeed_worker(rank: int, world: int, spec: OffloadSpec, offload: bool) -> dict:
    """DeepSpeed ZeRO-1 on the same GPT and batches; ``offload``: ``offload_optimizer.device = cpu`` with
    its own optimizer (DeepSpeedCPUAdam, built on first use)."""
    import logging
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    job, _ = parse_job(spec.argv(1, ()), world)
    model = GPT(job.model, seed=1234)
    zero = {"stage": 1, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = deepspeed_config(job.optimizer, spec.micro_batch, spec.micro_batches, zero, torch_adam=not offload)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=deepspeed_param_groups(model, job.optimizer),
                                      config=config)
    times, loss = [], 0.0
    for step in range(spec.warmup + spec.steps):
        t0 = time.perf_counter()
        loss = deepspeed_step(engine, as_tuples(spec.batch(step, rank)))
        times.append(time.perf_counter() - t0)
    return {"times": times[spec.warmup:], "loss": loss, "params": sum(p.numel() for p in model.parameters())}


def run_offload(spec: OffloadSpec, log=print, with_deepspeed: bool = True) -> dict:
    """Every variant's rank-0 result: step times, final loss, offload stats (``unavailable``: why not)."""
    out = {}
    for name, (stage, flags) in VARIANTS.items():
        swap = tempfile.mkdtemp(prefix="megazero_offload_bench_")
        try:
            out[name] = spawn(spec.dp, worker, spec, stage, flags, swap)[0]
        finally:
            shutil.rmtree(swap, ignore_errors=True)
        log(f"  {name}: {1000 * statistics.median(out[name]['times']):.0f} ms/step")
    for name, offload in (("ds-zero1", False), ("ds-zero1-optimizer-cpu", True)):
        if not with_deepspeed:
            out[name] = {"unavailable": "skipped (--no-deepspeed)"}
            continue
        try:
            out[name] = spawn(spec.dp, deepspeed_worker, spec, offload)[0]
            log(f"  {name}: {1000 * statistics.median(out[name]['times']):.0f} ms/step")
        except Exception as e:  # noqa: BLE001 -- report why DeepSpeed did not run, do not invent numbers
            out[name] = {"unavailable": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"}
            log(f"  {name}: {out[name]['unavailable']}")
    return out


__all__ = ["OffloadSpec", "QUICK_OFFLOAD", "VARIANTS", "run_offload"]
