"""The rules of the model section: its shape against the tensor-parallel layout, RoPE, grouped-query
attention, Mixture of Experts, its layers over the pipeline stages, and the activation-memory
(recompute, offload) flags. Called by
``ModelConfig.check`` (and by tools that reshard, :func:`check_model`); the helpers and the
conventions are :mod:`megazero.config.checks`'s.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megazero.config.checks import FLAG, fail, one_of, positive, positive_float
from megazero.config.fields import choices, flag

if TYPE_CHECKING:
    from megazero.config.sections import ModelConfig, ParallelConfig


def check_model(m: ModelConfig, par: ParallelConfig) -> None:
    """The model's shape against the tensor-parallel layout (also used by tools that reshard)."""
    if not isinstance(m.model_family, str) or not m.model_family.strip():
        fail(f"{FLAG.model_family} must name a model family, got {m.model_family!r}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                 "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by"):
        positive(getattr(m, name), name)
    if m.hidden_size % m.num_attention_heads:
        fail(f"{FLAG.hidden_size} {m.hidden_size} is not divisible by {FLAG.num_attention_heads} "
              f"{m.num_attention_heads}: choose a head count that divides the hidden size")
    if m.num_attention_heads % par.tp:
        fail(f"{FLAG.num_attention_heads} {m.num_attention_heads} is not divisible by {FLAG.tp} {par.tp}: "
              f"each tensor-parallel rank needs whole heads; use a tp that divides the head count")
    if m.ffn_hidden_size % par.tp:
        fail(f"{FLAG.ffn_hidden_size} {m.ffn_hidden_size} is not divisible by {FLAG.tp} {par.tp}: "
              f"choose an ffn size that is a multiple of tp")
    if m.padded_vocab_size(par.tp) % par.tp:
        fail(f"padded vocab {m.padded_vocab_size(par.tp)} is not divisible by {FLAG.tp} {par.tp}: "
              f"set {FLAG.make_vocab_size_divisible_by} to a multiple of tp")
    if m.max_position_embeddings < m.seq_length:
        fail(f"{FLAG.max_position_embeddings} {m.max_position_embeddings} is smaller than {FLAG.seq_length} "
              f"{m.seq_length}: raise it to at least the sequence length")
    if par.sequence_parallel and m.seq_length % par.tp:
        fail(f"{FLAG.sequence_parallel} needs {FLAG.seq_length} ({m.seq_length}) divisible by {FLAG.tp} "
              f"{par.tp}: change the sequence length or drop {FLAG.sequence_parallel}")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            fail(f"{flag(name)} must be in [0, 1), got {getattr(m, name)}")
    for name in ("layernorm_epsilon", "init_method_std"):
        positive_float(getattr(m, name), name)
    one_of(m, "activation")
    one_of(m, "normalization")
    _check_rope(m)
    _check_query_groups(m, par.tp)
    _check_moe(m, par)
    _check_context_parallel(m, par)


def _check_context_parallel(m: ModelConfig, par: ParallelConfig) -> None:
    """Context parallelism against the model: the sequence cuts into 2 x cp equal chunks (causal load
    balancing: cp rank r holds chunks r and 2cp-1-r), Ulysses' all-to-all needs whole heads and key/value
    groups per cp rank, and what is not built for a split sequence is refused by name."""
    cp = par.cp
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        fail(f"{FLAG.cp} {cp} needs {FLAG.seq_length} ({m.seq_length}) divisible by 2 x cp = {2 * cp} (each cp rank "
              f"holds two of 2 x cp equal chunks, for causal load balancing): use a multiple of {2 * cp}")
    if par.sequence_parallel and (m.seq_length // cp) % par.tp:
        fail(f"{FLAG.sequence_parallel} with {FLAG.cp} {cp} needs each cp rank's {m.seq_length // cp} tokens "
              f"divisible by {FLAG.tp} {par.tp}: use a {FLAG.seq_length} that is a multiple of {cp * par.tp}")
    if par.cp_comm_type == "a2a":
        heads, groups = m.num_attention_heads // par.tp, m.kv_heads // par.tp if m.kv_heads >= par.tp else 1
        if heads % cp or groups % cp:
            fail(f"{FLAG.cp_comm_type} a2a (Ulysses) gives each cp rank whole heads: the {heads} query heads and "
                  f"{groups} key/value group(s) per tp rank must divide by {FLAG.cp} {cp}; use a cp that divides "
                  f"both, or {FLAG.cp_comm_type} p2p")
    if m.attention_dropout > 0:
        fail(f"{FLAG.attention_dropout} {m.attention_dropout} with {FLAG.cp} {cp}: context-parallel attention has "
              f"no dropout; set {FLAG.attention_dropout} 0")


def _check_moe(m: ModelConfig, par: ParallelConfig) -> None:
    """Mixture-of-Experts flags against each other and the expert-parallel layout."""
    ep = par.expert_model_parallel_size
    positive(ep, "expert_model_parallel_size")
    if not m.num_experts:
        if m.num_experts is not None:
            fail(f"{FLAG.num_experts} must be a positive integer, got {m.num_experts}: leave it unset for dense MLPs")
        if ep > 1:
            fail(f"{FLAG.expert_model_parallel_size} {ep} needs {FLAG.num_experts}: there are no experts to split")
        defaults = {f.name: f.default for f in dataclasses.fields(m)}
        for name in ("moe_router_topk", "moe_layer_freq", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                     "moe_expert_capacity_factor"):
            if getattr(m, name) != defaults[name]:
                fail(f"{flag(name)} {getattr(m, name)} applies to Mixture-of-Experts layers and this model has "
                      f"none: add {FLAG.num_experts} N, or drop {flag(name)}")
        return
    positive(m.moe_router_topk, "moe_router_topk")
    positive(m.moe_layer_freq, "moe_layer_freq")
    if m.moe_router_topk > m.num_experts:
        fail(f"{FLAG.moe_router_topk} {m.moe_router_topk} exceeds {FLAG.num_experts} {m.num_experts}: "
              f"a token cannot pick more experts than there are")
    if m.num_experts % ep:
        fail(f"{FLAG.num_experts} {m.num_experts} is not divisible by {FLAG.expert_model_parallel_size} {ep}: "
              f"each expert-parallel rank holds the same number of whole experts")
    cp = par.cp
    if par.dp is not None and par.dp_x_cp % ep:
        over = f"data-parallel size {par.dp}" if cp == 1 else f"dp x cp = {par.dp} x {cp} = {par.dp_x_cp}"
        fail(f"{over} is not divisible by {FLAG.expert_model_parallel_size} {ep}: expert groups are carved out of "
              f"the data{'' if cp == 1 else ' x context'}-parallel group; choose EP dividing {par.dp_x_cp}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(m, name) < 0:
            fail(f"{flag(name)} must be >= 0, got {getattr(m, name)}")
    if m.moe_expert_capacity_factor is not None and not m.moe_expert_capacity_factor > 0:
        fail(f"{FLAG.moe_expert_capacity_factor} must be > 0, got {m.moe_expert_capacity_factor}: "
              f"leave it unset for dropless routing")


def _check_rope(m: ModelConfig) -> None:
    one_of(m, "position_embedding_type")
    rope = m.position_embedding_type == "rope"
    if not rope and (m.use_rope_scaling or m.rotary_percent != 1.0):
        fail(f"{FLAG.use_rope_scaling} and {FLAG.rotary_percent} apply to rotary embeddings only: add "
              f"{FLAG.position_embedding_type} rope or drop them")
    if not rope:
        return
    if not 0.0 < m.rotary_percent <= 1.0:
        fail(f"{FLAG.rotary_percent} must be in (0, 1], got {m.rotary_percent}")
    if m.rotary_dim < 2 or m.rotary_dim % 2:
        fail(f"{FLAG.rotary_percent} {m.rotary_percent} rotates {m.rotary_dim} of the {m.head_dim} features of "
              f"a head: RoPE needs an even number, at least 2; change {FLAG.rotary_percent}")
    if not m.rotary_base > 0 or (m.use_rope_scaling and not m.rope_scaling_factor >= 1.0):
        fail(f"{FLAG.rotary_base} must be > 0 (got {m.rotary_base}) and {FLAG.rope_scaling_factor} >= 1 "
              f"(got {m.rope_scaling_factor})")


def _check_query_groups(m: ModelConfig, tp: int) -> None:
    """Megatron's rule: each tp rank holds whole key/value groups when there are at least tp of them
    (G % tp == 0); with fewer, the groups are replicated (tp % G == 0), each rank using one."""
    if not m.group_query_attention:
        if m.num_query_groups is not None:
            fail(f"{FLAG.num_query_groups} {m.num_query_groups} needs {FLAG.group_query_attention}: add it, or "
                  f"drop {FLAG.num_query_groups} for multi-head attention")
        return
    g, heads = m.num_query_groups, m.num_attention_heads
    positive(g, "num_query_groups")
    if heads % g:
        fail(f"{FLAG.num_attention_heads} {heads} is not divisible by {FLAG.num_query_groups} {g}: every group "
              f"needs the same number of query heads; choose a group count that divides the heads")
    if g >= tp and g % tp:
        fail(f"{FLAG.num_query_groups} {g} is not divisible by {FLAG.tp} {tp}: each tensor-parallel rank "
              f"needs whole key/value groups; use a tp that divides {g}")
    if g < tp and tp % g:
        fail(f"{FLAG.tp} {tp} is not a multiple of {FLAG.num_query_groups} {g}: with fewer groups than tp "
              f"ranks each group is replicated over tp / groups ranks; use a tp that {g} divides")


def check_pipeline(m: ModelConfig, par: ParallelConfig) -> None:
    """The layers over the pipeline stages (and virtual chunks); fills ``par.virtual_stages`` and, with
    virtual chunks, the interleaved schedule."""
    one_of(par, "pipeline_schedule")
    per_virtual = par.num_layers_per_virtual_pipeline_stage
    virtual = FLAG.num_layers_per_virtual_pipeline_stage
    if par.pipeline_schedule == "zb-v" and par.pp > 1:      # at pp = 1 every schedule is no pipelining
        _check_zb_v(m, par)
    elif per_virtual is not None:
        positive(per_virtual, "num_layers_per_virtual_pipeline_stage")
        if par.pipeline_schedule == "zb-h1":
            fail(f"{FLAG.pipeline_schedule} zb-h1 runs one model chunk per rank: drop {virtual}")
        if par.pp < 2:
            fail(f"{virtual} needs {FLAG.pp} >= 2 (got {par.pp}): drop it or use pipeline parallelism")
        if m.num_layers % (par.pp * per_virtual):
            fail(f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.pp} {par.pp} * "
                  f"{virtual} {per_virtual}: each rank needs whole chunks")
        par.virtual_stages = m.num_layers // (par.pp * per_virtual)
        if par.virtual_stages < 2:
            fail(f"{virtual} {per_virtual} gives one chunk per rank "
                  f"({m.num_layers} layers / pp {par.pp}): use a smaller value or drop it")
        par.pipeline_schedule = "interleaved"
    elif par.pipeline_schedule == "interleaved":
        fail(f"{FLAG.pipeline_schedule} interleaved needs {virtual}")
    if m.num_layers % par.pp:
        fail(f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.pp} {par.pp}: "
              f"each pipeline stage needs the same number of layers")


def _check_zb_v(m: ModelConfig, par: ParallelConfig) -> None:
    """zb-v: two chunks per rank in a V (``virtual_stages = 2``), so num-layers / (2 * pp) layers per chunk."""
    per_virtual, virtual = par.num_layers_per_virtual_pipeline_stage, FLAG.num_layers_per_virtual_pipeline_stage
    if m.num_layers % (2 * par.pp):
        fail(f"{FLAG.pipeline_schedule} zb-v puts two chunks on each of the {par.pp} pipeline ranks: "
             f"{FLAG.num_layers} {m.num_layers} must be divisible by 2 * {FLAG.pp} {par.pp} = {2 * par.pp}")
    if per_virtual is not None and per_virtual * 2 * par.pp != m.num_layers:
        fail(f"{FLAG.pipeline_schedule} zb-v runs two chunks per rank ({m.num_layers // (2 * par.pp)} layers "
             f"each), but {virtual} {per_virtual} gives {m.num_layers / (par.pp * per_virtual):g}: drop {virtual}")
    par.virtual_stages = 2


def check_activation_memory(m: ModelConfig) -> None:
    """The recompute and activation-offload flags (Megatron-core's rules, which ``ModelConfig`` has
    already applied to ``--recompute-activations`` and to selective's default modules)."""
    g = m.recompute_granularity
    if m.recompute_activations and g != "full":
        fail(f"{FLAG.recompute_activations} is full recompute; with {FLAG.recompute_granularity} {g} drop it")
    if g is None and (m.recompute_method or m.recompute_num_layers is not None or m.recompute_modules):
        fail(f"{FLAG.recompute_method}, {FLAG.recompute_num_layers} and {FLAG.recompute_modules} apply with "
              f"{FLAG.recompute_granularity}: add it (full or selective) or drop them")
    if g is not None:
        one_of(m, "recompute_granularity")
    if g == "full":
        if m.recompute_method is None or m.recompute_num_layers is None:
            fail(f"{FLAG.recompute_granularity} full needs {FLAG.recompute_method} (uniform or block) and "
                  f"{FLAG.recompute_num_layers} N (or use {FLAG.recompute_activations} for every layer)")
        one_of(m, "recompute_method")
        if not isinstance(m.recompute_num_layers, int) or not 1 <= m.recompute_num_layers <= m.num_layers:
            fail(f"{FLAG.recompute_num_layers} must be between 1 and {FLAG.num_layers} {m.num_layers}, got "
                  f"{m.recompute_num_layers}")
        if m.recompute_modules:
            fail(f"{FLAG.recompute_modules} applies with {FLAG.recompute_granularity} selective; full recompute "
                  f"recomputes every module of the chosen layers")
    if g == "selective":
        if m.recompute_method is not None or m.recompute_num_layers is not None:
            fail(f"{FLAG.recompute_method} and {FLAG.recompute_num_layers} apply with {FLAG.recompute_granularity} "
                  f"full; selective recompute chooses modules ({FLAG.recompute_modules})")
        allowed = choices("recompute_modules")
        if not m.recompute_modules or any(x not in allowed for x in m.recompute_modules):
            fail(f"{FLAG.recompute_modules} takes some of {', '.join(allowed)}, got "
                  f"{' '.join(map(str, m.recompute_modules)) or 'none'}")
        if "moe_act" in m.recompute_modules and not m.num_experts:
            fail(f"{FLAG.recompute_modules} moe_act recomputes the experts' activation: it needs {FLAG.num_experts}")
    if m.cpu_offloading and g == "full":
        fail(f"{FLAG.cpu_offloading} with {FLAG.recompute_granularity} full: a recomputed layer keeps only its "
              f"input, so there is nothing to offload; choose one (or selective recompute with offload)")
    if m.cpu_offloading_num_layers is not None:
        if not m.cpu_offloading:
            fail(f"{FLAG.cpu_offloading_num_layers} applies with {FLAG.cpu_offloading}: add it or drop the count")
        if not isinstance(m.cpu_offloading_num_layers, int) or m.cpu_offloading_num_layers < 1:
            fail(f"{FLAG.cpu_offloading_num_layers} must be a positive integer, got {m.cpu_offloading_num_layers}")
