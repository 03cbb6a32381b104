"""The optimizer of each ZeRO stage: which range of every bucket a rank owns, over which group the
gradient norm is summed, and how the updated weights reach the model (the step itself is
:class:`megazero.parallel.zero.optimizer.BucketAdamW`'s; its module docstring has the who-holds-what
table). :func:`build_optimizer` picks the class by ``--zero-stage``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.config import OptimizerConfig, PrecisionConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.zero.buckets import Bucket
from megazero.parallel.zero.grad_sync import (AllReduceGradSync, BucketedGradSync, ReduceScatterGradSync,
                                              ShardedGradSync)
from megazero.parallel.zero.optimizer import BucketAdamW
from megazero.parallel.zero.param_sync import ShardedParamSync
from megazero.parallel.zero.swap import SwapDir


class DataParallelOptimizer(BucketAdamW):
    """Stage 0: every DP rank keeps fp32 masters and Adam state for every parameter."""

    def _check_grad_sync(self, grad_sync) -> None:
        if type(grad_sync) is not AllReduceGradSync:
            raise TypeError("DataParallelOptimizer needs full gradients: use AllReduceGradSync (--zero-stage 0)")

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return 0, bucket.numel

    def _norm_group(self):
        return self.topo.mp_group, "mp"


class ZeroStage1Optimizer(BucketAdamW):
    """ZeRO-1: rank r keeps fp32 masters and Adam state for shard r of every bucket, steps it and
    all-gathers the updated parameters over dp. Gradients stay full-size (ReduceScatterGradSync, or
    AllReduceGradSync where an all-reduce is the cheaper collective)."""

    def _check_grad_sync(self, grad_sync) -> None:
        if type(grad_sync) not in (ReduceScatterGradSync, AllReduceGradSync):
            raise TypeError("ZeroStage1Optimizer needs ReduceScatterGradSync or AllReduceGradSync (--zero-stage 1)")

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.grad_sync.shard_range(bucket)

    def _norm_group(self):
        return dist.group.WORLD, "world"

    def __init__(self, grad_sync, *args, **kwargs):
        super().__init__(grad_sync, *args, **kwargs)
        self.overlap = OverlappedParamGather(grad_sync) if grad_sync.cfg.overlap_param_gather else None

    def _share(self) -> None:
        """All-gather every bucket's updated shard over dp, in the order the forward uses the buckets
        (the last bucket holds the first layers); wait, or with ``--overlap-param-gather`` leave the
        gathers to finish behind the next forward."""
        handles = {}
        for k in reversed(range(len(self.ranges))):
            r = self.ranges[k]
            shard = r.bucket.param_data[r.lo:r.hi]
            handles[k] = comm.all_gather(r.bucket.param_data, shard, self.grad_sync.dp_group,
                                         self.comm_log, "dp", async_op=True)
        if self.overlap is not None:
            self.overlap.launched(handles)
            return
        for h in handles.values():
            if h is not None:
                h.wait()

    def wait_params(self) -> None:
        if self.overlap is not None:
            self.overlap.wait_all()

    def _before_write(self) -> None:
        self.wait_params()                        # a gather still writing the parameters finishes first

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        super().close()


class OverlappedParamGather:
    """ZeRO-1/2 with ``--overlap-param-gather``: the updated parameters' all-gathers finish behind the
    next forward instead of at the end of the step (Megatron's flag of the same name).

    A forward pre-hook on every module below a chunk's root waits for the gathers of the buckets
    that hold the parameters of its whole subtree: a module may read a child's parameters without
    calling the child (the MoE layer reads its router's and experts' weights). The chunk's root
    waits at the start of its forward for its own parameters and for those read by the root itself
    where no module that owns them is called: the output head (the model calls ``output_layer``
    to read it) and the last pipeline stage's tied copy of the word embeddings (``tied_copy``).
    Whatever else reads or writes the parameters first calls :meth:`wait_all`: the optimizer before
    it writes new values, the engine before saving, loading, ``gathered_parameters`` and
    ``state_dict``.

    Example, dp = 2, buckets filled in backward order: b0 = [output head, layer 1], b1 = [layer 0,
    embedding]. ``step()`` returns with both gathers queued, b1's first; the next forward's embedding
    waits for b1 alone and layer 0 runs while b0's gather goes on; layer 1 then waits for b0.
    """

    def __init__(self, grad_sync):
        self.pending: dict[int, object] = {}          # bucket index -> work handle of its all-gather
        bucket_of = {id(s.param): k for k, b in enumerate(grad_sync.buckets) for s in b.slots}
        self._hooks = []
        for chunk in grad_sync.chunks:
            for module in chunk.modules():
                if module is chunk:
                    params = [*chunk.parameters(recurse=False),
                              *(p for p in chunk.parameters() if getattr(p, "tied_copy", False))]
                else:
                    params = list(module.parameters())
                ks = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of})
                if ks:
                    self._hooks.append(module.register_forward_pre_hook(
                        lambda module, args, ks=ks: self.wait(ks)))

    def launched(self, handles: dict[int, object]) -> None:
        self.pending.update({k: h for k, h in handles.items() if h is not None})

    def wait(self, ks) -> None:
        if self.pending:
            for k in ks:
                h = self.pending.pop(k, None)
                if h is not None:
                    h.wait()

    def wait_all(self) -> None:
        self.wait(list(self.pending))

    def close(self) -> None:
        self.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []


class ZeroStage2Optimizer(ZeroStage1Optimizer):
    """ZeRO-2: as stage 1, over gradients that are themselves sharded (ShardedGradSync)."""

    def _check_grad_sync(self, grad_sync) -> None:
        if not isinstance(grad_sync, ShardedGradSync):
            raise TypeError("ZeroStage2Optimizer needs ShardedGradSync (--zero-stage 2)")


class ZeroStage3Optimizer(BucketAdamW):
    """AdamW on this rank's shard of every bucket; publishing = writing the shard (no all-gather:
    the next forward gathers)."""

    def _check_grad_sync(self, grad_sync) -> None:
        if not isinstance(grad_sync, ShardedParamSync):
            raise TypeError("ZeroStage3Optimizer needs ShardedParamSync (--zero-stage 3)")

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.grad_sync.shard_range(bucket)

    def _range_params(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        return self.grad_sync.shard_values(bucket)

    def _params_on_device(self) -> bool:
        return not self.grad_sync.shards.offloaded

    def _norm_group(self):
        return dist.group.WORLD, "world"

    def _before_write(self) -> None:
        self.grad_sync.release_all()              # gathered copies would be stale

    def _write_params(self, k: int, a: int, b: int, values: torch.Tensor) -> None:
        r = self.ranges[k]
        self.grad_sync.write_params(r.bucket, r.lo + a, r.lo + b, values)

    def _share(self) -> None:
        self.grad_sync.flush_params()             # the next forward gathers from the shards


OPTIMIZER_BY_STAGE = {0: DataParallelOptimizer, 1: ZeroStage1Optimizer, 2: ZeroStage2Optimizer,
                      3: ZeroStage3Optimizer}


def build_optimizer(grad_sync: BucketedGradSync, opt_cfg: OptimizerConfig,
                    precision: PrecisionConfig | None = None, stage: int | None = None, *,
                    swap: SwapDir | None = None) -> BucketAdamW:
    """The optimizer for ``stage`` (default: the grad sync's ``zero_stage``); ``swap``: where
    ``--offload-optimizer nvme`` keeps its file."""
    stage = grad_sync.cfg.zero_stage if stage is None else stage
    if stage not in OPTIMIZER_BY_STAGE:
        raise ValueError(f"--zero-stage {stage}: only 0, 1, 2 and 3 are implemented")
    return OPTIMIZER_BY_STAGE[stage](grad_sync, opt_cfg, precision, swap=swap)
