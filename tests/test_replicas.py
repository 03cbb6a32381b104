"""The replica dimension (--data-parallel-replicas, HSDP): ZeRO shards within each replica of dp / R ranks, the
reduced shards are summed across replicas; every layout equals the serial run, the cross-replica bytes are the
formula's, and a checkpoint is written once (by the first replica) and loads under another layout."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import run_on_ranks
from helpers.ckpt import VOCAB, full_params, make_job, train_one_step
from helpers.gpt_parity import (
    GPT_CFG,
    MB_SIZE,
    MICRO,
    SEED,
    check_against_reference,
    engine_steps,
)
from helpers.trainer import ROOT, TINY, assert_same_losses, read_metrics

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.checkpoint.offline import read_model
from megazero.config import JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from megazero.memory.estimate import estimate_stage
from megazero.models.gpt import (
    GPTConfig,
    build_model_chunks,
)
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.ranks import replica_split
from megazero.state import TrainState


def test_replica_split_cuts_blocks_and_strides():
    """The docstring's example: dp group [0, 2, 4, 6] (tp 2) at shard 2, and both tp groups' splits."""
    assert replica_split([[0, 2, 4, 6]], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert replica_split([[0, 2, 4, 6], [1, 3, 5, 7]], 2) == ([[0, 2], [1, 3], [4, 6], [5, 7]],
                                                              [[0, 4], [1, 5], [2, 6], [3, 7]])
    with pytest.raises(ValueError, match="must divide"):
        replica_split([[0, 1, 2]], 2)


@pytest.mark.parametrize("par,zero,words", [
    ({"data_parallel_replicas": 3}, {"zero_stage": 1}, "--data-parallel-replicas.* 3 must divide the data-parallel "
                                                       "size 4"),
    ({"data_parallel_replicas": 2}, {"zero_stage": 0}, "use --zero-stage 1, 2 or 3, or drop --data-parallel-replicas"),
    ({"data_parallel_replicas": 2}, {"zero_stage": 3, "quantized_weights": True}, "is not built"),
    ({"data_parallel_replicas": 2}, {"zero_stage": 1, "offload_optimizer": "cpu"}, "is not built"),
    ({"data_parallel_replicas": 2, "expert_model_parallel_size": 2}, {"zero_stage": 1}, "is not built"),
])
def test_what_the_replica_dimension_refuses(par, zero, words):
    with pytest.raises(ConfigError, match=words):
        validate(JobConfig(parallel=ParallelConfig(**par), zero=ZeroConfig(**zero)), 4)


def _run(topo, par, zero, steps, optimizer="adamw"):
    return engine_steps(topo, par, zero, steps, None, optimizer)

def _replicas_body(rank, world_size, stages, steps):
    """R = 2 replicas x shard 2 at dp 4, on two 'nodes' of two ranks (one replica each): per ZeRO stage, the run,
    the bytes sent across replicas a step and in all, and flat ZeRO-3 at dp 4 for comparison. The estimator's
    model-state bytes equal the engine's (a shard of dp / R)."""
    out = []
    for stage, replicas, optimizer in stages:
        topo = Topology(dp=4, ranks_per_node=2, replicas=replicas)
        par = ParallelConfig(dp=4, data_parallel_replicas=replicas)
        zero = ZeroConfig(zero_stage=stage, bucket_size=3000)
        result, engine = _run(topo, par, zero, steps, optimizer)
        sized = JobConfig(model=GPTConfig(**GPT_CFG), parallel=par, zero=zero,
                          train=TrainConfig(micro_batch_size=MB_SIZE, global_batch_size=MB_SIZE * MICRO * 4))
        estimated, measured = estimate_stage(sized, 0).parts, engine.model_state_bytes()
        for key in ("params", "master_weights", "optimizer_state"):
            assert estimated[key] == measured[key], (key, estimated[key], measured[key])
        shard = topo.data_shard()
        buckets = engine.bucket_groups[0].buckets
        out.append((result, engine.comm_log.bytes(), engine.comm_log.link_bytes(),
                    sum(b.shard_size for b in buckets), shard.size, shard.replicas.size if shard.replicas else 1))
    return out


def test_two_replicas_of_two_equal_the_serial_run_and_send_less_across_nodes():
    """R = 2 x shard 2 under ZeRO 1, 2 and 3 (and ZeRO-3 under Muon: each replica orthogonalises its matrices
    within its shard group): loss, clipped norm and every parameter after 5 steps equal one process (1e-5). Each step sums every rank's fp32 shard once across the replicas: 2 (R-1)/R x shard x 4 bytes
    (tag dp_replica), the only traffic between the two replicas' nodes but the global norm's few bytes, and less
    than flat ZeRO-3 sends between the same nodes at dp 4."""
    cases = [(1, 2, "adamw"), (2, 2, "adamw"), (3, 2, "adamw"), (3, 1, "adamw"), (3, 2, "muon")]
    results = run_on_ranks(4, _replicas_body, cases, 5, timeout=600)
    for i, (stage, replicas, optimizer) in enumerate(cases):
        if replicas == 1:
            continue
        check_against_reference([r[i][0] for r in results], 5, dp=4, optimizer=optimizer)
        for result, tags, links, shard_elements, shard_size, replica_size in (r[i] for r in results):
            assert (shard_size, replica_size) == (2, 2)
            assert tags["dp_replica"] == pytest.approx(5 * 2 * (2 - 1) / 2 * shard_elements * 4)
            # between the nodes: the replica sums, and part of the few bytes of the global norm's sums
            assert tags["dp_replica"] <= links["inter"] <= tags["dp_replica"] + tags["world"], (stage, tags, links)
    flat_inter = [r[3][2]["inter"] for r in results]
    hsdp_inter = [r[2][2]["inter"] for r in results]
    assert all(h < f for h, f in zip(hsdp_inter, flat_inter)), (hsdp_inter, flat_inter)


def _checkpoint_body(rank, world_size, replicas, stage, steps, save_dir=None, load_dir=None):
    """The checkpoint tests' GPT (tests/helpers/ckpt.py) at dp 4 with ``replicas``: ``steps`` steps, saved after
    step 2 (``save_dir``) or continued from ``load_dir``; (losses, full weights after loading, at the end)."""
    topo = Topology(dp=4, replicas=replicas)
    job = make_job(1, 1, 4, stage)
    job.parallel.data_parallel_replicas = replicas
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, device="meta")
    engine = build_engine(chunks, topo, job.zero, job.optimizer)
    state, loaded = TrainState(), None
    if load_dir:
        state = load_checkpoint(load_dir, chunks=chunks, engine=engine, topo=topo, job=job)
        loaded = full_params(chunks, topo, engine)
    losses = []
    while state.iteration < steps:
        losses.append(train_one_step(topo, chunks, engine, state.iteration))
        state.iteration += 1
        if save_dir and state.iteration == 2:
            save_checkpoint(save_dir, state, chunks=chunks, engine=engine, topo=topo, job=job)
    return losses, loaded, full_params(chunks, topo, engine)


def test_a_checkpoint_is_written_once_by_the_first_replica_and_loads_without_replicas(tmp_path):
    """R = 2 x shard 2 under ZeRO-3 saves after step 2: the tensors come from the first replica's two ranks
    only, each element once; flat ZeRO-1 at dp 4 loads them exactly and its step 3 equals the run that went on."""
    ran = run_on_ranks(4, _checkpoint_body, 2, 3, 3, str(tmp_path), timeout=300)
    index = json.loads((tmp_path / "iter_0000002" / "index.json").read_text())
    writers = {piece["file"] for entry in index["tensors"].values() for piece in entry["shards"]}
    assert writers == {"rank00000.safetensors", "rank00001.safetensors"}, writers   # the first replica's shards
    model = read_model(tmp_path)[1]
    resumed = run_on_ranks(4, _checkpoint_body, 1, 1, 3, load_dir=str(tmp_path), timeout=300)
    for (losses, _, final), (resumed_losses, loaded, resumed_final) in zip(ran, resumed):
        for name, value in loaded.items():
            assert torch.equal(value[:VOCAB] if "word_embeddings" in name else value, model[name]), name
        torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
        for name, value in resumed_final.items():
            torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=name)


def _model_parallel_body(rank, world_size, cases):
    out = []
    for tp, pp, stage, sp in cases:
        topo = Topology(tp=tp, pp=pp, replicas=2)
        par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, data_parallel_replicas=2)
        out.append(_run(topo, par, ZeroConfig(zero_stage=stage, bucket_size=3000), 5)[0])
    return out


@pytest.mark.slow
def test_replicas_with_tensor_and_pipeline_parallelism_equal_the_serial_run():
    """8 ranks, 2 replicas x shard 2 beside tp 2 with sequence parallelism (ZeRO-1) and beside pp 2 (ZeRO-3):
    the replica groups pair the ranks at the same tp / pp place; the runs equal one process."""
    cases = [(2, 1, 1, True), (1, 2, 3, False)]
    results = run_on_ranks(8, _model_parallel_body, cases, timeout=600)
    for i in range(len(cases)):
        check_against_reference([r[i] for r in results], 5, dp=4)


@pytest.mark.slow
def test_the_trainer_with_replicas_equals_flat_zero3(tmp_path):
    """pretrain_gpt.py on 4 ranks (torchrun), --data-parallel-replicas 2 under ZeRO-3: the start line names the
    replicas and the losses equal flat ZeRO-3's (the same global batch and data)."""
    runs = {}
    for name, extra in (("flat", []), ("replicas", ["--num-distributed-optimizer-instances", "2"])):
        path = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(ROOT / "pretrain_gpt.py"), *TINY, "--zero-stage", "3", *extra, "--metrics-file", str(path)]
        run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = (run.stdout, read_metrics(path)[0])
    assert "dp 4 (2 replicas x 2) | zero stage 3" in runs["replicas"][0]
    assert_same_losses(runs["replicas"][1], runs["flat"][1], "loss")
