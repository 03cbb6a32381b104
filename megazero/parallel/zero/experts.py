"""ZeRO with expert parallelism: dense parameters over the data-parallel group, experts over the
expert-data-parallel group, each with its own buckets, shards and optimizer.

Parameters marked ``expert_parallel`` (:mod:`megazero.parallel.params`; the experts of
:mod:`megazero.models.moe`) differ between the ep ranks of an expert group, so they cannot share buckets
with the dense parameters, which every dp rank holds. With ``ep > 1`` the engine is two engines of the
stage asked for, built from the same classes over two views of the same chunks:

    engine      parameters        reduced and sharded over      gradients averaged over
    dense       not expert        dp group (dp ranks)           dp
    experts     expert_parallel   expert-dp group (dp/ep)       dp (each expert saw the tokens of all
                                                                ep ranks through the all-to-all)

Worked example, dp = 4, ep = 2, E = 4, ZeRO-1: dp ranks 0-3 each hold the dense model, dp rank d owns
1/4 of every dense bucket; dp ranks 0 and 2 hold experts 0-1 and own halves of their buckets, ranks 1
and 3 experts 2-3. One step: both reduce-scatter their buckets, the gradient norm is summed over both
(each element once: the sharded halves once each; stage 0's replicas divided by their count), both clip
by it and step, both all-gather over their own group.

Checkpoints and ``state_dict`` see the union of the two (parameter names are global: expert e is
``...mlp.experts.<e>...`` at every ep), so a run saved at one ep loads at another.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megazero.parallel import counted_comm as comm
from megazero.parallel.params import attribute
from megazero.parallel.zero.stages import DataParallelOptimizer


def is_expert(p) -> bool:
    return bool(attribute(p, "expert_parallel"))


class ParamSubset:
    """A model chunk seen through a filter: only the parameters for which ``keep(p)`` holds, and only
    the ZeRO-3 units made of them. Everything else (``initial_value``, ``get_submodule``) is the chunk's,
    so the grad syncs build their buckets over the subset as over a whole chunk."""

    def __init__(self, chunk, keep):
        self.chunk, self.keep = chunk, keep

    def named_parameters(self):
        return [(n, p) for n, p in self.chunk.named_parameters() if self.keep(p)]

    def modules(self):
        return self.chunk.modules()

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def initial_value(self, name: str) -> torch.Tensor:
        return self.chunk.initial_value(name)

    def get_submodule(self, name: str):
        return self.chunk.get_submodule(name)

    def zero3_plan(self):
        plan = self.chunk.zero3_plan()
        for name, members in list(plan.units.items()):
            kept = [m for m in members if self.keep(m[1])]
            if kept and len(kept) != len(members):
                raise ValueError(f"ZeRO-3 unit {name!r} mixes expert and dense parameters: the model's "
                                 f"zero3_plan() must put experts in units of their own")
            if not kept:
                del plan.units[name]
        for use in plan.uses:
            use.units = [u for u in use.units if u in plan.units]
        plan.uses = [use for use in plan.uses if use.units]
        return plan


def dense_view(chunks) -> list[ParamSubset]:
    """The chunks without their experts (what the dense engine buckets)."""
    return [ParamSubset(c, lambda p: not is_expert(p)) for c in chunks]


def expert_view(chunks) -> list[ParamSubset]:
    """The chunks' experts only (what the expert engine buckets)."""
    return [ParamSubset(c, is_expert) for c in chunks]


class ExpertDataTopology:
    """``topo`` with its data-parallel group replaced by the expert-data-parallel group (what the grad
    syncs and optimizers read), gradients still averaged over the whole dp."""

    def __init__(self, topo):
        self._topo = topo
        self.dp_group, self.dp_size, self.dp_rank = topo.expert_dp_group, topo.expert_dp_size, topo.expert_dp_rank
        self.gradient_average_size = topo.dp_size

    def __getattr__(self, name):
        return getattr(self._topo, name)


class ExpertParallelEngine:
    """The :class:`megazero.parallel.zero.engine.ZeroEngine` protocol over a dense and an expert engine
    (see the module docstring). ``optimizer`` and ``grad_sync`` are the dense engine's (step count, loss
    scale, the trainer's diagnostics); ``engines`` both."""

    def __init__(self, dense, experts, topo):
        self.dense, self.experts, self.topo = dense, experts, topo
        self.engines = (dense, experts)
        self.optimizer, self.grad_sync, self.comm_log = dense.optimizer, dense.grad_sync, dense.comm_log

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        for e in self.engines:
            e.before_backward(chunk_id, is_last_microbatch)

    def finalize_grads(self) -> None:
        for e in self.engines:
            e.finalize_grads()

    def zero_grad(self) -> None:
        for e in self.engines:
            e.zero_grad()

    def set_lr(self, lr: float) -> None:
        for e in self.engines:
            e.set_lr(lr)

    @property
    def loss_scale(self) -> float:
        return self.dense.loss_scale

    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        """Both optimizers clip by the norm of the whole model and step."""
        begun = [e.optimizer.begin_step() for e in self.engines]
        for _, early in begun:
            if early is not None:          # fp16 overflow (validate refuses fp16 with ep > 1)
                return early
        grads = [g for g, _ in begun]
        sq = torch.zeros(1, dtype=torch.float64, device=self.topo.device)
        for e, g in zip(self.engines, grads):
            sq += e.optimizer.local_norm_sq(g) / _replicas(e.optimizer)
        comm.all_reduce(sq, dist.group.WORLD, self.comm_log, "world")
        norm = math.sqrt(sq.item())
        results = [e.optimizer.finish_step(g, norm) for e, g in zip(self.engines, grads)]
        return results[0]

    def model_state_bytes(self) -> dict[str, int]:
        """The two engines' figures added up (``*_peak`` too: an upper bound of the joint peak)."""
        out: dict[str, int] = {}
        for e in self.engines:
            for k, v in e.model_state_bytes().items():
                out[k] = out.get(k, 0) + v
        return out

    def state_dict(self) -> dict:
        dense, experts = (e.state_dict() for e in self.engines)
        return {**dense, "params": {**dense["params"], **experts["params"]}}

    def load_state_dict(self, state: dict) -> None:
        for e in self.engines:
            names = {s.name for s in e.grad_sync.slots}
            e.load_state_dict({**state, "params": {n: v for n, v in state["params"].items() if n in names}})

    def saved_pieces(self):
        return [p for e in self.engines for p in e.saved_pieces()]

    def loaded_pieces(self, weights_only: bool = False):
        return [p for e in self.engines for p in e.loaded_pieces(weights_only)]

    def loaded(self, step: int, loss_scaler: dict | None, weights_only: bool) -> None:
        for e in self.engines:
            e.loaded(step, loss_scaler, weights_only)

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        with self.dense.gathered_parameters(write_back), self.experts.gathered_parameters(write_back):
            yield


def _replicas(optimizer) -> int:
    """How many ranks of the world hold each counted gradient element of this optimizer: its group's
    size when every rank holds the full gradients (stage 0), else 1 (sharded)."""
    return optimizer.grad_sync.dp_size if isinstance(optimizer, DataParallelOptimizer) else 1
