"""Scale rows: ZeRO 0/1/2/3 where the gathered and reduced bytes are real (30M+ parameters), against
DDP, DDP + ZeroRedundancyOptimizer, FSDP2 ``fully_shard`` (resharding after forward or not) and
DeepSpeed ZeRO 1/2/3, at dp = 2 and 4, with a per-phase split of our step.

The small dp rows (:mod:`rows_dp`) measure a model where per-operation overheads decide; here the
model is big enough that the collectives' bytes and the optimizer's passes over the states take the
time. Each ZeRO stage is timed against its peers in its own processes (all variants of every stage
at once would not fit in memory at this size): one step of each variant per round, rotated order,
median of the per-round ratios (:func:`common.run_variants`). ZeRO-1/2 run with
``--overlap-param-gather``, whose all-gathers finish behind the next step's forward: timed one step
at a time between peers, those gathers would run during the peer's step (slowing it) and never be
waited for by ours. Their groups therefore time blocks of two steps per variant, the second step's
gathers waited for inside the block (:func:`steps_per_round`): half of our gathers hidden, half not,
a lower bound on the overlap a long run gets.

Per-phase split of our step (slowest rank's figures are not combined: rank 0's, in ms):

    forward     the micro-batches' forwards, less the time waiting for parameter gathers (ZeRO-3)
    backward    the backwards, less the gather waits; includes launching the gradient reductions
    gather wait time waiting for a parameter all-gather that was not done yet: ZeRO-3's
                ``ShardedParams.wait``; ZeRO-1/2 (run with ``--overlap-param-gather``) the forward's
                waits for the previous step's gathers and the wait at the end of a block
    grad wait   ``finalize_grads``: waiting for the last gradient reductions
    optimizer   ``engine.step``: clipping, the AdamW update of this rank's shard and, at ZeRO-1/2,
                launching the all-gathers of the updated parameters

Memory: the peak live tensor bytes of a variant during its second warm-up step (what it built plus
the allocations of its first two steps, the peak taken in the second, where the first step's
gradients are freed; ``run_variants(live_memory=True)``), beside the peak RSS.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from bench.common import (
    GPT,
    WARMUP_STEPS,
    Spec,
    Variant,
    largest_over_ranks,
    loss_diffs,
    losses_over_ranks,
    median,
    num_params,
    ratio_of_medians_per_round,
    run_variants,
    spawn,
    step_batches,
    table,
)
from bench.rows_dp import build_ddp, build_deepspeed, build_fsdp2, deepspeed_status
from bench.steps import engine_step
from megazero.config import ZeroConfig
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine

# The shape of the measurement that opened the question (69M parameters: 8 x 768, untied output layer) and a
# deeper, narrower one (46M).
SCALE_SHAPES = (Spec(layers=8, hidden=768, heads=12, seq=64, vocab=8192, micro_batch=1, micro_batches=1, rounds=7,
                     untied=True),
                Spec(layers=12, hidden=512, heads=8, seq=64, vocab=8192, micro_batch=1, micro_batches=1, rounds=7,
                     untied=True))
QUICK_SCALE = (Spec(layers=2, hidden=128, heads=4, seq=32, vocab=1024, micro_batch=1, micro_batches=1, rounds=4,
                    untied=True),)

# Ours -> the peers timed beside it, and the step-time ratio each must reach (ours / peer at most).
GROUPS = {
    "ours-zero0": {"torch-ddp": 1.0},
    "ours-zero1": {"torch-ddp-zero": 0.9, "ds-zero1": 0.9},
    "ours-zero2": {"torch-ddp-zero": 0.9, "ds-zero2": 0.9},
    "ours-zero3": {"torch-fsdp2": 0.8, "ds-zero3": 0.8},
    "ours-zero3-keep": {"torch-fsdp2-noreshard": 0.8},
}
# DeepSpeed's buckets at our bucket size: its default reduce bucket (5e8 elements) allocates a 1.9 GiB
# fp32 buffer in the first backward whatever the model's size.
DS_BUCKETS = {"reduce_bucket_size": ZeroConfig.bucket_size, "allgather_bucket_size": ZeroConfig.bucket_size}
PHASES = ("forward", "backward", "gather wait", "grad wait", "optimizer")
# Same training? fp32 rounding differences (reduction order, fused or not) are amplified by AdamW's
# normalised steps, about 3x a step here: at 8x768 dp 2, torch DDP and DeepSpeed ZeRO-1 -- both correct --
# end 7 steps 2e-4 apart, 12 steps some 2e-3 apart. So a pair must agree to EARLY_LOSS_TOL over its
# first EARLY_STEPS losses (two updates, where a wrong reduction, gather or update already shows) and
# end within FINAL_LOSS_TOL (0.1% of the loss); the section lists the peers' own final spread beside.
EARLY_STEPS, EARLY_LOSS_TOL, FINAL_LOSS_TOL = 3, 1e-5, 1e-2


def same_training(a: dict, b: dict) -> tuple[float, float, bool]:
    """(early loss difference, final loss difference, whether both are within this rule) of two variants
    whose results carry every rank's losses (:func:`bench.common.losses_over_ranks` with EARLY_STEPS)."""
    early, final = loss_diffs(a, b)
    return early, final, early <= EARLY_LOSS_TOL and final <= FINAL_LOSS_TOL


@dataclass
class PhaseClock:
    """Seconds per phase (:data:`PHASES`) of each step of one of our variants: :meth:`start` opens a
    step's record, :meth:`phase` times a part of it (the engine step's ``phase``), and the gather waits
    inside the forward and backward (counted by the engine's wrapped ``wait``, :meth:`timed_wait`) are
    taken out of those two and counted as ``gather wait``."""

    steps: list[dict] = field(default_factory=list)
    gather_wait: float = 0.0

    def timed_wait(self, wait):
        def run(unit):
            t0 = time.perf_counter()
            wait(unit)
            self.gather_wait += time.perf_counter() - t0
        return run

    def start(self) -> None:
        self.steps.append(dict.fromkeys(PHASES, 0.0))

    @contextlib.contextmanager
    def phase(self, name: str):
        t0, w0 = time.perf_counter(), self.gather_wait
        yield
        took, waited = time.perf_counter() - t0, self.gather_wait - w0
        step = self.steps[-1]
        if name in ("forward", "backward"):
            step[name] += took - waited
            step["gather wait"] += waited
        else:
            step[name] += took


def build_ours_phased(spec: Spec, topo, stage: int, clock: PhaseClock, keep_params_gathered: bool = False):
    """Our engine on the whole model (dp only), its step split into :data:`PHASES`."""
    model = GPT(spec.model_cfg(), seed=1234)
    engine = build_engine(model, topo, ZeroConfig(zero_stage=stage, keep_params_gathered=keep_params_gathered,
                                                  overlap_param_gather=stage in (1, 2)), spec.opt_cfg())
    if stage == 3:
        engine.bucket_groups[0].params.wait = clock.timed_wait(engine.bucket_groups[0].params.wait)
    else:
        overlap = engine.optimizer.publish.overlap
        if overlap is not None:
            overlap.wait = clock.timed_wait(overlap.wait)

    def step(micro) -> float:
        clock.start()
        engine.comm_log.reset()
        return engine_step(model, engine, micro, clock.phase)

    def extra():
        return {"state": engine.model_state_bytes(), "comm": dict(engine.comm_log.bytes())}

    def settle():
        """The gathers the step left running (ZeRO-1/2 with overlap), counted as the step's gather wait."""
        t0 = time.perf_counter()
        engine.optimizer.wait_params()
        clock.steps[-1]["gather wait"] += time.perf_counter() - t0

    return step, extra, settle


def _variants(spec: Spec, topo, world: int, ours: str, clock: PhaseClock, with_deepspeed: bool) -> list[Variant]:
    stage = int(ours[len("ours-zero")])
    keep = ours.endswith("-keep")
    out = [Variant(ours, lambda: build_ours_phased(spec, topo, stage, clock, keep))]
    ds_reason = deepspeed_status() if with_deepspeed else "skipped (--no-deepspeed)"
    builders = {"torch-ddp": lambda: build_ddp(spec, False), "torch-ddp-zero": lambda: build_ddp(spec, True),
                "torch-fsdp2": lambda: build_fsdp2(spec, world),
                "torch-fsdp2-noreshard": lambda: build_fsdp2(spec, world, reshard_after_forward=False)}
    for peer in GROUPS[ours]:
        if peer.startswith("ds-zero"):
            out.append(Variant(peer, lambda s=int(peer[-1]): build_deepspeed(spec, s, **DS_BUCKETS), unavailable=ds_reason))
        else:
            out.append(Variant(peer, builders[peer]))
    return out


def steps_per_round(ours: str) -> int:
    """ZeRO-1/2 run with ``--overlap-param-gather``: a step's all-gathers finish behind the next
    step's forward, so every variant of their groups is timed over 2 consecutive steps (the second's
    gathers waited for at the block's end, not hidden); 1 elsewhere."""
    return 2 if ours in ("ours-zero1", "ours-zero2") else 1


def scale_worker(rank: int, world: int, spec: Spec, ours: str, with_deepspeed: bool) -> dict:
    topo = Topology(dp=world)
    clock = PhaseClock()
    k = steps_per_round(ours)
    batches = step_batches(spec, WARMUP_STEPS + (spec.rounds - WARMUP_STEPS) * k, world, rank)
    res = run_variants(_variants(spec, topo, world, ours, clock, with_deepspeed), batches, live_memory=True,
                       steps_per_round=k)
    # The throwaway build's step and the warm-up steps come first; keep the timed rounds' phases,
    # each round's as the mean over its block of steps.
    rounds = len(res[ours].get("times", []))
    timed = clock.steps[len(clock.steps) - rounds * k:] if rounds else []
    res[ours]["phases"] = [{p: sum(s[p] for s in timed[i:i + k]) / k for p in PHASES} for i in range(0, len(timed), k)]
    return res


def run_scale(spec: Spec, dp: int, only: list[str] | None = None, with_deepspeed: bool = True, log=print) -> dict:
    """{ours variant: rank 0's results of it and its peers} for one shape at ``dp`` ranks, with every
    rank's early and final losses and the largest peaks."""
    out = {}
    for ours in GROUPS:
        if only and ours not in only:
            continue
        log(f"scale {spec.layers}x{spec.hidden} dp={dp}: {ours} vs {', '.join(GROUPS[ours])}")
        per_rank = spawn(dp, scale_worker, spec, ours, with_deepspeed)
        out[ours] = losses_over_ranks(largest_over_ranks(per_rank, ("peak_live_mib", "peak_rss_mib")), per_rank,
                                      EARLY_STEPS)
    return out


# ---------------------------------------------------------------------------------------- report
def _row(spec: Spec, dp: int, ours: str, peer: str, target: float, res: dict) -> list[str]:
    label = [f"{spec.layers}x{spec.hidden}", str(dp), f"{ours} vs {peer}"]
    a, b = res[ours], res[peer]
    if "unavailable" in a or "unavailable" in b:
        return label + ["-"] * 9 + [a.get("unavailable") or b.get("unavailable")]
    ratio = ratio_of_medians_per_round(a["times"], b["times"])
    early, diff, same = same_training(a, b)
    speed = ("met" if ratio <= target else "MISSED") if same else "void (losses differ)"
    memory = "met" if a["peak_live_mib"] <= b["peak_live_mib"] else "MISSED"
    return label + [f"{1e3 * median(a['times']):.0f}", f"{1e3 * median(b['times']):.0f}", f"{ratio:.2f}x",
                    f"<= {target}x: {speed}", f"{a['peak_live_mib']:.0f}", f"{b['peak_live_mib']:.0f}",
                    f"{a['peak_rss_mib']:.0f} / {b['peak_rss_mib']:.0f}", memory, f"{early:.1e}", f"{diff:.1e}"]


def _peer_spread(spec: Spec, dp: int, results: list[dict], names: list[str]) -> list[str]:
    """'a vs b at shape dp: final loss diff' for the first two peers of a group that both ran."""
    ran = [(n, r) for n, r in zip(names, results) if "rank_final_losses" in r]
    if len(ran) < 2:
        return []
    (na, a), (nb, b) = ran[:2]
    _, diff = loss_diffs(a, b)
    return [f"{na} vs {nb} at {spec.layers}x{spec.hidden} dp {dp}, {len(a['losses'])} steps: {diff:.1e}"]


def _phase_row(spec: Spec, dp: int, ours: str, r: dict) -> list[str]:
    head = [f"{spec.layers}x{spec.hidden}", str(dp), ours]
    if "unavailable" in r or not r.get("phases"):
        return head + ["-"] * (len(PHASES) + 2)
    ms = {p: 1e3 * median([s[p] for s in r["phases"]]) for p in PHASES}
    comm = sum(r["extra"].get("comm", {}).values()) / 2**20
    return head + [f"{1e3 * median(r['times']):.0f}"] + [f"{ms[p]:.0f}" for p in PHASES] + [f"{comm:.0f}"]


def scale_section(results: list) -> list[str]:
    """BENCHMARKS.md lines from ``[(spec, dp, run_scale(...)), ...]``."""
    out = ["## Scale: ZeRO at 30M+ parameters vs DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed", ""]
    shapes = {(s.layers, s.hidden): s for s, _, _ in results}
    for s in shapes.values():
        out.append(f"- {s.layers}x{s.hidden}: {s.describe()}, {num_params(s.model_cfg()) / 1e6:.1f}M parameters, "
                   f"{s.micro_batches} micro-batch(es) per rank and step, 2 untimed steps per variant, then "
                   f"{s.rounds - WARMUP_STEPS} timed rounds of 1 step (ZeRO-0/3 groups) or 2 (ZeRO-1/2 groups).")
    out += ["", "Each ZeRO stage runs in its own processes beside its peers, one step each per round in a rotated "
            "order (ZeRO-1/2's groups two consecutive steps each, every variant alike: ours run with "
            "`--overlap-param-gather`, whose all-gathers finish behind the next step's forward; the block's last "
            "gathers are waited for inside its time, so no gather runs during a peer's step or escapes ours); "
            "ms = median step (slowest rank), ratio = median of per-round ratios. Same training: the pair's losses "
            f"agree to {EARLY_LOSS_TOL:g} over the first {EARLY_STEPS} steps and to {FINAL_LOSS_TOL:g} at the end "
            "(AdamW's normalised steps amplify fp32 rounding about 3x a step here, so two correct peers end "
            "12 steps some 1e-3 apart: see the peers' own spread below the table), else the speed target is void. Peak live MiB: the "
            "largest rank's peak of live tensor bytes in its second step (what the variant built plus the allocations "
            "of its first two steps, counted from the second; gloo-thread frees are not seen, so an upper bound); RSS with allocations over 64 KiB "
            "mmapped. Memory target: ours' peak live bytes at or below the peer's. DeepSpeed's reduce and "
            f"all-gather buckets are set to our bucket size ({ZeroConfig.bucket_size:,} elements; its default reduce "
            "bucket allocates 1.9 GiB). `ours-zero3-keep` is "
            "`--zero3-keep-params-gathered`, FSDP2's `reshard_after_forward=False`.", ""]
    rows, phases, spread = [], [], []
    for spec, dp, res in results:
        for ours, peers in GROUPS.items():
            if ours not in res:
                continue
            rows += [_row(spec, dp, ours, peer, target, res[ours]) for peer, target in peers.items()
                     if peer in res[ours]]
            spread += _peer_spread(spec, dp, [res[ours][p] for p in peers if p in res[ours]], list(peers))
            phases.append(_phase_row(spec, dp, ours, res[ours][ours]))
    out += table("| shape | dp | pair | ours ms | peer ms | ours/peer | speed target | ours peak live MiB "
                 "| peer peak live MiB | peak RSS MiB ours / peer | memory | loss diff, first 3 steps | final loss diff |", rows)
    if spread:
        out += ["", "The peers against each other (the fp32 noise floor of the final loss, same run): " + "; ".join(spread)
                + "."]
    out += ["", "### Where our step's time goes (rank 0, median ms per phase)", "",
            "forward / backward exclude the gather waits (ZeRO-3: each unit's all-gather; ZeRO-1/2, run with "
            "`--overlap-param-gather`: the previous step's parameter all-gathers, finishing behind the forward); "
            "grad wait = `finalize_grads`; optimizer = `engine.step` (clip, AdamW on the shard, launching ZeRO-1/2's "
            "parameter all-gathers). Comm = the CommLog's bytes per step: each collective's volume per rank as a ring "
            "moves it ((N-1)/N of the buffer for an all-gather or reduce-scatter, twice that for an all-reduce); on "
            "gloo ours runs its all-gather as broadcasts and ZeRO-2/3's gradient reduce-scatter as point-to-point "
            "messages, the same bytes (ZeRO-1's as an all-reduce of the bucket, twice the bytes).", ""]
    out += table("| shape | dp | variant | ms/step | " + " | ".join(PHASES) + " | comm MiB/step |", phases)
    return out + [""]
