"""Data parallelism and ZeRO stages 0-3: one package, read top to bottom.

    buckets.py     flat, padded bucket layout shared by every stage (who owns which elements)
    materialize.py sharded construction: meta parameters get their values where they live
    swap.py        ZeRO-Infinity's swap files under --nvme-path (reserved up front, removed however a run ends)
    offload.py     ZeRO-Offload / ZeRO-Infinity: the optimizer state in host memory or swap files
    offload_params.py  stage 3's parameter shards in host memory or swap files
    grad_sync.py   stages 0-2: gradient buckets reduced over the data-parallel group
    units.py       the ZeRO-3 gather units a model declares (``zero3_plan()``)
    param_sync.py  stage 3: parameters sharded too, gathered per unit around forward and backward
    optimizer.py   AdamW over the owned shard of every bucket (fp32 masters, clipping, fp16 scaling)
    stages.py      the optimizer of each stage: owned range, norm group, how new weights reach the model
    experts.py     MoE expert parallelism: experts bucketed and sharded over the expert-data-parallel group
    engine.py      ZeroEngine / build_engine: what the trainer drives; model-state accounting

Each file imports only the ones listed above it.
"""
from megazero.parallel.zero.buckets import PAD_MULTIPLE, Bucket, ParamSlot, plan_buckets
from megazero.parallel.zero.engine import (StatePiece, ZeroEngine, ZeroStage3Engine, build_engine, model_state_bytes,
                                           zero_paper_bytes)
from megazero.parallel.zero.grad_sync import (MAX_REDUCTIONS_IN_FLIGHT, AllReduceGradSync, BucketedGradSync,
                                              MicrobatchShardedGradSync, ReduceScatterGradSync, ShardedGradSync,
                                              wrap_data_parallel)
from megazero.parallel.zero.offload import OffloadStats
from megazero.parallel.zero.swap import OffloadError, SwapDir
from megazero.parallel.zero.optimizer import BucketAdamW, merge_optimizer_states
from megazero.parallel.zero.stages import build_optimizer
from megazero.parallel.zero.param_sync import ShardedParamSync
from megazero.parallel.zero.units import UnitUse, Zero3Plan, trainable, whole_module_plan

__all__ = ["AllReduceGradSync", "Bucket", "BucketAdamW", "BucketedGradSync", "MAX_REDUCTIONS_IN_FLIGHT",
           "MicrobatchShardedGradSync", "OffloadError", "OffloadStats", "PAD_MULTIPLE", "ParamSlot",
           "ReduceScatterGradSync", "ShardedGradSync", "ShardedParamSync", "StatePiece", "SwapDir", "UnitUse",
           "Zero3Plan", "ZeroEngine", "ZeroStage3Engine", "build_engine", "build_optimizer", "merge_optimizer_states",
           "model_state_bytes", "plan_buckets", "trainable", "whole_module_plan", "wrap_data_parallel",
           "zero_paper_bytes"]
