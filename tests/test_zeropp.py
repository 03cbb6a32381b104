"""ZeRO++ (megazero/parallel/zero/zeropp.py, quantize.py) on simulated nodes: the node-aware rank grid,
the block quantizer's error bound, the quantized all-gather and all-to-all reduce, the bytes per step
split into intra- and inter-node, and training with each switch against plain ZeRO-3."""
import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_CFG, GPT_OPT, MB_SIZE, SEED, gpt_batches

from megazero.config import JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from megazero.memory.estimate import estimate_stage
from megazero.models.gpt import GPTConfig, build_model_chunks
from megazero.parallel.counted_comm import CommLog, inter_fraction
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.parallel.zero.quantize import QMAX, dequantize_rows, packed_columns, quantize_dequantize, quantize_rows
from megazero.parallel.zero.reducers import HierarchicalReducer
from megazero.parallel.zero.zeropp import ZeroPlusPlusGathering
from megazero.ranks import dp_partitions, rank_grid
from megazero.training import train_step

ALL_THREE = dict(quantized_weights=True, hpz_partition_size=-1, quantized_gradients=True)   # -1: dp per node


# --------------------------------------------------------------------------- pure: nodes and bytes

def test_rank_grid_nodes_worked_example():
    """The listing in topology.py's docstring: world 8, tp 2, dp 4, 4 ranks per node."""
    g = rank_grid(8, 2, 1, 4, ranks_per_node=4)
    assert g.data == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.dp_intra == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.dp_inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [g.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dp_partitions(g, 2) == g.dp_intra and dp_partitions(g, 4) == g.data
    g = rank_grid(8, 1, 1, 8, ranks_per_node=4)
    assert g.dp_intra == [[0, 1, 2, 3], [4, 5, 6, 7]] and g.dp_inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    one = rank_grid(8, 1, 1, 8)                          # one node: the dp group itself, singles across
    assert one.dp_intra == one.data and one.dp_inter == [[r] for r in range(8)]
    # dp-fastest order with 3 ranks per node: dp group [0..3] has 3 ranks on node 0, 1 on node 1
    assert rank_grid(12, 3, 1, 4, order="dp-tp-pp", ranks_per_node=3).dp_intra == []
    with pytest.raises(ValueError, match="ranks per node"):
        rank_grid(8, 1, 1, 8, ranks_per_node=3)
    with pytest.raises(ValueError, match=r"secondary partition size \(3\) must divide"):
        dp_partitions(g, 3)


def test_inter_fraction_convention():
    """Ring: crossing edges / N; all-to-all: cross-node pairs / N(N-1) (counted_comm's docstring)."""
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    assert inter_fraction(nodes, "ring") == 2 / 8
    assert inter_fraction(nodes, "all_to_all") == 32 / 56
    assert inter_fraction([0, 0, 1, 1], "ring") == 2 / 4
    assert inter_fraction([0, 1], "all_to_all") == 1.0
    assert inter_fraction([3, 3, 3], "ring") == 0.0 and inter_fraction([5], "ring") == 0.0
    log = CommLog()                                      # no group: all intra
    log.record("dp", 10.0)
    assert log.link_bytes() == {"intra": 10.0, "inter": 0.0} and log.bytes() == {"dp": 10.0}


def test_validate_names_flag_and_fix():
    def job(world, stage=3, tp=1, rpn=None, **z):
        return validate(JobConfig(model=GPTConfig(**GPT_CFG), parallel=ParallelConfig(tp=tp, ranks_per_node=rpn),
                                  zero=ZeroConfig(zero_stage=stage, **z)), world)

    for kw, msg in [(dict(stage=2, quantized_weights=True), "--zero-quantized-weights .* --zero-stage 3"),
                    (dict(stage=2, hpz_partition_size=2), "--zero-hpz-partition-size applies to --zero-stage 3"),
                    (dict(hpz_partition_size=3), "--zero-hpz-partition-size 3 must divide the data-parallel size 8"),
                    (dict(stage=1, quantized_gradients=True), "--zero-quantized-gradients .* --zero-stage 2 or 3"),
                    (dict(rpn=3), "--ranks-per-node 3 must divide the world size 8"),
                    (dict(quantized_weights=True, quantization_block_size=0), "--zero-quantization-block-size")]:
        with pytest.raises(ConfigError, match=msg):
            job(8, **kw)
    assert job(8, stage=2, quantized_gradients=True, rpn=4).zero.quantized_gradients
    assert job(8, hpz_partition_size=4, quantized_weights=True).zero.hpz_partition_size == 4


# --------------------------------------------------------------------------- the quantizer

def test_block_quantization_round_trip():
    """Every element within half a quantization step (its block's scale / 2) of its value; a block of
    zeros stays zero; the last, shorter block too; bf16 in, bf16 out."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, generator=g) * torch.logspace(-4, 2, 1000)       # magnitudes far apart
    x[1, :128] = 0.0
    block = 128
    q, scales = quantize_rows(x, block)
    assert q.dtype == torch.int8 and q.abs().max() <= QMAX and scales.shape == (3, 8)
    back = dequantize_rows(q, scales, block)
    step = scales.repeat_interleave(block, dim=1)[:, :1000]
    err = (back - x).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all(), (err / step).max()
    assert (back[1, :128] == 0).all()
    assert torch.equal(scales[0], torch.stack([x[0, i:i + block].abs().max() / QMAX for i in range(0, 1000, block)]))
    y = x[0].to(torch.bfloat16)
    yq = quantize_dequantize(y, block)
    assert yq.dtype == torch.bfloat16 and (yq.float() - y.float()).abs().max() <= y.float().abs().max() / QMAX
    assert packed_columns(1000, 128) == 1000 + 4 * 8


# --------------------------------------------------------------------------- on 8 ranks, 2 nodes of 4

def _job(tp=1, pp=1, dp=8, steps=100):
    cfg = GPTConfig(**{**GPT_CFG, "untie_embeddings_and_output_weights": True})
    par = ParallelConfig(tp=tp, pp=pp, dp=dp)
    return cfg, par, JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=MB_SIZE))


def _train(steps, micro, rpn, tp=1, pp=1, block=4096, **zero_kw):
    """Train the untied test GPT ``steps`` steps with ZeRO-3 (and the ZeRO++ switches in ``zero_kw``) on
    nodes of ``rpn`` ranks; returns (topo, engine, losses, per-step link bytes)."""
    topo = Topology(tp=tp, pp=pp, ranks_per_node=rpn)
    if zero_kw.get("hpz_partition_size") == -1:
        zero_kw["hpz_partition_size"] = topo.data_parallel().intra.size
    cfg, par, job = _job(tp, pp, topo.dp_size)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED)
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=3, quantization_block_size=block, **zero_kw), GPT_OPT)
    losses, links = [], []
    batches_all = gpt_batches(steps, topo.dp_size * micro)
    for batches in batches_all:
        mine = batches[topo.dp_rank * micro:(topo.dp_rank + 1) * micro]
        engine.comm_log.reset()
        losses.append(train_step(chunks, mine, topo, engine, job).loss)
        links.append(engine.comm_log.link_bytes())
    return topo, engine, losses, links


def _expected_links(engine, micro, zeropp: bool, block: int = 4096):
    """(intra, inter) bytes per rank and step at dp 8 on 2 nodes of 4 (fp32), by the formulas of
    counted_comm (ring inter share 2/8) and zeropp (each bucket gathered once in forward and once
    in backward, reduced once, per micro-batch: the untied model has no unit used twice; then the
    gradient norm's all-reduce over the 8 ranks)."""
    intra = inter = 0.0
    for b in engine.bucket_groups[0].buckets:
        n, c = b.numel, b.shard_size
        if not zeropp:
            ring = 7 / 8 * 4 * n                                   # fp32 all-gather / reduce-scatter
            inter += 3 * ring * 2 / 8
            intra += 3 * ring * 6 / 8
            continue
        fwd = 7 / 8 * 8 * packed_columns(c, block)                 # int8 all-gather over the 8 ranks
        inter, intra = inter + fwd * 2 / 8, intra + fwd * 6 / 8
        intra += 3 / 4 * 4 * n                                     # hpZ: fp32 all-gather inside the node
        intra += 3 / 4 * 4 * packed_columns(2 * c, block)          # qgZ: all-to-all inside the node
        inter += 1 / 2 * 2 * packed_columns(c, block)              # qgZ: all-to-all across the nodes
    norm = 2 * 7 / 8 * 8                                           # the float64 gradient norm's all-reduce
    return micro * intra + norm * 6 / 8, micro * inter + norm * 2 / 8


def _quantized_gather_body(rank, world_size, block):
    """The quantized all-gather of every unit equals quantize-dequantize of the exact full unit, shard by
    shard; the optimizer's shards keep their exact values."""
    topo = Topology(ranks_per_node=4)
    cfg, par, _ = _job()
    chunks = build_model_chunks(cfg, par, topo, seed=SEED)
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=3, quantized_weights=True,
                                                   quantization_block_size=block), GPT_OPT)
    sync = engine.bucket_groups[0]
    params = sync.params
    assert isinstance(params.gathering, ZeroPlusPlusGathering)
    shards_before = [b.shard.clone() for b in sync.buckets]
    worst = 0.0
    for unit in params.units:
        params.gather(unit, exact=True)
        params.wait(unit)
        exact = [b.param_data.clone() for b in unit.buckets]
        params.release(unit)
        params.gather(unit)
        params.wait(unit)
        for b, full in zip(unit.buckets, exact):
            assert b.shard_size % block == 0
            expected = torch.cat([quantize_dequantize(s, block) for s in full.view(8, -1)])
            assert torch.equal(b.param_data, expected), unit.name
            assert not torch.equal(b.param_data, full) or full.abs().max() == 0
            worst = max(worst, float((b.param_data - full).abs().max()))
        params.release(unit)
    assert all(torch.equal(a, b.shard) for a, b in zip(shards_before, sync.buckets))
    return worst


def _reducer_body(rank, world_size):
    """qgZ's two all-to-alls land chunk dp_rank of the sum, as a reduce-scatter does (within the
    quantization error), at 2 nodes of 4 and 4 nodes of 2."""
    out = []
    for rpn in (4, 2):
        topo = Topology(ranks_per_node=rpn)
        log = CommLog(ranks_per_node=rpn)
        reducer = HierarchicalReducer(topo.data_parallel(), log, 64)
        g = torch.Generator().manual_seed(100 + rank)
        grad = torch.randn(8 * 256, generator=g)
        exact = grad.clone()
        dist.all_reduce(exact)
        mine = torch.empty(256)
        reducer.reduce_into(mine, grad)
        chunks = exact.view(8, 256)
        err = [(mine - chunks[j]).abs().max().item() for j in range(8)]
        out.append((rpn, topo.dp_rank, err, chunks.abs().max().item(), log.link_bytes()))
    return out


def _bytes_body(rank, world_size, micro):
    _, plain, _, plain_links = _train(1, micro, 4)
    _, zpp, _, zpp_links = _train(1, micro, 4, **ALL_THREE)
    job = _job()[2]
    job.zero = ZeroConfig(zero_stage=3, hpz_partition_size=4)
    estimated = estimate_stage(validate(job, 8), 0).parts["hpz_secondary_params"]
    return (plain_links[0], _expected_links(plain, micro, False), zpp_links[0], _expected_links(zpp, micro, True),
            zpp.model_state_bytes(), plain.model_state_bytes(), estimated)


def _stage2_body(rank, world_size):
    """qgZ at ZeRO-2 (once per step, and every micro-batch): 5 steps track plain ZeRO-2, with fewer
    inter-node bytes (a step of ZeRO-2 per micro-batch reduces once per micro-batch: 2 here)."""
    out = {}
    for name, kw in {"plain": {}, "qgZ": dict(quantized_gradients=True),
                     "plain-each": dict(reduce_each_microbatch=True),
                     "qgZ-each": dict(quantized_gradients=True, reduce_each_microbatch=True)}.items():
        topo = Topology(ranks_per_node=4)
        cfg, par, job = _job()
        chunks = build_model_chunks(cfg, par, topo, seed=SEED)
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=2, quantization_block_size=32, **kw), GPT_OPT)
        losses = []
        for batches in _learnable_batches(5, 16):
            engine.comm_log.reset()
            losses.append(train_step(chunks, batches[2 * topo.dp_rank:2 * topo.dp_rank + 2], topo, engine, job).loss)
        sync = engine.bucket_groups[0]
        out[name] = ((type(sync).__name__, type(sync.reducer).__name__, sync.reduce_every_backward), losses,
                     engine.comm_log.link_bytes()["inter"])
    return out


@pytest.mark.slow
def test_on_two_nodes_of_four():
    """One group of 8 processes, several checks: the quantized gather, the hierarchical reduce and
    the bytes per step (inter-node with all three switches at most 0.3x plain ZeRO-3's)."""
    for worst in run_on_ranks(8, _quantized_gather_body, 64):
        assert 0 < worst < 0.05
    for per_rpn in run_on_ranks(8, _reducer_body):
        for rpn, dp_rank, err, scale, links in per_rpn:
            assert err[dp_rank] < 0.03 * scale, (rpn, dp_rank, err)           # the right chunk, nearly exact
            assert min(e for j, e in enumerate(err) if j != dp_rank) > 0.3 * scale
            assert links["inter"] > 0 and links["intra"] > 0
    for plain, plain_expected, zpp, zpp_expected, zpp_states, plain_states, estimated in run_on_ranks(8, _bytes_body, 2):
        assert (plain["intra"], plain["inter"]) == pytest.approx(plain_expected, rel=1e-9)
        assert (zpp["intra"], zpp["inter"]) == pytest.approx(zpp_expected, rel=1e-9)
        assert zpp["inter"] <= 0.3 * plain["inter"], zpp["inter"] / plain["inter"]
        secondary = zpp_states["hpz_secondary_params"]             # 1/4 of the fp32 parameters
        assert zpp_states["params"] == plain_states["params"] + secondary
        assert secondary == 2 * plain_states["params"]             # Ψ/4 vs Ψ/8 elements
        assert estimated == secondary                              # the estimator counts the same
    for out in run_on_ranks(8, _stage2_body):
        for plain, quantized, each, reductions in (("plain", "qgZ", False, 1), ("plain-each", "qgZ-each", True, 2)):
            assert out[quantized][0] == ("ShardedGradSync", "HierarchicalReducer", each)   # stage 2 + the qgZ reducer
            assert out[plain][0] == ("ShardedGradSync", "ReduceScatter", each)
            assert out[quantized][1] != out[plain][1]
            assert out[quantized][1] == pytest.approx(out[plain][1], rel=1e-3)
            # ZeRO-2 sends X inter-node bytes per fp32 ring over the buckets: `reductions` reduce-scatters
            # and one parameter all-gather. qgZ keeps the all-gather and must cut each reduction by at
            # least 80% (int8, and only 1/4 of the data crosses: 1/16 plus the block scales)
            ring = out[plain][2] / (reductions + 1)
            assert ring < out[quantized][2] < ring + 0.2 * reductions * ring


# --------------------------------------------------------------------------- training

def _learnable_batches(steps, count, seq=GPT_CFG["seq_length"]):
    """Batches whose labels follow from the tokens (label = 7 t + 3 mod V), so the loss falls far in
    100 steps and a 2% gap means something."""
    g = torch.Generator().manual_seed(5)
    vocab = GPT_CFG["vocab_size"]
    out = []
    for _ in range(steps):
        step = []
        for _ in range(count):
            tokens = torch.randint(0, vocab, (MB_SIZE, seq), generator=g)
            step.append({"tokens": tokens, "labels": (7 * tokens + 3) % vocab, "loss_mask": torch.ones(MB_SIZE, seq)})
        out.append(step)
    return out


def _training_body(rank, world_size, layouts, rpn, steps, variants):
    """Losses of ``steps`` steps (2 micro-batches each) for each variant of ZeroConfig keywords, per
    (tp, pp) layout. Blocks of 32 elements: in this tiny model (hidden 32) a longer block of the flat
    bucket spans LayerNorm weights of 1.0 and weights of 0.02 alike, and its step (1/127) swamps the
    small ones (with blocks of 256 qwZ ends 39% above plain ZeRO-3 here); at real widths DeepSpeed's
    4096 sits inside one weight matrix."""
    return {layout: _train_variants(*layout, rpn, steps, variants) for layout in layouts}


def _train_variants(tp, pp, rpn, steps, variants):
    out = {}
    for name, kw in variants.items():
        topo = Topology(tp=tp, pp=pp, ranks_per_node=rpn)
        kw = dict(kw)
        if kw.get("hpz_partition_size") == -1:
            kw["hpz_partition_size"] = topo.data_parallel().intra.size
        cfg, par, job = _job(tp, pp, topo.dp_size)
        chunks = build_model_chunks(cfg, par, topo, seed=SEED)
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=3, quantization_block_size=32, **kw), GPT_OPT)
        losses = []
        for batches in _learnable_batches(steps, topo.dp_size * 2):
            mine = batches[topo.dp_rank * 2:(topo.dp_rank + 1) * 2]
            losses.append(train_step(chunks, mine, topo, engine, job).loss)
        out[name] = losses
    return out


STEPS = 60        # enough for plain ZeRO-3 to halve its loss; the switches' drift shows by then
SWITCHES = {"plain": {}, "qwZ": dict(quantized_weights=True), "hpZ": dict(hpz_partition_size=-1),
            "qgZ": dict(quantized_gradients=True), "all": ALL_THREE}


def _check_training(results, names):
    for by_layout in results:
        for out in by_layout.values():
            _check_losses(out, names)
    return results


def _check_losses(out, names):
    plain = out["plain"]
    assert plain[-1] < 0.5 * plain[0]                               # it learns
    for name in names:
        assert out[name][-1] == pytest.approx(plain[-1], rel=0.02), (name, out[name][-1], plain[-1])
        assert out[name] != plain or name == "hpZ"           # hpZ alone moves no quantized values


@pytest.mark.slow
def test_training_with_each_switch_tracks_zero3():
    """dp 4 on 2 nodes of 2 (hpZ over the 2 ranks of a node), STEPS steps: each switch alone and all three
    end within 2% of plain ZeRO-3's loss; hpZ alone is exact (same values, other group)."""
    results = _check_training(run_on_ranks(4, _training_body, [(1, 1)], 2, STEPS, SWITCHES, timeout=600),
                              ["qwZ", "hpZ", "qgZ", "all"])
    for by_layout in results:
        assert by_layout[(1, 1)]["hpZ"] == by_layout[(1, 1)]["plain"]


@pytest.mark.slow
def test_training_with_tp2_and_pp2_tracks_zero3():
    """tp 2 x dp 4 and pp 2 x dp 4 on 2 nodes of 4 ranks (2 dp ranks per node), STEPS steps: all three
    switches end within 2% of plain ZeRO-3's loss."""
    _check_training(run_on_ranks(8, _training_body, [(2, 1), (1, 2)], 4, STEPS,
                                 {"plain": {}, "all": ALL_THREE}, timeout=900), ["all"])


# --------------------------------------------------------------------------- with expert parallelism

def _experts_body(rank, world_size, steps):
    """ep 2 at dp 4 on 2 nodes of 2, ZeRO-3, MoE every layer: plain, hpZ over 2 ranks (the experts'
    secondary shards over their own expert-data-parallel block, not the dense one), and qgZ (the
    experts' reduction over their group cut by node)."""
    out = {}
    for name, kw in (("plain", {}), ("hpZ", dict(hpz_partition_size=2)), ("qgZ", dict(quantized_gradients=True))):
        topo = Topology(ranks_per_node=2, ep=2)
        cfg = GPTConfig(**{**GPT_CFG, "num_experts": 4, "moe_router_topk": 2})
        par = ParallelConfig(dp=topo.dp_size, expert_model_parallel_size=2)
        job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=MB_SIZE))
        chunks = build_model_chunks(cfg, par, topo, seed=SEED)
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=3, quantization_block_size=32, **kw), GPT_OPT)
        experts = engine.bucket_groups[1]
        groups = (experts.params.gathering.hpz_group, experts.dp.partition(2).ranks) if name == "hpZ" else None
        losses = [train_step(chunks, batches[2 * topo.dp_rank:2 * topo.dp_rank + 2], topo, engine, job).loss
                  for batches in _learnable_batches(steps, topo.dp_size * 2)]
        out[name] = (losses, groups and list(groups[1]), list(experts.dp.ranks))
    return out


@pytest.mark.slow
def test_zeropp_switches_with_expert_parallelism():
    """hpZ alone moves no value, so with experts it equals plain ZeRO-3 exactly, its experts' blocks being
    their expert-data-parallel ranks; qgZ tracks plain within its rounding."""
    for rank, out in enumerate(run_on_ranks(4, _experts_body, 20, timeout=600)):
        plain, hpz, qgz = out["plain"][0], out["hpZ"][0], out["qgZ"][0]
        assert hpz == plain, rank
        assert out["hpZ"][1] == out["hpZ"][2]                    # the secondary block: the experts' own group
        assert qgz != plain and qgz[-1] == pytest.approx(plain[-1], rel=0.02)
        assert plain[-1] < 0.9 * plain[0]                       # it learns
