"""The build and train steps of a run (its job and files checked): :func:`build` makes the topology, this
rank's model chunks (the model spec builds them) and the ZeRO engine; :func:`train_built` resumes, lays
out the data and runs the loop of :mod:`megazero.training`, with the embedded default a greedy
continuation of a prompt at the end."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.checkpoint import checkpoint_saver, resume
from megazero.checkpoint.lock import SaveLock
from megazero.compile import CompileLog, compile_model
from megazero.config import JobConfig
from megazero.data.sample import default_sample, sample_tokenizer
from megazero.data.samplers import build_data_iterators
from megazero.data.tokenizers import Tokenizer, tokenizer_from_config
from megazero.fault_tolerance import ReplicaGroups
from megazero.generation import gather_full_model, greedy_continuation
from megazero.kernels import describe_kernels
from megazero.memory import describe_cpu_memory, return_freed_memory, reuse_freed_memory
from megazero.memory.estimate import describe as describe_estimate
from megazero.memory.estimate import estimate_memory
from megazero.metrics import MetricsLog, wandb_settings
from megazero.parallel.topology import Topology, init_distributed
from megazero.parallel.zero import build_engine
from megazero.parallel.zero.protocol import Engine
from megazero.profiling import describe as describe_profiling
from megazero.reporting import describe_run, log_header, model_state_line
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train

SAMPLE_PROMPT = "A hacker is"


@dataclass
class Built:
    """What the build step hands the train step: this rank's groups, its model chunks (and the regions
    ``--compile`` compiles in them), the ZeRO engine over them, and the run's log."""

    topo: Topology
    log: MetricsLog
    chunks: list
    regions: list
    engine: Engine


def run(job: JobConfig, backend: str | None, tokenizer: Tokenizer | None, show_sample: bool,
        lock: SaveLock | None = None, started: float | None = None) -> int:
    """Build, then train (the job and files are checked; ``lock``: rank 0's lock of ``--save``, which
    every save checks; ``started``: the :func:`time.monotonic` reading when the process started, from
    which ``--exit-duration-in-mins`` counts); the engine and the log are closed however the run ends."""
    built = build(job, backend)
    try:
        train_built(job, built, tokenizer, show_sample, lock, started)
    finally:
        built.log.close()
        built.engine.close()                             # offload swap files go with the run
    return 0


def build(job: JobConfig, backend: str | None) -> Built:
    """Process groups, this rank's chunks (built on the meta device with ``--sharded-init``: the engine
    materialises them), the engine; rank 0 prints the run's first lines."""
    timeout_s = 60 * job.parallel.distributed_timeout_minutes
    topo = Topology(job.parallel.tp, job.parallel.pp, job.parallel.dp, order=job.parallel.order,
                    device=init_distributed(backend, timeout_s), timeout_s=timeout_s,
                    ranks_per_node=job.parallel.ranks_per_node, ep=job.parallel.expert_model_parallel_size,
                    cp=job.parallel.cp, replicas=job.parallel.data_parallel_replicas)
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
              + "\n" + describe_kernels(topo.device, job.compilation.compile,
                                            getattr(job.model, "apply_layernorm_1p", False))
              + "\n" + describe_cpu_memory(job.logging.return_freed_memory, topo.device)
              + ("\n" + describe_profiling(job.logging, job.checkpoint.save) if job.logging.profile else ""))
    return Built(topo, log, chunks, regions, engine)


def train_built(job: JobConfig, built: Built, tokenizer: Tokenizer | None, show_sample: bool,
                lock: SaveLock | None = None, started: float | None = None) -> None:
    """Resume (``--load``, ``--finetune``, or the latest checkpoint of ``--save``), the data from where the
    run stands, the loop (saving under ``lock``, rank 0's; ``started``: see :func:`run`); with
    ``show_sample``, what the model learnt, on rank 0."""
    topo, chunks, engine, log = built.topo, built.chunks, built.engine, built.log
    state = resume(job, chunks, engine, topo, say=log.print)   # --load / --finetune / auto-resume
    log_header(log, job, state)
    t = job.train
    groups, group = _data_groups(job)                    # torchft replica groups: each reads its share of the step
    train_data, valid_data, _ = build_data_iterators(
        job.data, seq_length=job.model.seq_length, seed=t.seed, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size * groups, dp_rank=topo.dp_rank,
        dp_size=topo.dp_size, cp_rank=topo.cp_rank, cp_size=topo.cp_size,
        train_iters=t.train_iters, eval_iters=t.eval_iters, eval_interval=t.eval_interval,
        vocab_size=job.model.vocab_size, eod=tokenizer.eod if tokenizer else None,
        is_writer=topo.rank == 0, barrier=dist.barrier, batch_at=lambda consumed: groups * t.global_batch_at(consumed))

    def train_batches(consumed_samples: int):
        train_data.consumed_samples = consumed_samples
        return _steps(train_data, topo.device)

    if valid_data is not None:                           # evaluations already run continue where they were
        valid_data.consumed_samples = (state.iteration // t.eval_interval) * t.eval_iters * t.global_batch_size * groups
        valid_data.share = lambda: (group, groups)       # each group evaluates its own share
    valid_steps = _steps(valid_data, topo.device) if valid_data is not None else None
    save = checkpoint_saver(job, chunks, engine, topo, say=log.print, lock=lock)
    replicas = _replica_groups(job, built) if job.fault_tolerance.enabled else None
    if replicas is not None:
        train_data.share = replicas.data_share           # the step's micro-batches split by the quorum
    try:
        state = train(job, topo, chunks, engine, train_batches, (lambda: valid_steps) if valid_steps else None,
                      log, state, save=replicas.saver(save) if replicas and save else save,
                      compile_log=CompileLog(len(built.regions)) if built.regions else None, started=started,
                      replicas=replicas)
    finally:
        if replicas is not None:
            replicas.shutdown()
    if show_sample:                                      # show what the tiny GPT learnt
        model = gather_full_model(chunks, topo, job, engine)
        if model is not None:
            prompt = tokenizer.tokenize(SAMPLE_PROMPT)
            out = greedy_continuation(model, prompt, max_new_tokens=24)
            print(f" greedy continuation after {state.iteration} iterations: "
                  f"{SAMPLE_PROMPT!r} -> {tokenizer.detokenize(out)!r}", flush=True)


def _data_groups(job: JobConfig) -> tuple[int, int]:
    """(replica groups sharing the data, this job's place among them): (1, 0) without torchft."""
    ft = job.fault_tolerance
    return (ft.ft_replica_groups, ft.ft_replica_id) if ft.enabled else (1, 0)


def _replica_groups(job: JobConfig, built: Built) -> ReplicaGroups:
    """This rank's torchft replica groups; a peer's state is loaded here only with the same ``layout``."""
    par, z = job.parallel, job.zero
    layout = {"world": built.topo.world_size, "tp": par.tp, "pp": par.pp, "dp": par.dp, "order": par.order,
              "virtual_stages": par.virtual_stages, "zero_stage": z.zero_stage, "model_family": job.model.model_family,
              "num_layers": job.model.num_layers, "hidden_size": job.model.hidden_size,
              "padded_vocab": job.model.padded_vocab_size(par.tp), "params": param_dtype(job).__repr__()}
    return ReplicaGroups(job.fault_tolerance, built.topo, built.chunks, built.engine, layout, job.train.global_batch_size,
                         built.log.print, checksums=job.fault_tolerance.ft_param_checksums,
                         micro_batch_size=job.train.micro_batch_size)


def resolve_data(job: JobConfig) -> tuple[JobConfig, Tokenizer | None]:
    """The tokenizer and data for this run; the model's vocab size follows the tokenizer.

    No data flags at all selects the embedded default: the bundled sample corpus, tokenized once
    into a cache with its bundled SentencePiece model. ``--mock-data`` uses ``--vocab-size``. The job
    was validated with the flags' vocab size; nothing validate() checks depends on it (the padded
    vocabulary is a multiple of tp by construction), so the filled-in job needs no second pass.
    """
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


def _steps(iterator, device):
    """One optimizer step's micro-batches at a time, on ``device``."""
    while True:
        try:
            step = iterator.next_step()
        except StopIteration:
            return
        yield [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in step]
