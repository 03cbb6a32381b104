"""megazero/training.py: the pieces of the run around the step (the step itself is proven by the parity
tests of every parallel module)."""
from helpers import run_on_ranks
from helpers.trainer import TINY, main_body

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


def _late_rank_body(rank, world, argv, late_rank, late_from_step):
    """pretrain_gpt.main with the clock of ``--exit-duration-in-mins`` faked: ``late_rank`` reads 60.2 minutes
    from its ``late_from_step``-th step on, every other rank 59.9; (status, rank 0's stop lines)."""
    import contextlib
    import io

    import megazero.training as training
    from megazero.cli import main as cli

    real, readings, out = training.minutes_since, [], io.StringIO()

    def minutes_since(started):
        readings.append(started)
        return 60.2 if rank == late_rank and len(readings) >= late_from_step else 59.9

    training.minutes_since = minutes_since
    try:
        with contextlib.redirect_stdout(out):
            status = cli.main(argv)
    finally:
        training.minutes_since = real
    return status, [line for line in out.getvalue().splitlines() if "stopping at" in line]


def test_exit_duration_stops_every_rank_at_the_late_ranks_step_saves_and_resumes(tmp_path):
    from helpers.trainer import read_metrics

    from megazero.checkpoint import latest_iteration

    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    argv = [*TINY, "--dp", "2", "--train-iters", "6", "--eval-interval", "6", "--eval-iters", "1", "--save", str(ck),
            "--metrics-file", str(metrics), "--exit-duration-in-mins", "60"]
    # Only rank 1 is past the limit (after its third step): both ranks stop there, or rank 0 would wait alone.
    results = run_on_ranks(2, _late_rank_body, argv, 1, 3, timeout=120)
    assert [status for status, _ in results] == [0, 0]
    assert results[0][1] == [f" stopping at iteration 3: --exit-duration-in-mins 60 reached (59.9 min since start); "
                             f"checkpoint saved to {ck}: resume with --load {ck}"]
    assert latest_iteration(ck) == 3
    assert [r["iteration"] for r in read_metrics(metrics)[0]] == [1, 2, 3]
    # The same command with --load resumes there and, the limit not reached, trains to the end.
    assert run_on_ranks(2, main_body, argv + ["--load", str(ck)], timeout=120) == [0, 0]
    assert latest_iteration(ck) == 6
    assert [r["iteration"] for r in read_metrics(metrics)[0]] == [1, 2, 3, 4, 5, 6]
