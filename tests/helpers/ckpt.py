"""Checkpoint test helpers: the test GPT, its batches, and a training body that saves and loads."""
import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.config import JobConfig, OptimizerConfig, ParallelConfig, ZeroConfig
from megazero.models.gpt import GPTConfig, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.params import split_dim
from megazero.parallel.pipeline import run_schedule
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.state import TrainState

VOCAB, SEED, MB_SIZE, GLOBAL_MB = 200, 4321, 2, 8
# divisible-by 48: padded vocab 240 at tp1, 288 at tp2 -- the stored form must not depend on it
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
             make_vocab_size_divisible_by=48)
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, clip_grad=0.3, adam_eps=1e-6)
MUON_OPT = dataclasses.replace(OPT, optimizer="muon")


def make_job(tp, pp, dp, stage, dropout=0.0, opt=OPT, **model_kw):
    model = GPTConfig(**{**MODEL, **model_kw}, hidden_dropout=dropout, attention_dropout=dropout)
    return JobConfig(model=model, parallel=ParallelConfig(tp=tp, pp=pp, dp=dp), zero=ZeroConfig(zero_stage=stage,
                     bucket_size=3000), optimizer=opt)


def batches(step):
    g = torch.Generator().manual_seed(1000 + step)
    s = MODEL["seq_length"]
    return [{"tokens": torch.randint(0, VOCAB, (MB_SIZE, s), generator=g),
             "labels": torch.randint(0, VOCAB, (MB_SIZE, s), generator=g),
             "loss_mask": (torch.rand(MB_SIZE, s, generator=g) > 0.2).float()} for _ in range(GLOBAL_MB)]


def global_loss(out, topo):
    t = torch.zeros(2)
    if topo.is_last_stage and topo.tp_rank == 0:
        t[0], t[1] = float(sum(x.item() for x in out)), float(len(out))
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def setup(tp, pp, stage, dropout=0.0, opt=OPT, **model_kw):
    """Topology, job, chunks and engine; the chunks are built on the meta device, as the trainer does.
    ``opt``: the optimizer's config (OPT: AdamW, MUON_OPT: Muon)."""
    topo = Topology(tp=tp, pp=pp)
    job = make_job(tp, pp, topo.dp_size, stage, dropout, opt, **model_kw)
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, device="meta")
    return topo, job, chunks, build_engine(chunks, topo, job.zero, job.optimizer)


def train_one_step(topo, chunks, engine, step):
    per = GLOBAL_MB // topo.dp_size
    mine = batches(step)[topo.dp_rank * per:(topo.dp_rank + 1) * per]
    engine.zero_grad()
    shape = activation_shape(chunks[0].cfg, MB_SIZE, topo.tp_size, chunks[0].sequence_parallel)
    out = run_schedule(chunks, mine, topo.pipeline(), loss_fn=masked_mean, tensor_shape=shape,
                       loss_scale=engine.loss_scale, grad_sync=engine)
    engine.finalize_grads()
    engine.step()
    return global_loss(out, topo)


def full_params(chunks, topo, engine=None):
    """Whole (tp-gathered) parameters; under ZeRO-3 inside engine.gathered_parameters()."""
    with engine.gathered_parameters() if engine is not None else contextlib.nullcontext():
        return {n: gather_full(p.detach(), split_dim(p), topo.tp_group).clone()
                for c in chunks for n, p in c.named_parameters()}


def run_body(rank, world_size, tp, pp, stage, steps, save_dir=None, save_at=(), load_dir=None,
             dropout=0.0, weights_only=False, model_kw=None, opt=OPT, load_optim=True):
    """Train until ``steps`` (from a checkpoint when ``load_dir``), saving after the steps in save_at.
    Returns (losses of the steps run, full params right after loading, full params at the end)."""
    topo, job, chunks, engine = setup(tp, pp, stage, dropout, opt, **(model_kw or {}))
    state, loaded = TrainState(), None
    if load_dir:
        state = load_checkpoint(load_dir, chunks=chunks, engine=engine, topo=topo, job=job, weights_only=weights_only,
                                load_optim=load_optim)
        loaded = full_params(chunks, topo, engine)
    losses = []
    while state.iteration < steps:
        losses.append(train_one_step(topo, chunks, engine, state.iteration))
        state.iteration += 1
        state.consumed_samples += GLOBAL_MB * MB_SIZE
        if state.iteration in save_at:
            save_checkpoint(save_dir, state, chunks=chunks, engine=engine, topo=topo, job=job)
    return losses, loaded, full_params(chunks, topo, engine), state
