"""ZeRO-Offload / ZeRO-Infinity (megazero/parallel/zero/offload.py): the same run with the optimizer's
shard, and ZeRO-3's parameter shards, in host memory or in swap files gives bitwise the same losses and
parameters in fp32; bf16 stays within its tolerance; checkpoints move between offloaded and resident
runs; the swap files exist while the engine lives and are gone after ``close()``."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import run_on_ranks
from helpers.ckpt import GLOBAL_MB, MB_SIZE, MODEL, OPT, SEED, full_params, train_one_step

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.config import JobConfig, ParallelConfig, PrecisionConfig, TrainConfig, ZeroConfig
from megazero.models.gpt import GPTConfig, build_model_chunks
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.parallel.zero.swap import SWAP_PREFIX
from megazero.state import TrainState

STEPS = 4
SUB_GROUP = 256          # elements: several sub-groups per shard, so the NVMe buffers rotate


def _swap_files(nvme_dir, rank="*") -> list[Path]:
    """This rank's swap files (every rank's by default) under ``nvme_dir``."""
    pattern = f"{SWAP_PREFIX}*-rank{rank if rank == '*' else f'{rank:05d}'}"
    return sorted(p for d in Path(nvme_dir).glob(pattern) for p in d.iterdir())


def _engine(tp, pp, stage, nvme_dir, bf16=False, opt=OPT, **offload):
    topo = Topology(tp=tp, pp=pp)
    zero = ZeroConfig(zero_stage=stage, bucket_size=3000, nvme_path=nvme_dir if "nvme" in offload.values() else None,
                      offload_sub_group_size=SUB_GROUP, **offload)
    job = JobConfig(model=GPTConfig(**MODEL), parallel=ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size), zero=zero,
                    optimizer=opt, precision=PrecisionConfig(bf16=bf16),
                    train=TrainConfig(micro_batch_size=MB_SIZE, global_batch_size=MB_SIZE * GLOBAL_MB))
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, device="meta",
                                dtype=torch.bfloat16 if bf16 else torch.float32)
    return topo, job, chunks, build_engine(chunks, topo, job.zero, job.optimizer, job.precision)


def _train(tp, pp, stage, nvme_dir, steps=range(STEPS), bf16=False, opt=OPT, **offload):
    """Losses and whole parameters after ``steps``; for nvme, the swap files seen while training."""
    topo, job, chunks, engine = _engine(tp, pp, stage, nvme_dir, bf16, opt, **offload)
    losses = [train_one_step(topo, chunks, engine, s) for s in steps]
    during = _swap_files(nvme_dir, topo.rank) if nvme_dir else []
    params = {n: p.float() for n, p in full_params(chunks, topo, engine).items()}
    engine.close()
    return losses, params, during


def _parity_body(rank, world_size, tp, pp, variants, nvme_dir, bf16):
    """Each variant (stage, offload flags) and its stage's resident run; what each one's swap files did."""
    out = {}
    for stage in sorted({s for s, _ in variants}):
        out[(stage, ())] = _train(tp, pp, stage, None, bf16=bf16)
    for stage, offload in variants:
        losses, params, during = _train(tp, pp, stage, nvme_dir, bf16=bf16, **dict(offload))
        out[(stage, offload)] = (losses, params, [str(p) for p in during],
                                 [str(p) for p in _swap_files(nvme_dir, rank)])
    return out


VARIANTS = [(s, (("offload_optimizer", where),)) for s in (1, 2, 3) for where in ("cpu", "nvme")] + \
           [(3, (("offload_params", where),)) for where in ("cpu", "nvme")] + \
           [(3, (("offload_optimizer", "nvme"), ("offload_params", "nvme")))]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 2), (2, 2, 2)],
                         ids=["dp2", "tp2pp2dp2"])
def test_fp32_offload_is_bitwise_the_resident_run(tmp_path, tp, pp, dp):
    results = run_on_ranks(tp * pp * dp, _parity_body, tp, pp, VARIANTS, str(tmp_path), False, timeout=400)
    for rank, out in enumerate(results):
        for stage, offload in VARIANTS:
            losses, params, during, after = out[(stage, offload)]
            ref_losses, ref_params, _ = out[(stage, ())]
            what = f"rank {rank} ZeRO-{stage} {dict(offload)}"
            assert losses == ref_losses, what
            for name, value in ref_params.items():
                assert torch.equal(params[name], value), f"{what}: {name}"
            nvme = "nvme" in dict(offload).values()
            assert bool(during) == nvme, f"{what}: swap files while training {during}"
            assert after == [], f"{what}: swap files left after close(): {after}"


@pytest.mark.slow
def test_bf16_offload_tracks_the_resident_run(tmp_path):
    variants = [(2, (("offload_optimizer", "cpu"),)), (3, (("offload_optimizer", "nvme"), ("offload_params", "cpu")))]
    out = run_on_ranks(2, _parity_body, 1, 1, variants, str(tmp_path), True, timeout=300)[0]
    for stage, offload in variants:
        losses, params, _, _ = out[(stage, offload)]
        ref_losses, ref_params, _ = out[(stage, ())]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=5e-3, atol=0)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=2e-2, atol=2e-3, msg=name)


def _resume_body(rank, world_size, stage, first, second, ck_dir, nvme_dir):
    """STEPS//2 steps with offload ``first``, save; a fresh engine with ``second`` loads and runs the rest;
    against STEPS uninterrupted resident steps."""
    half = STEPS // 2
    topo, job, chunks, engine = _engine(1, 1, stage, nvme_dir, **dict(first))
    before = [train_one_step(topo, chunks, engine, s) for s in range(half)]
    save_checkpoint(ck_dir, TrainState(half, 0, 0), chunks=chunks, engine=engine, topo=topo, job=job)
    engine.close()
    topo, job, chunks, engine = _engine(1, 1, stage, nvme_dir, **dict(second))
    load_checkpoint(ck_dir, chunks=chunks, engine=engine, topo=topo, job=replace(job))
    after = [train_one_step(topo, chunks, engine, s) for s in range(half, STEPS)]
    params = full_params(chunks, topo, engine)
    engine.close()
    ref_losses, ref_params, _ = _train(1, 1, stage, None)
    return before + after, params, ref_losses, ref_params


@pytest.mark.parametrize("stage,first,second", [
    (2, (("offload_optimizer", "cpu"),), ()),
    (3, (), (("offload_optimizer", "nvme"), ("offload_params", "nvme"))),
], ids=["zero2-saved-offloaded-loaded-resident", "zero3-saved-resident-loaded-nvme"])
def test_checkpoints_move_between_offloaded_and_resident_runs(tmp_path, stage, first, second):
    out = run_on_ranks(2, _resume_body, stage, first, second, str(tmp_path / "ck"), str(tmp_path), timeout=300)
    for losses, params, ref_losses, ref_params in out:
        assert losses == ref_losses
        for name, value in ref_params.items():
            assert torch.equal(params[name], value), name
    assert _swap_files(tmp_path) == []


BIG = dict(num_layers=12, hidden_size=512, num_attention_heads=8, seq_length=16, vocab_size=50257)   # 63.6M


def _memory_body(rank, world_size, nvme_dir):
    """Peak live tensor bytes of building the engine and two fp32 ZeRO-1 steps, without and with the
    optimizer in swap files (default sub-group size); the resident run's optimizer-state bytes (Adam
    moments: in fp32 the parameters are the masters)."""
    import gc

    from megazero.memory import LiveTensorBytes

    out = {}
    for where in ("none", "nvme"):
        gc.collect()
        topo = Topology()
        zero = ZeroConfig(zero_stage=1, offload_optimizer=where, nvme_path=nvme_dir if where == "nvme" else None)
        job = JobConfig(model=GPTConfig(**BIG), parallel=ParallelConfig(dp=topo.dp_size), zero=zero, optimizer=OPT)
        with LiveTensorBytes() as build:
            chunks = build_model_chunks(job.model, job.parallel, topo, seed=SEED, device="meta")
            engine = build_engine(chunks, topo, job.zero, job.optimizer)
        peak, previous = build.peak, build
        for step in range(2):
            with LiveTensorBytes(after=previous) as probe:
                train_one_step(topo, chunks, engine, step)
            peak, previous = max(peak, probe.peak), probe
        states = engine.model_state_bytes()
        swap = [p.stat().st_size for p in _swap_files(nvme_dir, rank)]
        engine.close()
        out[where] = dict(peak=peak, optimizer=states["master_weights"] + states["optimizer_state"], swap=sum(swap),
                          params=sum(p.numel() for c in chunks for p in c.parameters()),
                          left=_swap_files(nvme_dir, rank))
        del chunks, engine
    return out


@pytest.mark.slow
def test_nvme_offload_takes_the_optimizer_state_out_of_memory(tmp_path):
    """63M parameters at dp 2, fp32 ZeRO-1: the peak live bytes per rank drop by at least 80% of the
    optimizer-state bytes (8 bytes per owned element), which sit in the swap file during the run with the
    masters. On a CPU the offloaded optimizer reads the reduced gradients where they are (no host copy)."""
    for rank, out in enumerate(run_on_ranks(2, _memory_body, str(tmp_path), timeout=600)):
        resident, nvme = out["none"], out["nvme"]
        assert resident["params"] > 63e6 and resident["optimizer"] >= 8 * resident["params"] // 2 * 0.99
        drop = resident["peak"] - nvme["peak"]
        assert drop >= 0.8 * resident["optimizer"], (rank, drop / resident["optimizer"], out)
        print(f"rank {rank}: peak live MiB resident {resident['peak'] / 2**20:.0f}, nvme {nvme['peak'] / 2**20:.0f}; "
              f"drop {drop / resident['optimizer']:.0%} of the optimizer state's {resident['optimizer'] / 2**20:.0f}")
        assert nvme["swap"] >= resident["optimizer"] and nvme["left"] == [], (rank, out)


def _accounting_body(rank, world_size, nvme_dir):
    """model_state_bytes after one step, and the estimator's host and NVMe bytes, for two offloads."""
    from megazero.memory.estimate import estimate_memory

    out = {}
    for name, stage, bf16, offload in (("zero2-bf16-optimizer-cpu", 2, True, {"offload_optimizer": "cpu",
                                                                             "offload_delayed_update": True}),
                                       ("zero3-fp32-params-nvme", 3, False, {"offload_params": "nvme"})):
        topo, job, chunks, engine = _engine(1, 1, stage, nvme_dir, bf16, **offload)
        train_one_step(topo, chunks, engine, 0)
        est = estimate_memory(job, "cpu")[0]
        out[name] = (engine.model_state_bytes(), est.host, est.nvme)
        engine.close()
    return out


def test_device_host_and_nvme_bytes_follow_the_formulas(tmp_path):
    """ZeRO-2 + optimizer offload (bf16): 2Ψ params and 2Ψ/N gradients on the device, 12Ψ/N of masters and
    moments plus the 4Ψ/N fp32 gradient copy on the host, and (delayed update) the 4Ψ/N gradients its update
    steps with. ZeRO-3 + parameter offload to nvme (fp32): the
    4Ψ/N shards in the swap file, none on the device. The estimator counts the same host and NVMe bytes."""
    out = run_on_ranks(2, _accounting_body, str(tmp_path))[0]
    states, host, nvme = out["zero2-bf16-optimizer-cpu"]
    psi = states["params"] // 2                                  # padded elements of this rank's model
    assert states["master_weights"] == states["optimizer_state"] == 0
    assert states["grads"] == 2 * psi // 2
    assert states["host_master_weights"] == 4 * psi // 2 and states["host_optimizer_state"] == 8 * psi // 2
    assert states["host_grads"] == states["host_delayed_grads"] == 4 * psi // 2 and states["nvme_total"] == 0
    assert abs(host - states["host_total"]) <= 0.02 * states["host_total"] and nvme == 0, (host, states)
    states, host, nvme = out["zero3-fp32-params-nvme"]
    assert states["params"] == 0 and states["nvme_params"] > 0 and states["host_total"] == 0
    assert states["nvme_params"] == states["optimizer_state"] // 2             # 4Ψ/N beside 8Ψ/N of moments
    assert abs(nvme - states["nvme_total"]) <= 0.02 * states["nvme_total"] and host == 0, (nvme, states)


def _decoupled_body(rank, world_size):
    decoupled = replace(OPT, decoupled_lr=OPT.lr * 3)
    return [_train(1, 1, 1, None, range(2), opt=opt, **offload)[:2]
            for opt, offload in ((decoupled, {}), (decoupled, {"offload_optimizer": "cpu"}), (OPT, {}))]


def test_decoupled_lr_offloaded_is_bitwise_the_resident_run():
    """--decoupled-lr with the optimizer's shard on the host (sub-groups cutting the embedding's range):
    the same parameters as resident, and not those of a run without it."""
    for (losses, params), (off_losses, off_params), (_, plain) in run_on_ranks(2, _decoupled_body):
        assert off_losses == losses
        assert all(torch.equal(off_params[name], value) for name, value in params.items())
        assert not torch.equal(plain["embedding.word_embeddings.weight"], params["embedding.word_embeddings.weight"])


# --------------------------------------------------------------------------- the delayed parameter update

def _delayed_body(rank, world_size, steps):
    """ZeRO 1, 2 and 3 with the optimizer on the host and ``--offload-delayed-update``, at dp 2; and the
    stage-2 run saved after two steps and resumed by a fresh engine."""
    from helpers.gpt_parity import engine_steps

    topo = Topology()
    par = ParallelConfig(dp=world_size)
    out = {}
    for stage in (1, 2, 3):
        zero = ZeroConfig(zero_stage=stage, bucket_size=3000, offload_optimizer="cpu", offload_delayed_update=True)
        out[stage], engine = engine_steps(topo, par, zero, steps)
        engine.close()
    return out


def test_delayed_update_applies_each_step_one_step_late():
    """Each layout equals the single-process reference that applies every step's clipped gradients one
    step late (after the next step's backward; the last step's at the end): losses, norms and parameters
    to 1e-5. The reference without delay ends elsewhere, so the comparison can tell them apart."""
    from helpers.gpt_parity import check_against_reference, gpt_reference

    steps = 4
    results = run_on_ranks(2, _delayed_body, steps, timeout=300)
    for stage in (1, 2, 3):
        check_against_reference([r[stage] for r in results], steps, dp=2, delayed=True)
    _, _, delayed = gpt_reference(steps, 2, delayed=True)
    _, _, plain = gpt_reference(steps, 2)
    assert max((delayed[n] - plain[n]).abs().max().item() for n in plain) > 1e-3


def _delayed_resume_body(rank, world_size, ck_dir):
    """Two steps, save, two more steps (one run); a fresh engine loading the save runs the last two."""
    offload = {"offload_optimizer": "cpu", "offload_delayed_update": True}
    topo, job, chunks, engine = _engine(1, 1, 2, None, **offload)
    losses = [train_one_step(topo, chunks, engine, s) for s in range(2)]
    save_checkpoint(ck_dir, TrainState(2, 0, 0), chunks=chunks, engine=engine, topo=topo, job=job)
    losses += [train_one_step(topo, chunks, engine, s) for s in range(2, 4)]
    params = full_params(chunks, topo, engine)
    engine.close()
    topo, job, chunks, engine = _engine(1, 1, 2, None, **offload)
    load_checkpoint(ck_dir, chunks=chunks, engine=engine, topo=topo, job=replace(job))
    resumed = [train_one_step(topo, chunks, engine, s) for s in range(2, 4)]
    resumed_params = full_params(chunks, topo, engine)
    engine.close()
    return losses, params, resumed, resumed_params


def test_delayed_update_resumes_exactly_from_a_checkpoint(tmp_path):
    """A save applies the pending update first, so the run that saved and the run resumed from the save
    continue bitwise alike."""
    for losses, params, resumed, resumed_params in run_on_ranks(2, _delayed_resume_body, str(tmp_path / "ck"),
                                                                timeout=300):
        assert losses[2:] == resumed
        for name, value in params.items():
            assert torch.equal(resumed_params[name], value), name


def test_delayed_update_needs_the_optimizer_on_the_host():
    from megazero.config import validate
    from megazero.errors import ConfigError

    for where in ("none", "nvme"):
        zero = ZeroConfig(zero_stage=1, offload_optimizer=where, offload_delayed_update=True,
                          nvme_path="/tmp" if where == "nvme" else None)
        with pytest.raises(ConfigError, match="--offload-delayed-update .* needs --offload-optimizer cpu"):
            validate(JobConfig(zero=zero), 1)
