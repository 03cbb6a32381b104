"""The training loop: one step = pipeline schedule over micro-batches -> finalize grads -> optimizer step.

nanoGPT-shaped and top-down. Every rank runs the same loop; who does what inside a step is decided by
the schedule (pipeline stage), the gradient engine (data parallel / ZeRO) and the layers (tensor
parallel). Only global rank 0 prints and writes metrics; the loss it reports is the last pipeline
stage's, averaged over micro-batches and data-parallel ranks.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megazero.checkpoint import format as fmt
from megazero.checkpoint.distributed import rank_pieces
from megazero.checkpoint.finite import first_nonfinite, first_over_ranks
from megazero.compile import CompileLog, describe_recompiles
from megazero.config import JobConfig, flag
from megazero.errors import TrainingStopped
from megazero.lr_schedule import learning_rate
from megazero.memory.activation_offload import take_offloaded_bytes
from megazero.memory.measure import LastStepLiveBytes
from megazero.metrics import MetricsLog, device_peak_tflops, duration, peak_memory_bytes, timestamp
from megazero.spec import ModelSpec, get_model_spec
from megazero.parallel.context import context_parallel_loss
from megazero.parallel.params import attribute, counts_once, split_dim
from megazero.parallel.pipeline import get_schedule, run_schedule
from megazero.parallel.pipeline.zero_bubble import theory
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.profiling import StepProfiler
from megazero.state import TrainState


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    params_overflowed: bool = False     # an applied step left a non-finite fp16/bf16 parameter (any rank)


def global_mean_loss(losses: list[torch.Tensor], topo: Topology) -> float:
    """Mean of the last stage's micro-batch losses over all data-parallel ranks, known on every rank.

    Only ranks with losses (run_schedule returns them where the last virtual stage runs: the last pipeline
    rank, or pp rank 0 in the V of zb-v) and tp_rank 0 contribute (tp ranks hold identical losses), so a single
    all-reduce over the world of (sum, count) gives the same number everywhere, rank 0 included. Under
    context parallelism each cp rank's loss is its slice's share of the micro-batch's loss: every cp rank
    adds its share, only cp rank 0 counts the micro-batches.
    """
    return _global_figures(losses, topo, False)[0]


def _global_figures(losses: list[torch.Tensor], topo: Topology, flag: bool) -> tuple[float, bool]:
    """(:func:`global_mean_loss`, whether ``flag`` is set on any rank), in one all-reduce."""
    contributes = topo.tp_rank == 0 and losses      # losses: only the rank with the last virtual stage
    total = torch.zeros(3, device=topo.device)
    if contributes:
        total[0] = torch.stack(losses).sum().float()
        total[1] = len(losses) if topo.cp_rank == 0 else 0
    total[2] = float(flag)
    dist.all_reduce(total)
    return ((total[0] / total[1]).item() if total[1] > 0 else float("nan")), bool(total[2].item())


def _loss_fn(spec: ModelSpec, topo: Topology):
    """The model's loss; under context parallelism this cp rank's share of each sequence's."""
    return context_parallel_loss(spec.loss, topo.context_parallel())


def _boundary_shape(spec: ModelSpec, job: JobConfig, topo: Topology) -> tuple[int, ...]:
    """Shape of the activations passed between pipeline stages (the model spec's)."""
    return spec.boundary_shape(job.model, job.train.micro_batch_size, topo.model_groups(job.parallel.sequence_parallel))   # [s/cp(/tp), b, h]


def train_step(chunks, micro_batches: list[dict], topo: Topology, engine, job: JobConfig,
               spec: ModelSpec | None = None, iteration: int | None = None) -> StepResult:
    """Forward and backward over every micro-batch, reduce gradients, clip, and step the optimizer.
    ``spec``: the model's (default: the one ``job.model.model_family`` names); ``iteration``: this
    step's, for the optimizer's messages. With fp16/bf16 parameters, whether an applied step left one
    non-finite (its fp32 master beyond the type's range) travels in the loss's all-reduce."""
    spec = spec or get_model_spec(job.model.model_family)
    engine.zero_grad()
    spec.hooks.before_step(chunks, engine.loss_scale / len(micro_batches))   # e.g. MoE losses, as the main loss's
    losses = run_schedule(chunks, micro_batches, topo.pipeline(), loss_fn=_loss_fn(spec, topo), schedule=job.parallel,
                          tensor_shape=_boundary_shape(spec, job, topo), loss_scale=engine.loss_scale, grad_sync=engine)
    engine.finalize_grads()
    grad_norm, skipped = engine.step(iteration)
    overflowed = not skipped and bool(getattr(engine.optimizer, "params_overflowed", False))
    loss, overflowed = _global_figures(losses, topo, overflowed)
    return StepResult(loss, grad_norm, skipped, engine.loss_scale, overflowed)


@torch.no_grad()
def evaluate(chunks, batches: Iterator[list[dict]], topo: Topology, job: JobConfig, iters: int,
             spec: ModelSpec | None = None) -> float:
    """Mean validation loss over ``iters`` steps' worth of micro-batches (forward only)."""
    spec = spec or get_model_spec(job.model.model_family)
    for chunk in chunks:
        chunk.eval()
    losses = []
    for _ in range(iters):
        step_losses = run_schedule(chunks, next(batches), topo.pipeline(), loss_fn=_loss_fn(spec, topo),
                                   schedule=job.parallel,
                                   tensor_shape=_boundary_shape(spec, job, topo), forward_only=True)
        losses.append(global_mean_loss(step_losses, topo))
    for chunk in chunks:
        chunk.train()
    return sum(losses) / len(losses)


def train(job: JobConfig, topo: Topology, chunks, engine, train_batches: Callable[[int], Iterator[list[dict]]],
          valid_batches: Callable[[], Iterator[list[dict]]] | None, log: MetricsLog, state: TrainState,
          save: Callable[[TrainState], None] | None = None, compile_log: CompileLog | None = None) -> TrainState:
    """Run from ``state.iteration`` to ``train_iters``; evaluate and save at their intervals.

    ``train_batches(consumed_samples)`` yields, per step, this data-parallel rank's micro-batches of the
    global batch, starting at the given sample so a resumed run continues exactly. With ``save``, the
    last iteration is always saved too. A save that falls on a skipped step (an fp16 overflow) waits
    for the next applied one: a run that then stops for too many skipped steps keeps its last good
    checkpoint as the latest. ``save(state)`` may return the seconds it blocked the loop (recorded as
    ``save_blocked_seconds``) and have a ``finish()`` (waiting for a background save), called at the end
    and when the run stops. ``compile_log`` (``--compile``): what compiling took is printed after the
    first step, the graphs compiled since the last line on every log line. ``--profile``: the steps of
    its window are profiled on its ranks (:class:`megazero.profiling.StepProfiler`).
    """
    finish = getattr(save, "finish", None) or (lambda: None)
    profiler = StepProfiler(job.logging, job.checkpoint.save, topo.rank, topo.device,
                            say=lambda line: print(line, flush=True))
    if job.logging.profile and state.iteration >= job.logging.profile_step_end:
        log.print(f" profiler: this run resumes at iteration {state.iteration}, past the profiled iterations "
                  f"(up to {job.logging.profile_step_end}): nothing is profiled")
    try:
        state = _train_loop(job, topo, chunks, engine, train_batches, valid_batches, log, state, save, compile_log,
                            profiler)
    except TrainingStopped as stopped:
        try:                                  # a background save of a good state still becomes the latest
            finish()
        except Exception as e:  # noqa: BLE001 - both are said, in one line
            raise TrainingStopped(f"{stopped}; besides, {e}") from e
        raise
    finally:
        profiler.close()                      # a run that ended inside the profiled window writes it
    finish()
    return state


def _train_loop(job, topo, chunks, engine, train_batches, valid_batches, log, state, save, compile_log, profiler):
    """:func:`train`'s loop, up to the last save (started, if it runs in the background)."""
    t, opt = job.train, job.optimizer
    spec = get_model_spec(job.model.model_family)
    tokens_per_step = t.global_batch_size * job.model.seq_length
    flops_per_step = spec.flops_per_token(job.model, job.model.padded_vocab_size(job.parallel.tp),
                                          spec.recomputed_share(job.model, job.parallel)) * tokens_per_step
    peak = device_peak_tflops(topo.device, job.precision.dtype_name, job.logging.peak_tflops)
    if peak is None:
        log.print(f" MFU: not shown, the peak FLOP/s of this {topo.device.type.upper()} is not known: give "
                  f"{flag('peak_tflops')} to show it")
    batches = train_batches(state.consumed_samples)
    loop_start = window_start = time.perf_counter()
    window_iters = 0
    saved_at = state.iteration                    # a resumed run starts from a saved iteration
    skipped_in_a_row, save_due = 0, False
    comm_seen = _bytes_sent(engine)
    first_iteration = state.iteration
    live = LastStepLiveBytes(job.logging.measure_live_bytes, t.train_iters, topo.device)
    while state.iteration < t.train_iters:
        engine.set_lr(learning_rate(state.iteration, opt))
        with profiler.step(state.iteration), live.step(state.iteration):
            result = train_step(chunks, next(batches), topo, engine, job, iteration=state.iteration + 1)
        skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
        stop = stop_reason(job, engine, result, state.iteration + 1, skipped_in_a_row, topo)
        state.iteration += 1
        state.consumed_samples += t.global_batch_size
        state.skipped_iterations += int(result.skipped)
        window_iters += 1
        if compile_log is not None and state.iteration == first_iteration + 1:
            log.print(compile_log.describe_first(compile_log.metrics()))
        if state.iteration % t.log_interval == 0 or state.iteration == t.train_iters or stop:
            step_time = (time.perf_counter() - window_start) / window_iters
            extra = spec.hooks.metrics(chunks, job, topo.tp_rank, window_iters, topo.device)   # a collective
            text = spec.hooks.describe_metrics(extra)
            if compile_log is not None:
                extra = {**extra, **compile_log.metrics()}
                text += describe_recompiles(extra)
            sent = _bytes_sent(engine)
            extra["dp_comm_bytes"] = (sent - comm_seen) / window_iters
            comm_seen = sent
            if live.peak is not None and state.iteration == t.train_iters:     # --measure-live-bytes
                extra["peak_live_bytes"] = max_over_ranks(live.peak, topo)
                text += f" | peak live {extra['peak_live_bytes'] / 2**20:.0f} MiB"
            if job.model.cpu_offloading:                     # --cpu-offloading: bytes sent to the host
                extra["activation_offload_bytes"] = take_offloaded_bytes(chunks) // window_iters
                text += f" | activations offloaded {extra['activation_offload_bytes'] / 2**20:.1f} MiB/iter"
            _log_step(log, job, state, result, step_time, tokens_per_step, flops_per_step, peak, topo, extra, text,
                      elapsed=time.perf_counter() - loop_start)
            window_start, window_iters = time.perf_counter(), 0
        if stop:                               # logged, never saved
            raise TrainingStopped(stop)
        if valid_batches and t.eval_iters and (state.iteration % t.eval_interval == 0
                                               or state.iteration == t.train_iters):
            _log_eval(log, state, evaluate(chunks, valid_batches(), topo, job, t.eval_iters, spec))
            window_start = time.perf_counter()
            comm_seen = _bytes_sent(engine)     # the evaluation's gathers are not a step's
        if save and job.checkpoint.save_interval and state.iteration % job.checkpoint.save_interval == 0:
            save_due = True
        if save_due and not result.skipped:   # a skipped step changed no weights: save after one that did
            _save(save, state, log)
            save_due, saved_at, window_start = False, state.iteration, time.perf_counter()
    if save and saved_at != state.iteration:
        _save(save, state, log)
    return state


def _bytes_sent(engine) -> float:
    """Bytes this rank has sent in the data-parallel engine's collectives so far (counted per rank)."""
    comm_log = getattr(engine, "comm_log", None)
    return sum(comm_log.bytes().values()) if comm_log is not None else 0.0


def _save(save: Callable, state: TrainState, log: MetricsLog) -> None:
    """Save, and record how long the training loop was blocked (``save_blocked_seconds``)."""
    blocked = save(state)
    if isinstance(blocked, float):
        log.record({"iteration": state.iteration, "save_blocked_seconds": blocked}, state.iteration)


def stop_reason(job: JobConfig, engine, r: StepResult, iteration: int, skipped_in_a_row: int,
                topo: Topology | None = None) -> str | None:
    """Why the run must stop after this step, or None. The same on every rank (the figures are
    global): fp16/bf16 parameters left non-finite by an applied step (their fp32 masters beyond the
    type's range: every later step would overflow), a non-finite loss or gradient in bf16/fp32
    (``--check-for-nan-in-loss-and-grad``), an fp16 overflow at the minimum loss scale,
    ``--max-consecutive-skipped-steps`` skipped steps in a row (fp16 overflows, or non-finite steps
    skipped with the check off). ``topo`` (a collective then) names the first overflowed parameter."""
    pr = job.precision
    if r.params_overflowed:
        what = None
        if topo is not None:
            weights = [p for p in rank_pieces(None, engine, topo, job) if p[0].startswith(fmt.MODEL + "/")]
            what = first_over_ranks(first_nonfinite(weights), topo.device)
        return (f"iteration {iteration}: {what or f'a {pr.dtype_name} parameter'} is not finite after the step was "
                f"applied (its fp32 master weights are beyond what {pr.dtype_name} holds): the run stops without "
                f"saving this state (the last checkpoint stays the latest). Lower --lr"
                + (" or use --bf16" if pr.fp16 else ""))
    bad = not pr.fp16 and (not math.isfinite(r.loss) or r.skipped)     # fp16: its loss scaler's business
    if bad and job.train.check_for_nan_in_loss_and_grad:
        names = engine.optimizer.nonfinite_parameters(everywhere=True)      # a collective: every rank is here
        where = f" (first non-finite gradients: {', '.join(names)})" if names else ""
        return (f"iteration {iteration}: loss {r.loss:g}, gradient norm {r.grad_norm:g}{where}: not finite, the "
                f"step was not applied and the run stops without saving this state (the last checkpoint stays the "
                f"latest). Lower --lr, check the data, or use --no-check-for-nan-in-loss-and-grad to skip such steps")
    if pr.fp16 and r.skipped and r.loss_scale <= pr.min_loss_scale:
        return (f"iteration {iteration}: fp16 overflow at the minimum loss scale {pr.min_loss_scale:g}: the scale "
                f"can go no lower; lower --lr, use --bf16, or lower --min-loss-scale")
    if skipped_in_a_row >= pr.max_consecutive_skipped_steps:
        return (f"iteration {iteration}: {skipped_in_a_row} steps skipped in a row (overflowing or non-finite "
                f"gradients): the run is not training; see --max-consecutive-skipped-steps")
    return None


def _log_step(log: MetricsLog, job: JobConfig, state: TrainState, r: StepResult, step_time: float,
              tokens_per_step: int, flops_per_step: float, peak_tflops: float | None, topo: Topology,
              extra: dict, extra_text: str, elapsed: float) -> None:
    """The log line and metrics record of an iteration: ``step_time`` is the mean over the window since
    the last line, ``elapsed`` the seconds since this process's training loop started; the ETA is the
    window's step time times the iterations left (evaluations and saves not counted)."""
    lr = learning_rate(state.iteration - 1, job.optimizer)
    tflops = flops_per_step / step_time / 1e12 / topo.world_size
    eta = step_time * (job.train.train_iters - state.iteration)
    when = timestamp()
    record = {"iteration": state.iteration, "timestamp": when, "elapsed_s": elapsed, "eta_s": eta,
              "consumed_samples": state.consumed_samples, "loss": r.loss,
              "lr": lr, "grad_norm": r.grad_norm, "loss_scale": r.loss_scale, "skipped": r.skipped,
              "skipped_iterations": state.skipped_iterations, "step_time_s": step_time,
              "tokens_per_sec": tokens_per_step / step_time, "tflops_per_rank": tflops,
              "peak_memory_bytes": max_over_ranks(peak_memory_bytes(topo.device), topo), **extra}
    if peak_tflops:
        record["mfu"] = tflops / peak_tflops
    log.record(record, state.iteration)
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if peak_tflops else ""
    log.print(f" [{when[:19].replace('T', ' ')}] iteration {state.iteration:>6}/{job.train.train_iters} | consumed "
              f"samples {state.consumed_samples:>8} | elapsed {duration(elapsed)} | ETA {duration(eta)} | "
              f"ms/iter {1000 * step_time:8.1f} | lr {lr:.3e} | "
              f"loss {r.loss:.4f} | grad norm {r.grad_norm:.3f} | loss scale {r.loss_scale:g} | "
              f"skipped {state.skipped_iterations} | tokens/s {tokens_per_step / step_time:,.0f} | "
              f"TFLOP/s/rank {tflops:.3f}{mfu} | peak mem {record['peak_memory_bytes'] / 2**20:.0f} MiB"
              + extra_text
              + (_skip_words(job) if r.skipped else ""))


def _skip_words(job: JobConfig) -> str:
    """Why a step was skipped: fp16's loss scaler found an overflow, or (the non-finite check off) the
    gradients were not finite."""
    if job.precision.fp16:
        return " | step skipped: fp16 overflow, loss scale lowered"
    return f" | step skipped: non-finite gradients ({job.precision.dtype_name})"


def _log_eval(log: MetricsLog, state: TrainState, valid_loss: float) -> None:
    ppl = float("inf") if valid_loss > 700 else float(torch.tensor(valid_loss).exp())
    log.record({"iteration": state.iteration, "valid_loss": valid_loss, "valid_ppl": ppl}, state.iteration)
    log.print(f" validation at iteration {state.iteration} | loss {valid_loss:.4f} | ppl {ppl:.2f}")


def max_over_ranks(value: float, topo: Topology) -> int:
    """The largest ``value`` over all ranks (a collective: every rank calls it)."""
    t = torch.tensor([float(value)], device=topo.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def count_parameters(chunks, topo: Topology) -> int:
    """Parameters of the whole model, each counted once whatever the layout (a collective): the
    elements :func:`megazero.parallel.params.counts_once` picks, data-parallel replicas divided out
    (an MoE expert has dp / ep replicas: its count is multiplied by ep before the division).
    Call before the ZeRO engine shards the parameters (or on an unsharded model)."""
    ep = topo.ep_size
    local = sum(p.numel() * (ep if attribute(p, "expert_parallel") else 1)
                for chunk in chunks for p in chunk.parameters() if counts_once(p, topo.tp_rank))
    t = torch.tensor([float(local)], device=topo.device, dtype=torch.float64)
    dist.all_reduce(t)
    return int(t.item()) // (topo.dp_size * topo.cp_size)          # cp ranks hold the same weights too


def describe_run(job: JobConfig, topo: Topology, chunks) -> str:
    """The first log line: the resolved layout and the model size (a collective), with the pipeline
    schedule's prediction on rank 0, the rank that prints it."""
    par, m = job.parallel, job.model
    n = count_parameters(chunks, topo)
    schedule = f"{par.pipeline_schedule} (v={par.virtual_stages})" if par.pp > 1 else "none"
    spec = get_model_spec(m.model_family)
    cp = f" x cp {par.cp} ({par.cp_comm_type})" if par.cp > 1 else ""
    return (f" megazero: world {topo.world_size} = tp {par.tp}{cp} x pp {par.pp} x dp {par.dp} | zero stage "
            f"{job.zero.zero_stage} | {job.precision.dtype_name} | pipeline {schedule} | sequence parallel "
            f"{par.sequence_parallel} | micro-batch {job.train.micro_batch_size} x {job.num_micro_batches} "
            f"micro-batches x dp {par.dp} = global batch {job.train.global_batch_size}\n"
            f" model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}, seq "
            f"{m.seq_length}, vocab {m.vocab_size} (padded {m.padded_vocab_size(par.tp)}){spec.describe(m)} | "
            f"{n:,} parameters" + (predicted_pipeline(job) if topo.rank == 0 else ""))


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


@torch.no_grad()
def gather_full_model(chunks, topo: Topology, job: JobConfig, engine=None):
    """A single-process (tp = pp = 1) model with the trained weights (the spec's ``build_full``), on
    global rank 0; None elsewhere.

    Every rank takes part: tp shards are gathered within each tp group, then the first dp replica's
    tp rank 0 of every pipeline stage sends its tensors to rank 0 (and, with expert parallelism, the
    other members of the first ep group in its dp x cp group their experts). Under ZeRO stage 3 the engine's
    ``gathered_parameters()`` materialises the shards first.
    """
    with engine.gathered_parameters() if engine is not None else nullcontext():
        local = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                local[name] = gather_full(p.detach(), split_dim(p), topo.tp_group).float().cpu()
    # Experts are carved from dp x cp in consecutive blocks of ep: members 0..ep-1 of the dp x cp group hold
    # one copy of every expert (member 0 the dense weights too). E.g. dp 2 x cp 2, ep 2: members 0, 1.
    member, mine = topo.data_context_parallel().rank, {}
    if topo.tp_rank == 0 and member < topo.ep_size:
        mine = {n: t for n, t in local.items() if member == 0 or ".experts." in n}
    everything = [None] * topo.world_size if topo.rank == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if topo.rank != 0:
        return None
    model = get_model_spec(job.model.model_family).build_full(job.model, seed=job.train.seed)
    state = {}
    for part in everything:
        state.update(part)
    for name, p in model.named_parameters():      # the padded vocab differs between tp sizes
        src = state[name]
        if src.shape != p.shape:
            rows = min(src.shape[0], p.shape[0])
            src = torch.cat([src[:rows], src.new_zeros((p.shape[0] - rows,) + tuple(src.shape[1:]))])
        p.copy_(src)
    return model.eval()


@torch.no_grad()
def greedy_continuation(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The next ``max_new_tokens`` ids a single-process model predicts greedily after ``prompt_ids``
    (:func:`megazero.generation.generate`, which also samples with top-k / top-p)."""
    from megazero.generation import generate

    return generate(model, prompt_ids, max_new_tokens)
