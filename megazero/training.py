"""The training loop: one step = pipeline schedule over micro-batches -> finalize grads -> optimizer step.

nanoGPT-shaped and top-down. Every rank runs the same loop; who does what inside a step is decided by
the schedule (pipeline stage), the gradient engine (data parallel / ZeRO) and the layers (tensor
parallel). Only global rank 0 prints and writes metrics; the loss it reports is the last pipeline
stage's, averaged over micro-batches and data-parallel ranks.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from megazero.checkpoint.distributed import first_nonfinite_weight
from megazero.compile import CompileLog, describe_recompiles
from megazero.config import FLAG, JobConfig, flag, flag_off
from megazero.errors import TrainingStopped
from megazero.lr_schedule import decoupled_learning_rate, learning_rate
from megazero.memory.activation_offload import take_offloaded_bytes
from megazero.memory.measure import LastStepLiveBytes
from megazero.metrics import MetricsLog, device_peak_tflops
from megazero.parallel import fp8
from megazero.parallel.context import context_parallel_loss
from megazero.parallel.pipeline import run_schedule
from megazero.parallel.topology import Topology
from megazero.parallel.zero.protocol import Engine
from megazero.profiling import StepProfiler
from megazero.reporting import StepResult, log_eval, log_step, max_over_ranks
from megazero.spec import ModelSpec, get_model_spec
from megazero.state import TrainState


class Saver(Protocol):
    """How the loop saves (:class:`megazero.checkpoint.resume.CheckpointSaver`): ``save(state)`` writes the
    checkpoint of ``state`` (collective) and returns the seconds the loop was blocked; ``finish()`` waits
    for a save still writing in the background and raises its failure."""

    def __call__(self, state: TrainState) -> float | None: ...

    def finish(self) -> None: ...


class ReplicaSteps(Protocol):
    """The replica dimension across jobs (:class:`megazero.fault_tolerance.ReplicaGroups`): ``start_step(state)``
    joins the step's quorum before the first forward and returns True when ``state`` (with the weights
    and optimizer) was just healed from a peer; ``should_commit()``, after the gradients are averaged
    across the groups, says whether the optimizer may step (the same on every group); ``run_batch(b)``:
    the samples of the run's data one step covers, for this group's batch ``b``."""

    def start_step(self, state: TrainState) -> bool: ...

    def should_commit(self) -> bool: ...

    def run_batch(self, group_batch: int) -> int: ...


def global_mean_loss(losses: list[torch.Tensor], topo: Topology) -> float:
    """Mean of the last stage's micro-batch losses over all data-parallel ranks, known on every rank.

    Only ranks with losses (run_schedule returns them where the last virtual stage runs: the last pipeline
    rank, or pp rank 0 in the V of zb-v) and tp_rank 0 contribute (tp ranks hold identical losses), so a single
    all-reduce over the world of (sum, count) gives the same number everywhere, rank 0 included. Under
    context parallelism each cp rank's loss is its slice's share of the micro-batch's loss: every cp rank
    adds its share, only cp rank 0 counts the micro-batches.
    """
    return _global_figures(losses, topo)[0]


def _global_figures(losses: list[torch.Tensor], topo: Topology,
                    flags: tuple[bool, ...] = ()) -> tuple[float, tuple[bool, ...]]:
    """(:func:`global_mean_loss`, for each of ``flags`` whether it is set on any rank), in one all-reduce."""
    contributes = topo.tp_rank == 0 and losses      # losses: only the rank with the last virtual stage
    total = torch.zeros(2 + len(flags), device=topo.device)
    if contributes:
        total[0] = torch.stack(losses).sum().float()
        total[1] = len(losses) if topo.cp_rank == 0 else 0
    for i, flag_set in enumerate(flags):
        total[2 + i] = float(flag_set)
    dist.all_reduce(total)
    loss = (total[0] / total[1]).item() if total[1] > 0 else float("nan")
    return loss, tuple(bool(seen > 0) for seen in total[2:].tolist())


def minutes_since(started: float) -> float:
    """Minutes since ``started``, a :func:`time.monotonic` reading (the entry point's, for
    ``--exit-duration-in-mins``)."""
    return (time.monotonic() - started) / 60


def _loss_fn(spec: ModelSpec, topo: Topology):
    """The model's loss; under context parallelism this cp rank's share of each sequence's."""
    return context_parallel_loss(spec.loss, topo.context_parallel())


def _boundary_shape(spec: ModelSpec, job: JobConfig, topo: Topology) -> tuple[int, ...]:
    """Shape of the activations passed between pipeline stages (the model spec's)."""
    return spec.boundary_shape(job.model, job.train.micro_batch_size, topo.model_groups(job.parallel.sequence_parallel))   # [s/cp(/tp), b, h]


def train_step(chunks, micro_batches: list[dict], topo: Topology, engine: Engine, job: JobConfig,
               spec: ModelSpec | None = None, iteration: int | None = None,
               out_of_time: Callable[[], bool] | None = None, replicas: ReplicaSteps | None = None) -> StepResult | None:
    """Forward and backward over every micro-batch, reduce gradients, clip, and step the optimizer.
    ``spec``: the model's (default: the one ``job.model.model_family`` names); ``iteration``: this
    step's, for the optimizer's messages. With fp16/bf16 parameters, whether an applied step left one
    non-finite (its fp32 master beyond the type's range) travels in the loss's all-reduce; so does
    ``out_of_time()`` (asked after the optimizer step: is this rank past its wall-clock limit?), so that
    every rank agrees whether any is. ``replicas`` (torchft replica groups): the optimizer steps only if
    they commit the step; None is returned for a step not committed (nothing applied)."""
    spec = spec or get_model_spec(job.model.model_family)
    engine.zero_grad()
    spec.hooks.before_step(chunks, engine.loss_scale / len(micro_batches))   # e.g. MoE losses, as the main loss's
    losses = run_schedule(chunks, micro_batches, topo.pipeline(), loss_fn=_loss_fn(spec, topo), schedule=job.parallel,
                          tensor_shape=_boundary_shape(spec, job, topo), loss_scale=engine.loss_scale, grad_sync=engine)
    if job.fp8.enabled:                             # the delayed recipe's amaxes of this step, agreed
        fp8.finish_step(chunks, topo.tensor_parallel().group, topo.data_context_parallel().group,
                        topo.expert_data_parallel().group, topo.device)
    engine.finalize_grads()
    if replicas is not None and not replicas.should_commit():
        return None
    grad_norm, skipped = engine.step(iteration)
    spec.hooks.after_step(chunks, job, topo.tp_rank, topo.device)     # e.g. the MoE expert biases
    overflowed = not skipped and engine.params_overflowed
    late = out_of_time is not None and out_of_time()
    loss, (overflowed, late) = _global_figures(losses, topo, (overflowed, late))
    return StepResult(loss, grad_norm, skipped, engine.loss_scale, overflowed, late)


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


def train(job: JobConfig, topo: Topology, chunks, engine: Engine, train_batches: Callable[[int], Iterator[list[dict]]],
          valid_batches: Callable[[], Iterator[list[dict]]] | None, log: MetricsLog, state: TrainState,
          save: Saver | None = None, compile_log: CompileLog | None = None,
          started: float | None = None, replicas: ReplicaSteps | None = None) -> TrainState:
    """Run from ``state.iteration`` to ``train_iters``; evaluate and save at their intervals.

    ``train_batches(consumed_samples)`` yields, per step, this data-parallel rank's micro-batches of the
    global batch, starting at the given sample so a resumed run continues exactly. With ``save``, the
    last iteration is always saved too. A save that falls on a skipped step (an fp16 overflow) waits
    for the next applied one: a run that then stops for too many skipped steps keeps its last good
    checkpoint as the latest. ``save(state)`` may return the seconds it blocked the loop (recorded as
    ``save_blocked_seconds``); its ``finish()`` (waiting for a background save) is called at the end and
    when the run stops. ``compile_log`` (``--compile``): what compiling took is printed after the
    first step, the graphs compiled since the last line on every log line. ``--profile``: the steps of
    its window are profiled on its ranks (:class:`megazero.profiling.StepProfiler`).
    ``--exit-duration-in-mins``: once that many minutes have passed since ``started`` (a
    :func:`time.monotonic` reading taken when the process started; default: now) on any rank, the run
    ends after that step as at its last iteration -- saved, the save finished -- and says why it stopped.
    ``replicas`` (``--fault-tolerance``): each step joins the replica groups' quorum first (a healed group
    continues from its peer's position) and counts only if committed; an uncommitted step runs again on
    the same data.
    """
    started = time.monotonic() if started is None else started
    finish = save.finish if save is not None else (lambda: None)
    profiler = StepProfiler(job.logging, job.checkpoint.save, topo.rank, topo.device,
                            say=lambda line: print(line, flush=True))
    if job.logging.profile and state.iteration >= job.logging.profile_step_end:
        log.print(f" profiler: this run resumes at iteration {state.iteration}, past the profiled iterations "
                  f"(up to {job.logging.profile_step_end}): nothing is profiled")
    try:
        state, ended_early = _train_loop(job, topo, chunks, engine, train_batches, valid_batches, log, state, save,
                                         compile_log, profiler, started, replicas)
    except TrainingStopped as stopped:
        try:                                  # a background save of a good state still becomes the latest
            finish()
        except Exception as e:  # noqa: BLE001 - both are said, in one line
            raise TrainingStopped(f"{stopped}; besides, {e}") from e
        raise
    finally:
        profiler.close()                      # a run that ended inside the profiled window writes it
    finish()
    if ended_early:                           # said once its checkpoint is committed
        log.print(ended_early)
    return state


def _train_loop(job, topo, chunks, engine, train_batches, valid_batches, log, state, save, compile_log, profiler,
                started, replicas=None):
    """:func:`train`'s loop, up to the last save (started, if it runs in the background); returns the
    state and, for a run that ended at ``--exit-duration-in-mins``, the line saying so."""
    t, opt = job.train, job.optimizer
    if state.iteration >= t.train_iters:          # a resumed run with nothing left: no step, no save
        return state, None
    spec = get_model_spec(job.model.model_family)
    vocab = job.model.padded_vocab_size(job.parallel.tp)
    flops_per_token = spec.flops_per_token(job.model, vocab, 0.0)            # the model's: MFU
    hardware_per_token = spec.flops_per_token(job.model, vocab, spec.recomputed_share(job.model, job.parallel))
    peak = device_peak_tflops(topo.device, job.precision.dtype_name, job.logging.peak_tflops)
    if peak is None:
        log.print(f" MFU: not shown, the peak FLOP/s of this {topo.device.type.upper()} is not known: give "
                  f"{flag('peak_tflops')} to show it")
    batches = train_batches(state.consumed_samples)
    loop_start = window_start = time.perf_counter()
    window_iters = window_samples = 0
    saved_at = state.iteration                    # a resumed run starts from a saved iteration
    skipped_in_a_row, save_due, time_up = 0, False, False
    comm_seen = _bytes_sent(engine)
    first_iteration = state.iteration
    live = LastStepLiveBytes(job.logging.measure_live_bytes, t.train_iters, topo.device)
    limit = t.exit_duration_in_mins
    out_of_time = (lambda: minutes_since(started) >= limit) if limit is not None else None
    while state.iteration < t.train_iters:
        if replicas is not None and replicas.start_step(state):      # healed: the peer's position
            batches = train_batches(state.consumed_samples)
            saved_at = state.iteration
            if state.iteration >= t.train_iters:
                break
        position = t.lr_position(state.iteration, state.consumed_samples)
        engine.set_lr(learning_rate(position, opt), decoupled_learning_rate(position, opt))
        with profiler.step(state.iteration), live.step(state.iteration):
            result = train_step(chunks, next(batches), topo, engine, job, iteration=state.iteration + 1,
                                out_of_time=out_of_time, replicas=replicas)
        if result is None:                     # not committed by the replica groups: the same data again
            batches = train_batches(state.consumed_samples)
            continue
        skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
        stop = stop_reason(job, engine, result, state.iteration + 1, skipped_in_a_row, topo)
        time_up = result.out_of_time and not stop and state.iteration + 1 < t.train_iters
        state.iteration += 1
        step_batch = t.global_batch_at(state.consumed_samples)     # --step-batch-size-schedule, else constant
        state.consumed_samples += replicas.run_batch(step_batch) if replicas is not None else step_batch
        state.skipped_iterations += int(result.skipped)
        window_iters += 1
        window_samples += step_batch
        if compile_log is not None and state.iteration == first_iteration + 1:
            log.print(compile_log.describe_first(compile_log.metrics()))
        if state.iteration % t.log_interval == 0 or state.iteration == t.train_iters or stop or time_up:
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
            if t.batch_schedule is not None:
                extra["global_batch_size"] = step_batch
                text += f" | global batch {step_batch}"
            tokens_per_step = window_samples * job.model.seq_length / window_iters
            log_step(log, job, state, result, step_time, tokens_per_step,
                     (flops_per_token * tokens_per_step, hardware_per_token * tokens_per_step), peak,
                     topo, extra, text, elapsed=time.perf_counter() - loop_start, lr_position=position)
            window_start, window_iters, window_samples = time.perf_counter(), 0, 0
        if stop:                               # logged, never saved
            raise TrainingStopped(stop)
        if valid_batches and t.eval_iters and (state.iteration % t.eval_interval == 0
                                               or state.iteration == t.train_iters):
            log_eval(log, state, evaluate(chunks, valid_batches(), topo, job, t.eval_iters, spec))
            window_start = time.perf_counter()
            comm_seen = _bytes_sent(engine)     # the evaluation's gathers are not a step's
        if save and job.checkpoint.save_interval and state.iteration % job.checkpoint.save_interval == 0:
            save_due = True
        if save_due and not result.skipped:   # a skipped step changed no weights: save after one that did
            _save(save, state, log)
            save_due, saved_at, window_start = False, state.iteration, time.perf_counter()
        if time_up:
            break
    if save and saved_at != state.iteration:
        _save(save, state, log)
    return state, (time_up_line(job, state.iteration, minutes_since(started)) if time_up else None)


def _bytes_sent(engine: Engine) -> float:
    """Bytes this rank has sent in the data-parallel engine's collectives so far (counted per rank)."""
    return sum(engine.comm_log.bytes().values())


def _save(save: Saver, state: TrainState, log: MetricsLog) -> None:
    """Save, and record how long the training loop was blocked (``save_blocked_seconds``)."""
    blocked = save(state)
    if isinstance(blocked, float):
        log.record({"iteration": state.iteration, "save_blocked_seconds": blocked}, state.iteration)


def time_up_line(job: JobConfig, iteration: int, minutes: float) -> str:
    """The line of a run that ended at ``iteration``, ``minutes`` after its process started, for
    ``--exit-duration-in-mins``: where its checkpoint is and how to resume from it."""
    where = job.checkpoint.save
    saved = (f"checkpoint saved to {where}: resume with {FLAG.load} {where}" if where else
             f"no checkpoint saved (no {FLAG.save}): a new run starts from the beginning")
    return (f" stopping at iteration {iteration}: {FLAG.exit_duration_in_mins} {job.train.exit_duration_in_mins:g} "
            f"reached ({minutes:.4g} min since start); {saved}")


def stop_reason(job: JobConfig, engine: Engine, r: StepResult, iteration: int, skipped_in_a_row: int,
                topo: Topology | None = None) -> str | None:
    """Why the run must stop after this step, or None. The same on every rank (the figures are
    global): fp16/bf16 parameters left non-finite by an applied step (their fp32 masters beyond the
    type's range: every later step would overflow), a non-finite loss or gradient in bf16/fp32
    (``--check-for-nan-in-loss-and-grad``), an fp16 overflow at the minimum loss scale,
    ``--max-consecutive-skipped-steps`` skipped steps in a row (fp16 overflows, or non-finite steps
    skipped with the check off). ``topo`` (a collective then) names the first overflowed parameter."""
    pr = job.precision
    if r.params_overflowed:
        what = first_nonfinite_weight(engine, topo, job) if topo is not None else None
        return (f"iteration {iteration}: {what or f'a {pr.dtype_name} parameter'} is not finite after the step was "
                f"applied (its fp32 master weights are beyond what {pr.dtype_name} holds): the run stops without "
                f"saving this state (the last checkpoint stays the latest). Lower {FLAG.lr}"
                + (f" or use {FLAG.bf16}" if pr.fp16 else ""))
    bad = not pr.fp16 and (not math.isfinite(r.loss) or r.skipped)     # fp16: its loss scaler's business
    if bad and job.train.check_for_nan_in_loss_and_grad:
        names = engine.nonfinite_parameters(everywhere=True)      # a collective: every rank is here
        where = f" (first non-finite gradients: {', '.join(names)})" if names else ""
        return (f"iteration {iteration}: loss {r.loss:g}, gradient norm {r.grad_norm:g}{where}: not finite, the "
                f"step was not applied and the run stops without saving this state (the last checkpoint stays the "
                f"latest). Lower {FLAG.lr}, check the data, or use {flag_off('check_for_nan_in_loss_and_grad')} "
                f"to skip such steps")
    if pr.fp16 and r.skipped and r.loss_scale <= pr.min_loss_scale:
        return (f"iteration {iteration}: fp16 overflow at the minimum loss scale {pr.min_loss_scale:g}: the scale "
                f"can go no lower; lower {FLAG.lr}, use {FLAG.bf16}, or lower {FLAG.min_loss_scale}")
    if skipped_in_a_row >= pr.max_consecutive_skipped_steps:
        return (f"iteration {iteration}: {skipped_in_a_row} steps skipped in a row (overflowing or non-finite "
                f"gradients): the run is not training; see {FLAG.max_consecutive_skipped_steps}")
    return None


