"""Mixture of Experts: an MoE GPT at expert parallelism 1, 2 and 4 against a dense GPT with the same active
parameters per token, and against DeepSpeed's ``deepspeed.moe.layer.MoE`` in the same model (CPU, fp32, dp 4).

The MoE model is the bench spec's GPT with every MLP replaced by 4 experts of the spec's ffn width,
top-2 routing, dropless, load-balancing loss 0.01. A token passes through 2 experts, so the dense
model with the same active parameters per token has an ffn twice as wide (the router's h x E weights
aside). All variants: 4 processes, dp 4, megazero's ZeRO-1 engine, the same batches, one step of each
per round in a rotated order (``common.run_variants``). tokens/s counts the global batch.

DeepSpeed's MoE layer (``ds-moe-ep1``) replaces megazero's MoE layer inside the same GPT and engine: its
experts are then ordinary replicated parameters, which is what ep 1 means, so only the layer differs
(its gating, capacity bookkeeping and dispatch by einsum). Its expert parallelism needs the DeepSpeed
engine, which creates the expert groups and reduces the expert gradients over them; that is not
measured here.
"""
from __future__ import annotations

import torch
from torch import nn

from bench.common import Spec, Unavailable, Variant, median, run_variants, spawn, step_batches
from bench.steps import engine_step
from megazero.config import ParallelConfig, ZeroConfig
from megazero.models.gpt import GPT, build_model_chunks
from megazero.models.gpt.moe import moe_layers, set_aux_loss_scale
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine

EXPERTS, TOPK, AUX = 4, 2, 0.01
WORLD = 4


def moe_cfg(spec: Spec):
    return spec.model_cfg(num_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=AUX)


def dense_cfg(spec: Spec):
    """Same active parameters per token as the MoE model: an ffn TOPK times as wide."""
    return spec.model_cfg(ffn_hidden_size=TOPK * 4 * spec.hidden)


def _build(cfg, ep: int, spec: Spec, swap=None):
    topo = Topology(ep=ep)
    par = ParallelConfig(dp=topo.dp_size, expert_model_parallel_size=ep)
    chunk = build_model_chunks(cfg, par, topo, seed=1234)[0]
    if swap is not None:
        swap(chunk)
    engine = build_engine([chunk], topo, ZeroConfig(zero_stage=1), spec.opt_cfg())

    def step(micro) -> float:
        set_aux_loss_scale(chunk, 1.0 / len(micro))     # the MoE losses' gradient, as the main loss's
        return engine_step(chunk, engine, micro)

    return step


class _DeepSpeedMLP(nn.Module):
    """DeepSpeed's MoE layer where megazero's was: returns its output, adds its aux loss in backward."""

    def __init__(self, cfg, ds_layer):
        super().__init__()
        self.layer, self.coeff = ds_layer, AUX
        self.aux_loss_scale = 1.0

    def forward(self, x):
        out, l_aux, _ = self.layer(x)
        return _AddLoss.apply(out, l_aux * self.coeff, self)


class _AddLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, aux, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.owner.aux_loss_scale), None


def _deepspeed_swap(cfg):
    def swap(chunk):
        try:
            import deepspeed
            from deepspeed.moe.layer import MoE
            from deepspeed.utils import groups
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"deepspeed.moe not importable: {type(e).__name__}: {e}") from e
        try:
            deepspeed.init_distributed(dist_backend="gloo")
            for name, layer in moe_layers(chunk):
                expert = nn.Sequential(nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size), nn.GELU(approximate="tanh"),
                                       nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size))
                ds = MoE(hidden_size=cfg.hidden_size, expert=expert, num_experts=EXPERTS, ep_size=1, k=TOPK,
                         drop_tokens=False)
                if not groups._get_expert_parallel_group_dict():
                    groups._create_expert_and_data_parallel(1)
                ds.set_deepspeed_parallelism()
                owner = chunk.get_submodule(name.rsplit(".", 1)[0])
                owner.mlp = _DeepSpeedMLP(cfg, ds)
            for p in chunk.parameters():
                for attr, default in (("tensor_parallel", False), ("partition_dim", -1),
                                      ("sequence_parallel_grad", False)):
                    if not hasattr(p, attr):
                        setattr(p, attr, default)
        except Unavailable:
            raise
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"DeepSpeed MoE on CPU: {type(e).__name__}: {str(e)[:200]}") from e
    return swap


def worker(rank: int, world: int, spec: Spec) -> dict:
    moe, dense = moe_cfg(spec), dense_cfg(spec)
    variants = [Variant("dense", lambda: _build(dense, 1, spec))]
    variants += [Variant(f"moe-ep{ep}", lambda ep=ep: _build(moe, ep, spec)) for ep in (1, 2, 4)]
    variants.append(Variant("ds-moe-ep1", lambda: _build(moe, 1, spec, swap=_deepspeed_swap(moe))))
    res = run_variants(variants, step_batches(spec, spec.rounds, world, rank))
    return res


def run_moe(spec: Spec) -> dict:
    return spawn(WORLD, worker, spec)[0]


def count(cfg) -> tuple[int, int]:
    """(total, active per token) parameters: active counts TOPK of each MoE layer's experts."""
    model = GPT(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if not cfg.num_experts:
        return total, total
    return total, total - expert + expert * TOPK // cfg.num_experts


def moe_section(spec: Spec, res: dict) -> list[str]:
    """The BENCHMARKS.md section of :func:`run_moe`'s results."""
    from megazero.models.gpt.moe import moe_alltoall_bytes

    tokens = WORLD * spec.micro_batches * spec.micro_batch * spec.seq
    moe_total, moe_active = count(moe_cfg(spec))
    dense_total, _ = count(dense_cfg(spec))
    out = ["## Mixture of Experts: expert parallelism vs a dense model of the same active size (dp 4, CPU)", "",
           f"{spec.describe()}; 4 processes, dp 4, ZeRO-1. MoE: every MLP -> {EXPERTS} experts of ffn "
           f"{4 * spec.hidden}, top-{TOPK}, dropless, aux loss {AUX}: {moe_total:,} parameters, {moe_active:,} "
           f"active per token. Dense: ffn {TOPK * 4 * spec.hidden} ({dense_total:,} parameters, the same active "
           "size but the router). ms/step: median over rounds, slowest rank; ratio = step time / dense. "
           "all-to-all bytes/rank/step: balanced-routing formula (memory/estimate.py; the counted bytes follow "
           "the actual routing). These 2 cores are shared with other jobs: timings move by tens of percent "
           "between runs; compare ratios measured in the same run. ds-moe-ep1: DeepSpeed's "
           "`deepspeed.moe.layer.MoE` (its top-2 gating, drop_tokens=False) in place of megazero's layer in the same "
           "GPT and engine, at ep 1 only: its expert parallelism needs the DeepSpeed engine to create the expert "
           "groups and reduce the expert gradients over them, which this row does not set up. The MoE rows' "
           "equal final losses are the parity of the layouts; the DeepSpeed row differs by its own initialisation "
           "and its top-2 gating, which draws the second expert with Gumbel noise.", ""]
    rows = []
    dense = res.get("dense", {})
    for name, r in res.items():
        if "unavailable" in r:
            rows.append([name, "-", "-", "-", "-", r["unavailable"]])
            continue
        ep = int(name.rsplit("ep", 1)[1]) if "ep" in name else 1
        formula = moe_alltoall_bytes(spec.micro_batch * spec.seq, TOPK, spec.hidden, EXPERTS, ep, 4,
                                     spec.layers, spec.micro_batches) if name.startswith("moe") else 0
        ratio = median(r["times"]) / median(dense["times"]) if dense.get("times") else float("nan")
        rows.append([name, f"{1e3 * median(r['times']):.1f}", f"{tokens / median(r['times']):,.0f}",
                     f"{ratio:.2f}", f"{formula / 2**20:.2f} MiB", f"final loss {r['losses'][-1]:.4f}"])
    out += ["| variant | ms/step | tokens/s | vs dense | all-to-all bytes/rank/step | note |", "|---|---|---|---|---|---|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out + [""]

