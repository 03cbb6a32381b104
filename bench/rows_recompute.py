"""Recompute rows: what each activation-memory flag saves and what it costs in step time, beside what
the memory estimator predicts it saves, and full recompute against ``torch.utils.checkpoint`` as a
plain PyTorch user writes it.

The shape (:data:`RECOMPUTE_SHAPE`: 4 layers x 256 hidden, seq 2048, micro-batch 1, fp32) is one where
the activations and the buffers around them are most of a rank's peak on a CPU (about two thirds at
dp 1, by the estimator), so a saving shows against the model states. Two groups: dp 1 (one process,
ZeRO-0) and dp 2 with ZeRO-1 (two processes).

Every variant of ours goes through the trainer's own path: ``parse_job`` on the trainer's flags,
``build_model_chunks`` on the meta device, ``build_engine``, then ``train_step``; only the flags differ:

    none                               no recompute
    selective-core_attn                --recompute-granularity selective --recompute-modules core_attn
    selective-core_attn-mlp-layernorm  ... --recompute-modules core_attn mlp layernorm
    full-block-2                       --recompute-granularity full --recompute-method block --recompute-num-layers 2
    full-uniform-1                     --recompute-activations (full, uniform, 1 layer per group)
    offload                            --cpu-offloading (every layer's saved tensors copied to the host)

On a CPU the host is the device, so ``offload`` saves nothing here: its row shows the copies' cost and
the bytes they moved per step (``take_offloaded_bytes``), and the estimator's device figure (what a
GPU would keep) with the host bytes beside it. The peer, ``torch-checkpoint``, is the same GPT
(``GPT(job.model, seed=1234)``, the init of ours) with each transformer layer put back in its place
wrapped in a module whose forward is ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``,
torch AdamW under the same hyper-parameters and clipping, and DDP at dp 2; it is set against our
``full-uniform-1``, the same recompute (each layer keeps only its input).

Timing: all variants of a group live in the same processes, one step each per round in a rotated
order (:func:`common.run_variants`): ms = median step (slowest rank), ratio = median of the per-round
ratios to ``none``. Memory: the largest rank's peak of live tensor bytes in the second warm-up step
(``run_variants(live_memory=True)``, as in the scale section), beside the estimator's total and
activation figures (``estimate_memory(job, "cpu")``) for the same flags. Measured saving = peak of
``none`` - peak of the variant; estimated saving = estimated total of ``none`` - estimated total of the
variant. Target: the selective rows' measured saving at least :data:`SAVING_TARGET` of the estimated
one. Recompute must not change training: every variant's losses (the mean over ranks, each step)
equal ``none``'s to :data:`LOSS_TOL`, else the row is void; the peer (another optimizer
implementation) follows the scale section's rule against ``full-uniform-1``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.common import (
    GPT,
    WARMUP_STEPS,
    Spec,
    Variant,
    largest_over_ranks,
    losses_over_ranks,
    median,
    num_params,
    ratio_of_medians_per_round,
    ratio_range,
    run_variants,
    spawn,
    step_batches,
    table,
    torch_adamw,
    trainer_argv,
)
from bench.rows_scale import EARLY_LOSS_TOL, EARLY_STEPS, FINAL_LOSS_TOL, same_training
from bench.steps import as_dicts, torch_step
from megazero.cli.job import parse_job
from megazero.memory.activation_offload import take_offloaded_bytes
from megazero.memory.estimate import estimate_memory
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks, get_model_spec
from megazero.training import train_step

RECOMPUTE_SHAPE = Spec(layers=4, hidden=256, heads=4, seq=2048, vocab=2048, micro_batch=1, micro_batches=1,
                       rounds=8, untied=True)
QUICK_RECOMPUTE = Spec(layers=4, hidden=64, heads=4, seq=128, vocab=512, micro_batch=1, micro_batches=1, rounds=4,
                       untied=True)
BASE, FULL, PEER = "none", "full-uniform-1", "torch-checkpoint"
# Our variants: name -> the trainer's flags that make it.
FLAGS = {
    BASE: [],
    "selective-core_attn": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    "selective-core_attn-mlp-layernorm": ["--recompute-granularity", "selective", "--recompute-modules",
                                          "core_attn", "mlp", "layernorm"],
    "full-block-2": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", 2],
    FULL: ["--recompute-activations"],
    "offload": ["--cpu-offloading"],
}
SAVING_TARGET = 0.9           # selective rows: measured saving >= this x the estimated saving
LOSS_TOL = 1e-6               # recompute replays the same ops: our variants' losses equal none's
MIB = 2**20


@dataclass(frozen=True)
class Group:
    """One set of processes: the shape, dp and the ZeRO stage."""

    spec: Spec
    dp: int = 1
    stage: int = 0

    @property
    def name(self) -> str:
        """``dp1`` / ``dp2`` (``--variants`` picks groups by it)."""
        return f"dp{self.dp}"

    def layout(self) -> str:
        return f"dp {self.dp}, ZeRO-{self.stage}"

    def argv(self, variant: str) -> list[str]:
        """The trainer's flags for ``variant`` of ours (the peer is built from ``none``'s)."""
        s = self.spec
        opt = s.opt_cfg()
        return trainer_argv(s.layers, s.hidden, s.heads, s.seq, s.vocab, s.micro_batch,
                            "--zero-stage", self.stage, "--global-batch-size", s.micro_batch * s.micro_batches * self.dp,
                            "--lr", opt.lr, "--weight-decay", opt.weight_decay, "--clip-grad", opt.clip_grad,
                            "--seed", 1234, *(["--untie-embeddings-and-output-weights"] if s.untied else []),
                            *FLAGS.get(variant, []))


def groups(spec: Spec, only: list[str] | None = None) -> list[Group]:
    """dp 1 (ZeRO-0) and dp 2 (ZeRO-1); ``only``: the groups named (``dp1``, ``dp2``)."""
    out = [Group(spec, dp=1, stage=0), Group(spec, dp=2, stage=1)]
    return [g for g in out if not only or g.name in only]


def estimate(group: Group, variant: str) -> dict:
    """The estimator's figures for ``variant``'s flags (bytes): total, activations, buffers, host."""
    job, _ = parse_job(group.argv(variant), group.dp)
    e = max(estimate_memory(job, "cpu"), key=lambda s: s.total)
    return {"total": e.total, "activations": e.activations, "buffers": e.buffers,
            "host_activations": e.parts.get("host_activations", 0)}


# -------------------------------------------------------------------------------------- variants
def build_ours(group: Group, topo: Topology, variant: str):
    """The trainer's path with ``variant``'s flags; extra: the bytes sent to the host in the last step."""
    job, _ = parse_job(group.argv(variant), group.dp)
    spec = get_model_spec(job.model.model_family)
    chunks = build_model_chunks(spec, job, topo, device="meta" if job.zero.sharded_init else None)
    engine = build_engine(chunks, topo, job.zero, job.optimizer, job.precision)
    moved = {"offloaded_bytes": 0}

    def step(micro) -> float:
        loss = train_step(chunks, as_dicts(micro), topo, engine, job, spec).loss
        moved["offloaded_bytes"] = take_offloaded_bytes(chunks)
        return loss

    return step, (lambda: dict(moved))


class Checkpointed(nn.Module):
    """A layer whose forward keeps only its input, as a PyTorch user wraps a block."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=False)


def build_torch_checkpoint(group: Group):
    """Our GPT (same init) with every layer checkpointed by torch, torch AdamW, DDP at dp > 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    job, _ = parse_job(group.argv(BASE), group.dp)
    model = GPT(job.model, seed=1234)
    for key, layer in list(model.layers.items()):
        model.layers.register_module(key, Checkpointed(layer))
    wrapped = DDP(model) if group.dp > 1 else model
    opt = torch_adamw(model.named_parameters(), job.optimizer)

    def step(micro) -> float:
        """torch's step; the loss averaged over the ranks (``train_step`` reports that mean)."""
        loss = torch.tensor([torch_step(wrapped, opt, micro, job.optimizer.clip_grad)], dtype=torch.float64)
        dist.all_reduce(loss)
        return loss.item() / group.dp

    return step


def recompute_worker(rank: int, world: int, group: Group) -> dict:
    job, _ = parse_job(group.argv(BASE), world)
    topo = Topology(job.parallel.tp, job.parallel.pp, job.parallel.dp, order=job.parallel.order)
    variants = [Variant(name, lambda name=name: build_ours(group, topo, name)) for name in FLAGS]
    variants.append(Variant(PEER, lambda: build_torch_checkpoint(group)))
    batches = step_batches(group.spec, group.spec.rounds, topo.dp_size, topo.dp_rank, micro=group.spec.micro_batches)
    return run_variants(variants, batches, live_memory=True)


def run_group(group: Group) -> dict:
    """Rank 0's results per variant with every rank's losses, the largest peaks and the estimator's figures."""
    per_rank = spawn(group.dp, recompute_worker, group)
    res = losses_over_ranks(largest_over_ranks(per_rank, ("peak_live_mib", "peak_rss_mib")), per_rank, EARLY_STEPS)
    for name, r in res.items():
        if "losses" not in r:
            continue
        r["rank_losses"] = [pr[name]["losses"] for pr in per_rank]
        if name in FLAGS:
            r["estimate"] = estimate(group, name)
    return res


def run_recompute(spec: Spec, only: list[str] | None = None, rounds: int | None = None, log=print) -> list:
    """[(group, run_group(group)), ...] for the section; ``rounds``: instead of the shape's own."""
    spec = replace(spec, rounds=rounds) if rounds else spec
    out = []
    for g in groups(spec, only):
        log(f"recompute {spec.layers}x{spec.hidden} seq {spec.seq} {g.layout()}: {', '.join([*FLAGS, PEER])}")
        out.append((g, run_group(g)))
    return out


# ---------------------------------------------------------------------------------------- report
def _every_step_diff(a: dict, b: dict) -> float:
    """The largest difference of any step's loss of two variants, any rank."""
    return max(abs(x - y) for xs, ys in zip(a["rank_losses"], b["rank_losses"]) for x, y in zip(xs, ys))


def _mib(x: float) -> str:
    """MiB with a decimal where the figure is small (the quick shape's few MiB)."""
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _variant_row(group: Group, name: str, res: dict, met: list) -> list[str]:
    label = [group.layout(), name]
    r, base = res[name], res[BASE]
    if "unavailable" in r or "unavailable" in base:
        return label + ["-"] * 11 + [r.get("unavailable") or base.get("unavailable")]
    ratio = ratio_of_medians_per_round(r["times"], base["times"])
    est, est_base = r["estimate"], base["estimate"]
    diff = _every_step_diff(r, base)
    same = diff <= LOSS_TOL
    measured = base["peak_live_mib"] - r["peak_live_mib"]
    predicted = (est_base["total"] - est["total"]) / MIB
    share = measured / predicted if abs(predicted) > 1e-9 else float("nan")
    target = "-"
    if name.startswith("selective"):
        if not same:
            target = "void (losses differ)"
        else:
            ok = measured >= SAVING_TARGET * predicted
            met.append(ok)
            target = f">= {SAVING_TARGET}x: {'met' if ok else 'MISSED'}"
    activations = _mib(est["activations"] / MIB)
    if est["host_activations"]:
        activations += f" (+{_mib(est['host_activations'] / MIB)} host)"
    moved = r["extra"].get("offloaded_bytes", 0)
    saving = "-" if name == BASE else f"{measured:.1f} / {predicted:.1f}"
    on_host = name == BASE or est["host_activations"]        # a device saving the CPU cannot show
    return label + [f"{1e3 * median(r['times']):.0f}",
                    "1.00x" if name == BASE else f"{ratio:.2f}x{ratio_range(r['times'], base['times'])}",
                    _mib(r["peak_live_mib"]), _mib(est["total"] / MIB), activations, saving,
                    "-" if on_host else f"{share:.2f}", target,
                    _mib(moved / MIB) if moved else "-", f"{r['peak_rss_mib']:.0f}",
                    f"{diff:.1e}" + ("" if same else " **DIFFERS**")]


def _peer_row(group: Group, res: dict) -> list[str]:
    label = [group.layout(), f"{FULL} vs {PEER}"]
    a, b = res[FULL], res[PEER]
    if "unavailable" in a or "unavailable" in b:
        return label + ["-"] * 6 + [a.get("unavailable") or b.get("unavailable")]
    ratio = ratio_of_medians_per_round(a["times"], b["times"])
    early, final, same = same_training(a, b)
    return label + [f"{1e3 * median(a['times']):.0f}", f"{1e3 * median(b['times']):.0f}",
                    f"{ratio:.2f}x{ratio_range(a['times'], b['times'])}" + ("" if same else " (void: losses differ)"),
                    f"{_mib(a['peak_live_mib'])} / {_mib(b['peak_live_mib'])}", f"{early:.1e}", f"{final:.1e}"]


def recompute_section(results: list) -> list[str]:
    """BENCHMARKS.md lines from ``run_recompute(...)``: ``[(group, results), ...]``."""
    spec = results[0][0].spec if results else RECOMPUTE_SHAPE
    out = ["## Recompute: activation memory saved vs step time, beside the estimator, and vs torch.utils.checkpoint",
           "", f"- {spec.describe()}, {num_params(spec.model_cfg()) / 1e6:.1f}M parameters, {spec.micro_batches} "
               f"micro-batch per rank and step, {WARMUP_STEPS} untimed steps per variant, then "
               f"{spec.rounds - WARMUP_STEPS} timed rounds of 1 step."]
    met: list[bool] = []
    rows = [_variant_row(g, name, res, met) for g, res in results for name in FLAGS if name in res]
    peers = [_peer_row(g, res) for g, res in results if FULL in res and PEER in res]
    out += ["", f"Target: the selective rows' measured saving >= {SAVING_TARGET}x the estimator's. "
                f"**Met on {sum(met)} of {len(met)} counted rows.**", "",
            "Every variant is the trainer's own path (`parse_job` on the flags of `bench/rows_recompute.py`, "
            "`build_model_chunks`, `build_engine`, `train_step`); all variants of a group run in the same processes, "
            "one step each per round in a rotated order: ms = median step (slowest rank), vs none = median of the "
            "per-round ratios (in brackets their smallest and largest). Peak live MiB: the largest rank's peak of "
            "live tensor bytes in its second warm-up step, as in the scale section; estimated: "
            "`estimate_memory(job, \"cpu\")` for the same flags (total; activations held at the peak). Saving: peak "
            "of `none` less the variant's, measured / estimated (estimated: the estimated totals' difference), and "
            "their ratio. `offload` (`--cpu-offloading`) saves nothing on a CPU, where the host is the device: its "
            "copies stay in the measured peak, the estimator counts them as host bytes (in brackets), and the row "
            "shows the copies' cost and the bytes sent to the host per step. `core_attn` alone saves little here: on a CPU, "
            "without attention dropout, attention keeps no s x s probabilities, only the softmax statistics (the "
            "estimator counts the same), so its row checks the estimator on a small figure. Recompute replays the same "
            f"operations: every variant's losses equal `none`'s to {LOSS_TOL:g} at every step, else the row is "
            "void.", ""]
    out += table("| layout | variant | ms/step | vs none | peak live MiB | estimated total MiB "
                 "| estimated activations MiB | saving MiB measured / estimated | measured / estimated "
                 "| target | offloaded MiB/step | peak RSS MiB | largest loss diff vs none |", rows)
    out += ["", "### Full recompute: ours vs `torch.utils.checkpoint`", "",
            f"`{PEER}`: the same GPT (same init) with each transformer layer wrapped in a module whose forward "
            "is `torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)`, torch AdamW with the same "
            "settings, DDP at dp 2; against our `--recompute-activations`, the same recompute (each layer keeps "
            "its input and runs its forward again in the backward). The ratio is ours / the peer's step time: "
            "below 1 our step (recompute, engine and optimizer together) is the faster; both do the same "
            "arithmetic, so it shows the overhead around it, not the price of recomputing, which the first "
            f"table's `vs none` gives. Same training: the scale section's rule ({EARLY_LOSS_TOL:g} over the first "
            f"{EARLY_STEPS} steps, {FINAL_LOSS_TOL:g} at the end).", ""]
    out += table("| layout | pair | ours ms | peer ms | ours/peer (per-round range) | peak live MiB ours / peer "
                 "| loss diff, first 3 steps | final loss diff |", peers)
    return out + [""]


__all__ = ["RECOMPUTE_SHAPE", "QUICK_RECOMPUTE", "FLAGS", "PEER", "Group", "groups", "estimate", "run_group",
           "run_recompute", "recompute_section", "SAVING_TARGET"]
