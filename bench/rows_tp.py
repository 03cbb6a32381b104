"""Tensor-parallel rows: megazero's tp (with and without sequence parallel) against
``torch.distributed.tensor.parallel`` (ColwiseParallel / RowwiseParallel, + SequenceParallel) on the
plain twin of the same GPT, at tp = 2 and 4.

The torch plan (torchtitan's, adapted to a tied, learned-position GPT-2):

    wte          RowwiseParallel(input Replicate, output Replicate | Shard(1) with SP)  vocab-parallel
    blocks.i     qkv, fc1: ColwiseParallel;  dense, fc2: RowwiseParallel (output Shard(1) with SP)
                 with SP: the layer norms SequenceParallel, the attention/MLP inputs all-gathered
    output       F.linear with the Shard(0) wte weight -> Shard(-1) logits, ``loss_parallel``
    wpe          replicated; with SP each rank adds its own positions and the grad is summed over tp

No clipping in these rows (both sides): the step is forward/backward/AdamW over tp shards.
Theory: bytes sent per transformer layer and micro-batch, 8bsh(t-1)/t (fp32: x4 bytes), against
megazero's collectives counted during one forward + backward (difference of an L- and an
L/2-layer model, so embedding and loss traffic cancel).
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.nn.functional as F

from bench.common import (
    GPT,
    PlainGPT,
    Spec,
    Variant,
    largest_over_ranks,
    masked_mean,
    run_variants,
    spawn,
    step_batches,
    torch_adamw,
)
from bench.steps import engine_step
from megazero.config import ZeroConfig
from megazero.parallel import raw_comm as mz_comm
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine


def build_ours(spec: Spec, topo, sp: bool):
    model = GPT(spec.model_cfg(), topo.model_groups(sp), seed=1234)
    engine = build_engine(model, topo, ZeroConfig(zero_stage=0), spec.opt_cfg(clip=0.0))

    return (lambda micro: engine_step(model, engine, micro)), (lambda: {"state": engine.model_state_bytes()})


def _plan(model: PlainGPT, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())}
    if sp:
        plan["ln_f"] = SequenceParallel(use_local_output=True)
    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        plan.update({p + "qkv": ColwiseParallel(), p + "fc1": ColwiseParallel(),
                     p + "dense": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                     p + "fc2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())})
        if sp:
            plan.update({p + "input_layernorm": SequenceParallel(),
                         p + "post_attention_layernorm": SequenceParallel(),
                         p + "qkv": ColwiseParallel(input_layouts=Shard(1)),
                         p + "fc1": ColwiseParallel(input_layouts=Shard(1))})
    return plan


def build_torch(spec: Spec, topo, sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    cfg = spec.model_cfg()
    tp, rank = topo.tp_size, topo.tp_rank
    model = PlainGPT(cfg).load_from(GPT(cfg, seed=1234))
    mesh = init_device_mesh("cpu", (tp,))
    parallelize_module(model, mesh, _plan(model, sp))
    if sp:
        model.pos_offset = rank * cfg.seq_length // tp
    opt = torch_adamw(model.named_parameters(), spec.opt_cfg(clip=0.0))
    wte = model.wte.weight

    def loss_fn(ids, labels):
        h = model.hidden(ids)                             # [b, s, h] replicated, or [b, s/tp, h] with SP
        h = DTensor.from_local(h, mesh, [Shard(1) if sp else Replicate()]).redistribute(mesh, [Replicate()])
        logits = F.linear(h, wte)                         # DTensor, Shard(-1): vocab-parallel logits
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return loss.full_tensor() if isinstance(loss, DTensor) else loss, loss

    def step(micro):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for x, y, _ in micro:
            value, loss = loss_fn(x, y)
            with loss_parallel():
                (loss / len(micro)).backward()
            total += value.item() / len(micro)
        if sp:                                            # each rank saw its own positions: sum over tp
            dist.all_reduce(model.wpe.weight.grad, group=topo.tp_group)
        opt.step()
        return total

    return step, None


class _CountingComm:
    """Count bytes (ring convention, per rank) of megazero's tensor-parallel collectives."""

    def __init__(self):
        self.bytes = 0.0

    @contextlib.contextmanager
    def active(self):
        orig = (dist.all_reduce, mz_comm.all_gather_flat, mz_comm.reduce_scatter_flat)

        def nb(t):
            return t.numel() * t.element_size()

        def all_reduce(t, *a, group=None, **k):
            n = dist.get_world_size(group)
            self.bytes += 2 * (n - 1) / n * nb(t)
            return orig[0](t, *a, group=group, **k)

        def all_gather(out, inp, *a, group=None, **k):
            n = dist.get_world_size(group)
            self.bytes += (n - 1) / n * nb(out)
            return orig[1](out, inp, *a, group=group, **k)

        def reduce_scatter(out, inp, *a, group=None, **k):
            n = dist.get_world_size(group)
            self.bytes += (n - 1) / n * nb(inp)
            return orig[2](out, inp, *a, group=group, **k)

        dist.all_reduce, mz_comm.all_gather_flat, mz_comm.reduce_scatter_flat = all_reduce, all_gather, reduce_scatter
        try:
            yield self
        finally:
            dist.all_reduce, mz_comm.all_gather_flat, mz_comm.reduce_scatter_flat = orig


def layer_comm_bytes(spec: Spec, topo, sp: bool) -> float:
    """Measured bytes per layer per micro-batch (forward + backward) of our tp layers."""
    counts = []
    x, y, m = step_batches(spec, 1, 1, 0)[0][0]
    for layers in (spec.layers, spec.layers // 2):
        model = GPT(spec.model_cfg(num_layers=layers), topo.model_groups(sp), seed=1234)
        with _CountingComm().active() as c:
            masked_mean(model(x, y), m).backward()
        counts.append(c.bytes)
    return (counts[0] - counts[1]) / (spec.layers - spec.layers // 2)


def tp_worker(rank: int, world: int, spec: Spec) -> dict:
    topo = Topology(tp=world)
    vs = []
    for sp in (False, True):
        tag = "-sp" if sp else ""
        vs += [Variant(f"ours-tp{tag}", lambda sp=sp: build_ours(spec, topo, sp)),
               Variant(f"torch-tp{tag}", lambda sp=sp: build_torch(spec, topo, sp))]
    out = run_variants(vs, step_batches(spec, spec.rounds, 1, 0))
    out["_theory"] = {f"sp={sp}": layer_comm_bytes(spec, topo, sp) for sp in (False, True)}
    return out


def run_tp(spec: Spec, tp: int) -> dict:
    """Rank 0's per-variant results with the largest peak RSS over the ranks."""
    return largest_over_ranks(spawn(tp, tp_worker, spec), ("peak_rss_mib",))
