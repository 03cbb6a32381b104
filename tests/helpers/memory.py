"""The memory tests' model flags and measurement, shared by the estimator's and the planner's tests."""
import dataclasses
import gc

import torch

from helpers.multiproc import run_on_ranks
from megazero.cli.job import parse_job
from megazero.memory import LiveTensorBytes, reachable_tensor_bytes
from megazero.memory.estimate import estimate_memory

# RoPE, RMSNorm, SwiGLU, 2 key/value groups, no biases, untied output
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
BASE = ["--mock-data", "--vocab-size", "500", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "4"]


def measure_body(rank, world_size, argv):
    """Peak live tensor bytes of construction + one training step on this rank (the model of the job's
    ``--model-family``)."""
    from megazero.parallel.context_layout import rank_slice
    from megazero.parallel.topology import Topology
    from megazero.parallel.zero import build_engine
    from megazero.spec import build_model_chunks, get_model_spec
    from megazero.training import train_step

    gc.collect()
    job, _ = parse_job(argv, world_size)
    topo = Topology(job.parallel.tp, job.parallel.pp, job.parallel.dp, cp=job.parallel.cp)
    dtype = torch.bfloat16 if job.precision.bf16 else torch.float32
    b, s, v = job.train.micro_batch_size, job.model.seq_length, job.model.vocab_size
    g = torch.Generator().manual_seed(0)
    micro = [{"tokens": torch.randint(0, v, (b, s), generator=g), "labels": torch.randint(0, v, (b, s), generator=g),
              "loss_mask": torch.ones(b, s)} for _ in range(job.num_micro_batches)]
    micro = [{k: rank_slice(t, 1, topo.cp_rank, topo.cp_size) for k, t in mb.items()} for mb in micro]
    with LiveTensorBytes() as build:
        chunks = build_model_chunks(get_model_spec(job.model.model_family),
                                    dataclasses.replace(job, train=dataclasses.replace(job.train, seed=1)), topo,
                                    dtype=dtype, device="meta")
        engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    with LiveTensorBytes(after=build) as step:      # one step: see LiveTensorBytes on tp > 1
        train_step(chunks, micro, topo, engine, job)
    inputs = sum(t.untyped_storage().nbytes() for mb in micro for t in mb.values())
    return topo.pp_rank, step.peak, reachable_tensor_bytes() - inputs   # after the step: the model states


def estimate_errors(argv: list[str], world: int) -> dict[int, tuple]:
    """pipeline rank -> (the estimator's figures, each term's error as a share of the measured peak), the peak
    and the bytes alive after the step measured by :func:`measure_body` on ``world`` processes: ``total`` the
    estimated peak against the measured one, ``model states`` against the bytes alive after the step,
    ``activations + buffers`` against the rest of the peak."""
    job, _ = parse_job(argv, world)
    estimates = {e.pp_rank: e for e in estimate_memory(job, "cpu")}
    measured, states = {}, {}
    for pp_rank, peak, end in run_on_ranks(world, measure_body, argv):
        measured[pp_rank] = max(measured.get(pp_rank, 0), peak)
        states[pp_rank] = max(states.get(pp_rank, 0), end)
    return {pp_rank: (est, {"total": est.total / measured[pp_rank] - 1,
                            "model states": (est.model_states - states[pp_rank]) / measured[pp_rank],
                            "activations + buffers": (est.activations + est.buffers
                                                      - (measured[pp_rank] - states[pp_rank])) / measured[pp_rank]})
            for pp_rank, est in estimates.items()}
