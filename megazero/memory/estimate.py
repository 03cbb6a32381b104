"""Memory per rank, estimated before launch from the job's flags: what ``tools/estimate_memory.py`` prints.

Model-agnostic: the model's chunks come from its spec (:mod:`megazero.spec`), built on the meta
device; the engine's layout, bounds and transients from the ZeRO components' own formulas. Three
parts, each per pipeline stage (the binding rank is the largest):

* **model states** (the ZeRO paper's accounting, exact for this implementation): the rank's
  parameters Ψ (its tp-local slice of its stage, padded into the buckets exactly as the engine pads
  them, in the engine's bucket groups: experts over dp / ep with expert parallelism), in the
  parameter dtype (e bytes), fp32 masters when e < 4, Adam's two moments, and the gradients, each
  divided by N = dp x cp where the stage shards it::

      stage 0: eΨ + gΨ + 4Ψ + 8Ψ      1: eΨ + gΨ + 12Ψ/N      2: eΨ + gΨ/N + 12Ψ/N      3: 16Ψ/N (e = g = 2)

  (g: gradient bytes, 4 with --accumulate-allreduce-grads-in-fp32, the default under bf16). Under
  ``--optimizer muon`` the optimizer state is the same 8Ψ: Muon keeps its momentum where AdamW keeps its first
  moment (``exp_avg``) and leaves the second at zero (:mod:`megazero.parallel.zero.muon`); its step moves
  :func:`muon_step_comm_bytes` over the network. Under ``--fp8-recipe delayed`` each FP8 linear's amax
  history besides (:func:`fp8_history_bytes`).

* **activations**: what the model spec's activation model says one micro-batch leaves held in each
  chunk (the GPT family counts its implementation exactly, FP8 linears' 1-byte inputs and weights
  included, :mod:`megazero.models.gpt.memory`; other
  models get Korthikanti et al.'s generic count, :mod:`megazero.spec.activations`), times the
  micro-batches held at once, which come from replaying the rank's schedule (1 without a pipeline,
  pp - rank with 1F1B, m with GPipe, the interleaved order chunk by chunk). Under context parallelism a
  rank holds ``seq_length / cp`` tokens (:func:`cp_slice_job`), and with ``--cp-comm-type allgather``
  each layer also keeps the whole sequence's keys and values, its query chunks' outputs and their masks
  (:func:`allgather_attention_bytes`).

* **buffers**: the transients on top -- gradients in flight
  (:func:`megazero.parallel.zero.sharded_grads.backward_grad_bytes`), stage 3's gathered units
  (:func:`megazero.parallel.zero.param_sync.gathered_unit_bytes`), the logits of the current
  micro-batch, the fp32 copy of the gradients the optimizer step makes in bf16/fp16, and at the
  backward's end the word embedding's dense gradient (three copies when the head is tied on the same
  rank: the head's, the lookup's and their sum) before it goes into its bucket.

* **offloaded** (``--offload-optimizer``, ``--offload-params``): what leaves the device, counted on the
  host and on NVMe instead (:func:`offloaded_parts`; ``megazero/parallel/zero/offload.py`` has the table).

The estimate is checked against measured live tensor bytes on CPU (``tests/test_memory.py``) and reproduces the ZeRO
paper's worked figures (:func:`paper_model_states`).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field

from megazero.config import JobConfig
from megazero.parallel.context import allgather_held_bytes
from megazero.parallel.groups import ExpertParallel, ModelParallelGroups
from megazero.parallel.params import attribute, split_dim
from megazero.parallel.pipeline.actions import Compute, Kind
from megazero.parallel.pipeline.generators import get_schedule, stage_shape
from megazero.parallel.pipeline.partition import placements
from megazero.parallel.zero.buckets import plan_buckets
from megazero.parallel.zero.engine import bucket_group_filters
from megazero.parallel.zero.offload import sub_group_elements
from megazero.parallel.zero.param_sync import gathered_unit_bytes
from megazero.parallel.zero.reducers import HierarchicalReducer, ReduceScatter
from megazero.parallel.zero.sharded_grads import backward_grad_bytes
from megazero.parallel.zero.units import plan_of
from megazero.spec import get_model_spec
from megazero.spec.activations import TransformerActivations

GIB = 1e9


def paper_model_states(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per rank in the ZeRO paper (mixed-precision Adam, K = 12): 2Ψ + 2Ψ + KΨ
    sharded by stage. The paper's 7.5B-parameter, N = 64 example: 120, 31.4, 16.6, 1.9 GB."""
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[stage]


@dataclass
class StageEstimate:
    """One pipeline stage's rank (every tp and dp rank of a stage is alike). Bytes."""

    pp_rank: int
    params: int
    psi: int                                    # parameter elements on the rank, padded
    model_states: int = 0
    activations: int = 0
    buffers: int = 0
    parts: dict = field(default_factory=dict)
    host: int = 0                               # offloaded to host memory (not in total)
    nvme: int = 0                               # offloaded to swap files (not in total)
    extrapolated_from: tuple[int, int] | None = None   # layers per stage of the two exact estimates, if any

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers

    def as_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "parameters": self.params, "model_states_bytes": self.model_states,
                "activations_bytes": self.activations, "buffers_bytes": self.buffers, "total_bytes": self.total,
                "host_bytes": self.host, "nvme_bytes": self.nvme, "parts": dict(self.parts),
                **({"extrapolated_from_layers_per_stage": list(self.extrapolated_from)}
                   if self.extrapolated_from else {})}


def _chunks(job: JobConfig, pp_rank: int) -> list:
    """The stage's chunks on the meta device at tp = 1 (their declarations; local sizes are scaled),
    holding one ep rank's experts (E / ep of each MoE layer)."""
    par, ep = job.parallel, job.parallel.expert_model_parallel_size
    groups = ModelParallelGroups(ep=ExpertParallel(None, tuple(range(ep)), 0, ep))
    spec = get_model_spec(job.model.model_family)
    return [spec.build_chunk(job.model, placement, groups, device="meta")
            for placement in placements(job.model.num_layers, par.pp, pp_rank, par.virtual_stages, stage_shape(par))]


def _local_numel(p, job: JobConfig) -> int:
    """Elements of a parameter on one tp rank."""
    tp, cfg = job.parallel.tp, job.model
    if split_dim(p) < 0:
        return p.numel()
    if attribute(p, "vocab_padded"):
        return cfg.padded_vocab_size(tp) // tp * (p.numel() // p.shape[0])
    return p.numel() // tp


def _buckets(named, job: JobConfig, bucket_size: int, dp: int) -> list[int]:
    """Padded bucket sizes of parameters laid out in backward order, as the engine does."""
    named = list(named)[::-1]
    plan = plan_buckets([_local_numel(p, job) for _, p in named],
                        [bool(attribute(p, "shared_embedding")) for _, p in named], bucket_size, dp)
    return [padded for _, padded in plan]


def _state_groups(job: JobConfig, chunks: list) -> list[tuple[list[int], int, list[list[int]]]]:
    """The engine's bucket layout, per bucket group (:func:`megazero.parallel.zero.engine.bucket_group_filters`:
    the dense parameters over dp x cp and, with expert parallelism, the experts over dp x cp / ep): (padded
    bucket sizes, ranks sharding them, ZeRO-3 unit sizes per chunk)."""
    z, par = job.zero, job.parallel
    ep = par.expert_model_parallel_size
    has_experts = any(attribute(p, "expert_parallel") for c in chunks for p in c.parameters())
    out = []
    for name, keep in bucket_group_filters(ep, has_experts):
        # ZeRO over dp x cp (experts: / ep; with --data-parallel-replicas, within a replica: / R)
        n = par.dp_x_cp // ep if name == "experts" else par.dp_x_cp // par.data_parallel_replicas
        held = [[(m, p) for m, p in c.named_parameters() if keep is None or keep(p)] for c in chunks]
        if z.zero_stage == 3:
            names = [{m for m, _ in h} for h in held]
            per_chunk = [[u for u in (sum(_buckets([(m, p) for m, p in members if m in names[i]], job, sys.maxsize, n))
                                      for members in plan_of(c).units.values()) if u]
                         for i, c in enumerate(chunks)]
            out.append(([u for cu in per_chunk for u in cu], n, per_chunk))
        else:
            out.append(([x for h in held for x in _buckets(h, job, z.bucket_size, n)], n, [[] for _ in chunks]))
    return out


def _schedule_order(job: JobConfig, pp_rank: int) -> list[tuple[str, int]]:
    """The (F, B, I or W, chunk) sequence the rank's pipeline schedule runs in one step, read off the list
    its generator writes (what the executor runs)."""
    par = job.parallel
    actions = get_schedule(par)(par.pp, job.num_micro_batches, par.virtual_stages, False)[pp_rank]
    letter = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I", Kind.BACKWARD_WEIGHT: "W"}
    return [(letter[a.kind], a.chunk) for a in actions if isinstance(a, Compute)]


def _held_peak(job: JobConfig, pp_rank: int, per_chunk: list[int], until_w: list[int] | None = None) -> int:
    """Most activation bytes held at once: the schedule replayed, each forward adding its chunk's
    bytes for one micro-batch and each backward releasing them; a zero-bubble I releases all but
    ``until_w`` (what W needs: the chunk's bytes where not given), its W the rest."""
    until_w = per_chunk if until_w is None else until_w
    held = peak = 0
    for op, c in _schedule_order(job, pp_rank):
        held += {"F": per_chunk[c], "B": -per_chunk[c], "I": until_w[c] - per_chunk[c], "W": -until_w[c]}[op]
        peak = max(peak, held)
    return peak


def muon_step_comm_bytes(matrices: list[tuple[int, int, bool]], *, sharded: bool, dp: int, tp: int,
                         ns_dtype: str) -> int:
    """Bytes Muon's step sends per optimizer step, summed over all ranks (the comm tag "muon"). ``matrices``:
    one (tp-local elements n, elements of the piece its dp owner holds p, split over tp) per Muon matrix
    (:class:`megazero.parallel.zero.muon.MuonMatrix`: p is ``piece_len(dp_owner)``); ``sharded``: ZeRO 1-3.
    Each matrix's non-owned pieces travel to the owner and back, in the Newton-Schulz dtype (w = 4 bytes
    fp32, 2 bf16): over dp (sharded stages: at every tp rank, n - p elements each way) and over tp (split
    matrices: tp - 1 shards of n each way, at the dp owner, or at every dp rank at stage 0)::

        w * 2 * sum_m [ tp * (n - p)  (sharded)  +  (tp - 1) * n * (1 if sharded else dp)  (split) ]"""
    w = {"fp32": 4, "bf16": 2}[ns_dtype]
    total = 0
    for n, p, split in matrices:
        if sharded:
            total += tp * (n - p)
        if split:
            total += (tp - 1) * n * (1 if sharded else dp)
    return 2 * w * total


def estimate_stage(job: JobConfig, pp_rank: int, device: str = "cpu") -> StageEstimate:
    """The memory of a rank of pipeline stage ``pp_rank`` on ``device`` ("cpu" or "cuda": they keep
    dropout masks differently) (see the module docstring)."""
    z, prec, par = job.zero, job.precision, job.parallel
    e = 2 if (prec.bf16 or prec.fp16) else 4
    ge = 4 if z.accumulate_allreduce_grads_in_fp32 else e    # gradient element bytes
    mask = 1 if device == "cuda" else e
    n = par.dp_x_cp // par.data_parallel_replicas      # the ranks a dense bucket is reduce-scattered over
    spec = get_model_spec(job.model.model_family)
    activation_model = spec.activation_bytes or TransformerActivations()
    act_job = cp_slice_job(job)                  # activations: a context-parallel rank's slice of the sequence
    places = placements(job.model.num_layers, par.pp, pp_rank, par.virtual_stages, stage_shape(par))
    chunks = _chunks(job, pp_rank)
    groups = _state_groups(job, chunks)                # [(buckets, dp ranks sharing them)]: dense, experts
    units = [[u for _, _, per_chunk in groups for u in per_chunk[i]] for i in range(len(chunks))]
    buckets = [x for bs, _, _ in groups for x in bs]
    psi = sum(buckets)
    params = sum(_local_numel(p, job) for c in chunks for p in c.parameters())
    sharded = z.zero_stage >= 1
    est = StageEstimate(pp_rank, params, psi)
    parts = est.parts
    parts["params"] = parts["grads"] = parts["master_weights"] = parts["optimizer_state"] = 0
    for group_buckets, group_n, _ in groups:
        g_psi = sum(group_buckets)
        parts["params"] += e * g_psi // (group_n if z.zero_stage == 3 else 1)
        parts["grads"] += ge * g_psi // (group_n if z.zero_stage >= 2 else 1)
        parts["master_weights"] += (4 * g_psi if e < 4 else 0) // (group_n if sharded else 1)
        parts["optimizer_state"] += 8 * g_psi // (group_n if sharded else 1)
    if z.zero_stage == 3 and z.hpz_partition_size > 1:       # ZeRO++ hpZ: a secondary shard over K ranks
        parts["hpz_secondary_params"] = e * psi // z.hpz_partition_size
    if job.fp8.enabled and job.fp8.recipe == "delayed" and spec.fp8_layers is not None:
        parts["fp8_amax_histories"] = fp8_history_bytes(job, spec, chunks)
    offloaded = offloaded_parts(job, groups, e, parts, ge, device)
    est.model_states = sum(parts.values())

    held = [activation_model.held(act_job, pl, e, mask) + allgather_attention_bytes(job, pl, e) for pl in places]
    until_w = getattr(activation_model, "weight_grad_held", None)
    est.activations = _held_peak(job, pp_rank, held, None if until_w is None else
                                 [min(until_w(act_job, pl, e, mask), full)
                                  for pl, full in zip(places, held)])
    host_activations = _held_peak(job, pp_rank, [activation_model.offloaded(act_job, pl, e, mask) for pl in places])
    if host_activations:                               # --cpu-offloading: the offloaded layers' activations
        offloaded["host_activations"] = host_activations

    if z.zero_stage >= 2:                    # the bucket being filled, those reducing, scratch shards, inboxes
        accumulates_full = (z.zero_stage == 2 and not z.reduce_each_microbatch
                            or z.zero_stage == 3 and z.keep_params_gathered and job.num_micro_batches > 1)
        reducer = HierarchicalReducer if z.quantized_gradients else ReduceScatter
        parts["grads_in_backward"] = backward_grad_bytes(buckets, ge, n, z.zero_stage, overlap=z.overlap_grad_reduce,
                                                         accumulates_full=accumulates_full, on_cuda=device == "cuda",
                                                         reducer=reducer)
    if z.zero_stage == 3:
        parts["gathered_units"] = gathered_unit_bytes(units, e, z.prefetch_layers, z.keep_params_gathered)
    if places[-1].post_process:                        # the logits (and their float32 copy) beside the softmax
        parts["logits"] = activation_model.logits(act_job, e)
    # Two moments compete for the peak. The end of the last held forward: the logits beside the softmax,
    # and gradient storage already filled by earlier micro-batches (reduced once per step, m > 1). A
    # backward: the head's activations are gone first; the gradients passing between layers, the
    # gradients in flight and, recomputing, one layer's activations back.
    working = activation_model.working(act_job, places, e, mask, device)
    grads, gathered = parts.get("grads_in_backward", 0), parts.get("gathered_units", 0)
    accumulating = job.num_micro_batches > 1 and (z.zero_stage == 2 and not z.reduce_each_microbatch
                                                  or z.zero_stage == 3 and z.keep_params_gathered)
    forward_end = parts.get("logits", 0) + gathered + (grads if accumulating else 0)
    if places[-1].post_process:                        # the head's backward: all activations still held
        parts["logits_grad"] = activation_model.head_backward(act_job, e)
        forward_end = max(forward_end, parts["logits_grad"] + gathered + (grads if accumulating else 0))
    backward = max(working, 0) + gathered + grads
    step = 0
    if ge < 4 and z.offload_optimizer == "none":       # the optimizer step's fp32 copy of the gradients,
        step = parts["fp32_grads_in_step"] = sum(4 * sum(bs) // (gn if sharded else 1) for bs, gn, _ in groups)
    if z.offload_params != "none" and z.zero_stage == 3:   # device staging copies of the shards in flight
        parts["offload_staging"] = gathered // n
        forward_end, backward = forward_end + gathered // n, backward + gathered // n
    est.buffers = max(forward_end, backward, step - est.activations)
    if places[0].pre_process:          # the backward's end: the word embedding's dense gradient (and, tied
        # on this rank, the head's and their sum) before it is copied into its bucket; this micro-batch's
        # activations are gone, the gradients in flight are not
        cfg = job.model
        copies = 3 if (places[-1].post_process and not cfg.untie_embeddings_and_output_weights) else 1
        parts["embedding_grad"] = copies * e * cfg.padded_vocab_size(par.tp) // par.tp * cfg.hidden_size
        first = activation_model.held(act_job, places[0], e, mask)
        in_flight = grads if z.zero_stage < 3 else 0       # ZeRO-3 keeps one reduction in flight, done by then
        est.buffers = max(est.buffers, parts["embedding_grad"] + in_flight + gathered - first)
    parts.update(offloaded)
    est.host = sum(v for k, v in offloaded.items() if k.startswith("host_"))
    est.nvme = sum(v for k, v in offloaded.items() if k.startswith("nvme_"))
    return est


def fp8_history_bytes(job: JobConfig, spec, chunks: list) -> int:
    """``--fp8-recipe delayed``: each FP8 linear's amax history, [3, history length] fp32 (input, weight,
    output gradient), whole on every rank holding the linear. Counted over the linears the model declares
    (``ModelSpec.fp8_layers``), so also those its shapes leave in the parameters' precision: a bound."""
    linears = sum(len(spec.fp8_layers(c, job.fp8.fp8_head)) for c in chunks)
    return linears * 3 * job.fp8.history_len * 4


def cp_slice_job(job: JobConfig) -> JobConfig:
    """``job`` as one context-parallel rank sees its activations: a sequence of ``seq_length / cp`` tokens
    (its two chunks); ``job`` itself at cp 1."""
    cp = job.parallel.cp
    if cp == 1:
        return job
    return dataclasses.replace(job, model=dataclasses.replace(job.model, seq_length=job.model.seq_length // cp))


def allgather_attention_bytes(job: JobConfig, placement, e: int) -> int:
    """``--cp-comm-type allgather``: what the chunk's layers' attention keeps beyond its own slice
    (:func:`megazero.parallel.context.allgather_held_bytes` per layer: the gathered keys and values, the query
    chunks' outputs, the masks); 0 otherwise (p2p keeps only its own slice, a2a the whole sequence for
    heads/cp heads: the same bytes as its slice for all heads)."""
    par, cfg = job.parallel, job.model
    if par.cp == 1 or par.cp_comm_type != "allgather":
        return 0
    heads, kv_heads = cfg.num_attention_heads // par.tp, max(cfg.kv_heads // par.tp, 1)
    per_layer = allgather_held_bytes(cfg.seq_length, par.cp, job.train.micro_batch_size, heads, kv_heads,
                                     cfg.head_dim, e)
    return len(placement.layer_ids) * per_layer


def offloaded_parts(job: JobConfig, groups, e: int, parts: dict, ge: int = 4, device: str = "cpu") -> dict:
    """Move what ``--offload-optimizer`` / ``--offload-params`` keep off the device out of ``parts`` (the
    device model states) and return it as ``host_*`` / ``nvme_*`` bytes. Per rank, Ψ/N owned elements
    (summed over the bucket groups, each over its own N): host fp32 gradient copy 4Ψ/N (none on a CPU
    with fp32 gradients: the host reads the device's); masters and moments 12Ψ/N on the host (cpu) or in
    the swap file (nvme), with up to three sub-group buffers of 12 bytes per element on the host (nvme)
    and two cast buffers in the parameter dtype (bf16/fp16); ZeRO-3 parameter shards eΨ/N on the host
    or in the swap file."""
    z = job.zero
    out = {}
    owned = sum(sum(bs) // gn for bs, gn, _ in groups)
    width = min(sub_group_elements(z.offload_sub_group_size, owned), owned)
    if z.offload_optimizer != "none":
        parts["master_weights"] = parts["optimizer_state"] = 0
        out["host_grads"] = 0 if device == "cpu" and ge == 4 else 4 * owned
        if z.offload_delayed_update:                     # the gradients the delayed update steps with
            out["host_delayed_grads"] = 4 * owned
        where = "host" if z.offload_optimizer == "cpu" else "nvme"
        out[f"{where}_master_weights"] = 4 * owned
        out[f"{where}_optimizer_state"] = 8 * owned
        buffers = min(3, -(-owned // width)) if width else 0      # read-ahead, update, write-behind
        out["host_buffers"] = (buffers * 12 * width if where == "nvme" else 0) + (2 * e * width if e < 4 else 0)
    if z.offload_params != "none" and z.zero_stage == 3:
        out[f"{'host' if z.offload_params == 'cpu' else 'nvme'}_params"] = parts["params"]
        parts["params"] = 0
    return out


# Above this many layers per pipeline stage the estimate is extrapolated (see :func:`estimate_memory`).
EXACT_LAYERS_PER_STAGE = 256


def estimate_memory(job: JobConfig, device: str = "cpu") -> list[StageEstimate]:
    """Every pipeline stage's estimate for a validated job (``megazero.config.validate``).

    Bounded time for any depth: a stage of more than :data:`EXACT_LAYERS_PER_STAGE` layers (one chunk
    per rank) is estimated at two depths whose layers repeat the model's pattern (a multiple of
    ``--moe-layer-freq`` layers per stage) and the rest extrapolated along the line through them:
    every part is an affine function of the layers per stage (parameters, model states, activations
    held, gradient buckets; the per-layer transients do not grow), exact up to bucket padding, and
    each estimate records the depths in ``extrapolated_from``."""
    depths = _extrapolation_depths(job)
    if depths is None:
        return [estimate_stage(job, r, device) for r in range(job.parallel.pp)]
    pp, n = job.parallel.pp, job.model.num_layers // job.parallel.pp
    low, high = ([estimate_stage(_with_layers(job, d * pp), r, device) for r in range(pp)] for d in depths)
    return [_along_line(a, b, depths, n) for a, b in zip(low, high)]


def _extrapolation_depths(job: JobConfig) -> tuple[int, int] | None:
    """Two small layers-per-stage counts to extrapolate from, or None when the job is estimated as it is
    (few layers per stage, or interleaved chunks, whose schedule depends on their count)."""
    par, cfg = job.parallel, job.model
    if par.virtual_stages != 1 or cfg.num_layers // par.pp <= EXACT_LAYERS_PER_STAGE:
        return None
    period = cfg.layer_period                                      # the layers' pattern repeats every period
    fixed = 16                                                     # and layer counts that do not grow with depth
    method, n = cfg.recompute_method, cfg.recompute_num_layers
    if method == "uniform" and n:
        period = math.lcm(period, n)
    elif method == "block" and n:
        fixed = max(fixed, n)
    fixed = max(fixed, cfg.cpu_offloading_num_layers or 0)
    base = -(-fixed // period) * period
    return (base, 2 * base) if 2 * base < cfg.num_layers // par.pp else None


def _with_layers(job: JobConfig, layers: int) -> JobConfig:
    return dataclasses.replace(job, model=dataclasses.replace(job.model, num_layers=layers))


def _along_line(a: StageEstimate, b: StageEstimate, depths: tuple[int, int], n: int) -> StageEstimate:
    """The estimate at ``n`` layers per stage on the line through ``a`` (``depths[0]`` layers) and ``b``."""
    def at(x, y):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            return y
        return max(0, round(x + (y - x) * (n - depths[0]) / (depths[1] - depths[0])))

    fields = ("params", "psi", "model_states", "activations", "buffers", "host", "nvme")
    out = StageEstimate(a.pp_rank, **{f: at(getattr(a, f), getattr(b, f)) for f in fields[:2]})
    for f in fields[2:]:
        setattr(out, f, at(getattr(a, f), getattr(b, f)))
    out.parts = {k: at(a.parts.get(k, 0), v) for k, v in b.parts.items()}
    out.extrapolated_from = depths
    return out


def describe(estimates: list[StageEstimate]) -> str:
    """One line for the trainer's start: the binding stage's estimate."""
    worst = max(estimates, key=lambda x: x.total)
    mib = 2 ** 20
    offloaded = (f"; offloaded: host {worst.host / mib:.1f}, nvme {worst.nvme / mib:.1f}"
                 if worst.host or worst.nvme else "")
    return (f" memory estimate per rank (MiB, pipeline stage {worst.pp_rank}; tools/estimate_memory.py): model states "
            f"{worst.model_states / mib:.1f}, activations {worst.activations / mib:.1f}, buffers "
            f"{worst.buffers / mib:.1f}, total {worst.total / mib:.1f}{offloaded}")
