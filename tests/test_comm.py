"""megazero.parallel.comm: the flat collectives of the data-parallel path on gloo (broadcast-based
all-gather, all-reduce-based reduce-scatter) give exactly what the backend's own collectives give."""
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from megazero.parallel.comm import all_gather_into, reduce_scatter_into


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
        h = reduce_scatter_into(shard, full.clone(), group, async_op=async_op, input_is_scratch=True)
        if async_op:
            assert h.is_completed() in (True, False)
            h.wait()
        out[f"scatter async={async_op}"] = torch.allclose(shard, expect_shard, rtol=1e-6, atol=1e-6)
        scratch = full.clone()
        reduce_scatter_into(scratch[4 * me:4 * (me + 1)], scratch, group, input_is_scratch=True)
        out[f"scatter in place async={async_op}"] = torch.allclose(scratch[4 * me:4 * (me + 1)], expect_shard,
                                                                    rtol=1e-6, atol=1e-6)
        kept = full.clone()
        reduce_scatter_into(torch.empty(4), kept, group)           # not scratch: the input is left alone
        out[f"input kept async={async_op}"] = torch.equal(kept, full)
    return out


def test_gloo_collectives_equal_the_backend_ones():
    for res in run_on_ranks(4, _body):
        assert all(res.values()), res
    for res in run_on_ranks(2, _body):
        assert res and all(res.values()), res
