"""GPU section (runs only when CUDA is available): single-GPU throughput and MFU of GPT-2 124M and
350M in bf16, megazero against the same model written plainly in PyTorch (nanoGPT style), in the
same run, alternating steps.

    ours:   the trainer's path, as ``pretrain_gpt.py --bf16`` builds and steps it: ``parse_job`` of the
            trainer's flags, ``build_model_chunks`` (bf16 parameters; attention via
            F.scaled_dot_product_attention, flash on GPU), ``build_engine`` (ZeRO-0: fp32 master weights
            and Adam state in the engine), ``train_step``
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

from bench.common import PlainGPT, median, ratio_of_medians_per_round, trainer_argv
from megazero.cli.job import parse_job
from megazero.metrics import device_peak_tflops
from megazero.models.gpt.spec import flops_per_token as model_flops_per_token
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train_step

MODELS = {"gpt2-124M": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
          "gpt2-350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16)}
BF16_LOSS_TOL = 2e-2


def skip_reason() -> str | None:
    return None if torch.cuda.is_available() else "skipped: no CUDA device on this machine"


def _job(name: str, micro_batch: int, seq: int):
    """The trainer's job for this shape: bf16, lr 3e-4, weight decay 0.1, clipping at 1.0, seed 1234."""
    shape = MODELS[name]
    argv = trainer_argv(shape["num_layers"], shape["hidden_size"], shape["num_attention_heads"], seq, 50257,
                        micro_batch, "--bf16", "--lr", "3e-4", "--weight-decay", "0.1", "--clip-grad", "1.0",
                        "--seed", "1234")
    job, _ = parse_job(argv, 1)
    return job


def _run_model(name: str, micro_batch: int, seq: int, steps: int) -> dict:
    dev = torch.device("cuda", 0)
    job = _job(name, micro_batch, seq)
    cfg, opt_cfg = job.model, job.optimizer
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

    spec = get_model_spec(job.model.model_family)
    first_weights = {}

    def build_ours():
        torch.manual_seed(job.train.seed)
        chunks = build_model_chunks(spec, job, topo, dtype=torch.bfloat16)
        first_weights["chunk"] = {k: v.detach().to("cpu", copy=True) for k, v in chunks[0].named_parameters()}
        engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)

        def step(tok):
            micro = [{"tokens": tok[:, :-1], "labels": tok[:, 1:], "loss_mask": mask}]
            return train_step(chunks, micro, topo, engine, job, spec).loss
        return step

    def build_plain():
        plain = PlainGPT(cfg, dtype=torch.bfloat16, device=dev).load_from(first_weights.pop("chunk"))
        popt = torch.optim.AdamW(plain.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay, fused=True)

        def step(tok):
            popt.zero_grad(set_to_none=True)
            loss = plain(tok[:, :-1], tok[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), opt_cfg.clip_grad)
            popt.step()
            return loss.detach()
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
