import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from megazero.parallel.topology import Topology
from megazero.ranks import rank_grid


def test_megatron_16_rank_listing():
    # Megatron's worked example: tp=2, pp=4, dp=2 on 16 GPUs.
    g = rank_grid(16, tp=2, pp=4, dp=2)
    assert g.tensor == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.data == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.pipeline == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g.model == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert g.embedding == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g.coords(13) == {"tp": 1, "cp": 0, "dp": 0, "pp": 3}


def test_32_ranks_tp4_pp4_dp2():
    g = rank_grid(32, tp=4, pp=4, dp=2)
    assert g.tensor == [list(range(i, i + 4)) for i in range(0, 32, 4)]
    assert g.data == [[base + t, base + 4 + t] for base in range(0, 32, 8) for t in range(4)]
    assert g.pipeline == [[r, r + 8, r + 16, r + 24] for r in range(8)]
    assert g.model == [[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
                       [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]]
    assert g.embedding == [[r, r + 24] for r in range(8)]
    # Every rank is in exactly one group of each kind.
    for kind in ("tensor", "pipeline", "data", "model"):
        members = sorted(r for grp in getattr(g, kind) for r in grp)
        assert members == list(range(32)), kind


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4)])
def test_degenerate_sizes(tp, pp, dp):
    world = tp * pp * dp
    g = rank_grid(world, tp, pp, dp)
    everyone = [list(range(world))]
    singles = [[r] for r in range(world)]
    assert g.tensor == (everyone if tp > 1 else singles)
    assert g.pipeline == (everyone if pp > 1 else singles)
    assert g.data == (everyone if dp > 1 else singles)
    assert g.model == (everyone if tp * pp > 1 else singles)
    assert g.embedding == ([[0, world - 1]] if pp > 1 else singles)


def test_other_order_puts_pp_before_dp():
    g = rank_grid(8, tp=2, pp=2, dp=2, order="tp-pp-dp")
    assert g.pipeline == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.data == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.embedding == g.pipeline


def test_expert_groups_worked_listing():
    """The module docstring's listing: world 8, tp 2, dp 4, ep 2 (rank = tp_rank + 2 * dp_rank)."""
    g = rank_grid(8, tp=2, pp=1, dp=4, ep=2)
    assert g.data == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.expert == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.expert_data == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = rank_grid(16, tp=2, pp=2, dp=4, ep=4)             # ep = dp: one expert group per dp group
    assert g.expert == g.data and g.expert_data == [[r] for r in range(16)]
    assert rank_grid(4, 1, 1, 4).expert == [[0], [1], [2], [3]]     # ep 1: every rank alone
    with pytest.raises(ValueError, match="dp 4 is not divisible by expert-parallel size 3"):
        rank_grid(4, 1, 1, 4, ep=3)


def test_expert_groups_carved_from_data_x_context():
    """The module docstring's cp listing: world 4, cp 2, dp 2, ep 2 (rank = cp_rank + 2 * dp_rank): the
    expert groups are consecutive members of the dp x cp group, as Megatron's expert rank generator."""
    g = rank_grid(4, tp=1, pp=1, dp=2, ep=2, cp=2)
    assert g.data_context == [[0, 1, 2, 3]]
    assert g.expert == [[0, 1], [2, 3]] and g.expert_data == [[0, 2], [1, 3]]
    assert rank_grid(2, 1, 1, 1, ep=2, cp=2).expert == [[0, 1]]          # dp 1: ep from the cp ranks
    g = rank_grid(8, tp=2, pp=1, dp=2, ep=1, cp=2)
    assert g.expert_data == g.data_context == [[0, 2, 4, 6], [1, 3, 5, 7]]   # ep 1: experts reduced over dp x cp
    with pytest.raises(ValueError, match="dp x cp = 1x2 is not divisible by expert-parallel size 4"):
        rank_grid(2, 1, 1, 1, ep=4, cp=2)


def _check_expert_groups(rank, world_size):
    topo = Topology(tp=2, ep=2)                          # dp 4
    grid = rank_grid(8, 2, 1, 4, ep=2)
    out = {}
    ep, edp = topo.expert_parallel(), topo.expert_data_parallel()
    for name, view, kind in (("ep", ep, "expert"), ("edp", edp, "expert_data")):
        t = torch.tensor([2 ** rank], dtype=torch.int64)
        dist.all_reduce(t, group=view.group)
        assert t.item() == sum(2 ** r for r in grid.group_of(kind, rank)), name
        assert list(view.ranks) == grid.group_of(kind, rank) and view.size == len(view.ranks), name
        out[name] = t.item()
    assert ep.rank == dist.get_rank(ep.group) == topo.dp_rank % 2
    assert edp.rank == dist.get_rank(edp.group) == topo.dp_rank // 2
    assert edp.average_over == topo.data_parallel().average_over == 4     # experts average over the whole dp
    return out


def test_expert_groups_on_8_ranks():
    sums = run_on_ranks(8, _check_expert_groups)
    assert sums[0] == {"ep": 0b101, "edp": 0b10001} and sums[7] == {"ep": 0b10100000, "edp": 0b10001000}


def test_bad_grid_inputs():
    with pytest.raises(ValueError, match="world size 8"):
        rank_grid(8, tp=2, pp=2, dp=1)
    with pytest.raises(ValueError, match="order"):
        rank_grid(8, 2, 2, 2, order="tp-dp")


def _check_topology(rank, world_size):
    topo = Topology(tp=2, pp=2)  # dp inferred: 2
    grid = rank_grid(8, 2, 2, 2)
    coords = grid.coords(rank)
    assert (topo.tp_rank, topo.dp_rank, topo.pp_rank) == (coords["tp"], coords["dp"], coords["pp"])
    assert (topo.tp_size, topo.pp_size, topo.dp_size) == (2, 2, 2)
    assert topo.is_first_stage == (topo.pp_rank == 0) and topo.is_last_stage == (topo.pp_rank == 1)
    pipe = topo.pipeline()
    assert pipe.next_rank == (rank + 4 if topo.pp_rank == 0 else None)
    assert pipe.prev_rank == (rank - 4 if topo.pp_rank == 1 else None)
    assert (pipe.rank, pipe.size, topo.tensor_parallel().rank, topo.data_parallel().rank) == \
        (topo.pp_rank, 2, topo.tp_rank, topo.dp_rank)
    # An all_reduce of 2**rank over each group sums exactly the expected members.
    sums = {}
    for name, group, kind in (("tp", topo.tensor_parallel().group, "tensor"), ("pp", pipe.group, "pipeline"),
                              ("dp", topo.data_parallel().group, "data"), ("mp", topo.model_replica().group, "model"),
                              ("emb", pipe.embedding.group, "embedding")):
        t = torch.tensor([2 ** rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        expected = sum(2 ** r for r in grid.group_of(kind, rank))
        assert t.item() == expected, (name, t.item(), expected)
        sums[name] = t.item()
    return sums


def test_topology_groups_on_8_ranks():
    sums = run_on_ranks(8, _check_topology)
    assert sums[0] == {"tp": 0b11, "pp": 0b10001, "dp": 0b101, "mp": 0b110011, "emb": 0b10001}
    assert sums[7]["tp"] == 0b11000000


def _fail_on_rank_one(rank, world_size):
    assert rank != 1, "deliberate failure on rank 1"
    return rank


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    return rank


@pytest.mark.slow
def test_harness_reports_the_failing_rank():
    with pytest.raises(AssertionError, match="(?s)rank 1 of 2 failed.*deliberate failure"):
        run_on_ranks(2, _fail_on_rank_one)
    assert run_on_ranks(2, _ranks) == [0, 1]  # the next test gets a working pool


def _ranks(rank, world_size):
    return rank


@pytest.mark.slow
def test_harness_times_out_instead_of_hanging():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        run_on_ranks(2, _hang_on_rank_zero, timeout=5)
    assert run_on_ranks(2, _ranks) == [0, 1]  # a fresh pool replaced the broken one
