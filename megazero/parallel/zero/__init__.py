"""Data parallelism and ZeRO stages 0-3: one package, read top to bottom.

    buckets.py        flat, padded bucket layout shared by every stage (who owns which elements)
    materialize.py    sharded construction: meta parameters get their values where they live
    swap.py           ZeRO-Infinity's swap files under --nvme-path (reserved up front, removed however a run ends)
    adamw.py          AdamW's arithmetic on flat fp32 tensors; which parameters decay
    offload.py        ZeRO-Offload / ZeRO-Infinity: the optimizer state in host memory or swap files
    offload_params.py where stage 3's parameter shards live: the device, host memory or swap files
    quantize.py       block-wise int8 (ZeRO++)
    fp8_gather.py     --fp8-param-gather: parameter all-gathers with the FP8 linears' weights in FP8
    reducers.py       how a sharded bucket is summed: reduce-scatter, or qgZ's quantized hierarchical one
    replicated_params.py  stages 0-2's parameter component: whole parameters, one flat buffer per chunk
    grad_sync.py      the bucket machinery every stage shares, composed with a parameter component; stages 0, 1
    units.py          the ZeRO-3 gather units a model declares (``zero3_plan()``); a chunk seen through a filter
    sharded_grads.py  the sharded gradients of stages 2 and 3
    zeropp.py         stage 3's gathering: the plain all-gather, or ZeRO++'s qwZ and hpZ (node-aware)
    param_sync.py     stage 3's parameter component: a shard each, gathered per unit around forward and backward
    publish.py        each stage's optimizer policy: owned ranges, how new weights reach the model
    optimizer.py      the one AdamW over every bucket group (fp32 masters, clipping, fp16 scaling)
    engine.py         the stage table (stage -> parts), bucket groups (dense, experts), build_engine, accounting

Each file imports only the ones listed above it.
"""
from megazero.parallel.zero.buckets import PAD_MULTIPLE, Bucket, ParamSlot, plan_buckets
from megazero.parallel.zero.engine import (
                                           STAGES,
                                           Stage,
                                           StatePiece,
                                           ZeroEngine,
                                           bucket_group_filters,
                                           bucket_group_views,
                                           build_engine,
                                           build_grad_sync,
                                           build_optimizer,
                                           model_state_bytes,
                                           wrap_data_parallel,
                                           zero_paper_bytes,
)
from megazero.parallel.zero.grad_sync import AllReduceGradSync, BucketedGradSync, ReduceScatterGradSync
from megazero.parallel.zero.offload import OffloadStats
from megazero.parallel.zero.optimizer import BucketAdamW, merge_optimizer_states
from megazero.parallel.zero.param_sync import ShardedParams
from megazero.parallel.zero.replicated_params import ReplicatedParams
from megazero.parallel.zero.sharded_grads import ShardedGradSync, reductions_in_flight
from megazero.parallel.zero.swap import OffloadError, SwapDir
from megazero.parallel.zero.units import ParamSubset, UnitUse, Zero3Plan, trainable, whole_module_plan

__all__ = ["AllReduceGradSync", "Bucket", "BucketAdamW", "BucketedGradSync", "OffloadError", "OffloadStats",
           "PAD_MULTIPLE", "ParamSlot", "ParamSubset", "ReduceScatterGradSync", "ReplicatedParams", "STAGES",
           "ShardedGradSync", "ShardedParams", "Stage", "StatePiece", "SwapDir", "UnitUse", "Zero3Plan", "ZeroEngine",
           "bucket_group_filters", "bucket_group_views", "build_engine", "build_grad_sync", "build_optimizer",
           "merge_optimizer_states", "model_state_bytes", "plan_buckets", "reductions_in_flight", "trainable",
           "whole_module_plan", "wrap_data_parallel", "zero_paper_bytes"]
