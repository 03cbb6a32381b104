"""What a run says: its first lines (the layout, the model and its size, the pipeline schedule's
prediction, the model-state memory per rank) and, every ``--log-interval`` iterations, one line and one
metrics record (loss, learning rate, gradient norm, throughput, TFLOP/s and MFU, HFU with recompute, peak
memory, and what the model's hooks and the run's options add). Rank 0 prints; the figures that differ by rank are the
largest over ranks (collectives every rank takes part in)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.config import JobConfig
from megazero.lr_schedule import decoupled_learning_rate, learning_rate
from megazero.metrics import MetricsLog, duration, peak_memory_bytes, timestamp
from megazero.parallel import fp8
from megazero.parallel.params import attribute, counts_once, split_dim, whole_shape
from megazero.parallel.pipeline import get_schedule
from megazero.parallel.pipeline.zero_bubble import theory
from megazero.parallel.topology import Topology
from megazero.parallel.zero.muon import newton_schulz_flops
from megazero.spec import get_model_spec
from megazero.state import TrainState


@dataclass
class StepResult:
    """What one training step reports (the same on every rank: its figures are global)."""

    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    params_overflowed: bool = False     # an applied step left a non-finite fp16/bf16 parameter (any rank)
    out_of_time: bool = False           # a rank is past --exit-duration-in-mins after this step


def describe_run(job: JobConfig, topo: Topology, chunks) -> str:
    """The first log line: the resolved layout and the model size (a collective), with the pipeline
    schedule's prediction on rank 0, the rank that prints it."""
    par, m = job.parallel, job.model
    n = count_parameters(chunks, topo)
    schedule = f"{par.pipeline_schedule} (v={par.virtual_stages})" if par.pp > 1 else "none"
    spec = get_model_spec(m.model_family)
    cp = f" x cp {par.cp} ({par.cp_comm_type})" if par.cp > 1 else ""
    replicas = f" ({par.data_parallel_replicas} replicas x {par.shard_size})" if par.data_parallel_replicas > 1 else ""
    z = job.zero
    offload = "".join(f" + {what} on {where}" for what, where in (("optimizer", z.offload_optimizer),
                                                                  ("params", z.offload_params)) if where != "none")
    offload += " (one-step delayed update)" if z.offload_delayed_update else ""
    return (f" megazero: world {topo.world_size} = tp {par.tp}{cp} x pp {par.pp} x dp {par.dp}{replicas} | zero stage "
            f"{job.zero.zero_stage}{offload} | {job.precision.dtype_name} | pipeline {schedule} | sequence parallel "
            f"{par.sequence_parallel} | micro-batch {job.train.micro_batch_size} x {job.num_micro_batches} "
            f"micro-batches x dp {par.dp} = global batch {job.train.largest_global_batch}{_stepped(job.train)}\n"
            f" model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}, seq "
            f"{m.seq_length}, vocab {m.vocab_size} (padded {m.padded_vocab_size(par.tp)}){spec.describe(m)} | "
            f"{n:,} parameters" + fp8.describe(job.fp8, chunks, job.precision.dtype_name)
            + _optimizer_split(job, chunks, topo, n) + (predicted_pipeline(job) if topo.rank == 0 else ""))


def _optimizer_split(job: JobConfig, chunks, topo: Topology, total: int) -> str:
    """Under ``--optimizer muon``, the start line's note of what Muon and AdamW each step (a collective)."""
    o = job.optimizer
    if not o.muon:
        return ""
    matrices = count_parameters(chunks, topo, lambda p: attribute(p, "layer_matrix"))
    flops = count_parameters(chunks, topo, lambda p: attribute(p, "layer_matrix"),
                             size=lambda p: newton_schulz_flops(whole_shape(p, topo.tp_size), o.muon_ns_steps)
                             // (topo.tp_size if split_dim(p) >= 0 else 1))
    nesterov = " (nesterov)" if o.muon_nesterov else ""
    return (f"\n optimizer: muon on the layers' matrices, {matrices:,} parameters (momentum {o.muon_momentum}"
            f"{nesterov}, {o.muon_ns_steps} Newton-Schulz steps in {o.muon_ns_dtype}, lr scaled {o.muon_adjust_lr}: "
            f"{flops / 1e9:.3g} GFLOP a step, each matrix once per model replica); adamw on the other "
            f"{total - matrices:,} (embeddings, output layer, norms, biases)")


def predicted_pipeline(job: JobConfig) -> str:
    """The pipeline schedule's predicted bubble and peak activations (the simulator's timeline with unit
    times F = I = W = 1, full backward 2), as a third line of :func:`describe_run`; empty at pp = 1."""
    par, m = job.parallel, job.num_micro_batches
    if par.pp == 1:
        return ""
    v = par.virtual_stages
    bubble, peaks = theory(get_schedule(par), par.pp, m, v)
    held = (f"{max(peaks)} micro-batches per rank" if v == 1 else
            f"{max(peaks)} chunk sets per rank (= {max(peaks) / v:g} micro-batches of a rank's layers)")
    return (f"\n pipeline {par.pipeline_schedule}: predicted bubble {bubble:.3f} of the step, peak activations "
            f"{held}, held from F to its B or W (unit times F = I = W = 1, B = 2; by rank {list(peaks)})")


def count_parameters(chunks, topo: Topology, which=None, size=None) -> int:
    """Parameters of the whole model (``which``: those it accepts; ``size``: what each counts for, default its
    elements), each counted once whatever the layout (a collective): the elements
    :func:`megazero.parallel.params.counts_once` picks, data-parallel replicas divided out (an MoE expert has
    dp / ep replicas: its count is multiplied by ep before the division). Call before the ZeRO engine shards
    the parameters (or on an unsharded model)."""
    ep, size = topo.ep_size, size or (lambda p: p.numel())
    local = sum(size(p) * (ep if attribute(p, "expert_parallel") else 1)
                for chunk in chunks for p in chunk.parameters()
                if counts_once(p, topo.tp_rank) and (which is None or which(p)))
    t = torch.tensor([float(local)], device=topo.device, dtype=torch.float64)
    dist.all_reduce(t)
    return int(t.item()) // (topo.dp_size * topo.cp_size)          # cp ranks hold the same weights too


def model_state_line(engine, topo: Topology) -> str:
    """Largest per-rank model-state memory (params, grads, fp32 masters, Adam state) over all ranks, and
    what offloading keeps on the host and on NVMe."""
    keys = ("params", "grads", "master_weights", "optimizer_state", "total", "host_total", "nvme_total")
    local = engine.model_state_bytes()
    sizes = torch.tensor([float(local[k]) for k in keys], device=topo.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    values = sizes.tolist()
    parts = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.2f}" for k, v in zip(keys[:5], values[:5]))
    if values[5] or values[6]:
        parts += f"; offloaded: host {values[5] / 2**20:.2f}, nvme {values[6] / 2**20:.2f}"
    return f"\n model state per rank (MiB, max over ranks; grads allocated in backward): {parts}"


def _stepped(train) -> str:
    """The header's note on a batch-size schedule: the global batch it starts at and grows through."""
    if train.batch_schedule is None:
        return ""
    return " (largest; grown in steps: " + ", ".join(f"{b} from {t:,} samples" for t, b in train.batch_schedule) + ")"


def log_step(log: MetricsLog, job: JobConfig, state: TrainState, r: StepResult, step_time: float,
              tokens_per_step: int, flops_per_step: tuple[float, float], peak_tflops: float | None, topo: Topology,
              extra: dict, extra_text: str, elapsed: float, lr_position: float | None = None) -> None:
    """The log line and metrics record of an iteration: ``step_time`` is the mean over the window since
    the last line, ``elapsed`` the seconds since this process's training loop started; the ETA is the
    window's step time times the iterations left (evaluations and saves not counted). ``lr_position``:
    where the LR schedule stood for that step (``TrainConfig.lr_position``; default its iteration).
    ``flops_per_step``: (the model's, the hardware's) FLOPs of a step: TFLOP/s/rank and MFU count the
    model's; with recompute on, the hardware also runs the recomputed forward, and HFU (with
    ``hardware_tflops_per_rank``) counts that beside MFU."""
    position = state.iteration - 1 if lr_position is None else lr_position
    lr = learning_rate(position, job.optimizer)
    model_flops, hardware_flops = flops_per_step
    tflops = model_flops / step_time / 1e12 / topo.world_size
    hardware_tflops = hardware_flops / step_time / 1e12 / topo.world_size
    recomputes = hardware_flops > model_flops
    eta = step_time * (job.train.train_iters - state.iteration)
    when = timestamp()
    record = {"iteration": state.iteration, "timestamp": when, "elapsed_s": elapsed, "eta_s": eta,
              "consumed_samples": state.consumed_samples, "loss": r.loss,
              "lr": lr, "grad_norm": r.grad_norm, "loss_scale": r.loss_scale, "skipped": r.skipped,
              "skipped_iterations": state.skipped_iterations, "step_time_s": step_time,
              "tokens_per_sec": tokens_per_step / step_time, "tflops_per_rank": tflops,
              "peak_memory_bytes": max_over_ranks(peak_memory_bytes(topo.device), topo), **extra}
    if recomputes:
        record["hardware_tflops_per_rank"] = hardware_tflops
    if peak_tflops:
        record["mfu"] = tflops / peak_tflops
        if recomputes:
            record["hfu"] = hardware_tflops / peak_tflops
    decoupled = decoupled_learning_rate(position, job.optimizer)
    if decoupled is not None:
        record["decoupled_lr"] = decoupled
    log.record(record, state.iteration)
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if peak_tflops else ""
    if recomputes:
        mfu += f" | HFU {100 * record['hfu']:.1f}%" if peak_tflops else f" | with recompute {hardware_tflops:.3f}"
    log.print(f" [{when[:19].replace('T', ' ')}] iteration {state.iteration:>6}/{job.train.train_iters} | consumed "
              f"samples {state.consumed_samples:>8} | elapsed {duration(elapsed)} | ETA {duration(eta)} | "
              f"ms/iter {1000 * step_time:8.1f} | lr {lr:.3e} | "
              + (f"decoupled lr {decoupled:.3e} | " if decoupled is not None else "") +
              f"loss {r.loss:.4f} | grad norm {r.grad_norm:.3f} | loss scale {r.loss_scale:g} | "
              f"skipped {state.skipped_iterations} | tokens/s {tokens_per_step / step_time:,.0f} | "
              f"TFLOP/s/rank {tflops:.3f}{mfu} | peak mem {record['peak_memory_bytes'] / 2**20:.0f} MiB"
              + extra_text
              + (skip_words(job) if r.skipped else ""))


def skip_words(job: JobConfig) -> str:
    """Why a step was skipped: fp16's loss scaler found an overflow, or (the non-finite check off) the
    gradients were not finite."""
    if job.precision.fp16:
        return " | step skipped: fp16 overflow, loss scale lowered"
    return f" | step skipped: non-finite gradients ({job.precision.dtype_name})"


def log_header(log: MetricsLog, job: JobConfig, state: TrainState) -> None:
    """The metrics file's first record of a run (or of its resumption, at the iteration it starts from):
    what its DeepSpeed / Accelerate config files resolved to (``logging.config_files``), when it has any."""
    if job.logging.config_files:
        log.record({"iteration": state.iteration, "config_files": job.logging.config_files}, state.iteration)


def log_eval(log: MetricsLog, state: TrainState, valid_loss: float) -> None:
    ppl = float("inf") if valid_loss > 700 else float(torch.tensor(valid_loss).exp())
    log.record({"iteration": state.iteration, "valid_loss": valid_loss, "valid_ppl": ppl}, state.iteration)
    log.print(f" validation at iteration {state.iteration} | loss {valid_loss:.4f} | ppl {ppl:.2f}")


def max_over_ranks(value: float, topo: Topology) -> int:
    """The largest ``value`` over all ranks (a collective: every rank calls it)."""
    t = torch.tensor([float(value)], device=topo.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
