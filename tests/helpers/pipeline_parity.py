"""The pipeline parity harness shared by the pipeline test modules: the tiny model, the batches, the
serial reference and the checks of a tp x pp run against it (loss, step-0 gradients, parameters after
3 AdamW steps, tied-embedding copies, activation sets in flight)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megazero.config import ParallelConfig, ZeroConfig
from megazero.models.gpt import GPT, GPTConfig, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.params import attribute, split_dim
from megazero.parallel.pipeline import PipelineStats, get_schedule, interleaved_warmup, run_schedule
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.parallel.zero import wrap_data_parallel

SEED, STEPS, MICRO, LR = 1234, 3, 2, 1e-3


def model_cfg() -> GPTConfig:
    return GPTConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       make_vocab_size_divisible_by=16)


def batches(step: int, m: int, cfg: GPTConfig) -> list[dict]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length), generator=g)
        mask = (torch.rand(MICRO, cfg.seq_length, generator=g) < 0.8).float()
        mask[0, 0] = 1.0
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
    return out


@functools.lru_cache(maxsize=None)
def serial_run(m: int, dtype: torch.dtype = torch.float32):
    """One process, whole model, one forward over the whole global batch per step. Returns the step
    losses, the gradients of step 0 and the parameters after the last step."""
    cfg = model_cfg()
    model = GPT(cfg, None, seed=SEED, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        mbs = batches(step, m, cfg)
        per_token = model(torch.cat([b["tokens"] for b in mbs]), torch.cat([b["labels"] for b in mbs]))
        loss = torch.stack([masked_mean(per_token[i * MICRO:(i + 1) * MICRO], b["loss_mask"])
                            for i, b in enumerate(mbs)]).mean()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def parallel_body(rank, world, tp, pp, schedule, v, m, sp=False, dtype=torch.float32, overlap_grad_reduce=False):
    """On each rank of a tp x pp group (``run_on_ranks``): STEPS steps of the parity model under the
    ``--pipeline-schedule`` ``schedule`` (``v`` chunks per rank) with the trainer's gradient finalisation
    (the ZeRO-0 grad sync: tied-embedding grads summed over the first and last stage, sequence-parallel
    grads over tp) and AdamW. Returns what :func:`check_parity` compares: this rank's losses, step-0
    gradients and final parameters (tp shards gathered), the tied copies' equality and the activation
    sets in flight per step. A rank holding both tied copies (zb-v's rank 0) checks they carry the same
    gradient."""
    topo, cfg = Topology(tp=tp, pp=pp), model_cfg()
    par = ParallelConfig(tp=tp, pp=pp, pipeline_schedule=schedule, virtual_stages=v, sequence_parallel=sp)
    chunks = build_model_chunks(cfg, par, topo, seed=SEED, dtype=dtype)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    sync = wrap_data_parallel(chunks, topo, ZeroConfig(overlap_grad_reduce=overlap_grad_reduce))
    opt = torch.optim.AdamW([p for _, p in named], lr=LR)
    shape = activation_shape(cfg, MICRO, tp, sp)
    losses, tied, peaks, grads = [], [], [], {}
    for step in range(STEPS):
        stats = PipelineStats()
        sync.zero_grad()
        out = run_schedule(chunks, batches(step, m, cfg), topo.pipeline(), loss_fn=masked_mean,
                           schedule=get_schedule(par), tensor_shape=shape, stats=stats, grad_sync=sync)
        sync.finalize_grads()
        if step == 0:
            for n, p in named:
                g = full_tensor(p.grad, p, topo)
                assert n not in grads or torch.equal(grads[n], g), n
                grads[n] = g
        opt.step()
        losses.append(torch.stack(out).mean().item() if out else None)
        tied.append(tied_copies_equal(chunks, topo))
        peaks.append(stats.peak_in_flight)
    return {"pp_rank": topo.pp_rank, "losses": losses, "tied": tied, "peaks": peaks, "grads": grads,
            "params": {n: full_tensor(p, p, topo) for n, p in named}}


def full_tensor(t, p, topo):
    """The whole tensor ``t`` (a parameter or its gradient): tp shards gathered over the tp group."""
    if topo.tp_size == 1 or not p.tensor_parallel:
        return t.detach().clone()
    return gather_full(t.detach(), split_dim(p), topo.tp_group)


def tied_copies_equal(chunks, topo) -> bool | None:
    """On first/last stages: is this rank's tied embedding bit-identical to the other end's? (In the V
    of zb-v rank 0 holds both ends; the other end of its group, rank pp-1, holds neither.)"""
    if topo.pp_size == 1 or topo.pipeline().embedding is None:
        return None
    shared = [p for c in chunks for p in c.parameters() if attribute(p, "shared_embedding")]
    if len(shared) != 1:
        return torch.equal(shared[0], shared[1]) if shared else None
    (w,) = shared
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w.detach(), group=topo.pipeline().embedding.group)
    return torch.equal(both[0], both[1])


def close(got, ref, what, rtol, atol):
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda s: f"{what}: {s}")


def check_parity(results, m, pp, schedule, v, dtype):
    """Loss, step-0 gradients and weights after 3 AdamW steps against the serial run.

    fp32: 1e-5 relative. Gradient entries that cancel to ~0 are judged against 1e-6 of the tensor's
    largest entry. Adam normalises each update, so an entry whose true gradient is ~0 (e.g. the key
    bias: softmax ignores a constant shift) moves by rounding noise of either sign; weights therefore
    get an absolute floor of 1e-5, 1% of one lr=1e-3 step (a lost micro-batch, a wrong chunk or a
    missing tied-embedding sync moves weights by ~lr). The float64 cases remove rounding and must
    agree to 1e-10 (the same floor the tensor-parallel tests use).
    """
    ref_losses, ref_grads, ref_params = serial_run(m, dtype)
    fp64 = dtype == torch.float64
    loss_rank = 0 if schedule == "zb-v" else pp - 1          # the rank with the last virtual stage
    for r in results:
        if r["pp_rank"] == loss_rank:
            close(torch.tensor(r["losses"]), torch.tensor(ref_losses), "losses", rtol=1e-5, atol=0)
        else:
            assert r["losses"] == [None] * STEPS, f"pp rank {r['pp_rank']} returned losses"
    seen = set()
    for r in results:
        for name, full in r["params"].items():
            g = ref_grads[name]
            close(r["grads"][name], g, f"step-0 grad of {name}", rtol=1e-10 if fp64 else 1e-5,
                   atol=(1e-12 if fp64 else 1e-6) * g.abs().max().item())
            close(full, ref_params[name], f"{name} after {STEPS} AdamW steps", rtol=1e-10 if fp64 else 1e-5,
                   atol=1e-10 if fp64 else 1e-5)
            seen.add(name)
        if (r["pp_rank"] == 0 or (r["pp_rank"] == pp - 1 and schedule != "zb-v")) and pp > 1:
            assert r["tied"] == [True] * STEPS, f"tied embedding copies differ on pp rank {r['pp_rank']}"
        check_in_flight(r["peaks"], m, pp, r["pp_rank"], schedule, v)
    assert seen == set(ref_params), f"parameters held by no rank: {set(ref_params) - seen}"


def check_in_flight(peaks, m, pp, r, schedule, v):
    """Activation sets held at once: 1F1B <= pp - pp_rank; GPipe all m; interleaved warmup + 1."""
    if schedule == "1f1b":
        assert max(peaks) <= pp - r, f"1F1B held {max(peaks)} micro-batches on pp rank {r} (> {pp - r})"
        assert peaks == [min(pp - r, m)] * STEPS
    elif schedule == "gpipe":
        assert peaks == [m] * STEPS
    elif schedule == "zb-h1":                  # held from F to W, at most 1F1B's peak (rank 0's)
        assert max(peaks) <= min(pp, m)
    elif schedule == "zb-v":                   # chunk sets of half a rank's layers: 1F1B's rank-0 peak
        assert max(peaks) <= min(2 * pp, 2 * m)
    else:
        assert peaks == [min(interleaved_warmup(m, pp, r, v) + 1, m * v)] * STEPS
