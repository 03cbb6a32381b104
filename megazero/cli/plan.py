"""The plan step of a run: with ``--memory-budget-gib``, the memory planner picks the cheapest recompute /
offload choice whose estimate fits (:mod:`megazero.memory.planner`), and rank 0 says which; a budget
nothing meets is one line and status 2, before any process group exists."""
from __future__ import annotations

import os

import torch

from megazero.cli.arguments import stop_with
from megazero.config import JobConfig
from megazero.errors import ConfigError
from megazero.memory.planner import plan_for_budget


def plan_memory(job: JobConfig, world_size: int, prog: str = "pretrain_gpt.py") -> JobConfig:
    """``job`` with the planner's choice applied (``job`` itself without a budget)."""
    if job.train.memory_budget_gib is None:
        return job
    try:
        job, plan = plan_for_budget(job, world_size, "cuda" if torch.cuda.is_available() else "cpu")
    except ConfigError as e:
        stop_with(prog, [str(e)])
    if os.environ.get("RANK", "0") == "0":
        print(plan, flush=True)
    return job
