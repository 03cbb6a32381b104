"""Data parallelism and ZeRO stages 0-3: one package, read top to bottom.

    buckets.py        flat, padded bucket layout shared by every stage (who owns which elements)
    materialize.py    sharded construction: meta parameters get their values where they live
    swap.py           ZeRO-Infinity's swap files under --nvme-path (reserved up front, removed however a run ends)
    adamw.py          AdamW's arithmetic on flat fp32 tensors; which parameters decay
    offload.py        ZeRO-Offload / ZeRO-Infinity: the optimizer state in host memory or swap files
    offload_params.py stage 3's parameter shards in host memory or swap files
    quantize.py       block-wise int8 (ZeRO++)
    reducers.py       how a sharded bucket is summed: reduce-scatter, or qgZ's quantized hierarchical one
    grad_sync.py      the bucket machinery every stage shares; stages 0 and 1
    units.py          the ZeRO-3 gather units a model declares (``zero3_plan()``); a chunk seen through a filter
    sharded_grads.py  stage 2: gradients sharded (also stage 3's gradients)
    param_sync.py     stage 3: parameters sharded too, gathered per unit around forward and backward
    zeropp.py         ZeRO++'s qwZ and hpZ: stage 3's gathering, node-aware
    publish.py        each stage's optimizer policy: owned ranges, how new weights reach the model
    optimizer.py      the one AdamW over every bucket group (fp32 masters, clipping, fp16 scaling)
    engine.py         bucket groups (dense, experts), the stage table, build_engine, model-state accounting

Each file imports only the ones listed above it.
"""
from megazero.parallel.zero.buckets import PAD_MULTIPLE, Bucket, ParamSlot, plan_buckets
from megazero.parallel.zero.engine import (
                                           STAGES,
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
from megazero.parallel.zero.grad_sync import (
                                           AllReduceGradSync,
                                           BucketedGradSync,
                                           ReduceScatterGradSync,
)
from megazero.parallel.zero.offload import OffloadStats
from megazero.parallel.zero.optimizer import BucketAdamW, merge_optimizer_states
from megazero.parallel.zero.param_sync import ShardedParamSync
from megazero.parallel.zero.sharded_grads import ShardedGradSync, reductions_in_flight
from megazero.parallel.zero.swap import OffloadError, SwapDir
from megazero.parallel.zero.units import (
                                           ParamSubset,
                                           UnitUse,
                                           Zero3Plan,
                                           trainable,
                                           whole_module_plan,
)

__all__ = ["AllReduceGradSync", "Bucket", "BucketAdamW", "BucketedGradSync", "OffloadError", "OffloadStats",
           "PAD_MULTIPLE", "ParamSlot", "ParamSubset", "ReduceScatterGradSync", "STAGES", "ShardedGradSync",
           "ShardedParamSync", "StatePiece", "SwapDir", "UnitUse", "Zero3Plan", "ZeroEngine", "bucket_group_filters",
           "bucket_group_views",
           "build_engine", "build_grad_sync", "build_optimizer", "merge_optimizer_states", "model_state_bytes",
           "plan_buckets", "reductions_in_flight", "trainable", "whole_module_plan", "wrap_data_parallel",
           "zero_paper_bytes"]
