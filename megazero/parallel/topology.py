"""Process-group topology: the groups of one layout, created once per process and handed out as typed
views.

:func:`megazero.ranks.rank_grid` lists the ranks of every group (pure: the rank order, nodes, context and
expert parallelism are explained there with worked listings). :class:`Topology` is built once per
process after the default group exists: it creates every group (all ranks must create all groups, in
the same order), holds this rank's coordinates and gives each component the small frozen view it works
over (:mod:`megazero.parallel.groups`). It is passed explicitly to every component; nothing here is a
module-level global.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megazero.parallel.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    ModelParallelGroups,
    ModelReplica,
    PipelineLayout,
    SubGroup,
    TensorParallel,
)
from megazero.ranks import (
    DEFAULT_ORDER,
    dp_partitions,
    local_world_size,
    rank_grid,
    replica_split,
)


def default_backend() -> str:
    """nccl when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from torchrun's environment and return this rank's device.

    Works without torchrun too (a single process: rank 0 of world 1). With CUDA, binds the process
    to ``LOCAL_RANK``'s GPU. ``timeout_s`` bounds every collective of the default group (and, passed
    to :class:`Topology`, of every group): a stuck peer ends the job with an error instead of a hang.
    Under a launcher, the process also ends when the launcher dies (:func:`end_with_parent`).
    """
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        end_with_parent()
    backend = backend or os.environ.get("MEGAZERO_BACKEND") or default_backend()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
            # one process and no launcher: an in-process store, so that runs started side by side on one
            # machine never race for a TCP port
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group(backend=backend, timeout=timeout)
    return device


def end_with_parent() -> None:
    """Have Linux send this process SIGTERM when its parent (the launcher) dies, so killing torchrun
    never leaves workers training (and saving) as orphans. A no-op elsewhere."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:                       # the launcher died before the call took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Topology:
    """The process groups of one tp x cp x pp x dp layout and this rank's place in them.

    Build once per process, after the default group is initialised, and pass it to the entry point's
    builders, which hand each component the typed view it works over (:mod:`megazero.parallel.groups`)::

        topo = Topology(tp=2, pp=2, dp=2)       # on each of 8 ranks
        topo.tensor_parallel(), topo.pipeline(), topo.data_parallel(), topo.model_replica()
        topo.expert_parallel(), topo.expert_data_parallel()        # expert parallelism (ep=...)
        topo.context_parallel(), topo.data_context_parallel()      # context parallelism (cp=...)
        topo.tp_rank, topo.pp_rank, topo.dp_rank, topo.rank, topo.world_size, topo.device

    ``dp`` may be omitted: it is inferred as world // (tp * cp * pp). ``ranks_per_node`` (default: torchrun's
    ``LOCAL_WORLD_SIZE``, else the whole world on one node) places ranks on nodes; the data-parallel
    views carry their node-local and cross-node pieces and make hpZ's k-member blocks on first use.
    Groups that equal another are created once; a run without experts creates no expert groups.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None, order: str = DEFAULT_ORDER,
                 device: torch.device | None = None, timeout_s: float | None = None,
                 ranks_per_node: int | None = None, ep: int = 1, cp: int = 1, replicas: int = 1):
        world = dist.get_world_size()
        rank = dist.get_rank()
        dp = dp if dp is not None else world // (tp * cp * pp)
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self.ranks_per_node = ranks_per_node or local_world_size() or world
        self.grid = rank_grid(world, tp, pp, dp, order, self.ranks_per_node, ep, cp)
        self.world_size, self.rank = world, rank
        self.tp_size, self.pp_size, self.dp_size, self.ep_size, self.cp_size = tp, pp, dp, ep, cp
        self.device = device or torch.device("cpu")
        coords = self.grid.coords(rank)
        self.tp_rank, self.pp_rank, self.dp_rank, self.cp_rank = coords["tp"], coords["pp"], coords["dp"], coords["cp"]
        # ep is carved out of dp x cp. A group's members are numbered in sorted order (torch.distributed's
        # group ranks), which is the (dp_rank * cp + cp_rank) order of the grid's lists unless the rank order
        # puts dp before cp (dp-cp-...): each view below takes its rank from the sorted members.
        self.ep_rank = 0                                        # set from the expert group when ep > 1

        # Every rank creates every group in the same order (a torch.distributed requirement).
        self.tp_group, tp_ranks = self._create(self.grid.tensor)
        self.pp_group, pp_ranks = self._create(self.grid.pipeline)
        self.dp_group, dp_ranks = self._create(self.grid.data)
        mp_group, mp_ranks = self._create(self.grid.model)
        emb_group, emb_ranks = self._create(self.grid.embedding, required=False)  # middle stages: None, []
        self._partitions: dict[tuple[str, int], SubGroup] = {}
        self._tp = TensorParallel(self.tp_group, tuple(tp_ranks), self.tp_rank, tp)
        self._pipeline = PipelineLayout(self.pp_group, tuple(pp_ranks), self.pp_rank, pp,
                                        SubGroup(emb_group, tuple(emb_ranks)) if emb_ranks else None, self.device)
        self._replica = ModelReplica(mp_group, tuple(mp_ranks))
        self._dp = self._data_view("data", self.dp_group, dp_ranks, self.dp_rank)
        if cp > 1:                # groups made only when used: a run without context parallelism creates none
            cp_group, cp_ranks = self._create(self.grid.context)
            dpcp_group, dpcp_ranks = self._create(self.grid.data_context)
            self._cp = ContextParallel(cp_group, tuple(cp_ranks), self.cp_rank, cp)
            dpcp_ranks = sorted(dpcp_ranks)      # a view's rank is torch's group rank: its place in sorted order
            self._dp_cp = self._data_view("data_context", dpcp_group, dpcp_ranks, dpcp_ranks.index(rank))
        else:
            self._cp, self._dp_cp = ContextParallel(None, (rank,), 0, 1), self._dp
        if ep > 1:                # groups made only when used: a run without experts creates none
            ep_group, ep_ranks = self._create(self.grid.expert)
            edp_group, edp_ranks = self._create(self.grid.expert_data)
            ep_ranks, edp_ranks = sorted(ep_ranks), sorted(edp_ranks)
            self.ep_rank = ep_ranks.index(rank)
            self._ep = ExpertParallel(ep_group, tuple(ep_ranks), self.ep_rank, ep)
            self._expert_dp = self._data_view("expert_data", edp_group, edp_ranks, edp_ranks.index(rank))
        else:
            self._ep, self._expert_dp = ExpertParallel(None, (rank,), 0, 1), self._dp_cp
        self.replicas = replicas
        self._dp_shard = self._shard_view(replicas) if replicas > 1 else self._dp_cp

    # ------------------------------------------------------------------ views
    def tensor_parallel(self) -> TensorParallel:
        return self._tp

    def pipeline(self) -> PipelineLayout:
        return self._pipeline

    def data_parallel(self) -> DataParallel:
        """The data-parallel group: the ranks reading different samples (the data loader's dp)."""
        return self._dp

    def context_parallel(self) -> ContextParallel:
        """The context-parallel group: the ranks holding the slices of the same sequences."""
        return self._cp

    def data_context_parallel(self) -> DataParallel:
        """dp x cp (Megatron's dp_cp group): dense parameters are reduced and sharded over it. Gradients
        are averaged over dp only: each cp rank's loss is its slice's share of the sequence's loss, so
        their gradients add up to the sequence's. With cp = 1 it is the data-parallel view itself."""
        return self._dp_cp

    def data_shard(self) -> DataParallel:
        """The ranks ZeRO shards the dense parameters' state over: the data x context view itself, or, with
        ``replicas`` R, this rank's replica of dp / R consecutive members, whose ``replicas`` sum each reduced
        shard across the replicas (see :func:`megazero.ranks.replica_split`). Gradients still average over dp."""
        return self._dp_shard

    def _shard_view(self, replicas: int) -> DataParallel:
        """The shard view of the data-parallel groups split into ``replicas`` replicas (cp 1, no experts)."""
        shards, peers = replica_split(self.grid.data, self.dp_size // replicas)
        shard_group, shard_ranks = self._create(shards)
        replica_group, replica_ranks = self._create(peers)
        return DataParallel(shard_group, tuple(shard_ranks), shard_ranks.index(self.rank), len(shard_ranks),
                            self.dp_size, self.ranks_per_node, self.device,
                            replicas=SubGroup(replica_group, tuple(replica_ranks)))

    def expert_data_parallel(self) -> DataParallel:
        """The ranks holding the same experts (dp x cp / ep of them); gradients still averaged over dp. With
        ep = 1 it is the data x context view itself (the data-parallel view when cp = 1)."""
        return self._expert_dp

    def expert_parallel(self) -> ExpertParallel:
        return self._ep

    def model_replica(self) -> ModelReplica:
        return self._replica

    def model_groups(self, sequence_parallel: bool = False, cp_comm_type: str = "p2p") -> ModelParallelGroups:
        """What a model chunk's layers take: the tensor-, expert- and context-parallel groups."""
        return ModelParallelGroups(self._tp, self._ep, sequence_parallel and self.tp_size > 1, self._cp,
                                   cp_comm_type)

    def _data_view(self, kind: str, group, ranks: list[int], rank: int) -> DataParallel:
        """A data-parallel view over the groups ``grid.<kind>`` ("data" or "expert_data"), with its node
        pieces (ZeRO++)."""
        prefix = {"data": "dp", "data_context": "dp_cp"}.get(kind, kind)
        intra = self._node_group(getattr(self.grid, f"{prefix}_intra"), kind, group)
        inter = self._node_group(getattr(self.grid, f"{prefix}_inter"), kind, group)
        return DataParallel(group, tuple(ranks), rank, len(ranks), self.dp_size, self.ranks_per_node, self.device,
                            intra, inter, partitions=lambda k: self._partition(kind, k))

    def _node_group(self, groups: list[list[int]], kind: str, whole) -> SubGroup | None:
        """This rank's piece of a node split of the ``kind`` groups: the group ``whole`` itself when the
        pieces are the groups, no group for single ranks, else created here (so a one-node run makes
        exactly the groups it made before nodes existed)."""
        if not groups:
            return None
        mine = tuple(next(g for g in groups if self.rank in g))
        if groups == getattr(self.grid, kind):
            return SubGroup(whole, mine)
        if all(len(g) == 1 for g in groups):
            return SubGroup(None, mine)
        return SubGroup(*self._create_tuple(groups))

    def _partition(self, kind: str, k: int) -> SubGroup:
        """This rank's block of ``k`` consecutive members of its ``kind`` group (created on first use,
        so every rank must call it with the same ``k`` at the same point)."""
        if (kind, k) not in self._partitions:
            blocks = dp_partitions(self.grid, k, kind)
            self._partitions[kind, k] = SubGroup(*self._create_tuple(blocks))
        return self._partitions[kind, k]

    def _create_tuple(self, groups: list[list[int]]):
        group, ranks = self._create(groups)
        return group, tuple(ranks)

    def _create(self, groups: list[list[int]], required: bool = True):
        mine = (None, [])
        for ranks in groups:
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                mine = (group, ranks)
        assert mine[0] is not None or not required, f"rank {self.rank} not found in {groups}"
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} "
                f"cp {self.cp_rank}/{self.cp_size} pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size}")
