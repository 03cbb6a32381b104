"""Pretrain a GPT (or any registered model family, ``--model-family``) with tensor, pipeline and data
parallelism and a ZeRO-sharded optimizer.

    python pretrain_gpt.py                                   # tiny GPT on the bundled sample corpus
    torchrun --nproc-per-node 8 pretrain_gpt.py --tp 2 --pp 2 --dp 2 --zero-stage 1

Top-down: parse and validate every flag (before any process group, model or dataset exists), pick
the data and tokenizer, build the topology, the model chunks this rank owns (the model spec builds
them), the gradient/optimizer engine and the data iterators, then run the loop in
``megazero/training.py``.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from megazero.arguments import parse_job
from megazero.checkpoint import checkpoint_saver, resume
from megazero.compile import CompileLog, compile_model
from megazero.config import JobConfig
from megazero.data.samplers import build_data_iterators
from megazero.data.tokenizers import Tokenizer, tokenizer_from_config
from megazero.errors import CheckpointError, DataError, NothingToDo, PreflightError, TokenizerError, TrainingStopped
from megazero.kernels import describe_kernels
from megazero.launcher import SECONDHAND, report_to_launcher
from megazero.memory import describe_cpu_memory, return_freed_memory, reuse_freed_memory
from megazero.memory.estimate import describe as describe_estimate
from megazero.memory.estimate import estimate_memory
from megazero.metrics import MetricsLog, wandb_settings
from megazero.models.spec import build_model_chunks, get_model_spec
from megazero.parallel.topology import Topology, init_distributed
from megazero.parallel.zero import build_engine
from megazero.preflight import preflight
from megazero.profiling import describe as describe_profiling
from megazero.training import describe_run, gather_full_model, greedy_continuation, train

SAMPLE_PROMPT = "A hacker is"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")   # gloo, when a rank left


def main(argv: list[str] | None = None) -> int:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    job, args = parse_job(argv, world)                 # every flag validated here, once
    rank = int(os.environ.get("RANK", "0"))
    embedded_default = not (job.data.mock_data or job.data.data_path)
    try:                                               # ... and every file, still before any process group
        job, tokenizer = resolve_data(job)
        lock = preflight(job, args.backend, rank)      # noqa: F841 - held until the run ends
    except NothingToDo as e:                           # a finished run resumed: say so, succeed
        if rank == 0:
            print(f" {e}", flush=True)
        return 0
    except (PreflightError, TokenizerError, DataError, OSError) as e:
        stop(f"{e}", 2, rank, after_rank0=True)        # bad input: status 2, as for a bad flag
    try:
        return run(job, args.backend, tokenizer, show_sample=embedded_default)
    except (TrainingStopped, CheckpointError) as e:   # the same line on every rank: rank 0 says it
        stop(f"{e}", 1, rank)
    except (DataError, OSError) as e:                  # found by some ranks only (an index cache, a disk)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        stop(f"rank {rank}: {e}" if world > 1 else f"{e}", 1, rank, every_rank=True)
    except RuntimeError as e:                          # gloo and NCCL say "timed out" / "Timeout"
        if any(text in str(e) for text in PEER_GONE):  # another rank stopped first, with its own line
            stop(f"rank {rank}: {SECONDHAND}: its error is the line "
                 f"above (and torchrun's root cause) ({str(e).splitlines()[0][:200]})", 1, rank, every_rank=True,
                 secondhand=True)
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        # Only the ranks waiting on the stuck one time out, and the launcher stops the rest as soon as
        # the first exits: each rank that saw the timeout says so.
        stop(f"rank {rank}: a collective did not complete within --distributed-timeout-minutes "
             f"{job.parallel.distributed_timeout_minutes:g} (a rank stopped, died or is far slower): "
             f"{str(e).splitlines()[0][:300]}", 1, rank, every_rank=True)


def stop(message: str, status: int, rank: int, every_rank: bool = False, secondhand: bool = False,
         after_rank0: bool = False) -> None:
    """End the run with one line on stderr and ``status``: from rank 0 only (not one line per rank for
    what every rank sees alike: the checkpoint code gives every rank the failing rank's line), or
    ``every_rank`` for what only some ranks see. Under torchrun the line is also this worker's error
    file, so the launcher's failure report shows it instead of "To enable traceback see ...";
    ``secondhand`` (this rank stopped only because another did) dates it a second later, so the
    report's root cause is the rank that failed first. ``after_rank0`` (before any process group, where
    ranks cannot agree): rank 0 says it at once; another rank waits for the launcher to stop it (when
    rank 0 failed too, as for a file every rank reads) and otherwise says its own line, which only it
    found (a file on its node)."""
    if after_rank0 and rank != 0:
        time.sleep(5.0)
        every_rank, message = True, f"rank {rank}: {message}"
    if rank == 0 or every_rank:
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
        report_to_launcher(f"pretrain_gpt.py: error: {message}", message, secondhand)
    if rank != 0 and not every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(5.0)            # rank 0 says the line: leaving first could have the launcher stop it unsaid
    raise SystemExit(status)


def run(job: JobConfig, backend: str | None, tokenizer: Tokenizer | None, show_sample: bool) -> int:
    """Process groups, model, engine, data, then the training loop (the job and files are checked)."""
    timeout_s = 60 * job.parallel.distributed_timeout_minutes
    topo = Topology(job.parallel.tp, job.parallel.pp, job.parallel.dp, order=job.parallel.order,
                    device=init_distributed(backend, timeout_s), timeout_s=timeout_s,
                    ranks_per_node=job.parallel.ranks_per_node, ep=job.parallel.expert_model_parallel_size,
                    cp=job.parallel.cp)
    if topo.device.type == "cpu" and job.logging.return_freed_memory:    # honest resident peaks, slower
        return_freed_memory()
    log = MetricsLog(job.logging.metrics_file, job.logging.tensorboard_dir, enabled=topo.rank == 0,
                     wandb=wandb_settings(job.logging, job.checkpoint.save, job.to_dict()))
    torch.manual_seed(job.train.seed)

    spec = get_model_spec(job.model.model_family)
    chunks = build_model_chunks(spec, job, topo, dtype=param_dtype(job),
                                device="meta" if job.zero.sharded_init else None)   # the engine materialises
    regions = compile_model(chunks, spec.compile_regions, job.compilation)    # --compile: lazily, at first use
    header = describe_run(job, topo, chunks)           # counts parameters before ZeRO moves them
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    if topo.device.type == "cpu" and not job.logging.return_freed_memory:
        reuse_freed_memory()      # from here: the long-lived states are placed, each step's buffers reuse pages
    log.print(header + model_state_line(engine, topo) + "\n" + describe_estimate(estimate_memory(job, topo.device.type))
              + "\n" + describe_kernels(topo.device, job.compilation.compile)
              + "\n" + describe_cpu_memory(job.logging.return_freed_memory, topo.device)
              + ("\n" + describe_profiling(job.logging, job.checkpoint.save) if job.logging.profile else ""))
    state = resume(job, chunks, engine, topo, say=log.print)   # --load / --finetune / auto-resume

    t = job.train
    train_data, valid_data, _ = build_data_iterators(
        job.data, seq_length=job.model.seq_length, seed=t.seed, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=topo.dp_rank, dp_size=topo.dp_size,
        cp_rank=topo.cp_rank, cp_size=topo.cp_size,
        train_iters=t.train_iters, eval_iters=t.eval_iters, eval_interval=t.eval_interval,
        vocab_size=job.model.vocab_size, eod=tokenizer.eod if tokenizer else None,
        is_writer=topo.rank == 0, barrier=dist.barrier)

    def train_batches(consumed_samples: int):
        train_data.consumed_samples = consumed_samples
        return _steps(train_data, topo.device)

    if valid_data is not None:                           # evaluations already run continue where they were
        valid_data.consumed_samples = (state.iteration // t.eval_interval) * t.eval_iters * t.global_batch_size
    valid_steps = _steps(valid_data, topo.device) if valid_data is not None else None
    try:
        state = train(job, topo, chunks, engine, train_batches, (lambda: valid_steps) if valid_steps else None,
                      log, state, save=checkpoint_saver(job, chunks, engine, topo, say=log.print),
                      compile_log=CompileLog(len(regions)) if regions else None)
        if show_sample:                                  # show what the tiny GPT learnt
            model = gather_full_model(chunks, topo, job, engine)
            if model is not None:
                prompt = tokenizer.tokenize(SAMPLE_PROMPT)
                out = greedy_continuation(model, prompt, max_new_tokens=24)
                print(f" greedy continuation after {state.iteration} iterations: "
                      f"{SAMPLE_PROMPT!r} -> {tokenizer.detokenize(out)!r}", flush=True)
    finally:
        log.close()
        engine.close()                                   # offload swap files go with the run
    return 0


def resolve_data(job: JobConfig) -> tuple[JobConfig, Tokenizer | None]:
    """The tokenizer and data for this run; the model's vocab size follows the tokenizer.

    No data flags at all selects the embedded default: the bundled sample corpus, tokenized once
    into a cache with its bundled SentencePiece model. ``--mock-data`` uses ``--vocab-size``. The job
    was validated with the flags' vocab size; nothing validate() checks depends on it (the padded
    vocabulary is a multiple of tp by construction), so the filled-in job needs no second pass.
    """
    from megazero.data.sample import default_sample, sample_tokenizer

    d = job.data
    if d.mock_data:
        return job, None
    if d.data_path:
        tokenizer = tokenizer_from_config(d, vocab_size=job.model.vocab_size)
    else:
        cache = d.data_cache_path or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                  "megazero")
        tokenizer = sample_tokenizer()
        d = dataclasses.replace(d, data_path=[default_sample(cache)], data_cache_path=cache,
                                tokenizer_type="SentencePieceTokenizer", tokenizer_model=tokenizer.model_file)
    model = dataclasses.replace(job.model, vocab_size=tokenizer.vocab_size)
    return dataclasses.replace(job, model=model, data=d), tokenizer


def param_dtype(job: JobConfig) -> torch.dtype:
    """Model parameters are bf16/fp16 under mixed precision (fp32 masters live in the optimizer)."""
    return torch.bfloat16 if job.precision.bf16 else torch.float16 if job.precision.fp16 else torch.float32


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


def _steps(iterator, device):
    """One optimizer step's micro-batches at a time, on ``device``."""
    while True:
        try:
            step = iterator.next_step()
        except StopIteration:
            return
        yield [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in step]


def exit_process(code: int) -> None:
    """End the process with ``code`` once its process groups are gone, without the interpreter's teardown.

    A run that stopped with an error still holds its model, engine and process groups through the
    error's traceback. Left to the interpreter's teardown, a gloo group's worker thread may then free a
    tensor while Python is being torn down, and the process aborts ("terminate called without an active
    exception", status -6) after the run's one-line error. So they are freed here, while the interpreter
    is whole; the groups are destroyed (after a barrier on success: gloo aborts a rank whose peer hangs
    up while it still reads), the output is flushed and the process ends at once.
    """
    gc.collect()
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_status(stop: SystemExit) -> int:
    """The status a ``SystemExit`` asks for (argparse's 2, :func:`stop`'s), its message said as Python would."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def run_program(argv: list[str] | None = None) -> int:
    """The exit status of ``python pretrain_gpt.py argv``: :func:`main`, its ``SystemExit`` and any other
    error said as the program says them (a launcher that forks ranks runs this, then :func:`exit_process`)."""
    try:
        return main(argv)
    except SystemExit as stopped:
        return exit_status(stopped)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001 - an unforeseen error keeps its traceback
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    exit_process(run_program())
