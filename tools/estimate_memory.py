"""Estimate the memory per rank of a pretrain_gpt.py run before launching it.

    python tools/estimate_memory.py --world-size 64 --tp 8 --pp 2 --zero-stage 1 --bf16 \\
        --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \\
        --micro-batch-size 1 --global-batch-size 512 --vocab-size 50257 --recompute-activations
    python tools/estimate_memory.py --world-size 8 --tp 2 --pp 2 --zero-stage 3 --json   # machine-readable

Takes the trainer's own flags (the same parser, so a flag means the same thing in both; ``--config``
files too) plus ``--world-size``, ``--device``, ``--json`` and ``--fit-gib X`` (the memory planner: the
cheapest recompute / offload plan that fits X GiB per rank, or the layout change that would). Prints,
per pipeline stage, the model states (parameters, gradients, fp32 masters, Adam moments, as the ZeRO stage shards them), the
activations the schedule holds at its peak and the transient buffers on top, and beside them the ZeRO
paper's model-state figures for the same parameter count. With ``--offload-optimizer`` /
``--offload-params`` the device figures drop what is offloaded, and host and NVMe bytes are printed apart. The accounting is in
``megazero/memory/estimate.py``; ``tests/test_memory.py`` checks it against measured memory. The
vocabulary is ``--vocab-size`` (the trainer takes it from the tokenizer: pass the tokenizer's size).
"""
from __future__ import annotations

import json
import sys

from megazero.cli.arguments import build_parser
from megazero.cli.job import job_from_args
from megazero.cli.plan import plan_memory
from megazero.config.fields import FLAG
from megazero.config.train import planner_conflict
from megazero.memory.estimate import estimate_memory, paper_model_states

MIB = 2 ** 20


def parse(argv=None):
    parser = build_parser("tools/estimate_memory.py", __doc__.split("\n\n")[0])
    tool = parser.add_argument_group("estimate")
    tool.add_argument("--world-size", type=int, default=1, help="processes in the run (default 1)")
    tool.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                      help="where the run trains (dropout keeps 1-byte masks on CUDA, full ones on a CPU)")
    tool.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    tool.add_argument("--fit-gib", type=float, default=None, metavar="X",
                      help="pick the cheapest recompute / offload plan whose peak per rank fits X GiB "
                           "(megazero/memory/planner.py), print it with the plans it rejected, and estimate it")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    job = job_from_args(parser, args, args.world_size)
    if args.fit_gib is not None:
        refusal = fit_refusal(job, args.fit_gib)
        if refusal:
            parser.error(refusal)
    return plan_memory(job, args.world_size, parser.prog), args


def fit_refusal(job, fit_gib: float) -> str | None:
    """Why ``--fit-gib`` cannot plan this job (a budget that is not positive, a second budget, the job's own
    recompute or offload flags), or None."""
    if not fit_gib > 0:
        return f"--fit-gib must be > 0, got {fit_gib}"
    if job.train.memory_budget_gib is not None:
        return f"--fit-gib and {FLAG.memory_budget_gib} both ask the memory planner for a plan: keep one"
    return planner_conflict(job.model, "--fit-gib")


def recompute_words(m) -> str:
    """The recompute and offload choice, in a few words."""
    words = {None: "no recompute", "selective": f"selective recompute ({' '.join(m.recompute_modules or [])})",
             "full": f"full recompute ({m.recompute_method} {m.recompute_num_layers})"}[m.recompute_granularity]
    if m.cpu_offloading:
        words += f", offload {m.cpu_offloading_num_layers or 'all'} layers per chunk"
    return words


def report(job, device: str) -> dict:
    """The estimate as a JSON-able object; ``per_rank`` is the binding (largest) pipeline stage."""
    stages = [e.as_dict() for e in estimate_memory(job, device)]
    worst = max(stages, key=lambda s: s["total_bytes"])
    par, n = job.parallel, job.parallel.dp
    psi = sum(s["parameters"] for s in stages) * par.tp     # elements of the model, tied copies once each stage
    return {"world_size": par.tp * par.pp * par.dp, "tp": par.tp, "pp": par.pp, "dp": n,
            "zero_stage": job.zero.zero_stage, "precision": job.precision.dtype_name, "device": device,
            "per_rank": worst, "stages": stages,
            "zero_paper_model_states_bytes": {str(k): paper_model_states(psi / (par.tp * par.pp), n, k)
                                              for k in range(4)}}


def plan(job, args) -> object:
    """``--fit-gib``: the job with the chosen plan, after printing the plans tried; None when none fits."""
    from megazero.memory.planner import GIB, NoPlanFits, describe, fit, with_plan

    try:
        chosen, rejected = fit(job, args.fit_gib * GIB, args.world_size, args.device)
    except NoPlanFits as e:
        print(f"tools/estimate_memory.py: error: {e}", file=sys.stderr)
        return None
    for p in rejected:
        print(f"rejected: {p.name}: {p.peak / MIB:,.1f} MiB > {args.fit_gib * GIB / MIB:,.1f} MiB")
    print(describe(chosen, args.fit_gib * GIB))
    print(f"chosen flags: {chosen.flags}")
    return with_plan(job, chosen, args.world_size)


def main(argv=None) -> int:
    job, args = parse(argv)
    if args.fit_gib is not None:
        job = plan(job, args)
        if job is None:
            return 2
    out = report(job, args.device)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    par = job.parallel
    print(f"world {out['world_size']} = tp {par.tp} x pp {par.pp} x dp {par.dp} | zero stage {job.zero.zero_stage} | "
          f"{job.precision.dtype_name} | {args.device} | micro-batch {job.train.micro_batch_size} x "
          f"{job.num_micro_batches} micro-batches | {recompute_words(job.model)}")
    offload = any(s["host_bytes"] or s["nvme_bytes"] for s in out["stages"])
    extra = f" {'host':>10} {'nvme':>10}" if offload else ""
    print(f"{'stage':>5} {'params/rank':>14} {'model states':>13} {'activations':>12} {'buffers':>10} {'total':>10}"
          f"{extra}  MiB (total: on the device{'; host, nvme: offloaded' if offload else ''})")
    for s in out["stages"]:
        extra = f" {s['host_bytes'] / MIB:>10.1f} {s['nvme_bytes'] / MIB:>10.1f}" if offload else ""
        print(f"{s['pp_rank']:>5} {s['parameters']:>14,} {s['model_states_bytes'] / MIB:>13.1f} "
              f"{s['activations_bytes'] / MIB:>12.1f} {s['buffers_bytes'] / MIB:>10.1f} {s['total_bytes'] / MIB:>10.1f}"
              f"{extra}")
    w = out["per_rank"]
    print(f"per rank (stage {w['pp_rank']}): {w['total_bytes'] / MIB:,.1f} MiB "
          f"({w['total_bytes'] / 1e9:.2f} GB); buffers: " + ", ".join(
              f"{k} {v / MIB:.1f}" for k, v in w["parts"].items()
              if k not in ("params", "grads", "master_weights", "optimizer_state", "fp8_amax_histories")
              and not k.startswith(("host_", "nvme_"))))
    if job.optimizer.muon:
        print(f"optimizer state per rank (stage {w['pp_rank']}): {w['parts']['optimizer_state'] / MIB:,.1f} MiB under "
              f"{FLAG.optimizer} {job.optimizer.optimizer}, as AdamW's: Muon keeps its momentum in the first moment's "
              f"place and the second at zero (8 bytes per parameter)")
    if offload:
        print("offloaded per rank: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in w["parts"].items()
                                                  if k.startswith(("host_", "nvme_")) and v))
    paper = out["zero_paper_model_states_bytes"]
    print("ZeRO paper model states per rank for this model's parameters over dp "
          f"{par.dp} (2Ψ + 2Ψ + 12Ψ, mixed precision): " + ", ".join(
              f"stage {k} {v / 1e9:.3g} GB" for k, v in paper.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
