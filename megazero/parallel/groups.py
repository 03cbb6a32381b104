"""Typed views of the process groups: each component takes the small frozen object for the group it
works over, handed out by :class:`megazero.parallel.topology.Topology`, never the whole topology.

    view                     handed out by                  taken by
    TensorParallel           topo.tensor_parallel()         models' layers, gradient sums of SP parameters
    ExpertParallel           topo.expert_parallel()         MoE layers (the token all-to-all)
    ContextParallel          topo.context_parallel()        attention (keys/values exchanged over cp)
    PipelineLayout           topo.pipeline()                run_schedule, StageComm, tied-embedding sums
    DataParallel             topo.data_context_parallel()   ZeRO: dense parameters reduced/sharded over dp x cp
                             topo.data_shard()              ZeRO's shard group: dp x cp itself, or with
                                                            --data-parallel-replicas R one replica's dp / R
                                                            ranks, its ``replicas`` the ranks at the same place
                                                            in the other replicas
                             topo.data_parallel()           the data loader (which samples a rank reads)
                             topo.expert_data_parallel()    ZeRO: experts over the expert-data-parallel group
    ModelReplica             topo.model_replica()           the unsharded optimizer's gradient norm (tp x pp)

A new parallel axis (context parallelism, say) is a new view and a new ``Topology`` method, not a proxy
that impersonates the topology. Every view works at size 1 without a process group (``group=None``),
so tools and single-process tests build them with :meth:`single` class methods.

Worked example, world 8 with tp=2, dp=4, ep=2 (rank = tp_rank + 2 * dp_rank), rank 6::

    topo.tensor_parallel()        TensorParallel(ranks=(6, 7), rank=0, size=2)
    topo.data_parallel()          DataParallel(ranks=(0, 2, 4, 6), rank=3, size=4, average_over=4)
    topo.expert_parallel()        ExpertParallel(ranks=(4, 6), rank=1, size=2)
    topo.expert_data_parallel()   DataParallel(ranks=(2, 6), rank=1, size=2, average_over=4)

The expert view averages over the whole dp (4), not its own size (2): each expert saw the tokens of
every ep rank through the all-to-all, so its summed gradient covers the whole data-parallel batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class SubGroup:
    """A process group and its global ranks (in group-rank order); ``group`` None for a single rank."""

    group: Any
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's tensor-parallel group: ``size`` ranks each holding a shard of every split layer."""

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    size: int = 1

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel group: ``size`` consecutive members of the dp x cp group holding different
    experts, which exchange tokens by all-to-all (see the topology's module docstring)."""

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    size: int = 1

    @classmethod
    def single(cls) -> "ExpertParallel":
        return cls()


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group: ``size`` ranks each holding a slice of the same sequences
    (chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``, :mod:`megazero.parallel.context`),
    exchanging keys and values in attention."""

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    size: int = 1

    @classmethod
    def single(cls) -> "ContextParallel":
        return cls()


@dataclass(frozen=True)
class ModelParallelGroups:
    """What a model chunk's layers need: the tensor-parallel group (and whether sequence parallelism is on
    over it) and the expert-parallel group. ``single()``: one process (tools, the serial reference)."""

    tp: TensorParallel = field(default_factory=TensorParallel)
    ep: ExpertParallel = field(default_factory=ExpertParallel)
    sequence_parallel: bool = False
    cp: ContextParallel = field(default_factory=ContextParallel)
    cp_comm_type: str = "p2p"

    @classmethod
    def single(cls) -> "ModelParallelGroups":
        return cls()


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's pipeline: its stage ``rank`` of ``size``, the stages' global ranks in stage order, and
    the embedding group (first and last stage: the tied word embedding's two copies)."""

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    size: int = 1
    embedding: SubGroup | None = None
    device: torch.device = torch.device("cpu")

    @classmethod
    def single(cls, device: torch.device | None = None) -> "PipelineLayout":
        return cls(device=device or torch.device("cpu"))

    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.size - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous stage, or None on the first stage."""
        return None if self.is_first_stage else self.ranks[self.rank - 1]

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next stage, or None on the last stage."""
        return None if self.is_last_stage else self.ranks[self.rank + 1]


@dataclass(frozen=True)
class ModelReplica:
    """The tp x pp ranks that together hold one replica of the model (Megatron's model-parallel group)."""

    group: Any = None
    ranks: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class DataParallel:
    """A data-parallel group that ZeRO reduces gradients over and shards state over.

    ``rank``/``size``: this rank's place in ``ranks`` (dp-rank order). ``average_over``: gradients are
    divided by this (the whole dp, also for the expert view: see the module docstring).
    ``ranks_per_node``: for the byte log's intra/inter-node split and ZeRO++. ``intra``/``inter``: the
    group cut by node (members on this node / members at this rank's position on every node), None
    when the group has no regular node layout. ``partition(k)``: this rank's block of ``k``
    consecutive members (ZeRO++'s hpZ), created on first use: every rank must ask at the same point.
    ``tag``: the name its traffic is recorded under. ``replicas`` (``--data-parallel-replicas``, shard views
    only): the ranks holding this rank's shard in the other replicas, over which each reduced shard is
    summed (tag ``dp_replica``); None without replicas.
    """

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    size: int = 1
    average_over: int = 1
    ranks_per_node: int | None = None
    device: torch.device = torch.device("cpu")
    intra: SubGroup | None = None
    inter: SubGroup | None = None
    tag: str = "dp"
    partitions: Callable[[int], SubGroup] | None = field(default=None, compare=False, repr=False)
    replicas: SubGroup | None = None

    @classmethod
    def single(cls, device: torch.device | None = None) -> "DataParallel":
        return cls(device=device or torch.device("cpu"))

    def partition(self, k: int) -> SubGroup:
        """This rank's block of ``k`` consecutive members (in dp-rank order)."""
        if k == self.size:
            return SubGroup(self.group, self.ranks)
        if k == 1:
            return SubGroup(None, (self.ranks[self.rank],))
        if self.partitions is None:
            raise ValueError(f"this data-parallel view cannot make blocks of {k} ranks")
        return self.partitions(k)
