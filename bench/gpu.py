"""GPU section (runs only when CUDA is available): single-GPU step time, MFU and peak memory of GPT-2
124M / 350M and a Llama 1.5B shape in bf16, megazero against the same model written the way its users
write it, in the same process, alternating steps. ``run_gpu(TOY)`` runs every row at tiny shapes on
the CPU (gloo, one process), so the code paths are tested on a machine without a GPU.

Each row is a pair of sides, built one after the other, timed in alternated rounds, then freed:

    ours:              the trainer's path, as ``pretrain_gpt.py --bf16`` builds and steps it: ``parse_job``
                       of the trainer's flags, ``build_model_chunks`` (bf16 parameters; attention via
                       F.scaled_dot_product_attention, flash on GPU), ``build_engine`` (ZeRO-0: fp32 master
                       weights and Adam state in the engine), ``train_step``
    ours --compile:    the same with the trainer's regional compile (``megazero.compile.compile_model``:
                       each transformer layer its own torch.compile)
    ours offload:      the Llama shape at ZeRO-1 with ``--offload-optimizer cpu`` (fp32 masters and Adam on
                       the host), against ours on-device
    plain:             GPT-2 as PlainGPT (bench/common.py, nanoGPT style) in bf16 + torch AdamW (fused on
                       CUDA; bf16 weights and state, nanoGPT's usual setup), our initial weights
    plain compiled:    the same, ``model = torch.compile(model)`` as nanoGPT users write it
    hf / hf compiled:  Llama as HF ``LlamaForCausalLM`` (fp32 weights, bf16 autocast, fused AdamW, clip 1.0;
                       ``common.hf_llama_step``), eager and with each decoder layer compiled

Figures per side: median step time over the timed rounds, tokens/s, MFU (model FLOPs per token from
megazero.metrics against the device's dense bf16 peak, where known), peak allocated memory on CUDA
(each side alone over its build and two warm-up steps), first and last loss; per row the ratio of the
first side's step time to the second's (median of the per-round ratios). With them: the commit
measured, torch's version and the device.
"""
from __future__ import annotations

import gc
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.common import REPO, PlainGPT, hf_llama_step, median, ratio_of_medians_per_round, trainer_argv
from megazero.cli.job import parse_job
from megazero.cli.run import param_dtype
from megazero.compile import compile_model, compile_unavailable
from megazero.metrics import device_peak_tflops
from megazero.models.gpt.spec import flops_per_token as model_flops_per_token
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train_step

WARMUP = 2            # untimed steps of each side alone, over which its peak memory is taken
LLAMA_FLAGS = ("--group-query-attention", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
               "rope", "--rotary-base", "500000", "--disable-bias-linear", "--untie-embeddings-and-output-weights")


@dataclass(frozen=True)
class Model:
    """One model of the section: its shape, batch, and whether it is the Llama (else GPT-2) kind."""
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    micro_batch: int
    seq: int
    llama: bool = False
    num_query_groups: int = 0
    ffn_hidden_size: int = 0

    def argv(self, *extra) -> list[str]:
        """The trainer's flags for this model: bf16, lr 3e-4, weight decay 0.1, clipping at 1.0, seed 1234."""
        shape = (("--num-query-groups", self.num_query_groups, "--ffn-hidden-size", self.ffn_hidden_size)
                 + LLAMA_FLAGS if self.llama else ())
        return trainer_argv(self.num_layers, self.hidden_size, self.num_attention_heads, self.seq, self.vocab_size,
                            self.micro_batch, *shape, "--bf16", "--lr", "3e-4", "--weight-decay", "0.1",
                            "--clip-grad", "1.0", "--seed", "1234", *extra)

    def describe(self) -> str:
        kind = (f", {self.num_query_groups} KV groups, ffn {self.ffn_hidden_size}, SwiGLU, RMSNorm, RoPE"
                if self.llama else "")
        return (f"{self.num_layers} layers x {self.hidden_size} hidden, {self.num_attention_heads} heads{kind}, "
                f"vocab {self.vocab_size}, {self.micro_batch} x {self.seq} tokens a step")


@dataclass(frozen=True)
class Shapes:
    """What the section runs: its models, on which device, for how many steps (``WARMUP`` of them untimed),
    and whether the compiled rows run."""
    models: tuple[Model, ...]
    device: str = "cuda"
    steps: int = 12
    compiled: bool = True
    backend: str = "nccl"


GPU = Shapes(models=(
    Model("gpt2-124M", 12, 768, 12, 50257, micro_batch=8, seq=1024),
    Model("gpt2-350M", 24, 1024, 16, 50257, micro_batch=8, seq=1024),
    Model("llama-1.5B", 16, 2048, 32, 128256, micro_batch=4, seq=2048, llama=True, num_query_groups=8,
          ffn_hidden_size=8192)))
TOY = Shapes(models=(
    Model("gpt2-toy", 2, 64, 4, 512, micro_batch=2, seq=32),
    Model("llama-toy", 2, 64, 4, 512, micro_batch=2, seq=32, llama=True, num_query_groups=2, ffn_hidden_size=128)),
    device="cpu", steps=5, compiled=False, backend="gloo")


def skip_reason(shapes: Shapes = GPU) -> str | None:
    if shapes.device == "cuda" and not torch.cuda.is_available():
        return "skipped: no CUDA device on this machine"
    return None


def commit_measured() -> str:
    """The repository's short HEAD, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=REPO)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


class _Side:
    """One side of a row: its step (tokens [b, seq + 1] -> loss), the peak bytes its build and warm-up
    allocated (None off CUDA), its timings and losses, and what to close when the row is done."""

    def __init__(self, build, data, dev):
        _sync(dev)
        cuda = dev.type == "cuda"
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self.step, self.close = build()
        self.losses = [float(self.step(tok)) for tok in data[:WARMUP]]
        _sync(dev)
        self.peak = torch.cuda.max_memory_allocated() - before if cuda else None
        self.times: list[float] = []


def _ours(model: Model, dev, topo, *extra, weights: dict | None = None):
    """The builder of our side: the trainer's job for ``model`` (``extra`` flags added), its chunks,
    ``--compile``'s regions, its engine; ``weights`` receives the first chunk's initial parameters."""
    def build():
        job, _ = parse_job(model.argv(*extra), 1)
        spec = get_model_spec(job.model.model_family)
        torch.manual_seed(job.train.seed)
        chunks = build_model_chunks(spec, job, topo, dtype=param_dtype(job))
        if weights is not None:
            weights.update({k: v.detach().to("cpu", copy=True) for k, v in chunks[0].named_parameters()})
        compile_model(chunks, spec.compile_regions, job.compilation)
        engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
        mask = torch.ones(model.micro_batch, model.seq, device=dev)

        def step(tok):
            micro = [{"tokens": tok[:, :-1], "labels": tok[:, 1:], "loss_mask": mask}]
            return train_step(chunks, micro, topo, engine, job, spec).loss
        return step, engine.close
    return build


def _plain(model: Model, dev, weights: dict, compiled: bool):
    """The builder of the nanoGPT-style side, from our side's initial ``weights``."""
    def build():
        job, _ = parse_job(model.argv(), 1)
        opt_cfg = job.optimizer
        plain = PlainGPT(job.model, dtype=torch.bfloat16, device=dev).load_from(weights)
        weights.clear()
        popt = torch.optim.AdamW(plain.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay,
                                 fused=dev.type == "cuda")
        run = torch.compile(plain) if compiled else plain

        def step(tok):
            popt.zero_grad(set_to_none=True)
            loss = run(tok[:, :-1], tok[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), opt_cfg.clip_grad)
            popt.step()
            return loss.detach()
        return step, lambda: None
    return build


def _hf(model: Model, dev, compiled: bool):
    """The builder of the HF Llama side (``common.hf_llama_step``) at ``model``'s shape."""
    def build():
        job, _ = parse_job(model.argv(), 1)
        shape = dict(num_layers=model.num_layers, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
                     ffn_hidden_size=model.ffn_hidden_size, vocab_size=model.vocab_size)
        step, _ = hf_llama_step(shape, model.seq, job.optimizer, dev, compiled)
        return step, lambda: None
    return build


def _row(model: Model, builders: dict, data: list, dev, flops_per_step: float, peak_tflops) -> dict:
    """Build each side (alone, its peak memory taken), alternate them over the timed rounds, free them:
    {"sides": {label: figures}, "ratio": first side's step time / second's}."""
    sides = {label: _Side(build, data, dev) for label, build in builders.items()}
    try:
        labels = list(sides)
        for i, tok in enumerate(data[WARMUP:]):
            for label in (labels if i % 2 == 0 else labels[::-1]):      # alternate which side goes first
                _sync(dev)
                t0 = time.perf_counter()
                loss = sides[label].step(tok)
                _sync(dev)
                sides[label].times.append(time.perf_counter() - t0)
                sides[label].losses.append(float(loss))
    finally:
        for side in sides.values():
            side.close()
    tokens = model.micro_batch * model.seq
    out = {}
    for label, side in sides.items():
        t = median(side.times)
        out[label] = {"step_ms": 1e3 * t, "tokens_s": tokens / t, "tflops": flops_per_step / t / 1e12,
                      "mfu": flops_per_step / t / 1e12 / peak_tflops if peak_tflops else None,
                      "peak_mib": side.peak / 2**20 if side.peak is not None else None,
                      "loss_first": side.losses[0], "loss_last": side.losses[-1]}
    first, second = (sides[label].times for label in labels)
    return {"sides": out, "ratio": ratio_of_medians_per_round(first, second)}


def _rows(model: Model, shapes: Shapes, dev, topo) -> dict:
    """{row name: row} for one model: eager, compiled (or why not), and for the Llama shape the offload row;
    a row's ``same_start``: both sides start from the same weights, so their losses agree to bf16's tolerance."""
    job, _ = parse_job(model.argv(), 1)
    cfg = job.model
    flops = model_flops_per_token(cfg, cfg.padded_vocab_size(1)) * model.micro_batch * model.seq
    peak = device_peak_tflops(dev, "bf16")
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (model.micro_batch, model.seq + 1), generator=gen).to(dev)
            for _ in range(shapes.steps)]
    weights: dict = {}

    def peer(compiled):
        return _hf(model, dev, compiled) if model.llama else _plain(model, dev, weights, compiled)

    twin = "hf" if model.llama else "plain"
    rows = {"eager": {"ours": _ours(model, dev, topo, weights=weights), twin: peer(False)}}
    why = None if shapes.compiled else "compiled rows not requested"
    why = why or compile_unavailable(dev.type)
    rows["compiled"] = why or {"ours --compile": _ours(model, dev, topo, "--compile", weights=weights),
                               f"{twin} compiled": peer(True)}
    if model.llama:
        rows["offload"] = {"ours offload-optimizer cpu": _ours(model, dev, topo, "--zero-stage", "1",
                                                                "--offload-optimizer", "cpu"),
                           "ours": _ours(model, dev, topo)}
    out = {}
    for name, builders in rows.items():
        if isinstance(builders, str):
            out[name] = {"unavailable": builders}
            continue
        out[name] = _row(model, builders, data, dev, flops, peak)
        out[name]["same_start"] = name == "offload" or not model.llama     # the HF twin has its own init
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def run_gpu(shapes: Shapes = GPU) -> dict:
    """{"commit", "torch", "device", "models": {name: {"describe": text, "rows": {row: {"sides": {label:
    figures}, "ratio": x, "same_start": bool} or {"unavailable": why}}}}}, or {"skipped": reason}."""
    reason = skip_reason(shapes)
    if reason:
        return {"skipped": reason}
    dev = torch.device(shapes.device, 0) if shapes.device == "cuda" else torch.device(shapes.device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(shapes.backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        topo = Topology(device=dev)
        return {"commit": commit_measured(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "models": {m.name: {"describe": m.describe(), "rows": _rows(m, shapes, dev, topo)}
                           for m in shapes.models}}
    finally:
        if started:
            dist.destroy_process_group()
