"""torchft replica groups (--fault-tolerance torchft): refusals, the state transport (bitwise, no pickle), the parity
proof (two replica groups as separate jobs equal --data-parallel-replicas 2 inside one job), and a short chaos run
(one kill and rejoin: the rejoined group's weights equal its peer's bitwise, the survivor keeps going)."""
import importlib.util
import io
import math
import pickle
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from helpers import run_on_ranks
from helpers.trainer import ROOT, main_body, read_metrics

from megazero.checkpoint.offline import read_model
from megazero.checkpoint.transport import TensorTransport, read_state, write_state
from megazero.config import FaultToleranceConfig, JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from tools import chaos

FT = dict(fault_tolerance="torchft", ft_replica_groups=2, ft_replica_id=0, ft_lighthouse="http://127.0.0.1:1")


def _job(ft=None, par=None, zero=None, train=None):
    return JobConfig(fault_tolerance=FaultToleranceConfig(**{**FT, **(ft or {})}),
                     parallel=ParallelConfig(**(par or {})), zero=ZeroConfig(**(zero or {"zero_stage": 1})),
                     train=TrainConfig(**(train or {})))


def test_refused_in_one_line_without_torchft(monkeypatch):
    """torchft not importable: the flag is refused before anything starts, naming the extra to install."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a))
    with pytest.raises(ConfigError) as refused:
        validate(_job(), 1)
    assert "pip install megazero[ft]" in str(refused.value) and "\n" not in str(refused.value)
    validate(JobConfig(parallel=ParallelConfig(data_parallel_replicas=2), zero=ZeroConfig(zero_stage=1)), 2)


@pytest.mark.parametrize("ft,par,zero,train,words", [
    ({"ft_replica_id": 2}, None, None, None, r"--ft-replica-id must be 0 to 1 .*got 2"),
    ({"ft_replica_id": None}, None, None, None, r"--ft-replica-id must be 0 to 1"),
    ({"ft_replica_groups": None}, None, None, None, r"needs --ft-replica-groups"),
    ({"ft_min_replicas": 3}, None, None, None, r"--ft-min-replicas must be 1 to --ft-replica-groups 2"),
    ({}, {"data_parallel_replicas": 2}, None, None, r"drop --data-parallel-replicas"),
    ({}, None, {"zero_stage": 1, "offload_optimizer": "cpu"}, None, r"with --offload-optimizer cpu is not built"),
    ({}, {"cp": 2}, None, None, r"with --context-parallel-size.* 2 is not built"),
    ({"fault_tolerance": None}, None, None, None, r"--ft-replica-id sets up torchft replica groups: add --fault-tolerance"),
    ({"ft_lighthouse": None}, None, None, None, r"needs a lighthouse"),
])
def test_what_fault_tolerance_refuses(ft, par, zero, train, words, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=words):
        validate(_job(ft, par, zero, train), 2)


def test_lighthouse_defaults_to_torchft_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    job = validate(_job({"ft_lighthouse": None}), 1)
    assert job.fault_tolerance.ft_lighthouse == "http://lighthouse:29510"
    assert job.fault_tolerance.save_dir("/ckpt").endswith("replica-group-0")


def test_a_peer_of_another_layout_is_refused_in_one_line():
    """A healing group whose peer has another layout stops before loading anything, naming what differs."""
    from megazero.fault_tolerance import LayoutMismatch, ReplicaGroups

    groups = ReplicaGroups.__new__(ReplicaGroups)
    groups.layout, groups.replica_id = {"tp": 1, "dp": 2, "zero_stage": 1}, 1
    with pytest.raises(LayoutMismatch) as refused:
        groups.load_peer_state({"layout": {"tp": 2, "dp": 1, "zero_stage": 1}, "tensors": {}})
    line = str(refused.value)
    assert "\n" not in line and "dp 1 there, 2 here; tp 2 there, 1 here" in line and "same parallel" in line


def _state():
    g = torch.Generator().manual_seed(0)
    return {"layout": {"tp": 1, "order": "tp-cp-dp-pp"}, "train": {"iteration": 7, "consumed_samples": 56},
            "rng": {"torch_cpu": "abc", "list": [1, 2.5, None, True]},
            "tensors": {"w.model": torch.randn(5, 3, generator=g), "w.exp_avg": torch.randn(7, generator=g).bfloat16(),
                        "b": torch.tensor([True, False, True]), "h": torch.randn(3, generator=g).half(),
                        "i": torch.arange(5), "e": torch.empty(0, 4), "nan": torch.tensor([math.nan, -0.0, math.inf])}}


def _assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert got[key].reshape(-1).view(torch.uint8).tolist() == value.reshape(-1).view(torch.uint8).tolist(), key
        elif isinstance(value, dict):
            _assert_bitwise(got[key], value)
        else:
            assert got[key] == value, key


def test_transport_round_trips_a_state_bitwise_without_pickle(monkeypatch):
    """In memory and over the HTTP transport: every tensor bitwise (NaN, -0.0, bf16, bool, empty), the
    metadata as given; pickle and torch.load are never called on the way."""
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling was attempted")
    for module, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    state = _state()
    buffer = io.BytesIO()
    write_state(state, buffer)
    buffer.seek(0)
    _assert_bitwise(read_state(buffer), state)

    sender, receiver = TensorTransport(timedelta(seconds=10), host="127.0.0.1"), TensorTransport(timedelta(seconds=10))
    try:
        sender.send_checkpoint([1], 7, {"user": {"default": state}, "torchft": {"step": 7, "batches_committed": 14}},
                               timedelta(seconds=10))
        got = receiver.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=10))
        sender.disallow_checkpoint()
    finally:
        sender.shutdown()
        receiver.shutdown()
    _assert_bitwise(got["user"]["default"], state)
    assert got["torchft"] == {"step": 7, "batches_committed": 14}
    with pytest.raises(TypeError, match="string keys"):
        write_state({1: torch.zeros(1)}, io.BytesIO())


PARITY = ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "16", "--num-layers", "2",
          "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
          "--train-iters", "5", "--lr", "1e-2", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0",
          "--seed", "7", "--zero-stage", "1", "--save-interval", "5"]


def test_two_replica_groups_equal_the_replica_dimension_inside_one_job(tmp_path):
    """The parity proof: two torchft replica groups of one rank each (separate jobs, each reading its share of the
    data, global batch 4 each) against --data-parallel-replicas 2 on 2 ranks in one job (global batch 8): the
    mean of the groups' losses, the gradient norms and the final weights agree at 1e-5 relative."""
    inside = tmp_path / "inside"
    assert run_on_ranks(2, main_body, PARITY + ["--global-batch-size", "8", "--data-parallel-replicas", "2",
                                                "--metrics-file", str(inside / "m.jsonl"),
                                                "--save", str(inside / "ckpt")], timeout=180) == [0, 0]
    port = chaos.free_port()
    lighthouse = chaos.start_lighthouse(port, 2, tmp_path / "lighthouse.log")
    try:
        jobs = [subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *PARITY, "--global-batch-size", "4",
                                  "--fault-tolerance", "torchft", "--ft-replica-groups", "2", "--ft-replica-id", str(g),
                                  "--ft-lighthouse", f"http://127.0.0.1:{port}", "--ft-timeout-seconds", "60",
                                  "--metrics-file", str(tmp_path / f"g{g}.jsonl"), "--save", str(tmp_path / "ckpt")],
                                 env=chaos.trainer_env(), stdout=open(tmp_path / f"g{g}.log", "w"),
                                 stderr=subprocess.STDOUT) for g in range(2)]
        assert [j.wait(timeout=300) for j in jobs] == [0, 0], (tmp_path / "g0.log").read_text()[-3000:]
    finally:
        lighthouse.kill()
    want, _ = read_metrics(inside / "m.jsonl")
    groups = [read_metrics(tmp_path / f"g{g}.jsonl")[0] for g in range(2)]
    assert [r["iteration"] for r in want] == [1, 2, 3, 4, 5]
    for w, a, b in zip(want, *groups):
        assert math.isclose((a["loss"] + b["loss"]) / 2, w["loss"], rel_tol=1e-5), (w, a, b)
        assert math.isclose(a["grad_norm"], w["grad_norm"], rel_tol=1e-5) and a["grad_norm"] == b["grad_norm"]
        assert a["consumed_samples"] == w["consumed_samples"]
    _, inside_weights, _ = read_model(inside / "ckpt")
    _, ft_weights, _ = read_model(tmp_path / "ckpt" / "replica-group-0")
    assert inside_weights.keys() == ft_weights.keys()
    for name, w in inside_weights.items():
        torch.testing.assert_close(ft_weights[name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_killed_replica_group_rejoins_bitwise_and_the_survivor_keeps_going(tmp_path):
    """Two replica groups of two ranks (torchrun each): one rank of one group is SIGKILLed, the harness restarts that
    group, which heals from its peer; its weights equal the peer's bitwise before its first step, the survivor
    loses at most the step the kill interrupted and every group finishes."""
    options = chaos.parse_args(["--groups", "2", "--ranks", "2", "--iters", "1000", "--batch", "16", "--save-interval", "400",
                                "--out", str(tmp_path)])
    groups, lines, ok = chaos.run_groups(options, tmp_path, "chaos", ["kill-rank"])
    assert ok and len(lines) == 1 and "bitwise equal (healed)" in lines[0], lines
    assert all(any(s[2] == 1000 for s in g.steps) for g in groups)
    assert not [e for g in groups for e in g.exits if e[1] != 0 and not e[2]]
