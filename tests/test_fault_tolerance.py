"""torchft replica groups (--fault-tolerance torchft): refusals, the state transport (bitwise, no pickle), the parity
proofs (two replica groups as separate jobs equal --data-parallel-replicas 2 inside one job; groups missing from a
step split its micro-batches and equal one process with the whole global batch), and a short chaos run (one kill
and rejoin: the rejoined group's weights equal its peer's bitwise, the survivor keeps going)."""
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
    ({"ft_batch_policy": "grow"}, None, None, None, r"--ft-batch-policy must be one of keep, shrink, got 'grow'"),
    ({}, {"pp": 2, "num_layers_per_virtual_pipeline_stage": 1}, None, None,
     r"--ft-batch-policy keep with the interleaved .* add --ft-batch-policy shrink"),
    ({"fault_tolerance": None, "ft_replica_id": None, "ft_replica_groups": None, "ft_lighthouse": None,
      "ft_batch_policy": "shrink"}, None, None, None, r"--ft-batch-policy sets up torchft replica groups"),
    ({"fault_tolerance": None, "ft_replica_id": None, "ft_replica_groups": None, "ft_lighthouse": None,
      "ft_quorum_timeout_seconds": 30.0}, None, None, None, r"--ft-quorum-timeout-seconds sets up torchft"),
    ({"ft_timeout_seconds": 0.0}, None, None, None, r"--ft-timeout-seconds must be > 0, got 0"),
    ({"ft_timeout_seconds": 10.0, "ft_quorum_timeout_seconds": 10.0}, None, None, None,
     r"--ft-quorum-timeout-seconds must be above --ft-timeout-seconds 10, got 10: a group's ranks reach the quorum"),
])
def test_what_fault_tolerance_refuses(ft, par, zero, train, words, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=words):
        validate(_job(ft, par, zero, train), 2)


def test_quorum_waits_twice_the_gradient_average_unless_given():
    """The quorum's timeout is filled in as twice ``--ft-timeout-seconds``, or kept as given above it."""
    assert validate(_job({"ft_timeout_seconds": 8.0}), 1).fault_tolerance.ft_quorum_timeout_seconds == 16.0
    given = validate(_job({"ft_timeout_seconds": 8.0, "ft_quorum_timeout_seconds": 9.0}), 1)
    assert given.fault_tolerance.ft_quorum_timeout_seconds == 9.0


@pytest.mark.parametrize("env,value,refused", [
    ("TORCHFT_TIMEOUT_SEC", "60", True), ("TORCHFT_TIMEOUT_SEC", "120", False),
    ("TORCHFT_QUORUM_TIMEOUT_SEC", "60", True), ("TORCHFT_QUORUM_TIMEOUT_SEC", "120", False),
    ("TORCHFT_QUORUM_TIMEOUT_SEC", "two", True)])
def test_torchft_timeout_variables_never_override_the_flags(env, value, refused, monkeypatch):
    """torchft reads its timeout variables over the Manager's arguments (both given the quorum's timeout, by
    default 120 s): one that disagrees with the flag is refused in one line naming both; one that agrees is
    taken."""
    monkeypatch.setenv(env, value)
    if not refused:
        validate(_job(), 1)
        return
    name = "--ft-quorum-timeout-seconds"
    with pytest.raises(ConfigError, match=rf"{env}={value} in the environment would replace {name} .*unset {env}"):
        validate(_job(), 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_loses_the_quorum_says_so_itself(rank, monkeypatch, capsys):
    """The ranks of a replica group lose torchft's quorum at different moments, or only some of them: each rank
    that does ends with status 1 and its own line, rank 1 as well as rank 0 (not the silent exit a line said by
    rank 0 alone would leave)."""
    import megazero.cli.main as cli
    from megazero.errors import ReplicaGroupLost

    def lost(*args, **kwargs):
        raise ReplicaGroupLost("--fault-tolerance: replica group 1 lost its quorum (Timeout expired): restart "
                               "this group; it heals from a live one")
    monkeypatch.setattr(cli, "run", lost)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                  "--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "1"])
    assert stopped.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pretrain_gpt.py: error: rank {rank}: --fault-tolerance: replica group 1 lost its quorum "
                   f"(Timeout expired): restart this group; it heals from a live one"], err


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


class _Quorums:
    """A stand-in for torchft's Manager: each ``start_quorum`` takes the next (participants, place) given."""

    def __init__(self, quorums):
        self.quorums, self.now = list(quorums), None

    def start_quorum(self):
        self.now = self.quorums.pop(0)

    def num_participants(self):
        return self.now[0]

    def participating_rank(self):
        return self.now[1]

    def load_state_dict(self, state):
        pass

    def batches_committed(self):
        return 0


@pytest.mark.parametrize("quorums,saved_again", [
    ([(3, 1), (2, 0)], [500]),        # the saver (first) left right after its save; this group is first now
    ([(3, 1), (3, 1)], []),           # everyone still there
    ([(3, 1), (2, 1)], []),           # a group left, but another is first now and saves again
    ([(3, 0), (2, 0)], []),           # this group was the saver: its own save finished before the quorum
])
def test_the_first_group_saves_again_when_the_saver_leaves_right_after_its_save(quorums, saved_again):
    """Groups 0-2 step; at iteration 500 the group first in the quorum saves. If the next quorum has lost a group
    and this group is first in it, it writes iteration 500 too, before any step, saying why; otherwise it does
    not (and it never saves twice a save it made itself)."""
    from megazero.fault_tolerance import ReplicaGroups
    from megazero.state import TrainState

    groups = ReplicaGroups.__new__(ReplicaGroups)
    said, written = [], []
    groups.manager, groups.say, groups.replica_id, groups.groups = _Quorums(quorums), said.append, 1, 3
    groups.keeps_batch, groups.checksums, groups.global_batch, groups._participants = False, False, 16, None
    groups._save = groups._unconfirmed_save = None

    class Save:
        def __call__(self, state):
            written.append(state.iteration)

        def finish(self):
            pass

    saver = groups.saver(Save())
    state = TrainState(iteration=499, consumed_samples=0)
    groups.start_step(state)
    state.iteration = 500                           # the step ran; the loop saves
    saver(state)
    own = list(written)
    groups.start_step(state)
    assert written[len(own):] == saved_again
    assert any("saves iteration 500 again" in line for line in said) == bool(saved_again), said


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


def _start_groups(out, argv: list[str], groups: int, present: list[int]) -> list:
    """A lighthouse and the replica groups ``present`` of ``groups`` (one process each, under ``out``: logs
    ``g<id>.log``, metrics ``g<id>.jsonl``, checkpoints ``ckpt``); the first quorum waits for all of them."""
    out.mkdir(exist_ok=True)
    port = chaos.free_port()
    procs = [chaos.start_lighthouse(port, len(present), out / "lighthouse.log")]
    for g in present:
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv, "--fault-tolerance", "torchft", "--ft-replica-groups",
             str(groups), "--ft-replica-id", str(g), "--ft-lighthouse", f"http://127.0.0.1:{port}",
             "--ft-timeout-seconds", "60", "--metrics-file", str(out / f"g{g}.jsonl"), "--save", str(out / "ckpt")],
            env=chaos.trainer_env(), stdout=open(out / f"g{g}.log", "w"), stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list, timeout: float = 300) -> None:
    """Wait for the processes after the first (a lighthouse, killed then) to end with status 0."""
    try:
        for p in procs[1:]:
            assert p.wait(timeout=timeout) == 0, p.args
    finally:
        procs[0].kill()


def test_two_replica_groups_equal_the_replica_dimension_inside_one_job(tmp_path):
    """The parity proof: two torchft replica groups of one rank each (separate jobs, each reading its share of the
    data, global batch 4 each) against --data-parallel-replicas 2 on 2 ranks in one job (global batch 8): the
    mean of the groups' losses, the gradient norms and the final weights agree at 1e-5 relative."""
    inside = tmp_path / "inside"
    assert run_on_ranks(2, main_body, PARITY + ["--global-batch-size", "8", "--data-parallel-replicas", "2",
                                                "--metrics-file", str(inside / "m.jsonl"),
                                                "--save", str(inside / "ckpt")], timeout=180) == [0, 0]
    _wait(_start_groups(tmp_path, PARITY + ["--global-batch-size", "4"], groups=2, present=[0, 1]))
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
    """Two replica groups of two ranks (torchrun each): one rank of one group is SIGKILLed, then the group saving a
    checkpoint while it writes; the harness restarts each, which heals from its peer: its weights equal the peer's
    bitwise before its first step, the survivor loses at most the step the kill interrupted, every group finishes,
    and the interrupted checkpoint is written by the survivor (no --save-interval checkpoint is missing)."""
    options = chaos.parse_args(["--groups", "2", "--ranks", "2", "--iters", "1200", "--batch", "16",
                                "--save-interval", "300", "--out", str(tmp_path)])
    groups, lines, ok = chaos.run_groups(options, tmp_path, "chaos", ["kill-rank", "kill-in-save"])
    assert ok and len(lines) == 2 and all("bitwise equal (healed)" in line for line in lines), lines
    assert all(any(s[2] == 1200 for s in g.steps) for g in groups)
    assert not [e for g in groups for e in g.exits if e[1] != 0 and not e[2]]
    saved, report = chaos.checkpoint_report(groups, tmp_path / "chaos-save", 1200, 300)
    assert saved and "missing none" in report and "(written: " in report, report
    logs = "".join((tmp_path / f"chaos-group{g}.log").read_text() for g in range(2))
    assert " again: a replica group left the quorum right after the save" in logs


@pytest.mark.slow
def test_groups_taking_part_split_the_step_so_it_trains_on_the_fault_free_samples(tmp_path):
    """--ft-batch-policy keep, groups missing from the first step on: one group alone of 2 (4 samples each) equals
    one process with the global batch of 8, and 2 groups of 3 (2 samples, one micro-batch each: the step's 3
    micro-batches split 2 and 1, gradients weighted 4/3 and 2/3 before torchft's average) equal one process with
    the global batch of 6: per step the loss (the groups' losses weighted by their micro-batches), the gradient
    norm and the samples consumed, and the final weights, at 1e-5 relative; the split is said in the log. No linear
    biases: the key bias's gradient is zero but for rounding (softmax ignores a shift shared by all keys), and Adam
    would move it by that rounding's sign."""
    argv = PARITY + ["--disable-bias-linear"]
    runs = {"alone": (8, 4, 2, [0], [4]), "uneven": (6, 2, 3, [0, 1], [2, 1])}
    serial = {name: subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv, "--global-batch-size",
                                      str(batch), "--metrics-file", str(tmp_path / f"{name}.jsonl"),
                                      "--save", str(tmp_path / f"{name}-ckpt")], env=chaos.trainer_env(),
                                     stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)
              for name, (batch, *_) in runs.items()}
    started = {name: _start_groups(tmp_path / name, argv + ["--global-batch-size", str(group_batch)], groups, present)
               for name, (_, group_batch, groups, present, _) in runs.items()}
    for name, (batch, group_batch, groups, present, micro_batches) in runs.items():
        assert serial[name].wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        _wait(started[name])
        want, _ = read_metrics(tmp_path / f"{name}.jsonl")
        got = [read_metrics(tmp_path / name / f"g{g}.jsonl")[0] for g in present]
        assert [r["iteration"] for r in want] == [1, 2, 3, 4, 5]
        for step, w in enumerate(want):
            rows = [g[step] for g in got]
            loss = sum(n * r["loss"] for n, r in zip(micro_batches, rows)) / sum(micro_batches)
            assert math.isclose(loss, w["loss"], rel_tol=1e-5), (name, w, rows)
            for r in rows:
                assert math.isclose(r["grad_norm"], w["grad_norm"], rel_tol=1e-5), (name, w, r)
                assert r["consumed_samples"] == w["consumed_samples"]
        _, serial_weights, _ = read_model(tmp_path / f"{name}-ckpt")
        _, ft_weights, _ = read_model(tmp_path / name / "ckpt" / "replica-group-0")
        for key, w in serial_weights.items():
            torch.testing.assert_close(ft_weights[key], w, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    log = (tmp_path / "uneven" / "g0.log").read_text()
    assert ("2 of 3 replica groups take part: each takes 2 or 1 of the step's 3 micro-batches" in log and
            "1 of 2 replica groups take part: each takes 4 of the step's 4 micro-batches"
            in (tmp_path / "alone" / "g0.log").read_text()), log[-2000:]
