"""megazero.parallel.raw_comm: the flat collectives of the data-parallel path on gloo (broadcast-based
all-gather, point-to-point reduce-scatter) give what the backend's own collectives give."""
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from megazero.parallel.raw_comm import all_gather_into, reduce_scatter_into


def _body(rank, world_size):
    out = {}
    # A group whose group ranks differ from the global ranks: the broadcasts' sources must be mapped.
    ranks = [3, 1, 2] if world_size == 4 else list(range(world_size))
    group = dist.new_group(ranks)
    if rank not in ranks:
        return out
    n, me = len(ranks), ranks.index(rank)
    g = torch.Generator().manual_seed(7 + rank)
    local = torch.randn(5, generator=g)
    for async_op in (False, True):
        gathered, expect = torch.empty(5 * n), torch.empty(5 * n)
        h = all_gather_into(gathered, local, group, async_op=async_op)
        if async_op:
            h.wait()
        dist.all_gather_into_tensor(expect, local, group=group)
        out[f"gather async={async_op}"] = torch.equal(gathered, expect)

        in_place = torch.zeros(5 * n)
        in_place[5 * me:5 * (me + 1)] = local
        all_gather_into(in_place, in_place[5 * me:5 * (me + 1)], group)
        out[f"gather in place async={async_op}"] = torch.equal(in_place, expect)

        full = torch.randn(4 * n, generator=g)
        expect_shard = torch.empty(4)
        dist.reduce_scatter_tensor(expect_shard, full.clone(), group=group)
        shard = torch.empty(4)
        h = reduce_scatter_into(shard, full.clone(), group, async_op=async_op, input_is_scratch=True,
                                inbox=async_op)
        if async_op:
            assert h.is_completed() in (True, False)
            h.wait()
        out[f"scatter async={async_op}"] = torch.allclose(shard, expect_shard, rtol=1e-6, atol=1e-6)
        scratch = full.clone()
        reduce_scatter_into(scratch[4 * me:4 * (me + 1)], scratch, group, input_is_scratch=True, inbox=async_op)
        out[f"scatter in place async={async_op}"] = torch.allclose(scratch[4 * me:4 * (me + 1)], expect_shard,
                                                                    rtol=1e-6, atol=1e-6)
        kept = full.clone()
        reduce_scatter_into(torch.empty(4), kept, group)           # not scratch: the input is left alone
        out[f"input kept async={async_op}"] = torch.equal(kept, full)

    # The point-to-point reduce-scatter sums in group-rank order, whatever order messages arrive in:
    # bitwise equal to summing every rank's input locally, rank 0 first. Three reductions and a
    # gather in flight at once on the same group, as in ZeRO-3's backward, each land in their place.
    me = dist.get_rank(group)                    # torch orders a group's ranks: 3 is group rank 2
    inputs = [torch.randn(3, 4 * n, generator=torch.Generator().manual_seed(100 + r))
              for r in dist.get_process_group_ranks(group)]
    mine = inputs[me]
    expect = []
    for k in range(3):
        total = inputs[0][k].clone()
        for x in inputs[1:]:
            total += x[k]
        expect.append(total[4 * me:4 * (me + 1)])
    shards = [torch.empty(4) for _ in range(3)]
    gathered, gather_expect = torch.empty(5 * n), torch.empty(5 * n)

    def scatter(k):
        return reduce_scatter_into(shards[k], mine[k].clone(), group, True, input_is_scratch=True, inbox=True)
    handles = [scatter(0), all_gather_into(gathered, local, group, async_op=True), scatter(1), scatter(2)]
    for h in reversed(handles):
        h.wait()
    dist.all_gather_into_tensor(gather_expect, local, group=group)
    out["scatter in flight bitwise"] = all(torch.equal(s, e) for s, e in zip(shards, expect))
    out["gather beside scatters"] = torch.equal(gathered, gather_expect)
    return out


def test_gloo_collectives_equal_the_backend_ones():
    for res in run_on_ranks(4, _body):
        assert all(res.values()), res
    for res in run_on_ranks(2, _body):
        assert res and all(res.values()), res
