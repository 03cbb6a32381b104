"""A planned run scaled down to CPU processes: the same layout axes, a tiny model.

    d, notes = scale_down(["--tp", "8", "--pp", "4", "--dp", "2", "--num-layers", "32", ...])
    d.world            # 8: tp 2, pp 2, dp 2 -- every axis > 1 in the plan stays > 1 (cp too)
    check(d, workdir)  # then tools.fuzz.checker compares it with its serial twin

What is kept: every switch of the plan (precision, sequence parallel, schedule, ZeRO stage and its
switches, offload to the host, ZeRO++, recompute, activation offload, the model family's flags,
experts and routing, the context-parallel comm type, the seed). What is scaled: each parallel size
above 1 becomes 2 (tp, cp, pp, dp, expert parallel, hpZ partitions; dp 4 where hpZ and experts both
are on, as hpZ cuts the experts' shards from dp / ep; interleaving keeps two chunks per
rank), the model becomes a few layers of width 8 per head, vocabulary 100 of mock data, sequence 16,
and four iterations at the plan's peak learning rate (warmup 1). What is dropped is listed in the notes
(data, checkpoint and logging paths, compile, the memory planner); NVMe swap files go to the scaled
run's directory.
"""
from __future__ import annotations

import argparse

from megazero.cli.arguments import arguments, build_parser, flag_values
from megazero.errors import ConfigError
from tools.fuzz.sampler import NOT_APPLICABLE, STEPS_PER_LEG, Draw, parse_and_validate

# Settings a scaled copy cannot or need not keep: where data, checkpoints and logs go, and what only
# pays off at scale. (section.field)
DROPPED = {"data.data_path", "data.split", "data.tokenizer_type", "data.vocab_file", "data.merge_file",
           "data.tokenizer_model", "data.data_cache_path", "checkpoint.save", "checkpoint.load",
           "checkpoint.save_interval", "checkpoint.finetune", "checkpoint.async_save", "logging.tensorboard_dir",
           "logging.metrics_file", "compilation.compile", "compilation.compile_mode", "train.memory_budget_gib",
           "train.train_iters", "train.eval_interval", "train.eval_iters", "train.log_interval",
           "zero.nvme_path", "parallel.ranks_per_node", "parallel.dp", "model.max_position_embeddings",
           "model.ffn_hidden_size", "model.hidden_size", "model.num_attention_heads", "model.num_query_groups",
           "model.num_layers", "model.seq_length", "model.vocab_size", "model.make_vocab_size_divisible_by",
           "model.num_layers_per_virtual_pipeline_stage", "parallel.num_layers_per_virtual_pipeline_stage",
           "model.recompute_num_layers", "model.cpu_offloading_num_layers", "train.micro_batch_size",
           "train.global_batch_size", "optimizer.lr_warmup_iters", "optimizer.lr_decay_iters", "optimizer.adam_eps",
           "zero.bucket_size", "zero.offload_sub_group_size", "zero.quantization_block_size"}
# The serial twin leaves these out (section.field): the layout and how activations are kept.
LAYOUT_SECTIONS = ("parallel.", "zero.")
LAYOUT_MODEL_FIELDS = {"model.recompute_activations", "model.recompute_granularity", "model.recompute_method",
                       "model.recompute_num_layers", "model.recompute_modules", "model.cpu_offloading",
                       "model.cpu_offloading_num_layers", "fp8.fp8_param_gather"}   # with ZeRO: the layout's


def _two(n: int | None) -> int:
    return 2 if n and n > 1 else 1


def scale_down(argv: list[str], world_size: int | None = None) -> tuple[Draw, list[str]]:
    """The scaled copy of a planned run's flags (``world_size``: the plan's, when it gives no ``--dp``),
    as a :class:`Draw` whose resume layout is the same layout, and notes on what changed."""
    plan, full, notes = _read_plan(argv, world_size)
    layout = _scaled_layout(full, plan, notes)
    sizes, heads = _scaled_sizes(full, layout)
    values = {**{k: v for k, v in plan.items() if k not in DROPPED}, **sizes, **layout}
    serial = {k: v for k, v in values.items() if not k.startswith(LAYOUT_SECTIONS) and k not in LAYOUT_MODEL_FIELDS}
    layout_values = {k: v for k, v in values.items() if k not in serial}
    model_args, layout_args = values_to_argv(serial), values_to_argv(layout_values)
    tp_s, pp_s, dp_s = layout["parallel.tp"], layout["parallel.pp"], layout["parallel.dp"]
    cp_s = layout.get("parallel.cp", 1)
    world = tp_s * cp_s * pp_s * dp_s
    job = parse_and_validate(model_args + layout_args, world)
    parse_and_validate(model_args, 1)
    axes = axes_of(job)
    notes.append(f"scaled: {world} ranks (tp {tp_s}, {f'cp {cp_s}, ' if cp_s > 1 else ''}pp {pp_s}, dp {dp_s}), "
                 f"{job.model.num_layers} layers, hidden "
                 f"{job.model.hidden_size}, heads {heads}, vocab 100 (mock data), sequence 16, "
                 f"{2 * STEPS_PER_LEG} iterations")
    return Draw(0, axes, world, model_args, layout_args, axes, world, layout_args, common=[]), notes


def _read_plan(argv: list[str], world_size: int | None) -> tuple[dict, object, list[str]]:
    """The plan's flag values (``{section.field: value}``, Megatron-LM's spellings read as the trainer
    reads them), its validated job, and the notes saying what it is and what the copy drops."""
    args = build_parser().parse_args(argv)
    if args.config or args.deepspeed_config or args.accelerate_config:
        raise ConfigError("check_layout takes the plan's flags; give the config file's settings as flags")
    plan, _ = flag_values(args)
    tp, pp, cp = plan.get("parallel.tp", 1), plan.get("parallel.pp", 1), plan.get("parallel.cp", 1)
    if world_size is None and plan.get("parallel.dp") is None:
        raise ConfigError("the plan gives no --dp: pass --world-size (its number of processes)")
    world = world_size if world_size is not None else tp * cp * pp * plan["parallel.dp"]
    full = parse_and_validate(argv, world)          # the trainer's own refusals, the world size's among them
    dp = full.parallel.dp
    notes = [f"plan: {tp * cp * pp * dp} ranks (tp {tp}, {f'cp {cp}, ' if cp > 1 else ''}pp {pp}, dp {dp}), "
             f"{full.model.num_layers} layers, hidden "
             f"{full.model.hidden_size}, vocab {full.model.vocab_size}, sequence {full.model.seq_length}"]
    shown = ("data.", "checkpoint.", "logging.", "compilation.", "train.memory_budget_gib")
    dropped = [k.split(".")[1] for k in sorted(plan) if k in DROPPED and k.startswith(shown)]
    if dropped:
        notes.append("dropped (paths and what pays off only at scale): " + ", ".join(dropped))
    return plan, full, notes


def _scaled_layout(full, plan: dict, notes: list[str]) -> dict:
    """The copy's parallel settings: each size above 1 becomes 2, interleaving keeps two chunks per rank,
    NVMe swap goes to the copy's own directory (noted)."""
    par, z = full.parallel, full.zero
    layout = {"parallel.tp": _two(par.tp), "parallel.pp": _two(par.pp), "parallel.dp": _two(par.dp)}
    if par.cp > 1:
        layout["parallel.cp"] = 2
    if "parallel.expert_model_parallel_size" in plan:
        layout["parallel.expert_model_parallel_size"] = _two(par.expert_model_parallel_size)
    if "zero.hpz_partition_size" in plan:
        layout["zero.hpz_partition_size"] = _two(z.hpz_partition_size)
        ep = layout.get("parallel.expert_model_parallel_size", 1)
        if ep > 1 and layout["zero.hpz_partition_size"] > 1:     # hpZ cuts the experts' shards from dp / ep
            layout["parallel.dp"] = ep * 2
    if par.virtual_stages > 1:
        layout["parallel.num_layers_per_virtual_pipeline_stage"] = 1
    if "nvme" in (z.offload_optimizer, z.offload_params):
        layout["zero.nvme_path"] = "."
        notes.append(f"nvme offload: --nvme-path {z.nvme_path} -> the scaled run's directory")
    return layout


def _scaled_sizes(full, layout: dict) -> tuple[dict, int]:
    """The copy's model and batch (a few layers of width 8 per head, vocabulary 100, sequence 16, four
    iterations at the plan's peak learning rate) and its number of heads, divisible as the layout needs."""
    m = full.model
    tp_s, pp_s, dp_s = layout["parallel.tp"], layout["parallel.pp"], layout["parallel.dp"]
    cp_s = layout.get("parallel.cp", 1)
    v_s = 2 if "parallel.num_layers_per_virtual_pipeline_stage" in layout else 1
    ulysses = cp_s > 1 and full.parallel.cp_comm_type == "a2a"   # whole heads and key/value groups per cp rank
    groups = None
    if m.group_query_attention:
        groups = 2 if m.num_query_groups >= full.parallel.tp else 1    # replicated key/values stay replicated
        if ulysses:
            groups = tp_s * cp_s
        heads = max(groups * min(m.num_attention_heads // m.num_query_groups, 2), tp_s)
    else:
        heads = 2 * tp_s * (cp_s if ulysses else 1)
    sizes = {"model.num_layers": max(2, pp_s * v_s), "model.hidden_size": 8 * heads,
             "model.num_attention_heads": heads, "model.seq_length": 16, "model.vocab_size": 100,
             "model.make_vocab_size_divisible_by": 16, "train.micro_batch_size": 1,
             "train.global_batch_size": dp_s * 2 * pp_s, "optimizer.lr_warmup_iters": 1,
             "optimizer.lr_decay_iters": 2 * STEPS_PER_LEG, "optimizer.adam_eps": max(full.optimizer.adam_eps, 1e-6),
             "data.mock_data": True, "train.eval_iters": 0, "train.log_interval": 1, "zero.bucket_size": 2000}
    if m.swiglu:
        sizes["model.ffn_hidden_size"] = 16 * heads
    if groups:
        sizes["model.num_query_groups"] = groups
    if m.num_experts:
        e = max(2, 2 * layout.get("parallel.expert_model_parallel_size", 1))
        sizes["model.num_experts"] = e
        sizes["model.moe_router_topk"] = min(m.moe_router_topk, e)
        if m.moe_router_num_groups:                 # groups of at least 2 experts, keeping at least top-k
            groups = max(1, min(m.moe_router_num_groups, e // 2))
            keep = min(m.moe_router_group_topk, groups)
            sizes["model.moe_router_num_groups"] = groups
            sizes["model.moe_router_group_topk"] = keep if keep * (e // groups) >= sizes["model.moe_router_topk"] \
                else groups
        if isinstance(m.moe_layer_freq, list):      # a layer pattern: its first layer's kind, then its last's
            n = sizes["model.num_layers"]
            sizes["model.moe_layer_freq"] = str([m.moe_layer_freq[0]] + [m.moe_layer_freq[-1]] * (n - 1))
        for width in ("moe_shared_expert_intermediate_size", "moe_ffn_hidden_size"):   # shared: split over tp
            if getattr(m, width):
                sizes[f"model.{width}"] = 8 * heads
    if m.recompute_granularity == "full":
        sizes["model.recompute_num_layers"] = 1
    if m.cpu_offloading_num_layers:
        sizes["model.cpu_offloading_num_layers"] = 1
    return sizes, heads


def values_to_argv(values: dict) -> list[str]:
    """Flags giving ``{section.field: value}``, each by its first spelling (the trainer's parser's table)."""
    table = {dest: (flags, kw) for entries in arguments().values() for flags, dest, kw in entries}
    out = []
    for dest, value in values.items():
        flags, kw = table[dest]
        action = kw.get("action")
        if action == "store_true":
            out += [flags[0]] if value else []
        elif action == "store_false":
            out += [] if value else [flags[0]]
        elif action is argparse.BooleanOptionalAction:
            out.append(flags[0] if value else "--no-" + flags[0][2:])
        elif isinstance(value, list):
            out += [flags[0], *map(str, value)]
        elif value is not None:
            out += [flags[0], str(value)]
    return out


def axes_of(job) -> dict:
    """The fuzzer's axes (:data:`~tools.fuzz.sampler.AXES`) of a validated job, for reports and coverage."""
    m, par, z = job.model, job.parallel, job.zero
    gran = m.recompute_granularity
    return {
        "family": "llama" if m.swiglu or m.normalization == "RMSNorm" else "gpt", "layers": m.num_layers,
        "experts": m.num_experts or 0, "topk": m.moe_router_topk if m.num_experts else NOT_APPLICABLE,
        "aux_loss": m.moe_aux_loss_coeff if m.num_experts else NOT_APPLICABLE,
        "capacity": (m.moe_expert_capacity_factor or 0.0) if m.num_experts else NOT_APPLICABLE,
        "router": ("deepseek" if m.moe_router_score_function == "sigmoid" else "softmax") if m.num_experts
        else NOT_APPLICABLE,
        "precision": job.precision.dtype_name, "micro_batch": job.train.micro_batch_size,
        "micro_batches": job.train.global_batch_size // job.train.micro_batch_size,
        "tp": par.tp, "sp": par.sequence_parallel, "cp": par.cp,
        "cp_comm": par.cp_comm_type if par.cp > 1 else NOT_APPLICABLE, "pp": par.pp,
        "schedule": par.pipeline_schedule if par.pp > 1 else NOT_APPLICABLE,
        "virtual": par.virtual_stages if par.virtual_stages > 1 else NOT_APPLICABLE, "dp": par.dp,
        "order": par.order, "zero": z.zero_stage, "keep_gathered": z.keep_params_gathered,
        "reduce_each_mb": z.reduce_each_microbatch, "overlap_param_gather": z.overlap_param_gather,
        "small_buckets": z.bucket_size < 4_000_000, "ep": par.expert_model_parallel_size,
        "offload_optimizer": z.offload_optimizer, "offload_params": z.offload_params,
        "qwz": z.quantized_weights, "hpz": z.hpz_partition_size, "qgz": z.quantized_gradients,
        "recompute": "none" if gran is None else f"full-{m.recompute_method}" if gran == "full" else "selective",
        "recompute_modules": " ".join(m.recompute_modules) if gran == "selective" else NOT_APPLICABLE,
        "activation_offload": m.cpu_offloading,
        "fp8": job.fp8.fp8_format or "off",
        **({"fp8_recipe": job.fp8.recipe, "fp8_head": job.fp8.fp8_head, "fp8_param_gather": job.fp8.fp8_param_gather}
           if job.fp8.enabled else dict.fromkeys(("fp8_recipe", "fp8_head", "fp8_param_gather"), NOT_APPLICABLE)),
    }
