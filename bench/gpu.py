"""GPU section (runs only when CUDA is available): single-GPU throughput and MFU of GPT-2 124M and
350M in bf16, megazero against the same model written plainly in PyTorch (nanoGPT style), in the
same run, alternating steps.

    ours:   GPT(cfg, dtype=bf16) (attention via F.scaled_dot_product_attention, flash on GPU)
            + build_engine(stage 0, bf16: fp32 master weights and Adam state in the engine)
    plain:  PlainGPT in bf16 + torch.optim.AdamW(fused=True) (bf16 weights and state, nanoGPT's
            usual setup: cheaper in memory, less exact than fp32 masters)

Figures: median step time, tokens/s, MFU (model FLOPs per token from megazero.metrics, against the
device's dense bf16 peak), peak allocated memory (each side alone over its build and two warm-up
steps), final losses (bf16: same-loss tolerance 2e-2).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bench.common import GPT, PlainGPT, median, ratio_of_medians_per_round
from bench.steps import engine_step
from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.metrics import device_peak_tflops
from megazero.models.gpt import GPTConfig
from megazero.models.gpt.spec import flops_per_token as model_flops_per_token
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine

MODELS = {"gpt2-124M": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
          "gpt2-350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16)}
BF16_LOSS_TOL = 2e-2


def skip_reason() -> str | None:
    return None if torch.cuda.is_available() else "skipped: no CUDA device on this machine"


def _cfg(name: str, seq: int) -> GPTConfig:
    return GPTConfig(seq_length=seq, vocab_size=50257, **MODELS[name])


def _run_model(name: str, micro_batch: int, seq: int, steps: int) -> dict:
    dev = torch.device("cuda", 0)
    cfg, opt_cfg = _cfg(name, seq), OptimizerConfig(lr=3e-4, weight_decay=0.1, clip_grad=1.0)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen).to(dev) for _ in range(steps)]
    mask = torch.ones(micro_batch, seq, device=dev)

    topo = Topology(device=dev)
    peaks = {}

    def measured_build(label, build):
        """Build, then two warm-up steps alone: peak allocated above what was there before the build."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step = build()
        for tok in data[:2]:
            step(tok)
        torch.cuda.synchronize()
        peaks[label] = torch.cuda.max_memory_allocated() - before
        return step

    def build_ours():
        model = GPT(cfg, topo.model_groups(), seed=1234, dtype=torch.bfloat16, device=dev)
        engine = build_engine(model, topo, ZeroConfig(0), opt_cfg, PrecisionConfig(bf16=True))

        return lambda tok: engine_step(model, engine, [(tok[:, :-1], tok[:, 1:], mask)])

    def build_plain():
        plain = PlainGPT(cfg, dtype=torch.bfloat16, device=dev).load_from(GPT(cfg, seed=1234))
        popt = torch.optim.AdamW(plain.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay, fused=True)

        def step(tok):
            popt.zero_grad(set_to_none=True)
            loss = plain(tok[:, :-1], tok[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), opt_cfg.clip_grad)
            popt.step()
            return loss
        return step

    steps = {"ours": measured_build("ours", build_ours), "plain": measured_build("plain", build_plain)}
    times, losses = {"ours": [], "plain": []}, {}
    for i, tok in enumerate(data[2:]):                 # alternate which side goes first
        for label in (("ours", "plain") if i % 2 == 0 else ("plain", "ours")):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = steps[label](tok)
            torch.cuda.synchronize()
            times[label].append(time.perf_counter() - t0)
            losses[label] = float(loss)           # ours returns a float, the plain step its loss tensor
    tokens = micro_batch * seq
    flops = model_flops_per_token(cfg, cfg.padded_vocab_size(1)) * tokens
    peak = device_peak_tflops(dev, "bf16")
    out = {}
    for label in times:
        t = median(times[label])
        out[label] = {"step_ms": 1e3 * t, "tokens_s": tokens / t, "tflops": flops / t / 1e12,
                      "mfu": (flops / t / 1e12 / peak) if peak else None, "peak_mib": peaks[label] / 2**20,
                      "loss": losses[label]}
    out["ratio"] = ratio_of_medians_per_round(times["ours"], times["plain"])
    return out


def run_gpu(micro_batch: int = 8, seq: int = 1024, steps: int = 12) -> dict:
    """{model: {"ours": {...}, "plain": {...}, "ratio": x}} or {"skipped": reason}."""
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    try:
        return {name: _run_model(name, micro_batch, seq, steps) for name in MODELS}
    finally:
        if started:
            dist.destroy_process_group()
