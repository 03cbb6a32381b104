"""What differs between the ZeRO stages on the optimizer's side, as one small policy object per stage:
which range of every bucket a rank owns (and steps), how many ranks hold each reduced gradient element
(for the global norm), and how the updated weights reach the model afterwards. The step itself is
:class:`megazero.parallel.zero.optimizer.BucketAdamW`'s; it reads and writes the parameters of a range
through the range's grad sync's parameter component (``r.sync.params``: whole parameters at stages
0-2, this rank's shards at stage 3).

    policy            stage  owns             gradient held by     after the step
    Replicated        0      whole bucket     all N dp ranks       write the masters into the params
    AllGatherShards   1, 2   shard r          rank r alone         write the shard, all-gather it over dp
    WriteShards       3      shard r          rank r alone         write the shard; the next forward gathers

The engine's stage table names the policy; ``from_config`` builds it from the ZeRO config. Each derives
from :class:`PublishPolicy` (what they share), none from another stage's. Every method takes the
range's own grad sync (``r.sync``), so one optimizer steps bucket groups over different data-parallel
groups (dense parameters over dp, experts over the expert-data-parallel group).
"""
from __future__ import annotations

from megazero.compile import in_compiled_region, parent_map
from megazero.parallel import counted_comm as comm
from megazero.parallel.zero.buckets import Bucket
from megazero.parallel.zero.fp8_gather import FP8Wire
from megazero.parallel.zero.units import ParamSubset


class PublishPolicy:
    """What the stages' policies share (not a stage itself): the bucket groups' grad syncs, ownership of
    this rank's shard of every bucket (``sharded``), and nothing to wait for or to close."""

    sharded = True
    overlap = None                            # the overlapped parameter gather (stages 1-2 with the flag)

    def __init__(self, syncs):
        self.syncs = syncs

    @classmethod
    def from_config(cls, syncs, zero_cfg) -> "PublishPolicy":
        """The policy over ``syncs`` for a ZeRO config (the switches it takes, if any)."""
        return cls(syncs)

    def owned_range(self, sync, bucket: Bucket) -> tuple[int, int]:
        """The bucket elements this rank steps: its shard."""
        return sync.shard_range(bucket)

    def replicas(self, sync) -> int:
        """Ranks holding each reduced gradient element this rank holds (its norm is divided by this): one,
        or the replicas of ``--data-parallel-replicas``."""
        return sync.dp.replicas.size if sync.dp.replicas is not None else 1

    def before_write(self) -> None:
        """Called before new parameter values are stored."""

    def share(self, ranges) -> None:
        """Make the stored values the model's everywhere."""

    def wait(self) -> None:
        """Return once the parameters hold the last step's values."""

    def exact(self) -> None:
        """Return once every parameter holds its exact value (none rounded for the wire)."""

    def close(self) -> None:
        pass


class Replicated(PublishPolicy):
    """Stage 0: every dp rank keeps fp32 masters and Adam state for every parameter, steps them all and
    writes them into its parameters: nothing to share."""

    sharded = False

    def owned_range(self, sync, bucket: Bucket) -> tuple[int, int]:
        return 0, bucket.numel

    def replicas(self, sync) -> int:
        return sync.dp_size


class AllGatherShards(PublishPolicy):
    """ZeRO-1/2: rank r keeps fp32 masters and Adam state for shard r of every bucket, steps it and
    all-gathers the updated parameters over its bucket group's dp, in the order the forward uses the
    buckets (the last bucket holds the first layers). With ``--overlap-param-gather`` the gathers finish
    behind the next forward (:class:`OverlappedParamGather`). With ``--fp8-param-gather`` the FP8 weights
    travel in FP8 (:mod:`.fp8_gather`): the other ranks' pieces of them hold FP8-rounded values until
    :meth:`exact` gathers them again as they are."""

    def __init__(self, syncs, overlap: bool = False):
        super().__init__(syncs)
        self.overlap = OverlappedParamGather(syncs) if overlap else None
        self.fp8 = {id(sync): FP8Wire(sync.dp, sync.comm_log) for sync in syncs}
        self.rounded = False                  # an FP8 share left rounded pieces in the parameters

    @classmethod
    def from_config(cls, syncs, zero_cfg) -> "AllGatherShards":
        return cls(syncs, overlap=zero_cfg.overlap_param_gather)

    def share(self, ranges) -> None:
        handles = {}
        for sync in self.syncs:
            mine = [r for r in ranges if r.sync is sync]
            wire = self.fp8[id(sync)]
            in_fp8 = [r for r in mine if wire.plan(r.bucket) is not None]
            scales = wire.agree([(r.bucket, r.bucket.param_data[r.lo:r.hi]) for r in in_fp8]) if in_fp8 else []
            scales = {id(r): s for r, s in zip(in_fp8, scales)}
            self.rounded = self.rounded or bool(in_fp8)
            for r in reversed(mine):
                shard = r.bucket.param_data[r.lo:r.hi]
                if id(r) in scales:
                    handles[id(r.bucket)] = wire.launch(r.bucket, shard, scales[id(r)])
                else:
                    handles[id(r.bucket)] = comm.all_gather(r.bucket.param_data, shard, sync.dp_group, sync.comm_log,
                                                            sync.dp.tag, async_op=True)
        if self.overlap is not None:
            self.overlap.launched(handles)
            return
        for h in handles.values():
            if h is not None:
                h.wait()

    def wait(self) -> None:
        if self.overlap is not None:
            self.overlap.wait_all()

    def exact(self) -> None:
        """After an FP8 share, all-gather the buckets holding FP8 weights again in the parameters' dtype."""
        self.wait()
        if not self.rounded:
            return
        for sync in self.syncs:
            for b in sync.buckets:
                if self.fp8[id(sync)].plan(b) is not None:
                    lo, hi = sync.shard_range(b)
                    comm.all_gather(b.param_data, b.param_data[lo:hi], sync.dp_group, sync.comm_log, sync.dp.tag)
        self.rounded = False

    def before_write(self) -> None:
        self.wait()                               # a gather still writing the parameters finishes first

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()


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

    Under ``--compile`` the modules inside a compiled region get no hook of their own (a hook would run
    inside the compiled graph): the region's hook waits for its whole subtree.

    Example, dp = 2, buckets filled in backward order: b0 = [output head, layer 1], b1 = [layer 0,
    embedding]. ``step()`` returns with both gathers queued, b1's first; the next forward's embedding
    waits for b1 alone and layer 0 runs while b0's gather goes on; layer 1 then waits for b0.
    """

    def __init__(self, syncs):
        self.pending: dict[int, object] = {}          # bucket number -> work handle of its all-gather
        # Buckets numbered in one order on every rank (bucket groups in order, then their buckets), so the
        # gathers are waited for in the same order everywhere.
        self.number = {id(b): k for k, b in enumerate(b for sync in syncs for b in sync.buckets)}
        bucket_of = {id(s.param): self.number[id(b)] for sync in syncs for b in sync.buckets for s in b.slots}
        self._hooks = []
        for chunk in _distinct_chunks(syncs):
            parents = parent_map(chunk)
            for module in chunk.modules():
                if in_compiled_region(module, parents):     # the region's own hook waits for its subtree
                    continue
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
        """``handles``: id(bucket) -> the work handle of its all-gather."""
        self.pending.update({self.number[k]: h for k, h in handles.items() if h is not None})

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


def _distinct_chunks(syncs):
    """The model chunks under the syncs' parameter views, each once (a bucket group sees a chunk
    through a :class:`~megazero.parallel.zero.units.ParamSubset`)."""
    seen, out = set(), []
    for sync in syncs:
        for c in sync.chunks:
            chunk = c.chunk if isinstance(c, ParamSubset) else c
            if id(chunk) not in seen:
                seen.add(id(chunk))
                out.append(chunk)
    return out


class WriteShards(PublishPolicy):
    """ZeRO-3: AdamW on this rank's shard of every bucket; publishing = writing the shard (no
    all-gather: the next forward gathers)."""

    def before_write(self) -> None:
        for sync in self.syncs:
            sync.params.release_all()             # gathered copies would be stale

    def share(self, ranges) -> None:
        for sync in self.syncs:
            sync.params.flush()                   # the next forward gathers from the shards
