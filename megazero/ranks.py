"""Rank arithmetic: which global ranks form each tensor-, context-, pipeline-, data- and expert-parallel
group of a layout, computed by pure functions (no ``torch.distributed``, no process group), so the
listings are unit-tested against hand-written ones and the configuration's checks can use them before
any process exists. :class:`megazero.parallel.topology.Topology` creates the groups these functions
list.

Rank order. ``order`` names the dimensions from fastest- to slowest-varying; the default
``"tp-cp-dp-pp"`` is Megatron's (``RankGenerator``'s ``"tp-cp-ep-dp-pp"``, whose ep is carved out of dp
here, see below): neighbouring ranks share a tensor-parallel group (they talk most), then
context-parallel, data-parallel, pipeline. An order without cp (``"tp-dp-pp"``, the spelling of the
three-axis layouts) puts cp right after tp. Worked example, world 16 with tp=2, pp=4, dp=2 (cp=1,
Megatron's listing)::

    rank = tp_rank + 2 * dp_rank + 4 * pp_rank

    tensor-parallel   [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    data-parallel     [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    pipeline          [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    model-parallel    [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]      (tp x pp: one model replica)
    embedding         [0,12] [1,13] [2,14] [3,15]      (first and last stage of each pipeline)

Context parallelism (``cp`` = --context-parallel-size) splits every sequence over cp ranks, which read
the same samples; gradients are reduced and ZeRO shards over the dp x cp group (Megatron's dp_cp).
Worked example, world 16 with tp=2, cp=2, dp=2, pp=2::

    rank = tp_rank + 2 * cp_rank + 4 * dp_rank + 8 * pp_rank

    tensor-parallel   [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    context-parallel  [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    data-parallel     [0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]
    data x context    [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]   (in dp_rank * cp + cp_rank order)
    pipeline          [0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]
    model-parallel    [0,1,8,9] [2,3,10,11] [4,5,12,13] [6,7,14,15]  (tp x pp: cp ranks hold the same weights)

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
data x context group (the data-parallel group when cp = 1), as Megatron's expert rank generator
("tp-ep-dp-pp" over the ranks the dense layout gives cp x dp): member ``d = dp_rank * cp + cp_rank`` is
expert-parallel rank ``d % ep`` of the expert group of the ``ep`` consecutive members ``d - d % ep ..``,
which exchange tokens by all-to-all; the ``dp cp / ep`` members holding the same experts (same ``d % ep``)
form an expert-data-parallel group, over which the experts' gradients are reduced. Worked example, world 8
with tp=2, pp=1, dp=4, ep=2 (rank = tp_rank + 2 * dp_rank)::

    data-parallel          [0,2,4,6] [1,3,5,7]
    expert-parallel        [0,2] [1,3] [4,6] [5,7]     (dp ranks 0-1 and 2-3 of each data-parallel group)
    expert-data-parallel   [0,4] [1,5] [2,6] [3,7]     (dp ranks 0,2 hold experts 0..E/2-1; 1,3 the rest)

and world 4 with cp=2, dp=2, ep=2 (rank = cp_rank + 2 * dp_rank; data x context [0,1,2,3])::

    expert-parallel        [0,1] [2,3]                 (the cp ranks of one dp rank: each routes its slice)
    expert-data-parallel   [0,2] [1,3]
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

DIMS = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"


@dataclass(frozen=True)
class RankGrid:
    """Rank lists of every group of a (tp, cp, pp, dp) layout. Each list of groups is sorted."""

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
    expert_data_intra: list[list[int]] = field(default_factory=list)
    expert_data_inter: list[list[int]] = field(default_factory=list)
    cp: int = 1
    context: list[list[int]] = field(default_factory=list)        # in cp-rank order
    data_context: list[list[int]] = field(default_factory=list)   # dp x cp, in (dp_rank * cp + cp_rank) order
    dp_cp_intra: list[list[int]] = field(default_factory=list)
    dp_cp_inter: list[list[int]] = field(default_factory=list)

    def node_of(self, rank: int) -> int:
        """The node of a global rank (ranks fill nodes in blocks of ``ranks_per_node``)."""
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': tp_rank, 'cp': cp_rank, 'dp': dp_rank, 'pp': pp_rank} of a global rank."""
        return _coords(rank, self.order, self._sizes())

    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of kind ('tensor', 'context', 'pipeline', 'data', 'data_context', 'model',
        'embedding', 'expert', 'expert_data') holding rank."""
        for group in getattr(self, kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in no {kind} group")


def parse_order(order: str) -> list[str]:
    """The dims of ``order`` fastest first. An order that does not name cp (the three-axis spelling
    ``tp-dp-pp`` of earlier versions) gets it right after tp, where Megatron puts it."""
    names = order.split("-")
    if "cp" not in names and "tp" in names:
        names.insert(names.index("tp") + 1, "cp")
    if sorted(names) != sorted(DIMS):
        raise ValueError(f"order {order!r} must name each of tp, cp, dp, pp once, e.g. {DEFAULT_ORDER!r}")
    return names


def _coords(rank: int, order: str, size: dict[str, int]) -> dict[str, int]:
    out, rest = {}, rank
    for name in parse_order(order):
        out[name] = rest % size[name]
        rest //= size[name]
    return out


def _rank_of(coords: dict[str, int], order: str, size: dict[str, int]) -> int:
    rank, stride = 0, 1
    for name in parse_order(order):
        rank += coords[name] * stride
        stride *= size[name]
    return rank


def _groups_varying(varying: tuple[str, ...], order: str, size: dict[str, int]) -> list[list[int]]:
    """All groups whose members differ only in the `varying` dims (the others fixed); each group listed
    with its first varying dim fastest (so (cp, dp) lists a dp x cp group in dp_rank * cp + cp_rank order)."""
    fixed = [d for d in DIMS if d not in varying]
    groups = []
    for fixed_vals in itertools.product(*(range(size[d]) for d in fixed)):
        members = []
        for var_vals in itertools.product(*(range(size[d]) for d in reversed(varying))):
            coords = dict(zip(fixed, fixed_vals)) | dict(zip(reversed(varying), var_vals))
            members.append(_rank_of(coords, order, size))
        groups.append(members)
    return sorted(groups)


def rank_grid(world_size: int, tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER,
              ranks_per_node: int | None = None, ep: int = 1, cp: int = 1) -> RankGrid:
    """List the ranks of every group for a tp x cp x pp x dp layout, with ``ep`` expert-parallel ranks
    carved out of dp (pure; see the module docstring). With ``ranks_per_node``, also the node-local
    and cross-node pieces of every data-parallel group."""
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("ep", ep)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if (dp * cp) % ep:
        over = f"dp {dp}" if cp == 1 else f"dp x cp = {dp}x{cp}"
        raise ValueError(f"{over} is not divisible by expert-parallel size {ep}")
    if tp * cp * pp * dp != world_size:
        raise ValueError(f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp} != world size {world_size}")
    size = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    pipeline = _groups_varying(("pp",), order, size)
    embedding = sorted(sorted({g[0], g[-1]}) for g in pipeline)
    data = _groups_varying(("dp",), order, size)
    data_context = _groups_varying(("cp", "dp"), order, size)
    intra, inter = _split_by_node(data, world_size, ranks_per_node)
    cp_intra, cp_inter = _split_by_node(data_context, world_size, ranks_per_node)
    expert_data = sorted(g[i::ep] for g in data_context for i in range(ep))
    expert_intra, expert_inter = _split_by_node(expert_data, world_size, ranks_per_node)
    return RankGrid(
        world_size=world_size, tp=tp, pp=pp, dp=dp, order=order,
        tensor=_groups_varying(("tp",), order, size),
        pipeline=pipeline,
        data=data,
        model=sorted(sorted(g) for g in _groups_varying(("tp", "pp"), order, size)),
        embedding=embedding,
        ranks_per_node=ranks_per_node, dp_intra=intra, dp_inter=inter,
        ep=ep,
        expert=sorted(g[i:i + ep] for g in data_context for i in range(0, dp * cp, ep)),
        expert_data=expert_data, expert_data_intra=expert_intra, expert_data_inter=expert_inter,
        cp=cp, context=_groups_varying(("cp",), order, size), data_context=data_context,
        dp_cp_intra=cp_intra, dp_cp_inter=cp_inter,
    )


def _split_by_node(data: list[list[int]], world_size: int, ranks_per_node: int | None):
    """(dp_intra, dp_inter) groups of every data-parallel group (see the module docstring); both empty
    when some data-parallel group holds different numbers of ranks on different nodes."""
    rpn = ranks_per_node or world_size
    if rpn < 1 or world_size % rpn:
        raise ValueError(f"ranks per node ({rpn}) must divide the world size ({world_size})")
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


def dp_partitions(grid: RankGrid, k: int, kind: str = "data") -> list[list[int]]:
    """Every data-parallel group (``kind`` "data", or "expert_data") cut into consecutive blocks of
    ``k`` members (in dp-rank order): ZeRO++'s hpZ secondary partition groups. ``k`` must divide the
    groups' size."""
    groups = getattr(grid, kind)
    size = len(groups[0])
    if k < 1 or size % k:
        raise ValueError(f"hpZ's secondary partition size ({k}) must divide the data-parallel size ({size})")
    return sorted(g[i:i + k] for g in groups for i in range(0, len(g), k))


def replica_split(groups: list[list[int]], shard: int) -> tuple[list[list[int]], list[list[int]]]:
    """Every data-parallel group (in dp-rank order) split for a replica dimension of ``len / shard`` replicas:
    (the shard groups: each group's consecutive blocks of ``shard`` members, over which ZeRO shards; the replica
    groups: the members at the same place in each block, over which each reduced shard is summed). Worked
    example, the group [0, 2, 4, 6] (tp 2) at shard 2: shards [[0, 2], [4, 6]], replicas [[0, 4], [2, 6]]."""
    size = len(groups[0])
    if shard < 1 or size % shard:
        raise ValueError(f"the shard size ({shard}) must divide the data-parallel size ({size})")
    shards = sorted(g[i:i + shard] for g in groups for i in range(0, size, shard))
    replicas = sorted(g[i::shard] for g in groups for i in range(shard))
    return shards, replicas


def local_world_size() -> int | None:
    """Ranks per node as torchrun says (``LOCAL_WORLD_SIZE``), or None outside a launcher."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


