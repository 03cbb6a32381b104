"""Scaling sweeps: model-state memory per rank as dp grows (1, 2, 4, 8) for each ZeRO stage, and
step time as the model grows (layers x2, hidden x2), megazero against the plain PyTorch twin.

Memory: each ZeRO stage's engine is built on the same GPT and takes one step; its
``model_state_bytes()`` (params + grads + separate masters + Adam state, as held after a step,
padding included) is set beside the fp32 formula :func:`common.zero_fp32_bytes`.
Step time: one process; ours = ``GPT`` + ``build_engine`` (dp = 1, stage 0); plain = ``PlainGPT``
loaded with the same weights + ``torch.optim.AdamW`` + ``clip_grad_norm_``: the framework's
overhead over the same math written plainly.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from bench.common import GPT, PlainGPT, Spec, Unavailable, Variant, run_variants, spawn, step_batches, torch_adamw
from bench.rows_dp import build_ours
from bench.steps import torch_step
from megazero.parallel.topology import Topology

STAGES = (0, 1, 2, 3)
SIZES = ((1, 1), (2, 1), (1, 2), (2, 2))        # (layers multiplier, hidden multiplier)


def mem_worker(rank: int, world: int, spec: Spec) -> dict:
    topo = Topology(dp=world)
    batch = step_batches(spec, 1, world, rank)[0]
    out = {}
    for stage in STAGES:
        try:
            step, extra = build_ours(spec, topo, stage)
        except Unavailable as e:
            out[stage] = str(e)
            continue
        step(batch)
        out[stage] = extra()["state"]["total"]
    return out


def run_memory(spec: Spec, dps=(1, 2, 4, 8)) -> dict:
    res = {}
    for dp in dps:
        per_rank = spawn(dp, mem_worker, spec)
        res[dp] = {s: (max(r[s] for r in per_rank) if isinstance(per_rank[0][s], int) else per_rank[0][s])
                   for s in STAGES}
    return res


def _build_plain(spec: Spec):
    cfg = spec.model_cfg()
    model = PlainGPT(cfg).load_from(GPT(cfg, seed=1234))
    opt_cfg = spec.opt_cfg()
    opt = torch_adamw(model.named_parameters(), opt_cfg)

    class _Adapter(torch.nn.Module):                 # PlainGPT returns the mean loss already
        def forward(self, x, y):
            return model(x, y).expand(x.shape)

    return lambda micro: torch_step(_Adapter(), opt, micro, opt_cfg.clip_grad, params=model.parameters())


def time_worker(rank: int, world: int, spec: Spec) -> dict:
    topo = Topology()
    out = {}
    for lm, hm in SIZES:
        s = replace(spec, layers=spec.layers * lm, hidden=spec.hidden * hm)
        vs = [Variant("ours", lambda s=s: build_ours(s, topo, 0)), Variant("plain-torch", lambda s=s: _build_plain(s))]
        out[(s.layers, s.hidden)] = run_variants(vs, step_batches(s, s.rounds, 1, 0))
    return out


def run_step_time(spec: Spec) -> dict:
    return spawn(1, time_worker, spec)[0]
