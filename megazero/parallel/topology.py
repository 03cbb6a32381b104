"""Process-group topology: which ranks form each tensor-, pipeline- and data-parallel group.

Two halves:

* :func:`rank_grid` is pure: from (world, tp, pp, dp, order) it lists the ranks of every group.
  No ``torch.distributed`` needed, so it is unit-tested against hand-written listings.
* :class:`Topology` is built once per process after the default group exists. It creates every
  group (all ranks must create all groups, in the same order) and holds this rank's coordinates.
  It is passed explicitly to every component; nothing here is a module-level global.

Rank order. ``order`` names the dimensions from fastest- to slowest-varying; the default
``"tp-dp-pp"`` is Megatron's: neighbouring ranks share a tensor-parallel group (they talk most), then
data-parallel, then pipeline. Worked example, world 16 with tp=2, pp=4, dp=2 (Megatron's listing)::

    rank = tp_rank + 2 * dp_rank + 4 * pp_rank

    tensor-parallel   [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    data-parallel     [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    pipeline          [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    model-parallel    [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]      (tp x pp: one model replica)
    embedding         [0,12] [1,13] [2,14] [3,15]      (first and last stage of each pipeline)

With pp=1 the embedding group of a rank is just that rank: first and last stage coincide.

Nodes. Ranks are placed on nodes in blocks of ``ranks_per_node`` consecutive global ranks (torchrun's
``LOCAL_WORLD_SIZE``; ``--ranks-per-node`` lets one machine pretend to be several). Each data-parallel
group is cut two ways (ZeRO++'s hierarchy): ``dp_intra`` = its members on one node, ``dp_inter`` =
its members with the same position on their node, one per node. Every data-parallel group must hold
the same number of members on each node it touches. Worked example, world 8, tp=2, dp=4, pp=1,
ranks_per_node=4 (node 0: ranks 0-3, node 1: ranks 4-7)::

    data-parallel     [0,2,4,6] [1,3,5,7]
    dp_intra          [0,2] [1,3] [4,6] [5,7]          (dp ranks 0,1 | 2,3 of each group)
    dp_inter          [0,4] [1,5] [2,6] [3,7]          (dp ranks 0,2 | 1,3 of each group)

so dp rank r of a group sits on node r // L at local position r % L (L = 2 dp members per node).
:func:`dp_partitions` cuts every data-parallel group into consecutive blocks of K dp ranks (ZeRO++'s
hpZ secondary partition; K = L keeps it inside a node): K=2 above gives the ``dp_intra`` groups.

Expert parallelism (``ep`` = --expert-model-parallel-size, Mixture of Experts) is carved out of the
data-parallel group: dp rank ``d`` is expert-parallel rank ``d % ep`` of the expert group of the ``ep``
consecutive dp ranks ``d - d % ep ..``, which exchange tokens by all-to-all; the ``dp / ep`` ranks
holding the same experts (same ``d % ep``) form an expert-data-parallel group, over which the experts'
gradients are reduced. Worked example, world 8 with tp=2, pp=1, dp=4, ep=2 (rank = tp_rank + 2 * dp_rank)::

    data-parallel          [0,2,4,6] [1,3,5,7]
    expert-parallel        [0,2] [1,3] [4,6] [5,7]     (dp ranks 0-1 and 2-3 of each data-parallel group)
    expert-data-parallel   [0,4] [1,5] [2,6] [3,7]     (dp ranks 0,2 hold experts 0..E/2-1; 1,3 the rest)
"""
from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DIMS = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"


@dataclass(frozen=True)
class RankGrid:
    """Rank lists of every group of a (tp, pp, dp) layout. Each list of groups is sorted."""

    world_size: int
    tp: int
    pp: int
    dp: int
    order: str
    tensor: list[list[int]]
    pipeline: list[list[int]]
    data: list[list[int]]
    model: list[list[int]]
    embedding: list[list[int]]
    ep: int = 1
    expert: list[list[int]] = field(default_factory=list)
    expert_data: list[list[int]] = field(default_factory=list)
    ranks_per_node: int | None = None          # None: one node holds every rank
    dp_intra: list[list[int]] = field(default_factory=list)
    dp_inter: list[list[int]] = field(default_factory=list)

    def node_of(self, rank: int) -> int:
        """The node of a global rank (ranks fill nodes in blocks of ``ranks_per_node``)."""
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': tp_rank, 'dp': dp_rank, 'pp': pp_rank} of a global rank."""
        return _coords(rank, self.order, self.tp, self.pp, self.dp)

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of kind ('tensor', 'pipeline', 'data', 'model', 'embedding', 'expert',
        'expert_data') holding rank."""
        for group in getattr(self, kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in no {kind} group")


def _parse_order(order: str) -> list[str]:
    names = order.split("-")
    if sorted(names) != sorted(DIMS):
        raise ValueError(f"order {order!r} must name each of tp, dp, pp once, e.g. {DEFAULT_ORDER!r}")
    return names


def _sizes_in_order(order: str, tp: int, pp: int, dp: int) -> list[tuple[str, int]]:
    size = {"tp": tp, "pp": pp, "dp": dp}
    return [(name, size[name]) for name in _parse_order(order)]


def _coords(rank: int, order: str, tp: int, pp: int, dp: int) -> dict[str, int]:
    out, rest = {}, rank
    for name, size in _sizes_in_order(order, tp, pp, dp):
        out[name] = rest % size
        rest //= size
    return out


def _rank_of(coords: dict[str, int], order: str, tp: int, pp: int, dp: int) -> int:
    rank, stride = 0, 1
    for name, size in _sizes_in_order(order, tp, pp, dp):
        rank += coords[name] * stride
        stride *= size
    return rank


def _groups_varying(varying: tuple[str, ...], order: str, tp: int, pp: int, dp: int) -> list[list[int]]:
    """All groups whose members differ only in the `varying` dims (the others fixed)."""
    size = {"tp": tp, "pp": pp, "dp": dp}
    fixed = [d for d in DIMS if d not in varying]
    groups = []
    for fixed_vals in itertools.product(*(range(size[d]) for d in fixed)):
        members = []
        for var_vals in itertools.product(*(range(size[d]) for d in varying)):
            coords = dict(zip(fixed, fixed_vals)) | dict(zip(varying, var_vals))
            members.append(_rank_of(coords, order, tp, pp, dp))
        groups.append(sorted(members))
    return sorted(groups)


def rank_grid(world_size: int, tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER,
              ranks_per_node: int | None = None, ep: int = 1) -> RankGrid:
    """List the ranks of every group for a tp x pp x dp layout, with ``ep`` expert-parallel ranks
    carved out of dp (pure; see the module docstring). With ``ranks_per_node``, also the node-local
    and cross-node pieces of every data-parallel group."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if dp % ep:
        raise ValueError(f"dp {dp} is not divisible by expert-parallel size {ep}")
    if tp * pp * dp != world_size:
        raise ValueError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} != world size {world_size}")
    pipeline = _groups_varying(("pp",), order, tp, pp, dp)
    by_stage = [_in_stage_order(g, order, tp, pp, dp) for g in pipeline]
    embedding = sorted(sorted({g[0], g[-1]}) for g in by_stage)
    data = [_in_dp_order(g, order, tp, pp, dp) for g in _groups_varying(("dp",), order, tp, pp, dp)]
    intra, inter = _split_by_node(data, world_size, ranks_per_node)
    return RankGrid(
        world_size=world_size, tp=tp, pp=pp, dp=dp, order=order,
        tensor=_groups_varying(("tp",), order, tp, pp, dp),
        pipeline=pipeline,
        data=data,
        model=_groups_varying(("tp", "pp"), order, tp, pp, dp),
        embedding=embedding,
        ranks_per_node=ranks_per_node, dp_intra=intra, dp_inter=inter,
        ep=ep,
        expert=sorted(g[i:i + ep] for g in data for i in range(0, dp, ep)),
        expert_data=sorted(g[i::ep] for g in data for i in range(ep)),
    )


def _split_by_node(data: list[list[int]], world_size: int, ranks_per_node: int | None):
    """(dp_intra, dp_inter) groups of every data-parallel group (see the module docstring); both empty
    when some data-parallel group holds different numbers of ranks on different nodes."""
    rpn = ranks_per_node or world_size
    if rpn < 1 or world_size % rpn:
        raise ValueError(f"ranks per node ({rpn}) must divide the world size ({world_size}): "
                         f"set --ranks-per-node to a divisor of {world_size}")
    intra, inter = [], []
    for group in data:
        by_node: dict[int, list[int]] = {}
        for r in group:
            by_node.setdefault(r // rpn, []).append(r)
        sizes = {len(members) for members in by_node.values()}
        if len(sizes) != 1:            # no regular hierarchy: ZeRO++'s hierarchical paths refuse this layout
            return [], []
        local = sizes.pop()
        nodes = [by_node[n] for n in sorted(by_node)]
        intra += nodes
        inter += [[members[i] for members in nodes] for i in range(local)]
    return sorted(intra), sorted(inter)


def dp_partitions(grid: RankGrid, k: int) -> list[list[int]]:
    """Every data-parallel group cut into consecutive blocks of ``k`` members (in dp-rank order):
    ZeRO++'s hpZ secondary partition groups. ``k`` must divide dp."""
    if k < 1 or grid.dp % k:
        raise ValueError(f"--zero-hpz-partition-size {k} must divide the data-parallel size {grid.dp}")
    return sorted(g[i:i + k] for g in grid.data for i in range(0, len(g), k))


def local_world_size() -> int | None:
    """Ranks per node as torchrun says (``LOCAL_WORLD_SIZE``), or None outside a launcher."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def _in_dp_order(group: list[int], order: str, tp: int, pp: int, dp: int) -> list[int]:
    """A data-parallel group's ranks ordered by dp_rank."""
    return sorted(group, key=lambda r: _coords(r, order, tp, pp, dp)["dp"])


def _in_stage_order(group: list[int], order: str, tp: int, pp: int, dp: int) -> list[int]:
    """A pipeline group's ranks ordered by stage (pp_rank), which need not be rank order."""
    return sorted(group, key=lambda r: _coords(r, order, tp, pp, dp)["pp"])


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
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
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
    """The process groups of one tp x pp x dp layout and this rank's place in them.

    Build once per process, after the default group is initialised, and pass it to every component::

        topo = Topology(tp=2, pp=2, dp=2)       # on each of 8 ranks
        topo.tp_rank, topo.pp_rank, topo.dp_rank
        topo.tp_group, topo.pp_group, topo.dp_group, topo.mp_group, topo.embedding_group
        topo.next_rank, topo.prev_rank        # global ranks of the neighbouring stages (or None)
        topo.ep_group, topo.ep_rank, topo.ep_size      # expert parallelism (ep=..., see the module doc)
        topo.expert_dp_group, topo.expert_dp_rank, topo.expert_dp_size

    ``dp`` may be omitted: it is inferred as world // (tp * pp). ``ranks_per_node`` (default: torchrun's
    ``LOCAL_WORLD_SIZE``, else the whole world on one node) places ranks on nodes; the node-local and
    cross-node pieces of this rank's dp group are ``topo.dp_intra_group`` / ``topo.dp_inter_group``
    (with their ranks in ``dp_intra_ranks`` / ``dp_inter_ranks``), and ``topo.dp_partition_group(k)``
    creates (once, on every rank) hpZ's k-member blocks of the dp groups.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None, order: str = DEFAULT_ORDER,
                 device: torch.device | None = None, timeout_s: float | None = None,
                 ranks_per_node: int | None = None, ep: int = 1):
        world = dist.get_world_size()
        rank = dist.get_rank()
        dp = dp if dp is not None else world // (tp * pp)
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self.ranks_per_node = ranks_per_node or local_world_size() or world
        self.grid = rank_grid(world, tp, pp, dp, order, self.ranks_per_node, ep)
        self.world_size, self.rank = world, rank
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.device = device or torch.device("cpu")
        coords = self.grid.coords(rank)
        self.tp_rank, self.pp_rank, self.dp_rank = coords["tp"], coords["pp"], coords["dp"]

        # Every rank creates every group in the same order (a torch.distributed requirement).
        self.tp_group, self.tp_ranks = self._create(self.grid.tensor)
        self.pp_group, self.pp_ranks = self._create(self.grid.pipeline)
        self.dp_group, self.dp_ranks = self._create(self.grid.data)
        self.mp_group, self.mp_ranks = self._create(self.grid.model)
        self.embedding_group, self.embedding_ranks = self._create(self.grid.embedding, required=False)  # middle stages: None, []
        self.pp_ranks = _in_stage_order(self.pp_ranks, order, tp, pp, dp)
        self.node = self.grid.node_of(rank)
        self.dp_intra_group, self.dp_intra_ranks = self._node_groups(self.grid.dp_intra)
        self.dp_inter_group, self.dp_inter_ranks = self._node_groups(self.grid.dp_inter)
        self._partitions: dict[int, tuple] = {}
        self.ep_size, self.ep_rank = ep, self.dp_rank % ep
        self.expert_dp_size, self.expert_dp_rank = dp // ep, self.dp_rank // ep
        if ep > 1:                # groups made only when used: a run without experts creates none
            self.ep_group, self.ep_ranks = self._create(self.grid.expert)
            self.expert_dp_group, self.expert_dp_ranks = self._create(self.grid.expert_data)
        else:
            self.ep_group, self.ep_ranks = None, [rank]
            self.expert_dp_group, self.expert_dp_ranks = self.dp_group, self.dp_ranks

    def _node_groups(self, groups: list[list[int]]):
        """Create the groups only when they differ from the dp groups and are not single ranks (so a
        one-node run makes exactly the groups it made before nodes existed)."""
        if not groups:
            return None, []
        if groups == self.grid.data:
            return self.dp_group, self.dp_ranks
        if all(len(g) == 1 for g in groups):
            return None, [self.rank]
        return self._create(groups)

    def dp_partition_group(self, k: int):
        """(group, ranks) of this rank's block of ``k`` consecutive dp members (:func:`dp_partitions`);
        created on first use, so every rank must call it with the same ``k`` at the same point."""
        if k not in self._partitions:
            blocks = dp_partitions(self.grid, k)
            self._partitions[k] = ((self.dp_group, self.dp_ranks) if blocks == self.grid.data else
                                   (None, [self.rank]) if k == 1 else self._create(blocks))
        return self._partitions[k]

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

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage, or None on the last stage."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage, or None on the first stage."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} "
                f"pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size}")
