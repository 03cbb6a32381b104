"""Checkpoints at library level: save under one tp/pp/dp/ZeRO layout, load under others; exact resume;
crash safety (SIGKILL during a save); corrupted files refused by name; the offline reader and tools; FP8 delayed
scaling's amax histories (exact resume, another layout, FP8 <-> bf16); Muon's momentum (exact resume, another
layout, the optimizer a checkpoint's state belongs to)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from helpers.ckpt import (GLOBAL_MB, MB_SIZE, MODEL, MUON_OPT, SEED, VOCAB, batches, full_params, make_job, run_body,
                          setup, train_one_step)

from megazero.checkpoint import CheckpointReader, latest_iteration, load_checkpoint, save_checkpoint
from megazero.checkpoint.format import checkpoint_dir, file_record, recover, write_json
from megazero.checkpoint.offline import declarations, read_model, write_weights_checkpoint
from megazero.errors import CheckpointError
from megazero.models.gpt import GPT, GPTConfig, build_model_chunks
from megazero.parallel.params import split_dim
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.state import TrainState

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved_tp2pp2dp2(tmp_path_factory):
    """tp2 pp2 dp2 ZeRO-1: 3 steps, checkpoint after step 2; the uninterrupted losses."""
    d = tmp_path_factory.mktemp("ckpt_8")
    res = run_on_ranks(8, run_body, 2, 2, 1, 3, str(d), (2,), timeout=300)
    final = {}
    for r in res:
        final.update(r[2])
    return d, res[-1][0], final


def _check_loaded(d, results, ref_losses, ref_final):
    model = read_model(d)[1]
    for losses, loaded, final, state in results:
        assert state.iteration == 3
        for name, value in loaded.items():                 # the saved weights, exactly
            assert torch.equal(_unpad(name, value), model[name]), name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0)
        for name, value in final.items():          # the uninterrupted run's weights after step 3
            torch.testing.assert_close(_unpad(name, value), _unpad(name, ref_final[name]), rtol=1e-5, atol=1e-6,
                                       msg=name)


def _unpad(name, value):
    """The vocab rows (the padding differs between tp sizes)."""
    return value[:VOCAB] if name in ("embedding.word_embeddings.weight", "output_layer.weight") else value


def test_save_tp2pp2dp2_zero1_load_tp1pp1dp1(saved_tp2pp2dp2):
    d, ref_losses, ref_final = saved_tp2pp2dp2
    assert latest_iteration(d) == 2
    _check_loaded(d, run_on_ranks(1, run_body, 1, 1, 0, 3, load_dir=str(d)), ref_losses, ref_final)


def test_save_tp2pp2dp2_zero1_load_tp1pp4dp2_zero2(saved_tp2pp2dp2):
    d, ref_losses, ref_final = saved_tp2pp2dp2
    _check_loaded(d, run_on_ranks(8, run_body, 1, 4, 2, 3, load_dir=str(d), timeout=300), ref_losses, ref_final)


def test_checkpoint_is_layout_free(saved_tp2pp2dp2):
    d = saved_tp2pp2dp2[0]
    reader = CheckpointReader(d / "iter_0000002")
    assert reader.index["layout"]["tp"] == 2 and reader.index["train_state"]["iteration"] == 2
    assert reader.shape("model/embedding.word_embeddings.weight") == [VOCAB, 32]
    assert reader.shape("optim.exp_avg/layers.3.attention.dense.weight") == [32, 32]
    assert "optim.master/layers.0.attention.qkv.weight" not in reader.tensors   # fp32: masters are the weights
    assert len(reader.verify_all()) == 8 + 8 + 1                    # a tensor file and an rng file per rank, index
    assert json.loads((d / "iter_0000002" / "index.json").read_text())["job"]["zero"]["zero_stage"] == 1


def _resume_body(rank, world_size, tp, pp, stage, save_dir, dropout):
    """Straight 4 steps vs 2 + save + (new model, engine) load + 2: bitwise equal with dropout on."""
    straight = run_body(rank, world_size, tp, pp, stage, 4, dropout=dropout)
    torch.manual_seed(999)                          # disturb the global RNG: the load must restore it
    first = run_body(rank, world_size, tp, pp, stage, 2, save_dir, (2,), dropout=dropout)
    resumed = run_body(rank, world_size, tp, pp, stage, 4, load_dir=save_dir, dropout=dropout)
    assert first[0] + resumed[0] == straight[0], (first[0], resumed[0], straight[0])
    for name, value in straight[2].items():
        assert torch.equal(value, resumed[2][name]), name
    return True


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,stage", [(2, 1, 2), (1, 2, 1)])
def test_exact_resume_with_dropout(tmp_path, tp, pp, stage):
    assert all(run_on_ranks(4, _resume_body, tp, pp, stage, str(tmp_path), 0.1))


def _weights_only_body(rank, world_size, load_dir):
    topo, job, chunks, engine = setup(1, 1, 1)
    state = load_checkpoint(load_dir, chunks=chunks, engine=engine, topo=topo, job=job, weights_only=True)
    assert state == TrainState() and engine.state_dict()["step"] == 0
    return full_params(chunks, topo, engine)


def test_weights_only_and_offline_writer(saved_tp2pp2dp2, tmp_path):
    d = saved_tp2pp2dp2[0]
    cfg, tensors, index = read_model(d)
    job = make_job(1, 1, 1, 0)
    out = write_weights_checkpoint(tmp_path, tensors, job, tp=2, pp=2)
    assert latest_iteration(tmp_path) == 0 and (out / "rank00003.safetensors").is_file()
    for loaded in run_on_ranks(2, _weights_only_body, str(tmp_path)):
        for name, value in loaded.items():
            assert torch.equal(_unpad(name, value), tensors[name]), name


def _refuses_body(rank, world_size, load_dir, weights_only=False):
    topo, job, chunks, engine = setup(1, 1, 0)
    try:
        load_checkpoint(load_dir, chunks=chunks, engine=engine, topo=topo, job=job, weights_only=weights_only)
    except CheckpointError as e:
        return str(e)
    return None


def test_flipped_byte_is_refused_naming_the_file(saved_tp2pp2dp2, tmp_path):
    import shutil

    shutil.copytree(saved_tp2pp2dp2[0], tmp_path / "c")
    shard = tmp_path / "c" / "iter_0000002" / "rank00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    msgs = run_on_ranks(2, _refuses_body, str(tmp_path / "c"))
    assert any(m and str(shard) in m and "fails its checksum" in m for m in msgs), msgs
    assert all(m for m in msgs)                     # every rank raises, none waits forever


def test_weights_only_checkpoint_needs_finetune(saved_tp2pp2dp2, tmp_path):
    cfg, tensors, _ = read_model(saved_tp2pp2dp2[0])
    write_weights_checkpoint(tmp_path, tensors, make_job(1, 1, 1, 0))
    [msg] = run_on_ranks(1, _refuses_body, str(tmp_path))
    assert "--finetune" in msg


def _random_weights():
    """A weights-only model of the checkpoint tests' shape, by name, and its job."""
    job, g = make_job(1, 1, 1, 0), torch.Generator().manual_seed(0)
    return job, {name: 0.02 * torch.randn(d.shape, generator=g) for name, d in declarations(job.model).items()}


def test_nonfinite_weights_are_refused_at_load_naming_the_tensors(tmp_path):
    job, tensors = _random_weights()
    tensors["layers.1.mlp.dense_4h_to_h.weight"][0, 0] = float("nan")
    tensors["final_norm.weight"][3] = float("inf")
    write_weights_checkpoint(tmp_path, tensors, job)
    [msg] = run_on_ranks(1, _refuses_body, str(tmp_path), True)         # --finetune's load
    assert msg.startswith(f"{checkpoint_dir(tmp_path, 0)} holds NaN or inf values in 2 tensors ("), msg
    assert "layers.1.mlp.dense_4h_to_h.weight (fp32 weights)" in msg and "final_norm.weight (fp32 weights)" in msg


def test_an_hf_model_with_nonfinite_weights_is_refused_at_import(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from megazero.checkpoint.hf import save_hf
    from tools.convert_checkpoint import main as convert

    job, tensors = _random_weights()
    save_hf(tmp_path / "hf", tensors, job.model)
    state = load_file(tmp_path / "hf" / "model.safetensors")
    bad = [name for name in state if name.endswith(".weight")][:4]
    for name in bad:
        state[name].view(-1)[0] = float("nan")
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert convert(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "out"), "--to", "megazero"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds NaN or inf values in 4 tensors ({', '.join(bad[:3])}, ...): " in err, err
    assert not (tmp_path / "out").exists()


def test_offline_declarations_match_the_built_model():
    """The tools' meta-device declarations agree with a real model's attributes and stage split."""
    cfg = GPTConfig(**MODEL, untie_embeddings_and_output_weights=True)
    decls = declarations(cfg, pp=2)
    model = GPT(cfg)
    assert set(decls) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert decls[name].partition_dim == split_dim(p), name
    assert decls["layers.1.mlp.dense_h_to_4h.weight"].stages == (0,) and decls["final_norm.bias"].stages == (1,)
    assert decls["embedding.word_embeddings.weight"].vocab_padded and decls["output_layer.weight"].vocab_padded
    assert not decls["embedding.position_embeddings.weight"].vocab_padded


_CRASH_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    import megazero.checkpoint.distributed as ckpt
    import megazero.checkpoint.format as fmt
    from megazero.checkpoint import save_checkpoint
    from megazero.config import JobConfig
    from megazero.models.gpt import GPTConfig
    from megazero.models.gpt import build_model_chunks
    from megazero.parallel.topology import Topology
    from megazero.parallel.zero import build_engine
    from megazero.state import TrainState
    dist.init_process_group("gloo", init_method="file://{init}", rank=0, world_size=1)
    job = JobConfig(model=GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                      vocab_size=100, make_vocab_size_divisible_by=16))
    topo = Topology()
    chunks = build_model_chunks(job.model, job.parallel, topo)
    engine = build_engine(chunks, topo, job.zero, job.optimizer)
    save_checkpoint({d!r}, TrainState(1, 8, 0), chunks=chunks, engine=engine, topo=topo, job=job)
    hold = {where!r}
    real_write, real_commit = ckpt.write_pieces, fmt.replace_tracker
    def pause():
        print("PAUSED", flush=True)
        time.sleep(60)
    def write(*a, **k):
        out = real_write(*a, **k)
        if hold == "shard":
            pause()
        return out
    def tracker(*a, **k):
        if hold == "tracker":
            pause()
        return real_commit(*a, **k)
    ckpt.write_pieces, fmt.replace_tracker = write, tracker
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(1.0)
    save_checkpoint({d!r}, TrainState(2, 16, 0), chunks=chunks, engine=engine, topo=topo, job=job)
""")


@pytest.mark.parametrize("where", ["shard", "tracker"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, where):
    d = tmp_path / "save"
    script = _CRASH_SCRIPT.format(root=str(ROOT), init=str(tmp_path / "pg"), d=str(d), where=where)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PAUSED", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert latest_iteration(d) == 1
    cfg, tensors, index = read_model(d)              # complete and verified
    assert index["train_state"] == {"iteration": 1, "consumed_samples": 8, "skipped_iterations": 0}
    if where == "shard":                             # the half-written save is a hidden temporary
        assert (d / ".iter_0000002.tmp").exists() and not (d / "iter_0000002").exists()
    else:                                            # complete but not yet the latest
        assert (d / "iter_0000002" / "manifest.json").is_file()


def _half_body(rank, world_size, save_dir, stage, load: bool):
    """fp16 with a loss scaler: separate fp32 masters are saved and restored exactly, with the scaler."""
    from megazero.config import PrecisionConfig

    topo = Topology(dp=world_size)
    job = make_job(1, 1, world_size, stage)
    job.precision = PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 10, loss_scale_window=2)
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, dtype=torch.float16)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    state = TrainState()
    if load:
        state = load_checkpoint(save_dir, chunks=chunks, engine=engine, topo=topo, job=job)
    else:
        for it in range(3):
            train_one_step(topo, chunks, engine, it)
        state = TrainState(3, 3 * GLOBAL_MB * MB_SIZE, 0)
        save_checkpoint(save_dir, state, chunks=chunks, engine=engine, topo=topo, job=job)
    return engine.state_dict(), state


def test_fp16_masters_moments_and_loss_scaler_across_dp_and_stage(tmp_path):
    from megazero.parallel.zero import merge_optimizer_states

    saved = merge_optimizer_states([s for s, _ in run_on_ranks(2, _half_body, str(tmp_path), 2, False)])
    assert saved["loss_scaler"]["scale"] > 2.0 ** 10                 # grew: the state is worth checking
    [(loaded, state)] = run_on_ranks(1, _half_body, str(tmp_path), 0, True)
    assert state.iteration == 3 and loaded["step"] == saved["step"] == 3
    assert loaded["loss_scaler"] == saved["loss_scaler"]
    reader = CheckpointReader(tmp_path / "iter_0000003")
    assert reader.has("optim.master/layers.0.attention.qkv.weight")
    for name, piece in saved["params"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["params"][name][key], piece[key]), (name, key)


def _resume_rules_body(rank, world_size, root):
    from megazero.checkpoint import checkpoint_saver, resume

    topo, job, chunks, engine = setup(1, 1, 0)
    ck, out = job.checkpoint, {}
    ck.load = ck.save = f"{root}/auto"                     # auto-resume: nothing yet -> fresh
    out["fresh"] = resume(job, chunks, engine, topo)
    checkpoint_saver(job, chunks, engine, topo)(TrainState(5, 80, 1))
    out["auto"] = resume(job, chunks, engine, topo)
    ck.save, ck.load = None, f"{root}/missing"
    try:
        resume(job, chunks, engine, topo)
    except CheckpointError as e:
        out["missing"] = str(e)
    ck.load, ck.finetune, ck.save = f"{root}/auto", True, f"{root}/ft"
    out["finetune"] = resume(job, chunks, engine, topo)
    checkpoint_saver(job, chunks, engine, topo)(TrainState(2, 32, 0))
    out["finetune_restart"] = resume(job, chunks, engine, topo)
    return out


def test_load_save_finetune_rules(tmp_path):
    [out] = run_on_ranks(1, _resume_rules_body, str(tmp_path))
    assert out["fresh"] == TrainState() and out["auto"] == TrainState(5, 80, 1)
    assert f"--load {tmp_path}/missing does not exist" in out["missing"]
    assert out["finetune"] == TrainState() and out["finetune_restart"] == TrainState(2, 32, 0)


def test_save_zero3_dp2_load_tp2_zero1(tmp_path):
    """ZeRO-3 shards gathered for the save (engine.gathered_parameters) and re-sharded on load."""
    res = run_on_ranks(2, run_body, 1, 1, 3, 3, str(tmp_path), (2,))
    _check_loaded(tmp_path, run_on_ranks(2, run_body, 2, 1, 1, 3, load_dir=str(tmp_path)), res[0][0], res[0][2])
    _check_loaded(tmp_path, run_on_ranks(2, run_body, 1, 1, 3, 3, load_dir=str(tmp_path)), res[0][0], res[0][2])


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
             group_query_attention=True, num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)


@pytest.mark.slow
def test_llama_save_tp4_kv_replicated_load_tp2pp2_and_tp1(tmp_path):
    """Key/value heads replicated over tp 4 (2 groups) are saved once, whole, and load split at tp 2 and
    whole at tp 1; training continues as if uninterrupted."""
    res = run_on_ranks(4, run_body, 4, 1, 1, 3, str(tmp_path), (2,), model_kw=LLAMA, timeout=300)
    ref_losses, ref_final = res[0][0], {k: v for r in res for k, v in r[2].items()}
    for tp, pp in ((2, 2), (1, 1)):
        results = run_on_ranks(tp * pp, run_body, tp, pp, 1, 3, load_dir=str(tmp_path), model_kw=LLAMA, timeout=300)
        last = [r for r in results if "final_norm.weight" in r[2]]
        _check_loaded(tmp_path, last, ref_losses, ref_final)


# --------------------------------------------------------------------------- sharded save and load
WIDE = dict(hidden_size=128)          # a 128-wide model: checksum blocks of 32 elements (see tensor_file)


def _sharded_body(rank, world_size, tp, pp, stage, steps, save_dir=None, load_dir=None):
    """Train to ``steps`` (from ``load_dir``'s checkpoint when given; saving after step 2 into
    ``save_dir``) and measure live tensor bytes: the step, the save, the load."""
    import gc

    from megazero.memory import LiveTensorBytes

    gc.collect()
    with LiveTensorBytes() as build:
        topo, job, chunks, engine = setup(tp, pp, stage, **WIDE)
    state, stats, losses, peaks = TrainState(), {}, [], {"build": build.peak}
    previous = build
    if load_dir:
        with LiveTensorBytes(after=previous) as load:
            state = load_checkpoint(load_dir, chunks=chunks, engine=engine, topo=topo, job=job, stats=stats)
        peaks["load"], previous = load.peak, load
    while state.iteration < steps:
        with LiveTensorBytes(after=previous) as step:
            losses.append(train_one_step(topo, chunks, engine, state.iteration))
        peaks["step"], previous = max(peaks.get("step", 0), step.peak), step
        state.iteration += 1
        state.consumed_samples += GLOBAL_MB * MB_SIZE
        if save_dir and state.iteration == 2:
            with LiveTensorBytes(after=previous) as save:
                save_checkpoint(save_dir, state, chunks=chunks, engine=engine, topo=topo, job=job)
            peaks["save"], previous = save.peak, save
    bucket = max(b.numel for b in engine.bucket_groups[0].buckets) * 4
    return dict(losses=losses, stats=stats, peaks=peaks, bucket=bucket, rank=topo.rank)


LAYOUTS = {"tp2pp2dp2-zero3": (8, 2, 2, 3), "tp1pp1dp4-zero1": (4, 1, 1, 1), "tp2dp2-zero2": (4, 2, 1, 2)}


@pytest.mark.parametrize("saver,loaders", [
    pytest.param("tp2pp2dp2-zero3", ["tp1pp1dp4-zero1", "tp2dp2-zero2"], marks=pytest.mark.slow),
    pytest.param("tp1pp1dp4-zero1", ["tp2pp2dp2-zero3"], marks=pytest.mark.slow),
    pytest.param("tp2dp2-zero2", ["tp2pp2dp2-zero3"], marks=pytest.mark.slow),
])
def test_sharded_checkpoint_loads_under_another_layout_reading_only_what_it_owns(tmp_path, saver, loaders):
    """Each rank writes its own shards and reads, from other layouts' files, only the elements it will
    hold: the run continues with the uninterrupted run's losses (1e-6), every rank's bytes read are
    within 10% of its bytes owned, and save and load stay within the training peak plus one bucket."""
    world, tp, pp, stage = LAYOUTS[saver]
    straight = run_on_ranks(world, _sharded_body, tp, pp, stage, 4, str(tmp_path), timeout=300)
    ref = next(r["losses"] for r in straight if r["losses"] and r["losses"][0] == r["losses"][0])
    assert len(list(tmp_path.glob("iter_0000002/rank*.safetensors"))) == world       # one file per rank
    for r in straight:
        assert r["peaks"]["save"] <= r["peaks"]["step"] + r["bucket"], r["peaks"]
    for loader in loaders:
        world, tp, pp, stage = LAYOUTS[loader]
        for r in run_on_ranks(world, _sharded_body, tp, pp, stage, 4, load_dir=str(tmp_path), timeout=300):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref[2:]), rtol=1e-6, atol=0)
            read, owned = r["stats"]["bytes_read"], r["stats"]["bytes_owned"]
            assert owned <= read <= 1.10 * owned, (loader, r["rank"], read, owned)
            assert r["peaks"]["load"] <= r["peaks"]["step"] + r["bucket"], (loader, r["peaks"])


def test_a_crash_in_any_window_of_a_save_leaves_a_readable_latest(saved_tp2pp2dp2, tmp_path):
    """Re-saving iteration 2 moves the old copy aside, renames the new one in, then replaces the
    tracker. A crash between the two renames leaves only ``.iter_0000002.old``: readers use it, and
    the next run (holding the lock) puts it back; a crash mid-write leaves a ``.tmp`` it removes."""
    src = saved_tp2pp2dp2[0]
    want = read_model(src)[1]
    crashed = tmp_path / "between_renames"
    shutil.copytree(src, crashed)
    (crashed / "iter_0000002").rename(crashed / ".iter_0000002.old")
    (crashed / ".iter_0000003.tmp").mkdir()
    (crashed / ".iter_0000003.tmp" / "rank00000.safetensors").write_bytes(b"half")
    assert checkpoint_dir(crashed, 2).name == ".iter_0000002.old"
    assert all(torch.equal(read_model(crashed)[1][k], v) for k, v in want.items())
    assert recover(crashed) == ["restored iter_0000002 from .iter_0000002.old",
                                "removed the half-written .iter_0000003.tmp"]
    assert sorted(p.name for p in crashed.iterdir() if p.name.startswith(("iter", "."))) == ["iter_0000002"]

    replaced = tmp_path / "before_cleanup"                  # new copy in place, old one not yet removed
    shutil.copytree(src, replaced)
    shutil.copytree(src / "iter_0000002", replaced / ".iter_0000002.old")
    assert checkpoint_dir(replaced, 2).name == "iter_0000002"
    assert recover(replaced) == ["removed .iter_0000002.old (replaced by iter_0000002)"]
    assert recover(replaced) == []


def _poisoned_save_body(rank, world_size, save_dir):
    """fp16 dp2 ZeRO-1 after one step: a finite save at iteration 1, then saves at iteration 2 after
    making one kind of state non-finite on one rank at a time; returns what each refusal said."""
    from megazero.checkpoint.distributed import NonFiniteState
    from megazero.config import PrecisionConfig

    topo = Topology(dp=world_size)
    job = make_job(1, 1, world_size, 1)
    job.precision = PrecisionConfig(fp16=True)
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, dtype=torch.float16)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    train_one_step(topo, chunks, engine, 0)
    save_checkpoint(save_dir, TrainState(1, 16, 0), chunks=chunks, engine=engine, topo=topo, job=job)
    views, said = engine.optimizer.states.views(0), []
    for who, poison in [(1, lambda: views["exp_avg_sq"].fill_(float("inf"))),
                        (0, lambda: views["master"].fill_(float("nan"))),      # rank 0 comes first
                        (0, lambda: next(chunks[0].parameters()).data.fill_(float("inf")))]:
        if rank == who:
            poison()
        try:
            save_checkpoint(save_dir, TrainState(2, 32, 0), chunks=chunks, engine=engine, topo=topo, job=job)
            said.append(None)
        except NonFiniteState as e:
            said.append(str(e))
        if rank == who and who == 0 and len(said) == 2:
            views["master"].zero_()
    return said


def test_a_save_of_non_finite_state_is_refused_and_the_latest_stays(tmp_path):
    """Any non-finite value in what a save would write -- an Adam moment on rank 1, an fp32 master, an
    fp16 weight -- stops the save on every rank before anything is written, naming the parameter, its
    precision and kind, the rank and the iteration; the previous checkpoint stays the latest, whole."""
    results = run_on_ranks(2, _poisoned_save_body, str(tmp_path))
    assert results[0] == results[1]
    kinds = [r"fp32 Adam exp_avg_sq, rank 1", r"fp32 master weights, rank 0", r"fp16 weights, rank 0"]
    for message, kind in zip(results[0], kinds):
        assert message is not None and re.fullmatch(
            rf"iteration 2: \S+ \({kind}\) is not finite: checkpoint iter_0000002 is not written \(iter_0000001 "
            rf"stays the latest\) and the run stops\. Lower --lr or check the data", message), message
    assert latest_iteration(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    reader = CheckpointReader(tmp_path / "iter_0000001")
    assert all(bool(reader.read_full(k).isfinite().all()) for k in reader.tensors)


def _tiny_plan(save_dir: Path, iteration: int):
    """A one-piece, one-rank save plan: what :func:`write_planned` writes, without a model."""
    from megazero.checkpoint.distributed import SavePlan
    from megazero.checkpoint.format import iter_dir_name

    piece = ("model/w", [4], [[0, 4]], (0, 4), torch.arange(4.0) + iteration)
    return SavePlan(save_dir, save_dir / iter_dir_name(iteration), 0, 1, [piece], {}, {"iteration": iteration,
                                                                                        "tensors": {}})


def test_a_clean_release_leaves_nothing_to_take_over_and_a_crashed_holder_is_named(tmp_path):
    """A second holder is refused naming the first; after a clean release the next run finds no holder
    to report; a holder that died without releasing (its file closed, the line left) is named."""
    from megazero.checkpoint.lock import SaveLock

    first = SaveLock.acquire(tmp_path / "run")
    assert first.previous == ""
    with pytest.raises(CheckpointError, match=rf"--save {tmp_path}/run is in use by another run \(pid {os.getpid()} "):
        SaveLock.acquire(tmp_path / "run")
    first.release()
    second = SaveLock.acquire(tmp_path / "run")
    assert second.previous == ""                      # a clean end: nothing to take over
    os.close(second.fd)                               # dies without releasing: the system drops the flock
    second.fd = -1
    third = SaveLock.acquire(tmp_path / "run")
    assert third.previous.startswith(f"pid {os.getpid()} on ")
    third.release()


@pytest.mark.parametrize("what", ["deleted", "lock deleted", "replaced", "deleted before the commit",
                                  "deleted as written"])
def test_a_save_into_a_deleted_or_replaced_save_directory_writes_nothing(what, tmp_path):
    """``--save`` deleted (or its ``.lock``, or replaced by another run's directory) under a run: its next
    save stops with one line naming ``--save`` and what happened, before writing anything (the deleted
    directory is not made again; the other run's directory gains nothing); so does a deletion while
    the save is written (caught before the commit, or by its files vanishing before the lock does)."""
    import megazero.checkpoint.distributed as distributed
    from megazero.checkpoint.distributed import write_planned
    from megazero.checkpoint.lock import SaveDirectoryLost, SaveLock

    save = tmp_path / "run"
    lock = SaveLock.acquire(save)
    write_planned(_tiny_plan(save, 5), torch.device("cpu"), lock=lock)
    other, real = None, distributed._write_rank_files
    if what in ("deleted", "replaced"):
        shutil.rmtree(save)
    if what == "lock deleted":
        (save / ".lock").unlink()
    if what == "replaced":
        other = SaveLock.acquire(save)                 # a second run takes the new directory
    if what == "deleted before the commit":
        distributed._write_rank_files = lambda plan: (real(plan), shutil.rmtree(save))
    if what == "deleted as written":                    # rmtree reached the save's files, not yet .lock
        distributed._write_rank_files = lambda plan: (shutil.rmtree(plan.tmp), real(plan))
    try:
        with pytest.raises(SaveDirectoryLost) as e:
            write_planned(_tiny_plan(save, 10), torch.device("cpu"), lock=lock)
    finally:
        distributed._write_rank_files = real
    said = {"deleted": "was deleted while this run was using it", "deleted before the commit": "was deleted",
            "lock deleted": "lost its .lock while this run was using it",
            "replaced": "was replaced while this run was using it (its .lock is another file",
            "deleted as written": "is being deleted while this run uses it (.iter_0000010.tmp vanished"}[what]
    assert str(e.value).startswith(f"--save {save} {said}"), str(e.value)
    assert "iter_0000010 is not written there and the run stops" in str(e.value)
    if what in ("deleted", "deleted before the commit"):
        assert not save.exists()
    else:
        kept = {"replaced": [".lock"], "lock deleted": ["iter_0000005", "latest_checkpointed_iteration.txt"],
                "deleted as written": [".lock", "iter_0000005", "latest_checkpointed_iteration.txt"]}[what]
        assert sorted(p.name for p in save.iterdir()) == kept
    if other is not None:
        assert other.path.read_text().startswith(f"pid {os.getpid()} ")    # its holder line untouched
        other.release()
    lock.release()


def test_a_failed_write_removes_its_temporary_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    """The file system refuses a save midway (``No space left on device`` after part of the files):
    the temporary directory is removed, the earlier checkpoint stays whole and the latest."""
    import errno

    import megazero.checkpoint.distributed as distributed
    from megazero.checkpoint.distributed import write_planned

    save = tmp_path / "run"
    write_planned(_tiny_plan(save, 5), torch.device("cpu"))
    before = {p.name: p.read_bytes() for p in (save / "iter_0000005").rglob("*") if p.is_file()}
    real = distributed.write_pieces

    def fills_the_disk(path, *args, **kwargs):
        real(path, *args, **kwargs)                    # written, then the next file does not fit
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(distributed, "write_pieces", fills_the_disk)
    with pytest.raises(OSError, match="No space left on device"):
        write_planned(_tiny_plan(save, 10), torch.device("cpu"))
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert latest_iteration(save) == 5
    assert {p.name: p.read_bytes() for p in (save / "iter_0000005").rglob("*") if p.is_file()} == before


# ---------------------------------------------------------------- FP8 delayed scaling's amax histories
FP8_DELAYED = dict(fp8_format="e4m3", fp8_amax_history_len=3, fp8_amax_compute_algo="max")


def _fp8_run(tp, fp8_on, bf16=False):
    """Topology, job, chunks and engine of the checkpoint test GPT at ``tp`` (dp the rest, ZeRO-1), its
    linears in FP8 with delayed scaling (``fp8_on``), bf16 parameters with fp32 masters (``bf16``)."""
    from megazero.config import FP8Config, PrecisionConfig

    topo = Topology(tp=tp)
    job = make_job(tp, 1, topo.dp_size, 1)
    job.train.micro_batch_size = MB_SIZE
    job.fp8 = FP8Config(**FP8_DELAYED) if fp8_on else FP8Config()
    job.precision = PrecisionConfig(bf16=bf16)
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, device="meta",
                                dtype=torch.bfloat16 if bf16 else torch.float32, fp8=job.fp8)
    return topo, job, chunks, build_engine(chunks, topo, job.zero, job.optimizer, job.precision)


def _fp8_steps(run, first, last, save_dir=None):
    """Steps ``first`` .. ``last - 1`` through the trainer's step (the delayed amaxes agreed at its end);
    saves at ``last`` into ``save_dir``. Returns the losses."""
    from megazero.training import train_step

    topo, job, chunks, engine = run
    per = GLOBAL_MB // topo.dp_size
    losses = [train_step(chunks, batches(step)[topo.dp_rank * per:(topo.dp_rank + 1) * per], topo, engine, job).loss
              for step in range(first, last)]
    if save_dir:
        save_checkpoint(save_dir, TrainState(last, last * GLOBAL_MB * MB_SIZE), chunks=chunks, engine=engine,
                        topo=topo, job=job)
    return losses


def _load(run, load_dir):
    """Load ``load_dir`` into ``run``; returns what the load said (rank 0's log lines)."""
    import logging

    topo, job, chunks, engine = run
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("megazero.checkpoint.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        load_checkpoint(load_dir, chunks=chunks, engine=engine, topo=topo, job=job)
    finally:
        logger.removeHandler(handler)
    return said


def _fp8_resume_body(rank, world_size, root):
    """FP8 delayed at dp2: 4 straight = 2 + save + (new model, engine) load + 2, bitwise (losses, weights,
    histories). The dp2 checkpoint loaded at tp2 (dp1) and that run's loaded back at dp2: the histories
    arrive with the output-gradient row in the loading run's units (x dp / saved dp, see
    megazero.parallel.fp8), and the first step after a load is the uninterrupted run's to fp32 rounding.
    Later steps are not compared across layouts: an fp32 rounding difference flips an FP8 rounding now and
    then, which Adam amplifies (their weights drift ~1e-4 apart with or without a checkpoint)."""
    from megazero.parallel import fp8

    straight = _fp8_run(1, True)
    want = _fp8_steps(straight, 0, 4)
    want_params = full_params(straight[2], straight[0], straight[3])
    histories = fp8.history_state(straight[2])
    first = _fp8_steps(_fp8_run(1, True), 0, 2, f"{root}/fp8")
    resumed = _fp8_run(1, True)
    assert _load(resumed, f"{root}/fp8") == [] and len(fp8.history_state(resumed[2])) == 16
    assert first + _fp8_steps(resumed, 2, 4) == want, (first, want)
    for name, value in full_params(resumed[2], resumed[0], resumed[3]).items():
        assert torch.equal(value, want_params[name]), name
    assert fp8.history_state(resumed[2]).keys() == histories.keys() and len(histories) == 16
    for name, h in fp8.history_state(resumed[2]).items():
        assert torch.equal(h, histories[name]), name
    dp_to_dp1 = torch.tensor([[1.0], [1.0], [0.5]])
    tp2 = _fp8_run(2, True)
    _load(tp2, f"{root}/fp8")
    at_two = CheckpointReader(f"{root}/fp8/iter_0000002")
    for name, h in fp8.history_state(tp2[2]).items():
        assert torch.equal(h, at_two.read_full(f"fp8.amax_history/{name}") * dp_to_dp1), name
    [loss] = _fp8_steps(tp2, 2, 3, f"{root}/tp2")
    assert abs(loss - want[2]) <= 1e-5 * abs(want[2]), (loss, want[2])
    dp2 = _fp8_run(1, True)
    _load(dp2, f"{root}/tp2")
    for name, h in fp8.history_state(dp2[2]).items():
        assert torch.equal(h * dp_to_dp1, fp8.history_state(tp2[2])[name]), name
    [loss] = _fp8_steps(dp2, 3, 4)
    assert abs(loss - want[3]) <= 1e-5 * abs(want[3]), (loss, want[3])
    return True


def _fp8_and_bf16_body(rank, world_size, root):
    """dp2: an FP8 checkpoint loads into a bf16 run (its histories unused, said), whose checkpoint loads into
    an FP8 run (no histories: its first step scales from the current values, said), whose checkpoint loads
    into a bf16 run again; each trains on. (The FP8 runs keep fp32 parameters: the ISA cap the suite puts on
    oneDNN (tests/conftest.py) leaves it no CPU kernel for torch._scaled_mm with a bf16 output.)"""
    from megazero.parallel import fp8

    _fp8_steps(_fp8_run(1, True), 0, 2, f"{root}/a")
    plain = _fp8_run(1, False, bf16=True)
    said = [_load(plain, f"{root}/a")]
    losses = _fp8_steps(plain, 2, 3, f"{root}/b")
    back = _fp8_run(1, True)
    said.append(_load(back, f"{root}/b"))
    assert fp8.history_state(back[2]) == {}
    losses += _fp8_steps(back, 3, 4, f"{root}/c")
    assert len(fp8.history_state(back[2])) == 16
    said.append(_load(_fp8_run(1, False, bf16=True), f"{root}/c"))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    return said


def test_fp8_delayed_histories_resume_bitwise_and_under_another_layout(tmp_path):
    assert run_on_ranks(2, _fp8_resume_body, str(tmp_path), timeout=300) == [True, True]
    reader = CheckpointReader(tmp_path / "fp8" / "iter_0000002")
    histories = reader.names("fp8.amax_history")
    assert len(histories) == 16 and reader.shape("fp8.amax_history/layers.0.attention.qkv") == [3, 3]
    assert all(len(reader.tensors[f"fp8.amax_history/{n}"]["shards"]) == 1 for n in histories)    # written once


def test_an_fp8_checkpoint_loads_into_a_run_without_fp8_and_back(tmp_path):
    said = run_on_ranks(2, _fp8_and_bf16_body, str(tmp_path), timeout=300)
    assert said[1] == [[], [], []]
    unused, fresh, unused_again = said[0]
    assert unused == [f"{tmp_path}/a/iter_0000002 holds FP8 amax histories (--fp8-recipe delayed); this run does not "
                      f"train in FP8 (no --fp8-format): they are not used"]
    assert fresh == [f"{tmp_path}/b/iter_0000003 holds no amax history for 16 FP8 linear(s) (layers.0.attention.qkv, "
                     f"..., rank 0): their first step scales from the current values, as in a fresh run"]
    assert len(unused_again) == 1
    assert CheckpointReader(tmp_path / "b" / "iter_0000003").names("fp8.amax_history") == []
    assert len(CheckpointReader(tmp_path / "c" / "iter_0000004").names("fp8.amax_history")) == 16


def _fp16_overflow_body(rank, world_size, root):
    """fp16 FP8 delayed at dp2 from a loss scale that overflows: the skipped steps leave the histories as
    they were (an inf or NaN there would scale later gradients to zero or NaN), so every step's checkpoint
    saves (finite state) and the run steps again once the scale is down."""
    from megazero.config import FP8Config, PrecisionConfig
    from megazero.parallel import fp8
    from megazero.training import train_step

    topo = Topology(dp=world_size)
    job = make_job(1, 1, world_size, 1)
    job.train.micro_batch_size = MB_SIZE
    job.fp8 = FP8Config(**FP8_DELAYED)
    job.precision = PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 27, hysteresis=1)
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, device="meta", dtype=torch.float16,
                                fp8=job.fp8)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    per, skipped = GLOBAL_MB // world_size, []
    for step in range(10):
        skipped.append(train_step(chunks, batches(step)[rank * per:(rank + 1) * per], topo, engine, job).skipped)
        assert all(torch.isfinite(h).all() for h in fp8.history_state(chunks).values()), step
        save_checkpoint(root, TrainState(step + 1, (step + 1) * GLOBAL_MB * MB_SIZE), chunks=chunks, engine=engine,
                        topo=topo, job=job)
    return skipped


def test_an_fp16_overflow_leaves_the_fp8_histories_finite_and_the_run_saves(tmp_path):
    skipped = run_on_ranks(2, _fp16_overflow_body, str(tmp_path), timeout=300)[0]
    assert skipped[0] and not skipped[-1], skipped
    reader = CheckpointReader(tmp_path / "iter_0000010")
    assert all(torch.isfinite(reader.read_full(f"fp8.amax_history/{n}")).all() for n in reader.names("fp8.amax_history"))


# ---------------------------------------------------------------------------------------------- Muon
def _muon_resume_body(rank, world_size, root, layouts):
    """Muon, straight 6 steps vs 3 + save + (new model, engine) load + 3, at each (tp, stage) of ``layouts``:
    returns, per layout, (straight losses, resumed losses, whether every final parameter is bitwise equal)."""
    out = []
    for tp, stage in layouts:
        save_dir = f"{root}/tp{tp}-zero{stage}"
        straight = run_body(rank, world_size, tp, 1, stage, 6, opt=MUON_OPT)
        first = run_body(rank, world_size, tp, 1, stage, 3, save_dir, (3,), opt=MUON_OPT)
        resumed = run_body(rank, world_size, tp, 1, stage, 6, load_dir=save_dir, opt=MUON_OPT)
        same = all(torch.equal(value, resumed[2][name]) for name, value in straight[2].items())
        out.append((straight[0], first[0] + resumed[0], same))
    return out


def test_a_muon_run_resumes_bitwise_at_dp2_zero1_and_tp2(tmp_path):
    """The momentum travels under optim.exp_avg: 3 + 3 steps equal 6 straight ones, bit for bit."""
    layouts = [(1, 1), (2, 1)]
    results = run_on_ranks(2, _muon_resume_body, str(tmp_path), layouts, timeout=300)
    for (tp, stage), (straight, resumed, same) in zip(layouts, results[0]):
        assert resumed == straight and same, (tp, stage, straight, resumed)
    reader = CheckpointReader(tmp_path / "tp1-zero1" / "iter_0000003")
    assert reader.index["optimizer"]["name"] == "muon"
    momentum = reader.read_full("optim.exp_avg/layers.0.attention.qkv.weight")
    assert momentum.abs().sum() > 0 and reader.read_full("optim.exp_avg_sq/layers.0.attention.qkv.weight").abs().sum() == 0
    from tools.inspect_checkpoint import describe

    assert "  optimizer: muon, step 3" in describe(str(tmp_path / "tp1-zero1"))


def _muon_layouts_body(rank, world_size, save_dir, layouts):
    """From the dp2 ZeRO-1 Muon checkpoint at step 3, to step 6 at each (tp, stage) of ``layouts``."""
    return [run_body(rank, world_size, tp, 1, stage, 6, load_dir=save_dir, opt=MUON_OPT) for tp, stage in layouts]


def _wrong_optimizer_body(rank, world_size, root):
    """Muon state into an AdamW run and AdamW state into a Muon run: refused unless the optimizer starts
    fresh; a checkpoint without the record (written before it existed) is AdamW's."""
    out = {}
    run_body(rank, world_size, 1, 1, 1, 1, f"{root}/adamw", (1,))
    run_body(rank, world_size, 1, 1, 1, 1, f"{root}/muon", (1,), opt=MUON_OPT)
    for key, load_dir, opt in (("muon_into_adamw", "muon", None), ("adamw_into_muon", "adamw", MUON_OPT)):
        kw = {} if opt is None else {"opt": opt}
        try:
            run_body(rank, world_size, 1, 1, 1, 2, load_dir=f"{root}/{load_dir}", **kw)
        except CheckpointError as e:
            out[key] = str(e)
        out[key + "_fresh"] = run_body(rank, world_size, 1, 1, 1, 2, load_dir=f"{root}/{load_dir}",
                                       load_optim=False, **kw)[3].iteration
    dist.barrier()
    if rank == 0:                                          # as a checkpoint older than the record
        where = Path(root) / "adamw" / "iter_0000001"
        saved = json.loads((where / "index.json").read_text())
        del saved["optimizer"]["name"]
        write_json(where / "index.json", saved)
        manifest = json.loads((where / "manifest.json").read_text())
        manifest["files"]["index.json"] = file_record(where / "index.json")
        write_json(where / "manifest.json", manifest)
    dist.barrier()
    try:
        run_body(rank, world_size, 1, 1, 1, 2, load_dir=f"{root}/adamw", opt=MUON_OPT)
    except CheckpointError as e:
        out["unrecorded_into_muon"] = str(e)
    out["unrecorded_into_adamw"] = run_body(rank, world_size, 1, 1, 1, 2, load_dir=f"{root}/adamw")[3].iteration
    return out


def test_a_muon_checkpoint_continues_under_another_layout(tmp_path):
    """Saved at dp2 ZeRO-1, resumed at tp2 (ZeRO-1), dp2 ZeRO-3 and on one rank: the straight run's losses and
    weights (1e-5, as every layout change)."""
    ref = run_on_ranks(2, run_body, 1, 1, 1, 6, str(tmp_path), (3,), opt=MUON_OPT)[0]
    assert CheckpointReader(tmp_path / "iter_0000003").index["optimizer"]["name"] == "muon"
    for world, layouts in ((2, [(2, 1), (1, 3)]), (1, [(1, 0)])):
        for rank_results in run_on_ranks(world, _muon_layouts_body, str(tmp_path), layouts):
            for (tp, stage), (losses, _, final, state) in zip(layouts, rank_results):
                _check_muon_continues(ref, tp, stage, losses, final, state)


def _check_muon_continues(ref, tp, stage, losses, final, state):
    """A run loaded at (tp, stage) continued the straight run ``ref`` (losses, _, final weights, _)."""
    assert state.iteration == 6
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0][3:]), rtol=1e-5, atol=0)
    for name, value in final.items():
        torch.testing.assert_close(_unpad(name, value), _unpad(name, ref[2][name]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name} at tp{tp} zero{stage}: {m}")


def test_optimizer_state_of_another_optimizer_is_refused_unless_it_starts_fresh(tmp_path):
    [out, _] = run_on_ranks(2, _wrong_optimizer_body, str(tmp_path))
    assert out["muon_into_adamw"] == (                   # every rank raises rank 0's line
        f"rank 0: checkpoint {tmp_path}/muon/iter_0000001 holds muon optimizer state but --optimizer is adamw (adamw keeps "
        f"other state): give --optimizer muon to continue it, or add --no-load-optim to start the adamw optimizer "
        f"fresh from the checkpoint's weights")
    assert "holds adamw optimizer state but --optimizer is muon" in out["adamw_into_muon"]
    assert "holds adamw optimizer state but --optimizer is muon" in out["unrecorded_into_muon"]
    assert out["muon_into_adamw_fresh"] == out["adamw_into_muon_fresh"] == out["unrecorded_into_adamw"] == 2
