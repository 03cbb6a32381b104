"""Muon (--optimizer muon) under ZeRO: its arithmetic against torch.optim.Muon, the serial engine against
torch.optim.Muon + AdamW on the same parameter split, and every layout against the serial run."""
import contextlib
import io
import math

import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import (
    LLAMA_KW,
    check_against_reference,
    engine_steps,
    fp32_newton_schulz,
    gpt_reference,
)
from helpers.trainer import TINY, read_metrics
from torch.optim import _muon as torch_muon

from megazero.cli.job import parse_job
from megazero.config import (
    JobConfig,
    OptimizerConfig,
    ParallelConfig,
    ZeroConfig,
    validate,
)
from megazero.errors import ConfigError
from megazero.parallel.topology import Topology
from megazero.parallel.zero.muon import (
    NS_COEFFICIENTS,
    NS_EPS,
    adjusted_lr,
    newton_schulz,
    newton_schulz_flops,
)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_and_the_lr_scaling_are_torch_muons(shape):
    """Bitwise torch.optim.Muon's iteration (wide, tall and square) and its two lr adjustments."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    want = torch_muon._zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, NS_EPS)
    assert torch.equal(newton_schulz(g, 5, torch.bfloat16), want)
    assert torch.equal(newton_schulz(g, 5, torch.float32), fp32_newton_schulz(g, NS_COEFFICIENTS, 5, NS_EPS))
    for mode in ("original", "match_rms_adamw"):
        assert adjusted_lr(0.01, mode, shape) == torch_muon._adjust_lr(0.01, mode, torch.Size(shape))
    assert newton_schulz_flops((24, 40), 5) == newton_schulz_flops((40, 24), 5) == 5 * (4 * 24 * 24 * 40 + 2 * 24 ** 3)


@pytest.mark.parametrize("kw,zero,words", [
    ({"muon_momentum": 0.9}, {}, r"--muon-momentum sets Muon, but --optimizer is adamw: add --optimizer muon"),
    ({"optimizer": "muon", "muon_momentum": 1.0}, {}, r"--muon-momentum must be in \[0, 1\)"),
    ({"optimizer": "muon", "muon_ns_steps": 0}, {}, "--muon-ns-steps must be between 1 and 99"),
    ({"optimizer": "muon"}, {"zero_stage": 1, "offload_optimizer": "cpu"},
     "Muon's state stays on the device .*: drop --offload-optimizer, or use --optimizer adamw"),
])
def test_muon_settings_are_refused_where_they_mean_nothing(kw, zero, words):
    with pytest.raises(ConfigError, match=words):
        validate(JobConfig(optimizer=OptimizerConfig(**kw), zero=ZeroConfig(**zero)), 2)


def test_megatrons_spellings_are_ours():
    """Megatron-LM's --optimizer adam is AdamW and dist_muon is Muon (always distributed here); its
    --muon-use-nesterov and --muon-num-ns-steps are our flags' aliases."""
    job = parse_job(["--optimizer", "dist_muon", "--muon-num-ns-steps", "3", "--no-muon-nesterov"], world_size=1)[0]
    assert job.optimizer.muon and job.optimizer.muon_ns_steps == 3 and not job.optimizer.muon_nesterov
    assert not parse_job(["--optimizer", "adam"], world_size=1)[0].optimizer.muon


def _run(topo, par, stage, steps, model_kw=None, optimizer="muon"):
    """``steps`` steps of the test GPT under OPTIMIZERS[optimizer] at ZeRO ``stage``: (what
    check_against_reference takes, the engine)."""
    return engine_steps(topo, par, ZeroConfig(zero_stage=stage, bucket_size=3000), steps, model_kw, optimizer)

def _serial_body(rank, world_size):
    out = []
    for optimizer in ("muon", "muon_bf16"):
        result, engine = _run(Topology(), ParallelConfig(), 0, 5, optimizer=optimizer)
        out.append((result, *engine.optimizer.muon.counts()))
    return out


def test_serial_muon_equals_torch_muon_and_adamw_on_the_same_split():
    """One process, 5 steps: the engine's Muon (the layers' matrices) + AdamW (the rest) equals
    torch.optim.Muon + torch.optim.AdamW on the same split within 1e-6 relative on every parameter: Newton-Schulz
    in bf16 (torch as shipped, clipping out of reach) and in fp32 (torch's step with its iteration in fp32,
    clipping active). Muon steps the 4 layers' 4 matrices each, nothing else."""
    (runs,) = run_on_ranks(1, _serial_body)
    for optimizer, (result, matrices, elements) in zip(("muon", "muon_bf16"), runs):
        check_against_reference([result], 5, dp=1, optimizer=optimizer, param_atol=1e-7, rtol=1e-6)
        _, _, _, _, params = result
        want = [n for n, (p, _) in params.items() if n.startswith("layers.") and p.dim() == 2]
        assert matrices == len(want) == 16
        assert elements == sum(params[n][0].numel() for n in want)


def _layout_body(rank, world_size, cases):
    out = []
    for tp, pp, ep, stage, sp, model_kw in cases:
        topo = Topology(tp=tp, pp=pp, ep=ep)
        par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, expert_model_parallel_size=ep)
        result, engine = _run(topo, par, stage, 5, model_kw)
        out.append((result, engine.comm_log.bytes().get("muon", 0), engine.optimizer.muon.orthogonalised))
    return out


MOE = {"num_experts": 4, "moe_router_topk": 2}
#        tp pp ep stage sp  model
DP2 = [(1, 1, 1, stage, False, None) for stage in (0, 1, 2, 3)]
TP2_PP2 = [(2, 1, 1, 1, True, None), (1, 2, 1, 2, False, None), (2, 1, 1, 3, False, LLAMA_KW)]
WORLD4 = [(2, 1, 1, 1, False, None), (2, 1, 1, 3, True, LLAMA_KW), (1, 1, 1, 2, False, None),
          (1, 1, 2, 1, False, MOE), (1, 1, 2, 3, False, MOE)]


def _check_layouts(results, cases, world: int) -> None:
    for i, (tp, pp, ep, stage, sp, model_kw) in enumerate(cases):
        dp = world // (tp * pp)
        check_against_reference([r[i][0] for r in results], 5, dp=dp, model_kw=model_kw, optimizer="muon")
        travels = tp > 1 or (dp > 1 and stage > 0)       # tp shards, or ZeRO shards over dp
        assert all((r[i][1] > 0) == travels for r in results), "the matrices travel to owners iff split"
        _, _, params = gpt_reference(5, dp, model_kw, None, "muon")
        matrices = sum(1 for n, p in params.items() if n.startswith("layers.") and p.dim() == 2)
        per_replica = dp if stage == 0 else 1            # ZeRO-0: every dp rank orthogonalises its own copy
        assert sum(r[i][2] for r in results) == matrices * per_replica, "each matrix orthogonalised once"


@pytest.mark.parametrize("cases", [DP2, TP2_PP2], ids=["dp2-zero0123", "tp2sp-pp2-llama-tp2"])
def test_each_layout_equals_the_serial_muon_run(cases):
    """dp 2 under ZeRO 0-3; tp 2 with sequence parallelism, pp 2 (ZeRO-2), and the Llama shape at tp 2
    (the fused QKV and SwiGLU matrices gathered whole): loss, clipped norm and every parameter after 5 steps
    equal the serial Muon run (1e-5 relative)."""
    _check_layouts(run_on_ranks(2, _layout_body, cases), cases, 2)


def test_four_rank_layouts_equal_the_serial_muon_run():
    """Both exchanges at once (tp 2 x dp 2 under ZeRO-1, and the Llama shape with sequence parallelism under
    ZeRO-3), dp 4 under ZeRO-2 (owners spread over four ranks), and experts at ep 2 x dp 4 under ZeRO-1 and 3
    (each expert's matrices their own, sharded over the expert-data-parallel pair): equal the serial run."""
    _check_layouts(run_on_ranks(4, _layout_body, WORLD4, timeout=600), WORLD4, 4)


def _main_printing(rank, world_size, argv):
    """The trainer's main on this rank, and what it printed (rank 0 prints the start lines)."""
    from helpers.trainer import main_body

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main_body(rank, world_size, argv)
    return code, out.getvalue()


def test_the_trainer_runs_muon_and_says_what_each_optimizer_steps(tmp_path):
    """The trainer's main with --optimizer muon at dp 2 under ZeRO-1 (the pool's two processes; the
    torchrun launch itself is tested in test_pretrain_gpt): the start line splits the parameters between
    Muon (the 4 layers' matrices) and AdamW, and every iteration's loss is finite (mock data: nothing to
    learn; the parity tests above prove the numbers)."""
    path = tmp_path / "metrics.jsonl"
    argv = [*TINY, "--zero-stage", "1", "--optimizer", "muon", "--muon-ns-steps", "4", "--metrics-file", str(path)]
    (code, stdout), (other_code, _) = run_on_ranks(2, _main_printing, argv, timeout=300)
    assert code == other_code == 0
    hidden, ffn = 32, 128
    matrices = 4 * (3 * hidden * hidden + hidden * hidden + 2 * hidden * ffn)
    line = next(x for x in stdout.splitlines() if x.startswith(" optimizer:"))
    assert f"muon on the layers' matrices, {matrices:,} parameters" in line, line
    assert "4 Newton-Schulz steps in fp32" in line and "adamw on the other" in line, line
    flops = 4 * (newton_schulz_flops((3 * hidden, hidden), 4) + newton_schulz_flops((hidden, hidden), 4)
                 + newton_schulz_flops((ffn, hidden), 4) + newton_schulz_flops((hidden, ffn), 4))
    assert f"{flops / 1e9:.3g} GFLOP a step, each matrix once per model replica" in line, line
    losses = [r["loss"] for r in read_metrics(path)[0]]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), losses
