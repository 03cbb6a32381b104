"""What every benchmark shares: the model and data, the plain-PyTorch twin of our GPT, the process
launchers, memory probes, the alternating timing loop, folding every rank's results, the theory formulas
and the markdown table.

Conventions used by every row of ``bench/run.py``:

* One model spec (:class:`Spec`) for all rows; each row builds *both* sides from the same init
  (our ``GPT(cfg, seed=1234)``; the peer either wraps that very module or loads its full weights
  into :class:`PlainGPT`) and feeds the same batches (:func:`step_batches`) in the same order.
* Timing: both sides of a pair (and every other variant of the row) live in the same processes
  and run one step each per round, in a rotated order, so a load change on the shared machine
  hits them alike. A step is timed from a barrier to its end on every rank; the step time of a
  round is the slowest rank's. Reported: medians over the timed rounds (the first, warm-up round
  is not timed) and the median of the per-round ratios ours / peer.
* Peak memory per rank (CPU): during the two warm-up steps each variant runs alone right after
  being built; the process's high-water mark (VmHWM) is reset before the build and read after the
  second step (torch optimizers create their state at the end of the first step, so only the
  second one shows the steady-state peak). Before that, a throwaway build + step of the same variant pays the one-time costs of its
  code path (lazy imports, communication buffers), so the order of the variants does not matter. ``peak = RSS before any variant was built + (HWM - RSS before this variant's build)``:
  the peak this variant would reach on its own. For this accounting, allocations above 64 KiB
  are served by mmap during the warm-up (``mallopt``), so freed tensors leave the RSS; the timed
  rounds run with a fixed 32 MiB threshold (glibc's own dynamic threshold tops out there).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from megazero.config import OptimizerConfig
from megazero.memory.measure import LiveTensorBytes, reachable_tensor_bytes, return_freed_memory, reuse_freed_memory
from megazero.models.gpt import GPT, GPTConfig, build_model_chunks, masked_mean
from megazero.parallel.zero import build_engine
from megazero.parallel.zero.adamw import weight_decay_groups

WARMUP_STEPS = 2         # untimed; memory is measured over them (lazy optimizer state appears in step 1,
                         # so only the second step shows a peer's steady-state peak)
LOSS_TOL = 1e-4          # a pair whose final losses differ by more does not count
THEORY_TOL = 0.10        # a theory row deviating by more is flagged


# ------------------------------------------------------------------------------------------ spec
@dataclass(frozen=True)
class Spec:
    """The model and batch every row uses (tiny-to-small GPT, fp32 on CPU)."""

    layers: int = 8
    hidden: int = 128
    heads: int = 4
    seq: int = 64
    vocab: int = 1024              # a multiple of 128 * 4: no vocab padding at tp = 1, 2, 4
    micro_batch: int = 4           # sequences per micro-batch
    micro_batches: int = 2         # micro-batches per step and data-parallel rank (DP and TP rows)
    pp_micro_batches: int = 8      # micro-batches per step in the pipeline rows
    rounds: int = 14               # steps per variant, the first WARMUP_STEPS untimed
    lr: float = 1e-3
    untied: bool = False           # a separate output layer (--untie-embeddings-and-output-weights)

    def model_cfg(self, **over) -> GPTConfig:
        cfg = GPTConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                          seq_length=self.seq, vocab_size=self.vocab, make_vocab_size_divisible_by=128,
                          untie_embeddings_and_output_weights=self.untied)
        return replace(cfg, **over) if over else cfg

    def opt_cfg(self, clip: float = 1.0) -> OptimizerConfig:
        return OptimizerConfig(lr=self.lr, weight_decay=0.1, clip_grad=clip)

    def describe(self) -> str:
        return (f"GPT {self.layers} layers x {self.hidden} hidden, {self.heads} heads, seq {self.seq}, "
                f"vocab {self.vocab}{', untied output layer' if self.untied else ''}, micro-batch {self.micro_batch}, fp32")


QUICK = Spec(layers=4, hidden=64, heads=4, seq=32, vocab=512, micro_batch=2, pp_micro_batches=4, rounds=4)


def step_batches(spec: Spec, steps: int, data_ranks: int, rank: int, micro: int | None = None) -> list[list[tuple]]:
    """Per step, the (tokens, labels, loss_mask) micro-batches of data-parallel rank ``rank``.

    The global batch of a step is ``data_ranks * micro`` micro-batches drawn from one seeded
    generator; every process draws all of them and keeps its own, so any layout sees the same data.
    """
    micro = micro or spec.micro_batches
    g = torch.Generator().manual_seed(100)
    out = []
    for _ in range(steps):
        step = []
        for r in range(data_ranks):
            for _ in range(micro):
                tok = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq + 1), generator=g)
                if r == rank:
                    step.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous(),
                                 torch.ones(spec.micro_batch, spec.seq)))
        out.append(step)
    return out


def trainer_argv(layers: int, hidden: int, heads: int, seq: int, vocab: int, micro_batch: int, *extra) -> list[str]:
    """The trainer's flags for a mock-data GPT of this shape (rows that go through ``parse_job``)."""
    return ["--mock-data", "--vocab-size", str(vocab), "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq), "--micro-batch-size", str(micro_batch),
            *map(str, extra)]


def random_micro_batches(vocab: int, micro_batch: int, seq: int, count: int, step: int, rank: int) -> list[dict]:
    """Rank ``rank``'s ``count`` micro-batches of step ``step`` as the trainer takes them (seeded: every
    variant of a row sees the same ones)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    shape = (micro_batch, seq)
    return [{"tokens": torch.randint(0, vocab, shape, generator=g),
             "labels": torch.randint(0, vocab, shape, generator=g),
             "loss_mask": torch.ones(shape)} for _ in range(count)]


@dataclass(frozen=True)
class TrainerRun:
    """A GPT shape and batch on ``dp`` CPU ranks, trained through the trainer's own flags and step:
    ``micro_batches`` micro-batches of ``micro_batch`` sequences per rank and step, fp32."""

    layers: int = 12
    hidden: int = 512
    heads: int = 8
    seq: int = 64
    vocab: int = 50257
    micro_batch: int = 1
    micro_batches: int = 2
    dp: int = 2

    def trainer_flags(self, *extra) -> list[str]:
        """The trainer's flags for this shape and its global batch, then ``extra``."""
        return trainer_argv(self.layers, self.hidden, self.heads, self.seq, self.vocab, self.micro_batch,
                            "--global-batch-size", self.micro_batch * self.micro_batches * self.dp, *extra)

    def batch(self, step: int, rank: int) -> list[dict]:
        """Rank ``rank``'s micro-batches of step ``step`` (seeded: every variant sees the same)."""
        return random_micro_batches(self.vocab, self.micro_batch, self.seq, self.micro_batches, step, rank)

    def model(self) -> str:
        return (f"GPT {self.layers} layers x {self.hidden} hidden, {self.heads} heads, seq {self.seq}, "
                f"vocab {self.vocab}")


def trainer_engine(job, topo) -> tuple[list, object]:
    """The trainer's model chunks for ``job`` (built on the meta device from seed 1234; the engine
    materialises each parameter where it lives) and its engine."""
    chunks = build_model_chunks(job.model, job.parallel, topo, seed=1234, device="meta")
    return chunks, build_engine(chunks, topo, job.zero, job.optimizer, job.precision)


def deepspeed_config(opt_cfg: OptimizerConfig, micro_batch: int, accumulation: int, zero: dict,
                     torch_adam: bool = True) -> dict:
    """DeepSpeed's config for our AdamW, clipping and batch (fp32) with ``zero`` as its
    ``zero_optimization``; ``torch_adam=False`` lets DeepSpeed pick its own optimizer (CPU Adam)."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": opt_cfg.lr, "betas": [opt_cfg.adam_beta1,
                                                                                  opt_cfg.adam_beta2],
                                                      "eps": opt_cfg.adam_eps, "weight_decay": opt_cfg.weight_decay,
                                                      "torch_adam": torch_adam}},
            "gradient_clipping": opt_cfg.clip_grad, "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def deepspeed_param_groups(model: nn.Module, opt_cfg: OptimizerConfig) -> list[dict]:
    """Our weight-decay groups in the form ``deepspeed.initialize`` takes."""
    return [{"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in torch_adamw(model.named_parameters(), opt_cfg).param_groups]


def torch_adamw(named_params, opt_cfg: OptimizerConfig, **kw) -> torch.optim.AdamW:
    """torch AdamW with our weight-decay rule and hyper-parameters."""
    return torch.optim.AdamW(weight_decay_groups(named_params, opt_cfg.weight_decay), lr=opt_cfg.lr,
                             betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2), eps=opt_cfg.adam_eps, **kw)


# ------------------------------------------------------------------------------- plain twin model
class _PlainBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, dtype, device):
        super().__init__()
        h, kw = cfg.hidden_size, dict(dtype=dtype, device=device)
        self.input_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon, **kw)
        self.qkv = nn.Linear(h, 3 * h, **kw)
        self.dense = nn.Linear(h, h, **kw)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon, **kw)
        self.fc1 = nn.Linear(h, cfg.ffn_hidden_size, **kw)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, h, **kw)
        self.head_dim = cfg.head_dim
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def attention(self, x):
        b, s = x.shape[:2]
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)      # -1: heads held here (all, or a tp shard)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x))
        return x + self.fc2(F.gelu(self.fc1(self.post_attention_layernorm(x)), approximate=self.approximate))


class PlainGPT(nn.Module):
    """The same GPT written plainly in PyTorch (nanoGPT style, [b, s, h], ``nn.Linear`` layers), so
    torch's own parallel APIs (``parallelize_module``) apply to it. Same math and fused-QKV layout as
    ``megazero.models.GPT``; :meth:`load_from` copies a tp=1 GPT's weights in.
    forward(ids, labels) -> mean cross-entropy."""

    def __init__(self, cfg: GPTConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        self.wte = nn.Embedding(cfg.padded_vocab_size(1), cfg.hidden_size, **kw)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, **kw)
        self.blocks = nn.ModuleList(_PlainBlock(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, **kw)
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.padded_vocab_size(1), bias=False, **kw)
                        if cfg.untie_embeddings_and_output_weights else None)
        self.pos_offset = 0          # sequence parallel: first position of this rank's chunk

    _NAMES = {"attention.qkv": "qkv", "attention.dense": "dense", "mlp.dense_h_to_4h": "fc1",
              "mlp.dense_4h_to_h": "fc2"}

    @torch.no_grad()
    def load_from(self, gpt: GPT | dict) -> "PlainGPT":
        """Copy in a tp=1 GPT's weights (the model, or its ``named_parameters`` as a dict)."""
        src = gpt if isinstance(gpt, dict) else dict(gpt.named_parameters())
        for name, p in self.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                for ours, plain in self._NAMES.items():
                    rest = rest.replace(plain + ".", ours + ".") if rest.startswith(plain + ".") else rest
                key = f"layers.{i}.{rest}"
            else:
                key = {"wte.weight": "embedding.word_embeddings.weight",
                       "wpe.weight": "embedding.position_embeddings.weight",
                       "ln_f.weight": "final_norm.weight", "ln_f.bias": "final_norm.bias",
                       "lm_head.weight": "output_layer.weight"}[name]
            p.copy_(src[key])
        return self

    def hidden(self, ids):
        x = self.wte(ids)                                        # [b, s(/tp), h]
        pos = torch.arange(self.pos_offset, self.pos_offset + x.shape[1], device=ids.device)
        x = x + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, ids, labels):
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight   # tied unless untied
        logits = F.linear(self.hidden(ids), head)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def hf_llama_step(shape: dict, seq: int, opt_cfg: OptimizerConfig, device: torch.device, compiled: bool = False):
    """The HF twin of the trainer's Llama rows, set up as ``Trainer(bf16=True)`` steps it, without the
    Trainer: ``LlamaForCausalLM`` in fp32 (SDPA attention, its own seeded init), bf16 autocast, torch
    AdamW (fused on CUDA), clipping; ``compiled``: each decoder layer ``.compile()``d, the per-layer
    compilation HF documents. ``shape``: num_layers, hidden_size, num_attention_heads, num_query_groups,
    ffn_hidden_size, vocab_size. Returns (step(tokens [b, seq + 1]) -> loss, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                      intermediate_size=shape["ffn_hidden_size"], num_hidden_layers=shape["num_layers"],
                      num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_query_groups"],
                      max_position_embeddings=seq, rope_theta=500000.0, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay,
                            fused=device.type == "cuda")

    def step(tok):
        ids = tok[:, :-1]                                  # HF shifts the labels itself
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, model


# ---------------------------------------------------------------------------------------- memory

def _status_kib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return float(line.split()[1])
    return float("nan")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> None:
    """Reset the process's RSS high-water mark to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    return _status_kib("VmHWM") / 1024


# ---------------------------------------------------------------------------------------- launch
def _worker(rank, world, init_file, fn, args, queue):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        out = fn(rank, world, *args)
        queue.put((rank, True, out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))


def spawn(world: int, fn, *args, timeout: float = 900.0) -> list:
    """Run module-level ``fn(rank, world, *args)`` on ``world`` fresh gloo processes (one torch
    thread each); returns the per-rank results or raises with the first failing rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="megazero_bench_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, fn, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world:
            rank, ok, out = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if not ok:
                raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {world}:\n{out}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository root


def torchrun(world: int, target: list[str], args, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``target`` (``[script path]``, or ``["-m", module]`` for a module of this repository) under
    torchrun on ``world`` local processes from the repository root, one torch thread each; its output
    captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *target,
           *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False)


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def deepspeed_error() -> Exception | None:
    """None when DeepSpeed imports here (on its CPU accelerator), else the import's exception."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        importlib.import_module("deepspeed")
    except Exception as e:  # noqa: BLE001 -- any import failure means it cannot run here
        return e
    return None


# -------------------------------------------------------------------------------- every rank's results
def largest_over_ranks(per_rank: list[dict], keys: tuple[str, ...], keep: int = 0) -> dict:
    """Rank ``keep``'s results (:func:`run_variants`' dict), each variant that ran with the largest
    value over the ranks of each of ``keys`` (peak memory, say)."""
    res = per_rank[keep]
    for name, r in res.items():
        if isinstance(r, dict) and "losses" in r:
            for key in keys:
                r[key] = max(pr[name][key] for pr in per_rank)
    return res


def losses_over_ranks(res: dict, per_rank: list[dict], early_steps: int = 0) -> dict:
    """``res`` with every rank's final loss of each variant that ran (``rank_final_losses``) and, for
    ``early_steps`` > 0, every rank's first that many losses (``rank_early_losses``)."""
    for name, r in res.items():
        if isinstance(r, dict) and "losses" in r:
            if early_steps:
                r["rank_early_losses"] = [pr[name]["losses"][:early_steps] for pr in per_rank]
            r["rank_final_losses"] = [pr[name]["losses"][-1] for pr in per_rank]
    return res


def loss_diffs(a: dict, b: dict) -> tuple[float, float]:
    """(largest difference of any rank's early losses, of any rank's final loss) of two variants, from
    the fields :func:`losses_over_ranks` adds."""
    early = max(abs(x - y) for xs, ys in zip(a["rank_early_losses"], b["rank_early_losses"]) for x, y in zip(xs, ys))
    final = max(abs(x - y) for x, y in zip(a["rank_final_losses"], b["rank_final_losses"]))
    return early, final


# ---------------------------------------------------------------------------------------- timing
@dataclass
class Variant:
    """One side of a comparison inside a row: ``build()`` returns ``step(micro_batches) -> loss``,
    or ``(step, extra)``, or ``(step, extra, settle)``.

    ``extra()`` (optional, called after the warm-up step) returns measured figures such as
    model-state bytes. ``settle()`` (optional) finishes the work a step leaves running behind it
    (ZeRO-1/2's overlapped parameter all-gathers), so it neither runs during another variant's
    timed step nor escapes this variant's time. ``pending``/``unavailable``: a reason string instead
    of figures."""

    name: str
    build: object
    unavailable: str | None = None


def _unpack(built) -> tuple:
    """(step, extra or None, settle or None) from what a :class:`Variant`'s build returned."""
    parts = built if isinstance(built, tuple) else (built,)
    return tuple(parts) + (None,) * (3 - len(parts))


def run_variants(variants: list[Variant], batches: list[list[tuple]], group=None, live_memory: bool = False,
                 steps_per_round: int = 1) -> dict:
    """Warm-up steps (memory, one variant at a time) then timed rounds (rotated order).

    ``steps_per_round``: each variant runs that many consecutive steps per round, then settles
    (:class:`Variant`); its time is the block's over ``steps_per_round``. A variant whose step leaves
    work running into the next one (an overlapped all-gather) is timed as in a run of such steps, all
    but the block's last overlapped, and a variant that leaves nothing running pays the same.

    Returns per variant: times (s per step, slowest rank per round), losses (per step, this rank),
    peak_rss_mib, extra (dict) -- or {"unavailable": reason}. ``live_memory``: also
    ``peak_live_mib``, the peak bytes of live tensors this variant holds during its last warm-up step
    (what it built, counted by :func:`reachable_tensor_bytes`, plus the step's own allocations counted
    by :class:`~megazero.memory.measure.LiveTensorBytes`, opened a step earlier and marked, so the
    tensors of the step before that die in it are seen leaving)."""
    _primer(group)
    base = rss_mib()
    steps, out = {}, {}
    return_freed_memory(64 * 1024)            # memory phase: freed tensors leave the resident set
    for v in variants:
        if v.unavailable:
            out[v.name] = {"unavailable": v.unavailable}
            continue
        try:                               # a throwaway build + step pays the one-time costs of
            built = v.build()              # this code path (lazy imports, comm buffers)
        except Unavailable as e:          # e.g. ZeRO-3 not in this build yet
            out[v.name] = {"unavailable": str(e)}
            continue
        step, _, settle = _unpack(built)
        step(batches[0])
        if settle:
            settle()
        del built, step, settle
        gc.collect()
        dist.barrier(group)
        before = rss_mib()
        reset_peak_rss()
        live_base = reachable_tensor_bytes() if live_memory else 0
        built = v.build()
        step, extra, settle = _unpack(built)
        settled_step = step if settle is None else (lambda micro: (step(micro), settle())[0])
        # The probe opens a step early: the last step frees what the one before left (gradients), and
        # the profiler sees a free only of what it saw allocated. The peak counts from the mark.
        losses = [settled_step(micro) for micro in batches[:WARMUP_STEPS - 2]]
        probe = LiveTensorBytes() if live_memory else contextlib.nullcontext()
        with probe:
            losses.append(settled_step(batches[WARMUP_STEPS - 2]))
            if live_memory:
                probe.mark(reachable_tensor_bytes() - live_base)
            losses.append(settled_step(batches[WARMUP_STEPS - 1]))
        out[v.name] = {"peak_rss_mib": base + peak_rss_mib() - before, "losses": losses, "times": [],
                       "extra": extra() if extra else {}}
        if live_memory:
            out[v.name]["peak_live_mib"] = probe.peak / 2**20
        steps[v.name] = (step, settle)
    reuse_freed_memory()                     # timed phase: as the trainer runs on CPU
    names = list(steps)
    timed = batches[WARMUP_STEPS:]
    blocks = [timed[i:i + steps_per_round] for i in range(0, len(timed) - steps_per_round + 1, steps_per_round)]
    for i, block in enumerate(blocks):
        k = i % max(1, len(names))
        for name in names[k:] + names[:k]:
            step, settle = steps[name]
            dist.barrier(group)
            t0 = time.perf_counter()
            losses = [step(micro) for micro in block]
            if settle:
                settle()
            t = torch.tensor([(time.perf_counter() - t0) / len(block)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            out[name]["times"].append(t.item())
            out[name]["losses"] += losses
    return out


def _primer(group=None) -> None:
    """Pay the one-time costs (autograd engine, thread pools, gloo buffers) before any variant is
    measured, so the first variant's peak memory is not inflated by them."""
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=128))
    ids = torch.zeros(1, 8, dtype=torch.long)
    model(ids, ids).mean().backward()
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.barrier(group)


class Unavailable(Exception):
    """Raised by a variant's build when the feature is not there (the row says why)."""


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def ratio_of_medians_per_round(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i] (both timed in the same round)."""
    return median([x / y for x, y in zip(a, b) if y > 0])


def ratio_range(a: list[float], b: list[float]) -> str:
    """`` (lo-hi)``: the smallest and largest per-round ratio a[i] / b[i]; empty without a round."""
    rounds = [x / y for x, y in zip(a, b) if y > 0]
    return f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds else ""


# ---------------------------------------------------------------------------------------- theory
def zero_fp32_bytes(psi: int, n: int, stage: int) -> float:
    """Model-state bytes per rank for fp32 AdamW (no separate master copy): params 4Ψ, grads 4Ψ,
    Adam m and v 8Ψ. Stage 0: 16Ψ; 1: 8Ψ + 8Ψ/N; 2: 4Ψ + 12Ψ/N; 3: 16Ψ/N (ZeRO paper, K = 8, fp32)."""
    return {0: 16.0 * psi, 1: 8.0 * psi + 8.0 * psi / n, 2: 4.0 * psi + 12.0 * psi / n,
            3: 16.0 * psi / n}[stage]


def dp_comm_bytes(psi: int, n: int, stage: int, elem: int = 4, micro: int = 1, psi_emb: int = 0) -> float:
    """Bytes sent per rank per step (ring): 2Ψ(N-1)/N for stages 0-2 (gradients reduced once per
    step); stage 3 gathers the parameters in every micro-batch's forward and backward and reduces
    its gradients, 3Ψ(N-1)/N per micro-batch, plus 2Ψ_emb(N-1)/N for a tied word embedding that
    is gathered again for the output layer (pp = 1)."""
    if stage == 3:
        return micro * (3.0 * psi + 2.0 * psi_emb) * elem * (n - 1) / n
    return 2.0 * psi * elem * (n - 1) / n


def tp_layer_comm_bytes(b: int, s: int, h: int, t: int, elem: int = 4) -> float:
    """Bytes per transformer layer per micro-batch (forward + backward): 8bsh(t-1)/t elements."""
    return 8.0 * b * s * h * (t - 1) / t * elem


def deviation(measured: float, theory: float) -> float:
    return (measured - theory) / theory if theory else float("nan")


def flag(measured: float, theory: float) -> str:
    d = deviation(measured, theory)
    return f"{100 * d:+.1f}%" + (" **FLAG >10%**" if abs(d) > THEORY_TOL else "")


def num_params(cfg: GPTConfig) -> int:
    """Ψ: parameters of the whole (tp=1) model (built on the meta device: no memory)."""
    return sum(p.numel() for p in GPT(cfg, device="meta").parameters())


def loss_check(a: float, b: float) -> str:
    if any(math.isnan(x) for x in (a, b)):
        return "n/a"
    return "same" if abs(a - b) <= LOSS_TOL else f"DIVERGED ({abs(a - b):.1e})"


def table(head: str, rows: list[list[str]]) -> list[str]:
    """A markdown table: the ``| a | b |`` head, its rule, a line per row of cells."""
    n = head.count("|") - 1
    return [head, "|" + "---|" * n] + ["| " + " | ".join(r) + " |" for r in rows]


__all__ = ["Spec", "QUICK", "TrainerRun", "step_batches", "random_micro_batches", "trainer_argv", "trainer_engine",
           "deepspeed_config", "deepspeed_param_groups", "deepspeed_error", "torch_adamw", "PlainGPT", "hf_llama_step",
           "spawn",
           "torchrun", "REPO", "cores", "largest_over_ranks", "losses_over_ranks", "loss_diffs", "Variant",
           "run_variants", "Unavailable", "median", "ratio_of_medians_per_round", "ratio_range", "zero_fp32_bytes",
           "dp_comm_bytes", "tp_layer_comm_bytes", "flag", "deviation", "num_params", "loss_check", "table",
           "masked_mean", "GPT", "rss_mib", "peak_rss_mib", "reachable_tensor_bytes", "reset_peak_rss", "WARMUP_STEPS",
           "LOSS_TOL", "THEORY_TOL"]
