"""Data-parallel rows: megazero ZeRO 0/1/2/3 against torch DDP, DDP + ZeroRedundancyOptimizer,
FSDP2 ``fully_shard`` and DeepSpeed ZeRO 1/2/3, at dp = 2 and 4, on the same GPT and data.

Every variant trains ``GPT(cfg, seed=1234)`` with AdamW (lr 1e-3, weight decay 0.1 on matrices,
clipping at 1.0) over ``micro_batches`` micro-batches per rank and step; the gradient reduction
happens once per step (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``, DeepSpeed's own
gradient accumulation boundary), except in DeepSpeed's stage 2, which reduces every micro-batch into
its gradient shard; ``ours-zero2-each-mb`` (``--zero2-reduce-each-microbatch``) does the same work.
"""
from __future__ import annotations

import contextlib
import os

import torch

from bench.common import (
    GPT,
    Spec,
    Unavailable,
    Variant,
    deepspeed_config,
    deepspeed_error,
    deepspeed_param_groups,
    largest_over_ranks,
    losses_over_ranks,
    run_variants,
    spawn,
    step_batches,
    torch_adamw,
)
from bench.steps import deepspeed_step, engine_step, torch_step
from megazero.config import ZeroConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import AllReduceGradSync, build_engine

PAIRS = [("ours-zero0", "torch-ddp"), ("ours-zero1", "torch-ddp-zero"), ("ours-zero3", "torch-fsdp2"),
         ("ours-zero1", "ds-zero1"), ("ours-zero2", "ds-zero2"), ("ours-zero2-each-mb", "ds-zero2"),
         ("ours-zero3", "ds-zero3"), ("ours-zero1-allreduce", "torch-ddp-zero")]


# Reducing every micro-batch saves memory only if a bucket is smaller than the model: ~1/4 of it here.
EACH_MB_BUCKET = 500_000


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def torch_state_bytes(params, opt) -> dict:
    """Params + grads + optimizer state held by this rank (local shards for DTensors)."""
    params = list(params)
    state = [_local(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    grads = [_local(p.grad) for p in params if p.grad is not None]
    return {"total": _nbytes(_local(p) for p in params) + _nbytes(grads) + _nbytes(state), "grads": _nbytes(grads)}


def build_ours(spec: Spec, topo, stage: int, grad_sync_cls=None, keep_params_gathered: bool = False,
               reduce_each_microbatch: bool = False, bucket_size: int = ZeroConfig.bucket_size):
    model = GPT(spec.model_cfg(), seed=1234)
    zero = ZeroConfig(zero_stage=stage, keep_params_gathered=keep_params_gathered,
                      reduce_each_microbatch=reduce_each_microbatch, bucket_size=bucket_size)
    try:
        engine = build_engine(model, topo, zero, spec.opt_cfg(), grad_sync_cls=grad_sync_cls)
    except (ValueError, NotImplementedError, TypeError) as e:
        if stage == 3:
            raise Unavailable(f"pending: build_engine does not accept zero_stage=3 yet ({e})") from e
        raise

    def step(micro):
        engine.comm_log.reset()
        return engine_step(model, engine, micro)

    def extra():
        return {"state": engine.model_state_bytes(), "comm": dict(engine.comm_log.bytes())}

    return step, extra


def build_ddp(spec: Spec, zero_redundancy: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    opt_cfg = spec.opt_cfg()
    ddp = DDP(GPT(spec.model_cfg(), seed=1234))
    if zero_redundancy:
        groups = torch_adamw(ddp.module.named_parameters(), opt_cfg).param_groups
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, lr=opt_cfg.lr,
                                      betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2), eps=opt_cfg.adam_eps,
                                      weight_decay=opt_cfg.weight_decay)
        opt.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
    else:
        opt = torch_adamw(ddp.module.named_parameters(), opt_cfg)

    def no_sync(last):
        return contextlib.nullcontext() if last else ddp.no_sync()

    def extra():
        return torch_state_bytes(ddp.module.parameters(), opt.optim if zero_redundancy else opt)

    return (lambda micro: torch_step(ddp, opt, micro, opt_cfg.clip_grad, no_sync=no_sync)), extra


def build_fsdp2(spec: Spec, world: int, reshard_after_forward: bool = True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    opt_cfg = spec.opt_cfg()
    model = GPT(spec.model_cfg(), seed=1234)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = torch_adamw(model.named_parameters(), opt_cfg)

    def no_sync(last):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    step = lambda micro: torch_step(model, opt, micro, opt_cfg.clip_grad, no_sync=no_sync)  # noqa: E731
    return step, (lambda: torch_state_bytes(model.parameters(), opt))


def deepspeed_status() -> str | None:
    """None when DeepSpeed can run here, else the reason it cannot."""
    e = deepspeed_error()
    return None if e is None else f"not installed / not importable ({type(e).__name__}: {str(e)[:80]})"


def build_deepspeed(spec: Spec, stage: int, **zero_options):
    """DeepSpeed ZeRO ``stage`` on our GPT; ``zero_options`` go into its ``zero_optimization``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    opt_cfg = spec.opt_cfg()
    model = GPT(spec.model_cfg(), seed=1234)
    config = deepspeed_config(opt_cfg, spec.micro_batch, spec.micro_batches, {"stage": stage, **zero_options})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=deepspeed_param_groups(model, opt_cfg),
                                      config=config)

    return (lambda micro: deepspeed_step(engine, micro)), None


def variants(spec: Spec, topo, world: int, with_deepspeed: bool = True) -> list[Variant]:
    out = [Variant("ours-zero0", lambda: build_ours(spec, topo, 0)),
           Variant("torch-ddp", lambda: build_ddp(spec, False)),
           Variant("ours-zero1", lambda: build_ours(spec, topo, 1)),
           Variant("ours-zero1-allreduce", lambda: build_ours(spec, topo, 1, AllReduceGradSync)),
           Variant("torch-ddp-zero", lambda: build_ddp(spec, True)),
           Variant("ours-zero2", lambda: build_ours(spec, topo, 2)),
           Variant("ours-zero2-each-mb", lambda: build_ours(spec, topo, 2, reduce_each_microbatch=True,
                                                            bucket_size=EACH_MB_BUCKET)),
           Variant("ours-zero3", lambda: build_ours(spec, topo, 3)),
           Variant("torch-fsdp2", lambda: build_fsdp2(spec, world))]
    ds_reason = deepspeed_status() if with_deepspeed else "skipped (--no-deepspeed)"
    for stage in (1, 2, 3):
        out.append(Variant(f"ds-zero{stage}", (lambda s=stage: build_deepspeed(spec, s)), unavailable=ds_reason))
    return out


def dp_worker(rank: int, world: int, spec: Spec, only: list[str] | None, with_deepspeed: bool) -> dict:
    torch.manual_seed(0)
    topo = Topology(dp=world)
    vs = [v for v in variants(spec, topo, world, with_deepspeed) if only is None or v.name in only]
    batches = step_batches(spec, spec.rounds, world, rank)
    return run_variants(vs, batches)


def run_dp(spec: Spec, dp: int, only=None, with_deepspeed: bool = True) -> dict:
    """Rank 0's per-variant results for a dp-rank job, with every rank's final loss (the pairs must agree
    on every rank) and the largest peak RSS."""
    per_rank = spawn(dp, dp_worker, spec, only, with_deepspeed)
    return losses_over_ranks(largest_over_ranks(per_rank, ("peak_rss_mib",)), per_rank)
