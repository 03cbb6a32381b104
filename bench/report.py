"""Turn the results of ``bench/run.py`` into BENCHMARKS.md tables and PNG plots."""
from __future__ import annotations

import math
import os

from bench.common import (
    LOSS_TOL,
    WARMUP_STEPS,
    Spec,
    deviation,
    dp_comm_bytes,
    flag,
    median,
    num_params,
    ratio_of_medians_per_round,
    ratio_range,
    table,
    tp_layer_comm_bytes,
    zero_fp32_bytes,
)
from bench.rows_dp import PAIRS as DP_PAIRS

MIB = 2**20
MEM_SLACK_MIB = 1.0     # RSS is counted in pages and moves by ~1 MiB between identical runs


def _ms(times) -> str:
    return f"{1e3 * median(times):.1f}"


def _f(x, fmt="{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _loss_diff(a: dict, b: dict) -> float:
    ra = a.get("rank_final_losses") or [a["losses"][-1]]
    rb = b.get("rank_final_losses") or [b["losses"][-1]]
    return max(abs(x - y) for x, y in zip(ra, rb))


def pair_row(ours: dict, peer: dict, tokens: int, targets: list, label: str, target_ratio: float = 1.0) -> list[str]:
    """Cells: ours ms, peer ms, ratio, ours tok/s, peer tok/s, ours RSS, peer RSS, losses, check."""
    if "unavailable" in ours or "unavailable" in peer:
        why = ours.get("unavailable") or peer.get("unavailable")
        return ["-"] * 8 + [why]
    ratio = ratio_of_medians_per_round(ours["times"], peer["times"])
    diff = _loss_diff(ours, peer)
    same = diff <= LOSS_TOL
    check = f"same (|d| {diff:.1e})" if same else f"**DIVERGED** (|d| {diff:.1e}): speed not counted"
    mem_ok = ours["peak_rss_mib"] <= peer["peak_rss_mib"] + MEM_SLACK_MIB
    if same:
        targets.append((label, ratio, target_ratio, mem_ok))
    return [_ms(ours["times"]), _ms(peer["times"]), f"{ratio:.2f}x" + ("" if same else " (void)"),
            f"{tokens / median(ours['times']):,.0f}", f"{tokens / median(peer['times']):,.0f}",
            f"{ours['peak_rss_mib']:.0f}", f"{peer['peak_rss_mib']:.0f}",
            f"{ours['losses'][-1]:.5f} / {peer['losses'][-1]:.5f}", check]


PAIR_HEAD = ("| ours ms | peer ms | ours/peer | ours tok/s | peer tok/s | ours peak RSS/rank MiB "
             "| peer peak RSS/rank MiB | final loss ours / peer | same loss (1e-4) |")


def dp_section(spec: Spec, results: dict, psi: int, targets: list) -> list[str]:
    out = ["## Data parallel (ZeRO) vs DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed", ""]
    rows, theory = [], []
    psi_emb = spec.model_cfg().padded_vocab_size(1) * spec.hidden
    for dp, res in results.items():
        tokens = dp * spec.micro_batches * spec.micro_batch * spec.seq
        for ours, peer in DP_PAIRS:
            if ours not in res or peer not in res:
                continue
            target = 0.8 if peer in ("torch-fsdp2", "ds-zero3") else 1.0
            rows.append([str(dp), f"{ours} vs {peer}"] + pair_row(res[ours], res[peer], tokens, targets,
                                                                    f"dp={dp} {ours} vs {peer}", target))
        for ours in ("ours-zero0", "ours-zero1", "ours-zero1-allreduce", "ours-zero2", "ours-zero2-each-mb",
                     "ours-zero3"):
            if ours not in res:
                continue
            r = res[ours]
            stage = int(ours[len("ours-zero")])
            t_state = zero_fp32_bytes(psi, dp, stage)
            t_comm = dp_comm_bytes(psi, dp, stage, micro=spec.micro_batches, psi_emb=psi_emb)
            if "unavailable" in r:
                theory.append([str(dp), ours, "-", f"{t_state / MIB:.2f}", "-", "-", f"{t_comm / MIB:.2f}",
                               r["unavailable"]])
                continue
            state = r["extra"]["state"]["total"]
            comm = sum(v for k, v in r["extra"]["comm"].items() if k == "dp")
            note = " (all-reduced grads: 3Ψ by design)" if ours.endswith("allreduce") else ""
            if ours.endswith("allreduce"):
                t_comm = 3.0 * psi * 4 * (dp - 1) / dp
            if ours.endswith("each-mb"):
                t_comm = (spec.micro_batches + 1) * psi * 4 * (dp - 1) / dp
                note = f" (gradients reduced in each of the m = {spec.micro_batches} micro-batches: (m+1)Ψ)"
            theory.append([str(dp), ours, f"{state / MIB:.2f}", f"{t_state / MIB:.2f}", flag(state, t_state),
                           f"{comm / MIB:.2f}", f"{t_comm / MIB:.2f}", flag(comm, t_comm) + note])
    out += table("| dp | pair " + PAIR_HEAD, rows)
    out += ["", f"Global tokens per step: dp x {spec.micro_batches} micro-batches x {spec.micro_batch} x "
                f"{spec.seq}. Timing: all variants of a dp size in the same processes, one step each per "
                f"round in a rotated order; median over rounds; ratio = median of per-round ratios.", "",
            "### Theory beside measurement (megazero, per rank)", "",
            f"Ψ = {psi:,} parameters, fp32 AdamW: model states 16Ψ (stage 0), 8Ψ + 8Ψ/N (1), 4Ψ + 12Ψ/N (2), "
            f"16Ψ/N (3) bytes; data-parallel bytes sent per step 2Ψ(N-1)/N x 4 (stages 0-2: gradients reduced "
            f"once per step), m (3Ψ + 2Ψ_emb)(N-1)/N x 4 for stage 3 (the paper's 3Ψ per forward + backward, "
            f"paid by each of the m = {spec.micro_batches} micro-batches since parameters are re-gathered; the "
            f"tied word embedding, Ψ_emb = {psi_emb:,}, is gathered again for the output layer). Measured: `engine.model_state_bytes()` after a step (bucket padding included) and the "
            f"engine's CommLog for one step (ring convention).", ""]
    out += table("| dp | variant | model states MiB | formula MiB | deviation | comm MiB/step | formula MiB "
                 "| deviation |", theory)
    return out + [""]


def tp_section(spec: Spec, results: dict, targets: list) -> list[str]:
    out = ["## Tensor parallel vs torch.distributed.tensor.parallel", ""]
    rows, theory = [], []
    tokens = spec.micro_batches * spec.micro_batch * spec.seq
    for tp, res in results.items():
        for sp in (False, True):
            tag = "-sp" if sp else ""
            rows.append([str(tp), "yes" if sp else "no"] + pair_row(res[f"ours-tp{tag}"], res[f"torch-tp{tag}"],
                                                                    tokens, targets, f"tp={tp} sp={sp}"))
            meas = res["_theory"][f"sp={sp}"]
            th = tp_layer_comm_bytes(spec.micro_batch, spec.seq, spec.hidden, tp)
            theory.append([str(tp), "yes" if sp else "no", f"{meas / 1024:.1f}", f"{th / 1024:.1f}", flag(meas, th)])
    out += table("| tp | sequence parallel " + PAIR_HEAD, rows)
    out += ["", "torch side: the plain twin (`PlainGPT`, same weights) under `parallelize_module` with "
                "ColwiseParallel/RowwiseParallel (+ SequenceParallel on the norms), vocab-parallel tied output "
                "with `loss_parallel`. No clipping on either side.", "",
            "### Theory beside measurement: bytes per layer and micro-batch (forward + backward)", "",
            "8bsh(t-1)/t elements x 4 bytes; measured: megazero's collectives counted during one forward + "
            "backward, (L-layer model - L/2-layer model) / (L/2).", ""]
    out += table("| tp | sequence parallel | measured KiB/layer | 8bsh(t-1)/t KiB | deviation |", theory)
    return out + [""]


def pp_section(spec: Spec, results: dict, targets: list) -> list[str]:
    out = ["## Pipeline parallel vs torch.distributed.pipelining", ""]
    rows, theory = [], []
    m = spec.pp_micro_batches
    tokens = m * spec.micro_batch * spec.seq
    for pp, res in results.items():
        for name in ("1f1b", "gpipe", "interleaved"):
            rows.append([str(pp), name, str(m)] + pair_row(res[f"ours-{name}"], res[f"torch-{name}"], tokens,
                                                            targets, f"pp={pp} {name}"))
            t = res["_theory"][name]
            theory.append([str(pp), name, str(m), f"{t['analytic']:.3f}", f"{t['order']:.3f}",
                           flag(t["order"], t["analytic"]), f"{t['measured']:.3f}",
                           flag(t["measured"], t["analytic"])])
        if pp > (os.cpu_count() or 1):
            rows.append([str(pp), "note", str(m)] + ["-"] * 8 + [f"{pp} processes on {os.cpu_count()} cores: "
                                                                  "oversubscribed, timings distorted"])
    out += table("| pp | schedule | m " + PAIR_HEAD, rows)
    out += ["", "Both sides run the same stage modules (`build_model_chunks`; v = 2 chunks per rank for "
                "interleaved), sum the tied-embedding grads of the first and last stage, and step torch AdamW.",
            "", "### Theory beside measurement: pipeline bubble", "",
            "analytic = (p-1)/m, interleaved (p-1)/(v m). order = the F/B order our schedule executed, replayed "
            "with F=1, B=2 and free communication. measured = step / busy - 1 (busy: the slowest rank's "
            "forward + backward time inside the step); it also holds p2p time and stage imbalance, and on "
            "a tiny CPU model the p2p round trips dominate.", ""]
    out += table("| pp | schedule | m | analytic | order | deviation | measured | deviation |", theory)
    return out + [""]


def scaling_section(spec: Spec, memory: dict, step_time: dict, psi: int, plots: dict) -> list[str]:
    out = ["## Scaling", "", "### Model-state memory per rank as dp grows (MiB; measured / fp32 formula)", ""]
    rows = []
    for dp, stages in sorted(memory.items()):
        cells = [str(dp)]
        for stage, v in sorted(stages.items()):
            th = zero_fp32_bytes(psi, dp, stage)
            cells.append("pending" if isinstance(v, str) else f"{v / MIB:.2f} / {th / MIB:.2f} ({flag(v, th)})")
        rows.append(cells)
    out += table("| dp | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |", rows)
    if plots.get("memory"):
        out += ["", f"![model-state memory vs dp]({plots['memory']})"]
    out += ["", "### Step time as the model grows (one process; megazero vs the plain PyTorch twin)", ""]
    rows = []
    for (layers, hidden), res in step_time.items():
        o, p = res["ours"], res["plain-torch"]
        diff = abs(o["losses"][-1] - p["losses"][-1])
        rows.append([str(layers), str(hidden), _ms(o["times"]), _ms(p["times"]),
                     f"{ratio_of_medians_per_round(o['times'], p['times']):.2f}x",
                     "same" if diff <= LOSS_TOL else f"**DIVERGED** ({diff:.1e})"])
    out += table("| layers | hidden | megazero ms | plain torch ms | ratio | same loss |", rows)
    if plots.get("step_time"):
        out += ["", f"![step time vs model size]({plots['step_time']})"]
    if plots.get("missing"):
        out += ["", f"Plots: {plots['missing']}"]
    return out + [""]


def llama_section(results: list) -> list[str]:
    """GPT-2 style vs Llama style at equal parameter count (bench/rows_llama.py), one table per
    (spec, result) of ``results``: the bench's small shape and one where the bytes are real."""
    out = ["## GPT-2 style vs Llama style at equal parameter count (one process)", "",
           "megazero's engine at dp = 1 on both sides (ZeRO-0, the same AdamW). Llama style: RoPE, RMSNorm, "
           "SwiGLU (width chosen to match the parameter count), 2 key/value groups, no biases, untied output "
           "layer. ratio = Llama / GPT-2 step time (median of per-round ratios).", ""]
    for spec, res in results:
        gpt2, llama = res["gpt2-style"], res["llama-style"]
        tokens = spec.micro_batches * spec.micro_batch * spec.seq
        out += [f"{spec.layers} layers x {spec.hidden} hidden, {spec.heads} heads, seq {spec.seq}, vocab "
                f"{spec.vocab}, {spec.micro_batches} micro-batches of {spec.micro_batch}, {spec.rounds} rounds:", ""]
        rows = []
        for name, r in (("GPT-2 style", gpt2), ("Llama style", llama)):
            x = r["extra"]
            rows.append([name, f"{x['params']:,}", str(x["ffn"]), f"{x['flops_per_token'] / 1e6:.2f}",
                         _ms(r["times"]), f"{tokens / median(r['times']):,.0f}", f"{r['peak_rss_mib']:.0f}",
                         f"{r['losses'][-1]:.4f}"])
        out += table("| model | parameters | ffn | MFLOP/token (train) | ms/step | tokens/s | peak RSS MiB | "
                     "final loss |", rows)
        ratio = ratio_of_medians_per_round(llama["times"], gpt2["times"])
        out += ["", f"Llama / GPT-2 step time: **{ratio:.2f}x**", ""]
    return out


def offload_section(spec, res: dict) -> list[str]:
    """Step time with and without each offload (bench/rows_offload.py)."""
    params = res["zero1"]["params"]
    out = ["## Offload: step time with and without ZeRO-Offload / ZeRO-Infinity on CPU", "",
           f"{spec.describe()}; {params / 1e6:.1f}M parameters. On a CPU the 'device' is host memory too, so "
           "this shows the cost of the offload machinery (sub-grouped host update, swap-file I/O through the "
           "page cache, staging copies), not a GPU's PCIe transfers. vs resident = the step time over the "
           "same ZeRO stage without offload. The shares are of the timed steps' wall time, rank 0: host "
           "AdamW update, copying new parameter values back, waiting for swap-file reads/writes.", ""]
    rows = []
    for name, r in res.items():
        if "unavailable" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", r["unavailable"]])
            continue
        base = res.get("ds-zero1" if name.startswith("ds") else name.split("-")[0], {})       # same stage, resident
        t, total = median(r["times"]), sum(r["times"])
        versus = f"{t / median(base['times']):.2f}x" if "times" in base else "-"
        st = r.get("stats")
        share = (lambda k: f"{100 * st[k] / total:.0f}%") if st else (lambda k: "-")
        io = f"{(st['bytes_read'] + st['bytes_written']) / len(r['times']) / 2**20:.0f}" if st else "-"
        rows.append([name, f"{1000 * t:.0f}", versus, share("update_s"),
                     share("to_device_s"), share("io_wait_s"), io, f"{r['loss']:.4f}"])
    out += table("| variant | ms/step | vs resident | host update | copy back | swap wait | swap MiB/step | loss |",
                 rows)
    return out + ["", "Every megazero variant reaches the same loss: fp32 offload is bitwise the resident run "
                      "(tests/test_offload.py). DeepSpeed's rows are its ZeRO-1 with torch's AdamW and with "
                      "`offload_optimizer: cpu` (DeepSpeedCPUAdam); their loss is rank 0's own micro-batches, ours "
                      "the global mean. Variants run one after another, not alternated: read differences under "
                      "~30% as noise. On a GPU, the largest model trainable with and without offload is the "
                      "figure to add when a GPU machine is at hand.", ""]


def _compile_cost(name: str, r: dict, eager_first: float) -> tuple[str, str, str]:
    """A variant's (compile seconds, inductor cache, graphs / breaks / recompiles) cells; '-' if eager."""
    if not name.endswith("-compiled"):
        return "-", "-", "-"
    f = r["first"]
    hits, misses = f["cache_hits"], f["cache_misses"]
    cache = ("cold" if misses and not hits else "warm" if hits and not misses else "mixed" if hits else
             "none: dynamo's graph from ours, same process")      # the same layer code, already compiled
    seconds = f"{f['seconds'] - eager_first:.1f}" if f["graphs"] else "-"      # nothing compiled: no cost to show
    return (f"{seconds} ({f['compile_seconds']:.1f})",
            f"{cache} ({hits:.0f} hits, {misses:.0f} misses)" if hits or misses else cache,
            f"{f['graphs']:.0f}, {f['breaks']:.0f}, {r['recompiles']:.0f}")


def _compile_row(group, compiled: str, other: str, res: dict, psi: int, met: list) -> list[str]:
    """One pair of the compile section: compiled vs the eager step or the compiled peer."""
    # Here, not at the top: the ranks every section spawns import this module (through bench.run, their
    # main), and only the compile section needs its machinery.
    from bench.rows_compile import TARGETS
    from bench.rows_scale import same_training

    s = group.spec
    label = [f"{s.layers}x{s.hidden}", group.layout(), f"{compiled} vs {other}"]
    a, b = res[compiled], res[other]
    if "unavailable" in a or "unavailable" in b:
        return label + ["-"] * 10 + [a.get("unavailable") or b.get("unavailable")]
    ratio = ratio_of_medians_per_round(a["times"], b["times"])
    early, final, same = same_training(a, b)
    target = "-"
    if (compiled, other) in TARGETS:
        op, bound, min_params = TARGETS[(compiled, other)]
        if psi < min_params:
            target = f"{op} {bound}x: n/a (below {min_params / 1e6:.0f}M)"
        elif not same:
            target = f"{op} {bound}x: void (losses differ)"
        else:
            ok = ratio < bound if op == "<" else ratio <= bound
            met.append(ok)
            target = f"{op} {bound}x: {'met' if ok else 'MISSED'}"
    eager_first = res[group.eager]["first"]["seconds"]
    ca, cb = _compile_cost(compiled, a, eager_first), _compile_cost(other, b, eager_first)
    both = [x if y == "-" else f"{x} / {y}" for x, y in zip(ca, cb)]      # "ours / peer" when both compile
    spread = ratio_range(a["times"], b["times"])
    return label + [f"{1e3 * median(a['times']):.0f}", f"{1e3 * median(b['times']):.0f}", f"{ratio:.3f}x{spread}",
                    target,
                    f"{a['peak_live_mib']:.0f} / {b['peak_live_mib']:.0f}",
                    f"{a['peak_rss_mib']:.0f} / {b['peak_rss_mib']:.0f}", *both, f"{early:.1e}", f"{final:.1e}"]


def compile_section(results: list) -> list[str]:
    """BENCHMARKS.md lines from ``rows_compile.run_compile(...)``: ``[(group, results), ...]``."""
    from bench.rows_compile import EARLY_LOSS_TOL, EARLY_STEPS, FINAL_LOSS_TOL, PEER, TARGETS  # as in _compile_row

    out = ["## Compile: regional torch.compile vs eager, and vs FSDP2 + torch.compile", ""]
    shapes = {(g.spec.layers, g.spec.hidden): g.spec for g, _ in results}
    psis = {k: num_params(s.model_cfg()) for k, s in shapes.items()}
    for (layers, hidden), s in shapes.items():
        out.append(f"- {layers}x{hidden}: {s.describe()}, {psis[layers, hidden] / 1e6:.1f}M parameters, "
                   f"{s.micro_batches} micro-batch(es) per rank and step (the pp row: its own count), "
                   f"{WARMUP_STEPS} untimed steps per variant, then {s.rounds - WARMUP_STEPS} timed rounds of 1 step.")
    tp_pp = [g.spec for g, _ in results if g.tp > 1 or g.pp > 1]
    if tp_pp:
        out.append(f"- The tp and pp rows run at one shape only ({tp_pp[0].layers}x{tp_pp[0].hidden}), "
                   "without data parallelism (ZeRO-0).")
    met: list[bool] = []
    rows = []
    for g, res in results:
        psi = psis[g.spec.layers, g.spec.hidden]
        rows += [_compile_row(g, c, o, res, psi, met) for c, o in g.pairs() if c in res and o in res]
    wanted = "; ".join(f"{c} / {o} step time {op} {bound}x" + (f" at {m / 1e6:.0f}M+ parameters" if m else "")
                       for (c, o), (op, bound, m) in TARGETS.items())
    out += ["", f"Targets: {wanted}. Only pairs that trained alike count. "
                f"**Met on {sum(met)} of {len(met)} counted rows.**", "",
            "Both sides of a row run in the same processes, one step each per round in a rotated order; "
            "ms = median step (slowest rank), ratio = median of per-round ratios (in brackets their smallest "
            "and largest: the round-to-round noise a difference must exceed). Ours is the trainer's own "
            "path: `parse_job` with or without `--compile`, `build_model_chunks`, `compile_model` (every "
            "transformer layer's forward replaced by its `torch.compile`), `build_engine`, `train_step`. "
            f"`{PEER}`: our GPT with each layer `torch.compile(layer, fullgraph=True)` then `fully_shard` per "
            "layer and on the root (torchtitan's order), torch AdamW with the same settings. Same training: "
            f"losses (the mean over ranks, both sides) agree to {EARLY_LOSS_TOL:g} over the first {EARLY_STEPS} "
            f"steps and to {FINAL_LOSS_TOL:g} at the end (compiled fp32 differs from eager in rounding, which "
            "AdamW amplifies; the scale section's rule), else the speed target is void. Peak live MiB: the "
            "largest rank's peak of live tensor bytes in its second warm-up step, as in the scale section.", "",
            "Compile s: the variant's first step (where dynamo traces and inductor compiles each region's "
            "forward and backward; slowest rank) less the eager variant's first step in the same processes, "
            "and in brackets dynamo's own compile seconds (`CompileStats`). The section's run starts from an "
            "empty inductor cache (a fresh `TORCHINDUCTOR_CACHE_DIR`, shared by its processes): the first "
            "compiled variant of each layer shape compiles cold (FX-graph cache misses only), later groups "
            "load what it stored (hits only: what a restarted run pays); ZeRO-3's group runs first at each "
            f"shape, so its row compiles cold. `{PEER}` runs after ours in the same processes, and its layers "
            "are the same `TransformerLayer` code: dynamo finds the graph compiled for ours in its cache (the "
            "guards pass) and compiles nothing of its own, so both sides run the very same kernels and the "
            "row compares what surrounds them (its own compile time, not measured here, would be about ours' cold "
            "one). Graphs: "
            "graphs compiled in the first step, graph breaks, graphs compiled in any later step (recompiles). "
            "Two figures in a cell: ours / the peer's.",
            ""]
    out += table("| shape | layout | pair | compiled ms | other ms | compiled/other (per-round range) | speed target "
                 "| peak live MiB compiled / other | peak RSS MiB compiled / other | compile s (dynamo s) "
                 "| inductor cache | graphs, breaks, recompiles | loss diff, first 3 steps | final loss diff |", rows)
    return out + [""]


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")   # generated plots and reports
GPU_REPORT = os.path.join(RESULTS, "BENCHMARKS_GPU.md")   # the GPU section's own file, from a machine with CUDA


def _link(path: str, outdir: str) -> str:
    """``path`` as a Markdown link target relative to the report's directory."""
    return os.path.relpath(path, outdir).replace(os.sep, "/")


GPU_LOSS_TOL = 2e-2       # two bf16 runs from the same weights: their last losses agree within this
GPU_HEADING = "## GPU: GPT-2 124M / 350M and Llama 1.5B, bf16, single GPU, vs nanoGPT-style and HF twins"


def _gpu_mib(x) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def gpu_section(gpu: dict, outdir: str) -> list[str]:
    """The GPU section from ``bench.gpu.run_gpu``: a line per side of each row (eager, compiled, offload),
    then the row's ratio; or the reason it was skipped and where a GPU machine's figures are."""
    out = [GPU_HEADING, ""]
    if "skipped" in gpu:
        elsewhere = (f" Figures from a GPU machine: [{os.path.basename(GPU_REPORT)}]({_link(GPU_REPORT, outdir)}), "
                     f"generated there by `python -m bench.run --sections gpu --out bench/results/BENCHMARKS_GPU.md`."
                     if os.path.exists(GPU_REPORT) else "")
        return out + [gpu["skipped"] + " (the section is coded in bench/gpu.py and runs when CUDA is present)."
                      + elsewhere, ""]
    out += [f"Commit measured: {gpu['commit']}; torch {gpu['torch']}; device: {gpu['device']}.", "",
            "Ours is the trainer's path (`parse_job` of `--bf16` flags, `build_model_chunks`, `build_engine`, "
            "`train_step`) and keeps fp32 master weights and Adam state (Megatron's mixed precision); `--compile` "
            "adds the trainer's regional compile (each layer its own graph). GPT-2's twin is nanoGPT-style PyTorch "
            "with our initial weights, bf16 weights and AdamW state (less memory, less exact), and `torch.compile` "
            "of the whole model when compiled. Llama's twin is HF `LlamaForCausalLM` (fp32 weights, bf16 autocast, "
            "its own initial weights), each decoder layer compiled when compiled. The offload row is ours at "
            "ZeRO-1 with `--offload-optimizer cpu` against ours on-device. Step time is the whole step: forward, "
            "backward, clipping and the optimizer; each row's two sides alternate, and the ratio is the first "
            "side's over the second's.", ""]
    rows = []
    for name, m in gpu["models"].items():
        for row, r in m["rows"].items():
            if "unavailable" in r:
                rows.append([name, row, "-", "", "", "", "", "", r["unavailable"]])
                continue
            labels = list(r["sides"])
            for side in labels:
                x = r["sides"][side]
                rows.append([name, row, side, f"{x['step_ms']:.1f}", f"{x['tokens_s']:,.0f}", _f(x["mfu"], "{:.1%}"),
                             _gpu_mib(x["peak_mib"]), f"{x['loss_first']:.4f}", f"{x['loss_last']:.4f}"])
            first, second = (r["sides"][side]["loss_last"] for side in labels)
            diff = abs(first - second)
            verdict = f"same within bf16 tolerance {GPU_LOSS_TOL:g}" if diff <= GPU_LOSS_TOL else "**DIVERGED**"
            same = f"\\|d\\| {diff:.1e} ({verdict})" if r["same_start"] else "own initial weights"
            rows.append([name, row, f"ratio {labels[0]} / {labels[1]}", f"{r['ratio']:.2f}x", "", "", "", "", same])
    return (out + [f"- {name}: {m['describe']}" for name, m in gpu["models"].items()] + [""]
            + table("| model | row | side | step ms | tokens/s | MFU | peak alloc MiB | first loss | last loss |", rows)
            + [""])


CAPACITY_HEAD = ("| variant | largest L within budget | parameters at L | measured peak MiB at L (phase) "
                 "| estimator's peak MiB at L | estimator's largest L | L+1 measured peak MiB | L measured |")


def _capacity_row(row) -> list[str]:
    """Cells of one variant's line in the capacity table."""
    if row.unavailable:
        return [row.name, "-", "-", "-", "-", "-", "-", row.unavailable]
    at, above = row.run_at(row.layers), row.run_at(row.layers + 1)
    binding = max(at.phases, key=at.phases.get) if at else ""
    est_peak = "-" if row.estimated_peak is None else (
        f"{row.estimated_peak / MIB:.1f} ({100 * deviation(row.estimated_peak, at.peak):+.0f}% vs measured)")
    est_layers = "-" if row.estimated_layers is None else str(row.estimated_layers)
    above_cell = f"{above.peak / MIB:.1f}" if above else "- (L = max searched)"
    return [row.name, f"**{row.layers}**", f"{row.params / 1e6:.2f} M",
            f"{at.peak / MIB:.1f} ({binding})" if at else "- (L = 1 is over)", est_peak, est_layers, above_cell,
            ", ".join(str(L) for L in sorted(row.runs))]


def _capacity_phases(rows) -> list[list[str]]:
    """Per variant at its answer L: each phase's peak, the re-anchoring correction, the run's time."""
    out = []
    for row in rows:
        at = None if row.unavailable else row.run_at(row.layers)
        if at is None:
            continue
        out.append([row.name, str(row.layers)] + [f"{at.phases[p] / MIB:.1f}" for p in ("construct", "steps", "save",
                                                                                         "load")]
                   + [f"{max(r.drift for r in row.runs.values()) / MIB:.1f}", f"{at.loss:.4f}", f"{at.seconds:.0f}"])
    return out


def capacity_section(spec, rows: list, plot: dict) -> list[str]:
    """The capacity table (see bench/rows_capacity.py) and its plot."""
    out = ["## Capacity: the largest GPT within a fixed memory budget per rank", "",
           f"Budget: **{spec.budget_mib:g} MiB of live tensor bytes per rank**. Model: {spec.describe()} (gloo, one "
           f"torch thread per rank). A run fits when its peak over every rank and phase -- construction, "
           f"{spec.steps} training step{'s' if spec.steps != 1 else ''}, a checkpoint save and a load into the live model and optimizer -- is at "
           f"most the budget. L is the largest layer count measured to fit with L + 1 measured not to; every "
           f"figure below is measured except the estimator's.", ""]
    out += table(CAPACITY_HEAD, [_capacity_row(r) for r in rows])
    done = {r.name: r.layers for r in rows if not r.unavailable}
    if done.get("ours-zero0") and done.get("ours-zero3"):
        out += ["", f"ZeRO-3 fits {done['ours-zero3'] / done['ours-zero0']:.1f}x the layers of ZeRO-0 in the "
                    f"same budget."]
    out += ["", "### Per phase at the answer L (peak live MiB per rank, largest over ranks)", ""]
    out += table("| variant | L | construct | steps | save | load | profiler drift corrected MiB | final loss "
                 "| run s |", _capacity_phases(rows))
    out += ["", "How to read it:", "",
            "- Memory is **live tensor bytes** (`megazero.memory.LiveTensorBytes`: every CPU tensor alive, from the "
            "torch profiler's allocation events), not resident memory: the allocator's cache, the interpreter and "
            "the libraries are not in it. All three frameworks allocate torch tensors, so the same probe measures "
            "them alike.",
            "- The profiler follows the thread that runs the phase; a tensor whose last reference dies in a gloo "
            "worker thread (an async collective's buffer) would stay counted. Between phases the chain is "
            "re-anchored on the bytes of the tensors Python still reaches (after a barrier, nothing in flight); "
            "'drift' is the largest such correction of the variant's runs. Within a phase such a buffer still "
            "counts: the peaks are upper bounds.",
            "- Construction as a user at the edge of memory does it: ours on the meta device, parameters "
            "materialised by the engine where they live; FSDP2 on the meta device, `fully_shard` per layer and "
            "root, `to_empty`, then each parameter's initial value written into its shard; DeepSpeed under "
            "`deepspeed.zero.Init` with its reduce bucket set to our bucket size and one layer prefetched (its "
            "defaults allocate a 2 GB reduce bucket and prefetch 5e7 elements). Save/load: ours "
            "`save_checkpoint`/`load_checkpoint`, FSDP2 `torch.distributed.checkpoint` of `get_state_dict`, "
            "DeepSpeed `engine.save_checkpoint`/`load_checkpoint`; the load goes into the live model and "
            "optimizer.",
            "- Estimator: `tools/estimate_memory.py` (`estimate_memory(job, 'cpu')`, the binding rank) at the "
            "measured L, its deviation from the measured peak, and the largest L it would allow. It models "
            "construction and a training step, not the save and load.", ""]
    if plot.get("capacity"):
        out += [f"![peak live MiB per rank vs layers]({plot['capacity']})", ""]
    elif plot.get("missing"):
        out += [f"Plot: {plot['missing']}", ""]
    return out


def capacity_plot(spec, rows: list, outdir: str, filename: str = "bench_capacity.png") -> dict:
    """Measured peak per rank against L for every variant, the budget line and the estimator's line
    for ours; saved in bench/results/ and linked relative to ``outdir``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"missing": "not drawn: matplotlib is not installed (pip install matplotlib, an optional extra)"}
    from bench.rows_capacity import estimated_peak  # only the capacity section needs its machinery

    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max([L for r in rows for L in r.runs] + [1]) + 1
    for row in rows:
        if row.unavailable or not row.runs:
            continue
        ls = sorted(row.runs)
        line, = ax.plot(ls, [row.runs[L].peak / MIB for L in ls], "o-", label=f"{row.name} (L = {row.layers})")
        if row.name.startswith("ours-zero"):
            est = range(1, top + 1)
            ax.plot(list(est), [estimated_peak(spec, L, int(row.name[-1])) / MIB for L in est], ":",
                    color=line.get_color(), linewidth=1)
    ax.axhline(spec.budget_mib, color="black", linestyle="--", linewidth=1, label=f"budget {spec.budget_mib:g} MiB")
    ax.set_xlabel("layers (L)")
    ax.set_ylabel("peak live tensor MiB per rank")
    ax.set_title(f"dp = {spec.dp}: measured (points), estimator for ours (dotted)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(RESULTS, filename)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"capacity": _link(path, outdir)}


def split_sections(text: str) -> tuple[str, dict[str, str]]:
    """(the text before the first ``## `` heading, {heading line: that section's text}), in order."""
    head, sections, current = [], {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line
            sections[current] = []
        (sections[current] if current else head).append(line)
    return "\n".join(head), {k: "\n".join(v) for k, v in sections.items()}


def update_sections(old_text: str, new_lines: list[str], note: str) -> str:
    """``old_text`` (a BENCHMARKS.md) with each section of ``new_lines`` replacing the section of the
    same heading (appended when new), ``note`` (the command and date of the rerun) under its heading;
    every other section is kept as it was."""
    head, old = split_sections(old_text)
    _, new = split_sections("\n".join(new_lines))
    for heading, body in new.items():
        first, _, rest = body.partition("\n")
        old[heading] = f"{first}\n\n{note}\n{rest}".rstrip() + "\n"
    return "\n".join([head.rstrip() + "\n"] + [v.rstrip() + "\n" for v in old.values()])


def targets_section(targets: list) -> list[str]:
    out = ["## Where we stand against the targets", "",
           "Targets: ours/peer step time <= 1.0x on every row, < 0.8x against FSDP2 and DeepSpeed ZeRO-3, "
           "peak memory per rank <= the peer's (within 1 MiB: RSS noise). Only pairs that trained to the same "
           "loss count.", ""]
    if not targets:
        return []
    rows = [[label, f"{r:.2f}x", f"{'<' if t < 1 else '<='} {t}x", "met" if (r < t if t < 1 else r <= t) else "MISSED",
             "met" if mem else "MISSED"] for label, r, t, mem in targets]
    met = sum(1 for row in rows if row[3] == "met")
    out += table("| pair | ours/peer | target | speed | memory |", rows)
    return out + ["", f"Speed target met on {met} of {len(rows)} counted pairs.", ""]


def plots(memory: dict, step_time: dict, psi: int, outdir: str) -> dict:
    """PNG plots in bench/results/, linked relative to ``outdir`` (the report's directory);
    {'missing': reason} when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"missing": "not drawn: matplotlib is not installed (pip install matplotlib, an optional extra)"}
    out = {}
    if memory:
        fig, ax = plt.subplots(figsize=(6, 4))
        dps = sorted(memory)
        for stage in (0, 1, 2, 3):
            ys = [memory[d][stage] / MIB if not isinstance(memory[d][stage], str) else None for d in dps]
            pts = [(d, y) for d, y in zip(dps, ys) if y is not None]
            line, = ax.plot([d for d, _ in pts], [y for _, y in pts], "o-", label=f"ZeRO-{stage} measured") \
                if pts else (None,)
            color = line.get_color() if line is not None else None
            ax.plot(dps, [zero_fp32_bytes(psi, d, stage) / MIB for d in dps], "--", color=color,
                    label=f"ZeRO-{stage} formula" + ("" if pts else " (stage 3 pending)"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel ranks")
        ax.set_ylabel("model-state MiB per rank")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "bench_memory.png"), dpi=100)
        plt.close(fig)
        out["memory"] = _link(os.path.join(RESULTS, "bench_memory.png"), outdir)
    if step_time:
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = [f"L{l} h{h}" for l, h in step_time]
        for side in ("ours", "plain-torch"):
            ax.plot(labels, [1e3 * median(r[side]["times"]) for r in step_time.values()], "o-",
                    label="megazero" if side == "ours" else "plain PyTorch")
        ax.set_ylabel("step ms (median)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "bench_step_time.png"), dpi=100)
        plt.close(fig)
        out["step_time"] = _link(os.path.join(RESULTS, "bench_step_time.png"), outdir)
    return out


__all__ = ["dp_section", "tp_section", "pp_section", "scaling_section", "gpu_section", "capacity_section",
           "targets_section", "offload_section", "compile_section", "plots", "capacity_plot", "deviation", "update_sections", "split_sections"]
