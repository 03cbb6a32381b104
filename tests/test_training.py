"""megazero/training.py: the pieces of the run around the step (the step itself is proven by the parity
tests of every parallel module)."""
from helpers import run_on_ranks
from helpers.trainer import TINY

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def _gather_body(rank, world, layouts):
    return [_gather_one(rank, world, TINY + MOE + layout) for layout in layouts]


def _gather_one(rank, world, argv):
    from megazero.cli.job import parse_job
    from megazero.generation import gather_full_model
    from megazero.parallel.topology import Topology
    from megazero.parallel.zero import build_engine
    from megazero.spec import build_model_chunks, get_model_spec

    job, _ = parse_job(argv, world)
    par = job.parallel
    topo = Topology(par.tp, par.pp, par.dp, order=par.order, ep=par.expert_model_parallel_size, cp=par.cp)
    spec = get_model_spec(job.model.model_family)
    sharded = job.zero.zero_stage == 3                  # the engine holds shards and gathers them for the model
    chunks = build_model_chunks(spec, job, topo, device="meta" if sharded else None)
    engine = build_engine(chunks, topo, job.zero, job.optimizer) if sharded else None
    model = gather_full_model(chunks, topo, job, engine)
    if rank != 0:
        return model is None
    want = dict(spec.build_full(job.model, seed=job.train.seed).named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max()) for n in want)


LAYOUTS = [["--cp", "2", "--expert-model-parallel-size", "2"],                 # dp 2 x cp 2: members 0, 1
           ["--tp", "2", "--cp", "2", "--expert-model-parallel-size", "2"],   # dp 1 x cp 2, tp 2
           ["--expert-model-parallel-size", "4"],                             # dp 4
           ["--zero-stage", "3", "--expert-model-parallel-size", "2"]]        # shards gathered, then released


def test_gather_full_model_collects_every_expert_from_dp_x_cp():
    """The single-process model gathered at the end of a run (the sample text) holds the weights every
    rank built: with experts carved from dp x cp, members 0..ep-1 of the dp x cp group send theirs; under
    ZeRO-3 the values taken while the engine holds the whole parameters are copies, so they survive the
    release of its gathered buffers (views of them read freed storage: a ZeRO-3 run's sample was noise)."""
    out = run_on_ranks(4, _gather_body, LAYOUTS, timeout=300)
    assert out[0] == [0.0] * len(LAYOUTS) and all(x == [True] * len(LAYOUTS) for x in out[1:])
