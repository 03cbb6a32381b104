"""ZeRO optimizer: AdamW numerics, model-state bytes vs the ZeRO paper, and the GPT composed with
tensor and pipeline parallelism (tp2 x pp2 x dp2) against the single-process run."""
import dataclasses

import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import (
    GPT_CFG,
    GPT_OPT,
    LLAMA_KW,
    MB_SIZE,
    MICRO,
    SEED,
    check_against_reference,
    global_loss,
    gpt_batches,
)
from helpers.tinynet import TinyNet, reference_run, train_dp

from megazero.config import JobConfig, ParallelConfig, PrecisionConfig, TrainConfig, ZeroConfig
from megazero.memory import LiveTensorBytes
from megazero.models.gpt import GPTConfig, activation_shape, build_model_chunks, masked_mean
from megazero.parallel.params import split_dim
from megazero.parallel.pipeline import run_schedule
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine, merge_optimizer_states, model_state_bytes, zero_paper_bytes
from megazero.parallel.zero.adamw import adamw_update
from megazero.parallel.zero.optimizer import BucketAdamW
from megazero.training import train_step


def test_flat_adamw_matches_torch_adamw():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(7, 5, generator=g), torch.randn(5, generator=g), torch.randn(3, 4, generator=g)]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": [ref[0], ref[2]], "weight_decay": 0.1},
                             {"params": [ref[1]], "weight_decay": 0.0}], lr=3e-2, betas=(0.8, 0.95), eps=1e-8)
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    decay = [(0, 35), (40, 52)]
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        opt.step()
        adamw_update([flat], [torch.cat([gr.reshape(-1) for gr in grads])], [m], [v], step=step, lr=3e-2,
                     beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.1, decay_ranges=[decay])
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1) for p in ref]), rtol=1e-6, atol=1e-7)


def test_decoupled_ranges_step_at_their_own_lr_like_torch_param_groups():
    """--decoupled-lr: the ranges of the embedding / output layer step at their own rate (decay included),
    the rest at lr: torch's AdamW with four groups (decay x lr), fp32."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(6, 5, generator=g), torch.randn(5, generator=g), torch.randn(4, 3, generator=g),
              torch.randn(3, generator=g)]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1, "lr": 5e-2},
                             {"params": [ref[1]], "weight_decay": 0.0},
                             {"params": [ref[2]], "weight_decay": 0.1},
                             {"params": [ref[3]], "weight_decay": 0.0, "lr": 5e-2}], lr=1e-2, betas=(0.8, 0.95))
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    decay, own = [(0, 30), (35, 47)], [(0, 30), (47, 50)]
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        opt.step()
        adamw_update([flat], [torch.cat([gr.reshape(-1) for gr in grads])], [m], [v], step=step, lr=1e-2,
                     beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.1, decay_ranges=[decay], decoupled_lr=5e-2,
                     decoupled_ranges=[own])
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1) for p in ref]), rtol=1e-6, atol=1e-7)


def _save_body(rank, world_size):
    topo = Topology(dp=world_size)
    _, _, params, _, opt = train_dp(topo, 2, steps=2, global_batch=8, micro_batches=1)
    return params, opt.state_dict()


def _resume_body(rank, world_size, params, opt_state):
    topo = Topology(dp=world_size)
    model = TinyNet()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    losses, _, final, _, _ = train_dp(topo, 1, steps=3, global_batch=8, micro_batches=1, model=model,
                                      start=2, opt_state=opt_state)
    return losses, final


def test_optimizer_state_saved_at_dp2_zero2_resumes_at_dp4_zero1():
    """state_dict pieces of every dp rank merge into whole tensors that load at another dp / stage."""
    saved = run_on_ranks(2, _save_body)
    keys = [set(state["params"]) for _, state in saved]
    assert keys[0] | keys[1] == set(saved[0][0]) and keys[0] & keys[1]   # some tensors span both ranks
    merged = merge_optimizer_states([state for _, state in saved])
    assert merged["step"] == 2
    results = run_on_ranks(4, _resume_body, saved[0][0], merged)
    ref_losses, _, ref_params = reference_run(5, 8)
    for losses, final in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(final[name], ref, rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- memory accounting

def _bytes_body(rank, world_size):
    topo = Topology(dp=world_size)
    out = {}
    for prec in (PrecisionConfig(bf16=True), PrecisionConfig(fp16=True)):
        dtype = torch.bfloat16 if prec.bf16 else torch.float16
        for stage in (0, 1, 2):
            _, _, _, sync, opt = train_dp(topo, stage, steps=1, global_batch=8, micro_batches=1,
                                          bucket_size=10_000_000, dtype=dtype, precision=prec, hidden=64)
            psi = sum(p.numel() for p in sync.parameters())
            out[(prec.dtype_name, stage)] = (model_state_bytes(sync, opt), psi)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_match_zero_formulas(world):
    """2Ψ+2Ψ+12Ψ (stage 0), 4Ψ+12Ψ/N (stage 1), 2Ψ+14Ψ/N (stage 2) per rank, within 5%."""
    for rank_out in run_on_ranks(world, _bytes_body):
        for (dtype, stage), (got, psi) in rank_out.items():
            n = world
            assert got["total"] == pytest.approx(zero_paper_bytes(psi, n, stage), rel=0.05), (dtype, stage, got)
            shard = 1 if stage == 0 else n
            assert got["params"] == pytest.approx(2 * psi, rel=0.05)
            assert got["grads"] == pytest.approx(2 * psi / (n if stage == 2 else 1), rel=0.05)
            assert got["master_weights"] == pytest.approx(4 * psi / shard, rel=0.05)
            assert got["optimizer_state"] == pytest.approx(8 * psi / shard, rel=0.05)


def _counting_launches(sync, beside):
    """``sync.reducer.reduce_into`` that first notes how many reductions are still in flight."""
    launch = sync.reducer.reduce_into

    def counted(target, grad):
        beside.append(len(sync._in_flight))
        return launch(target, grad)
    return counted


def _transients_body(rank, world_size):
    topo = Topology()
    cfg = GPTConfig(**GPT_CFG)
    par = ParallelConfig(dp=topo.dp_size)
    job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=MB_SIZE))
    out = {}
    for stage in (2, 3):
        chunks = build_model_chunks(cfg, par, topo, seed=SEED)
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage, bucket_size=2000), GPT_OPT)
        sync, beside = engine.bucket_groups[0], []
        sync.reducer.reduce_into = _counting_launches(sync, beside)
        mine = gpt_batches(1, 2 * topo.dp_size)[0][2 * rank:2 * rank + 2]
        train_step(chunks, mine, topo, engine, job)
        bucket = max(sync.buckets, key=lambda b: b.numel)
        with LiveTensorBytes() as probe:       # a retired storage of another size, then a fresh one
            spare = torch.empty(bucket.numel + 1000, dtype=torch.float32)
            sync._spare.append(spare)
            sync._held += spare.nbytes
            del spare
            fresh = sync._fresh_storage(bucket)
            del fresh
        out[stage] = (len(sync.buckets), max(beside), sync._max_in_flight, probe.peak, (bucket.numel + 1000) * 4)
    return out


def test_sharded_grad_sync_bounds_its_transients():
    """Stages 2 and 3 at dp = 4 on gloo, where each gradient reduction holds an inbox of (N-2)/N of
    its bucket: a reduction is launched only once fewer than the bound are in flight (so at most the
    bound's inboxes exist), and a retired storage of another size is freed before a new one is
    allocated (the peak is the larger of the two, not their sum)."""
    for out in run_on_ranks(4, _transients_body):
        for stage, (buckets, most_beside, bound, peak, spare_bytes) in out.items():
            assert buckets > bound + 2, (stage, buckets)
            assert most_beside == bound - 1, (stage, most_beside, bound)
            assert peak == spare_bytes, (stage, peak, spare_bytes)


# --------------------------------------------------------------------------- GPT with tp x pp x dp

class _DeferredGather:
    """An all-gather that runs only when waited for: with ``--overlap-param-gather`` a parameter read
    before its module waited sees the step's stale values, every time, not only when a real gather
    happens to lag (as one did at 69M parameters under load)."""

    def __init__(self, run):
        self.run = run

    def is_completed(self):
        return False

    def wait(self):
        run, self.run = self.run, None
        if run is not None:
            run()


def _deferring(all_gather):
    def deferred(*args, async_op=False, **kw):
        if not async_op:
            return all_gather(*args, **kw)
        return _DeferredGather(lambda: all_gather(*args, async_op=False, **kw))
    return deferred


def _gpt_body(rank, world_size, tp, pp, stage, sequence_parallel, steps, virtual_stages=1, overlap_param_gather=False,
              model_kw=None, opt_cfg=GPT_OPT):
    if overlap_param_gather:                  # gathers deferred to their wait (restored: workers are reused)
        from megazero.parallel.zero import publish
        real = publish.comm.all_gather
        publish.comm.all_gather = _deferring(real)
        try:
            return _gpt_run(tp, pp, stage, sequence_parallel, steps, virtual_stages, True, model_kw, opt_cfg)
        finally:
            publish.comm.all_gather = real
    return _gpt_run(tp, pp, stage, sequence_parallel, steps, virtual_stages, False, model_kw, opt_cfg)


def _gpt_run(tp, pp, stage, sequence_parallel, steps, virtual_stages, overlap_param_gather, model_kw, opt_cfg):
    topo = Topology(tp=tp, pp=pp)
    par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sequence_parallel,
                         virtual_stages=virtual_stages)
    chunks = build_model_chunks(GPTConfig(**{**GPT_CFG, **(model_kw or {})}), par, topo, seed=SEED)
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage, bucket_size=3000,
                                                   overlap_param_gather=overlap_param_gather), opt_cfg)
    losses, norms = [], []
    for batches in gpt_batches(steps, topo.dp_size * MICRO):
        mine = batches[topo.dp_rank * MICRO:(topo.dp_rank + 1) * MICRO]
        engine.zero_grad()
        shape = activation_shape(chunks[0].cfg, MB_SIZE, tp, sequence_parallel)
        out = run_schedule(chunks, mine, topo.pipeline(), loss_fn=masked_mean, loss_scale=engine.loss_scale,
                           grad_sync=engine, tensor_shape=shape)
        engine.finalize_grads()
        norm, skipped = engine.step()
        assert not skipped
        if overlap_param_gather:              # the gathers finish behind the next forward
            assert len(engine.optimizer.publish.overlap.pending) == len(engine.bucket_groups[0].buckets) > 1
        losses.append(global_loss(out, topo))
        norms.append(norm)
    with engine.gathered_parameters():        # waits for gathers still in flight
        params = {n: (p.detach().clone(), split_dim(p)) for c in chunks for n, p in c.named_parameters()}
    return topo.tp_rank, topo.tp_size, losses, norms, params


@pytest.mark.slow
@pytest.mark.parametrize("stage,sequence_parallel", [(1, False), (2, True)])
def test_gpt_tp2_pp2_dp2_matches_single_process(stage, sequence_parallel):
    """8 ranks: loss, clipped global grad norm and every parameter after 5 steps equal one process."""
    results = run_on_ranks(8, _gpt_body, 2, 2, stage, sequence_parallel, 5, timeout=300)
    check_against_reference(results, 5, dp=2)


@pytest.mark.slow
def test_gpt_tp2_dp2_stage0_sequence_parallel_matches_single_process():
    results = run_on_ranks(4, _gpt_body, 2, 1, 0, True, 3)
    check_against_reference(results, 3, dp=2)


@pytest.mark.parametrize("stage,tp,pp,sequence_parallel,model_kw", [
    (1, 1, 2, False, None),                                   # tied: the last stage's copy of the embedding
    (2, 2, 1, True, LLAMA_KW),                                # untied output head, RMSNorm, SwiGLU
    (2, 1, 1, False, {"num_experts": 4, "moe_router_topk": 2}),  # MoE: router and experts read by their layer
])
def test_overlapped_param_gather_matches_single_process(stage, tp, pp, sequence_parallel, model_kw):
    """--overlap-param-gather: step() returns with every bucket's all-gather pending; each module's
    forward waits for the buckets it reads, the gathers deferred until then (so a read before its
    wait sees stale values); the run equals one process."""
    results = run_on_ranks(4, _gpt_body, tp, pp, stage, sequence_parallel, 3, 1, True, model_kw)
    check_against_reference(results, 3, dp=4 // (tp * pp), model_kw=model_kw)


def test_gpt_interleaved_pp2_dp2_stage2_matches_single_process():
    """Two model chunks per rank: each chunk's buckets reduce on that chunk's last micro-batch."""
    results = run_on_ranks(4, _gpt_body, 1, 2, 2, False, 3, 2)
    check_against_reference(results, 3, dp=2)



@pytest.mark.parametrize("stage,model_kw", [(1, None), (3, {"untie_embeddings_and_output_weights": True})])
def test_decoupled_lr_at_dp2_matches_single_process(stage, model_kw):
    """--decoupled-lr: the word embedding (tied: also the head) and an untied output layer step at their own
    rate under ZeRO-1 and ZeRO-3, every other parameter at --lr: the run equals one process with torch's
    AdamW in param groups."""
    opt_cfg = dataclasses.replace(GPT_OPT, decoupled_lr=5e-3)
    results = run_on_ranks(2, _gpt_body, 1, 1, stage, False, 3, 1, False, model_kw, opt_cfg)
    check_against_reference(results, 3, dp=2, model_kw=model_kw, decoupled_lr=5e-3)


def _decoupled_elements_body(rank, world_size):
    topo = Topology()
    chunks = build_model_chunks(GPTConfig(**GPT_CFG, untie_embeddings_and_output_weights=True), ParallelConfig(dp=2),
                                topo, seed=SEED)
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=1, bucket_size=3000), GPT_OPT)
    opt: BucketAdamW = engine.optimizer
    marked = sum(b - a for r in opt.ranges for a, b in r.decoupled_ranges)
    return marked, {n for c in chunks for n, p in c.named_parameters() if getattr(p, "embedding_or_output")}


def test_embedding_and_output_ranges_are_the_models_declaration():
    """The optimizer's decoupled ranges (over both ZeRO-1 shards) are exactly the elements of the parameters
    the model marks ``embedding_or_output``: the word embedding and the untied output layer, not the
    position embedding."""
    results = run_on_ranks(2, _decoupled_elements_body)
    assert all(names == {"embedding.word_embeddings.weight", "output_layer.weight"} for _, names in results)
    assert sum(marked for marked, _ in results) == 2 * 256 * GPT_CFG["hidden_size"]
