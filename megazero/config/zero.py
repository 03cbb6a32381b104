"""The ZeRO section: data-parallel gradient reduction and what each stage shards, the stage-specific
switches, offload (ZeRO-Offload / Infinity) and ZeRO++. Its rules say what stage each switch needs and
what layout it can use; the engine that builds the stage trusts a checked section
(:func:`megazero.parallel.zero.build_engine`).
"""
from __future__ import annotations

from argparse import BooleanOptionalAction
from dataclasses import dataclass

from megazero.config.fields import FLAG, choices, flag_field
from megazero.config.model import ModelConfig
from megazero.config.parallel import ZERO_BUBBLE_SCHEDULES, ParallelConfig
from megazero.config.precision import PrecisionConfig
from megazero.config.rules import fail, one_of, positive
from megazero.ranks import dp_partitions, local_world_size, rank_grid

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

_PAR, _OFFLOAD = "parallelism", "offload"


@dataclass
class ZeroConfig:
    """Data-parallel gradient reduction and ZeRO sharding."""

    zero_stage: int = flag_field(0, "--zero-stage", type=int, choices=ZERO_STAGES, group=_PAR,
                                 help="0: data parallel; 1: optimizer state sharded; 2: and gradients; "
                                      "3: and parameters")
    bucket_size: int = flag_field(4_000_000, "--bucket-size", type=int, group=_PAR,
                                  help="elements per gradient bucket")
    overlap_grad_reduce: bool = flag_field(True, "--overlap-grad-reduce", action=BooleanOptionalAction, group=_PAR,
                                           help="reduce each gradient bucket behind the backward (default on)")
    overlap_param_gather: bool = flag_field(
        False, "--overlap-param-gather", action="store_true", group=_PAR,
        help="ZeRO-1/2: the updated parameters' all-gathers finish behind the next forward")
    prefetch_layers: int = flag_field(1, "--zero3-prefetch-layers", type=int, group=_PAR,
                                      help="ZeRO-3: layers gathered ahead of compute (default 1; 0: none)")
    prefetch_bucket_elements: int | None = None  # DeepSpeed's stage3_prefetch_bucket_size -> prefetch_layers
    max_live_elements: int | None = None         # DeepSpeed's stage3_max_live_parameters: caps prefetch_layers
    keep_params_gathered: bool = flag_field(
        False, "--zero3-keep-params-gathered", action="store_true", group=_PAR,
        help="ZeRO-3: gather each layer once per step and keep it until its backward in the last micro-batch")
    reduce_each_microbatch: bool = flag_field(
        False, "--zero2-reduce-each-microbatch", action="store_true", group=_PAR,
        help="stage 2: reduce gradients every micro-batch (less memory, m x the gradient traffic)")
    sharded_init: bool = flag_field(
        True, "--sharded-init", action=BooleanOptionalAction, group=_PAR,
        help="build the model on the meta device and give each parameter its values where it lives "
             "(ZeRO-3: shard by shard); default on")
    accumulate_allreduce_grads_in_fp32: bool | None = flag_field(
        None, "--accumulate-allreduce-grads-in-fp32", action=BooleanOptionalAction, group=_PAR,
        help="accumulate and reduce gradients in fp32 (default: on with --bf16)")
    gradient_accumulation_fusion: bool | None = flag_field(
        None, "--gradient-accumulation-fusion", action=BooleanOptionalAction, group=_PAR,
        help="linear layers' weight gradients made straight into the fp32 main gradients (default: on where "
             "that applies: bf16/fp16 parameters with fp32 gradient buckets at ZeRO stage 0 or 1, without "
             "--fp8-format, --compile or a zero-bubble pipeline schedule)")
    wgrad_into_main_grad: bool = False           # derived by validate(): gradient_accumulation_fusion, where it applies
    offload_optimizer: str = flag_field(
        "none", "--offload-optimizer", choices=OFFLOAD_DEVICES, group=_OFFLOAD,
        help="ZeRO 1-3: fp32 masters, Adam moments and the update on the host (cpu) or in swap files (nvme)")
    offload_params: str = flag_field(
        "none", "--offload-params", choices=OFFLOAD_DEVICES, group=_OFFLOAD,
        help="ZeRO-3: parameter shards on the host (cpu) or in swap files (nvme)")
    nvme_path: str | None = flag_field(None, "--nvme-path", group=_OFFLOAD, metavar="DIR",
                                       help="directory for the swap files of nvme offloading")
    offload_pin_memory: bool = flag_field(True, "--offload-pin-memory", action=BooleanOptionalAction,
                                          group=_OFFLOAD, help="page-locked host buffers on CUDA (default on)")
    offload_sub_group_size: int | None = flag_field(   # None: offload.sub_group_elements
        None, "--offload-sub-group-size", type=int, group=_OFFLOAD,
        help="elements updated (and swapped) at a time on the host (default: 1/32 of the rank's shard, at most 4M)")
    offload_delayed_update: bool = flag_field(
        False, "--offload-delayed-update", action="store_true", group=_OFFLOAD,
        help="ZeRO-Offload's one-step delayed parameter update (DPU): the host's optimizer step over step t's "
             "gradients runs during step t+1, whose forward and backward use the parameters before it")
    quantized_weights: bool = flag_field(False, "--zero-quantized-weights", action="store_true", group=_PAR,
                                         help="ZeRO++ qwZ (stage 3): int8 parameter all-gathers")
    quantization_block_size: int = flag_field(4096, "--zero-quantization-block-size", type=int, group=_PAR,
                                              help="elements per int8 block of qwZ and qgZ (one fp32 scale each)")
    hpz_partition_size: int = flag_field(
        1, "--zero-hpz-partition-size", type=int, group=_PAR,
        help="ZeRO++ hpZ (stage 3): backward gathers over K dp ranks (K = dp ranks per node)")
    quantized_gradients: bool = flag_field(
        False, "--zero-quantized-gradients", action="store_true", group=_PAR,
        help="ZeRO++ qgZ (stage 2/3): hierarchical int8 all-to-all gradient reduce")

    def check(self, par: ParallelConfig, world_size: int) -> None:
        """The ZeRO stage, and what each switch (stage-specific options, offload, ZeRO++) needs of it and
        of the layout; with context parallelism, what of ZeRO++ is not built."""
        stage, stages = self.zero_stage, choices("zero_stage")
        if stage not in stages:
            fail(f"{FLAG.zero_stage} must be {', '.join(map(str, stages[:-1]))} or {stages[-1]}, got {stage}")
        positive(self.bucket_size, "bucket_size")
        if self.prefetch_layers < 0:
            fail(f"{FLAG.prefetch_layers} must be >= 0 (0: no prefetch), got {self.prefetch_layers}")
        if self.keep_params_gathered and stage != 3:
            fail(f"{FLAG.keep_params_gathered} applies to {FLAG.zero_stage} 3 only (got {stage}): "
                  f"drop the flag or use {FLAG.zero_stage} 3")
        if self.overlap_param_gather and stage not in (1, 2):
            fail(f"{FLAG.overlap_param_gather} applies to {FLAG.zero_stage} 1 and 2 (got {stage}; stage 3 gathers "
                  f"each layer ahead of its compute, see {FLAG.prefetch_layers}): drop the flag or use stage 1 or 2")
        if self.reduce_each_microbatch and stage != 2:
            fail(f"{FLAG.reduce_each_microbatch} applies to {FLAG.zero_stage} 2 only (got {stage}): "
                  f"drop the flag or use {FLAG.zero_stage} 2")
        self._check_offload()
        self._check_zeropp(par, world_size)
        self._check_replicas(par)
        if par.cp > 1 and (self.hpz_partition_size > 1 or self.quantized_weights or self.quantized_gradients):
            fail(f"{FLAG.cp} {par.cp} with ZeRO++ ({FLAG.hpz_partition_size}, {FLAG.quantized_weights}, "
                 f"{FLAG.quantized_gradients}) is not built: drop the ZeRO++ flags or {FLAG.cp}")

    def _check_replicas(self, par: ParallelConfig) -> None:
        """``--data-parallel-replicas``: ZeRO 1-3 shard within a replica; ZeRO++ shapes its own groups."""
        r = par.data_parallel_replicas
        if r == 1:
            return
        if self.zero_stage == 0:
            fail(f"{FLAG.data_parallel_replicas} {r} splits ZeRO's shards over replicas, and {FLAG.zero_stage} 0 "
                 f"shards nothing: use {FLAG.zero_stage} 1, 2 or 3, or drop {FLAG.data_parallel_replicas}")
        if self.offload_optimizer != "none":
            fail(f"{FLAG.data_parallel_replicas} with {FLAG.offload_optimizer} is not built (the host copy of the "
                 f"gradients is taken before the sum over replicas): drop one of them")
        zeropp = [f for f, on in ((FLAG.hpz_partition_size, self.hpz_partition_size > 1),
                                  (FLAG.quantized_weights, self.quantized_weights),
                                  (FLAG.quantized_gradients, self.quantized_gradients)) if on]
        if zeropp:
            fail(f"{FLAG.data_parallel_replicas} with {zeropp[0]} is not built (ZeRO++ makes its own groups within "
                 f"dp): drop one of them")

    def _check_offload(self) -> None:
        for name in ("offload_optimizer", "offload_params"):
            one_of(self, name)
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            fail(f"{FLAG.offload_optimizer} {self.offload_optimizer} moves the ZeRO optimizer shard: use "
                  f"{FLAG.zero_stage} 1, 2 or 3 (or drop the flag)")
        if self.offload_params != "none" and self.zero_stage != 3:
            fail(f"{FLAG.offload_params} {self.offload_params} applies to {FLAG.zero_stage} 3 only "
                 f"(got {self.zero_stage}): use {FLAG.zero_stage} 3 or drop the flag")
        nvme = "nvme" in (self.offload_optimizer, self.offload_params)
        if nvme and not self.nvme_path:
            fail(f"offloading to nvme needs {FLAG.nvme_path} DIR (a directory on a fast local drive for the swap "
                 f"files)")
        if self.nvme_path and not nvme:
            fail(f"{FLAG.nvme_path} {self.nvme_path} is used only with {FLAG.offload_optimizer} nvme or "
                  f"{FLAG.offload_params} nvme: add one or drop {FLAG.nvme_path}")
        if self.offload_sub_group_size is not None:
            positive(self.offload_sub_group_size, "offload_sub_group_size")
        if self.offload_delayed_update and self.offload_optimizer != "cpu":
            fail(f"{FLAG.offload_delayed_update} delays the host's optimizer step: it needs {FLAG.offload_optimizer} "
                 f"cpu (got {self.offload_optimizer}; with nvme it is not built): add {FLAG.offload_optimizer} cpu "
                 f"or drop {FLAG.offload_delayed_update}")

    def _check_zeropp(self, par: ParallelConfig, world: int) -> None:
        """ZeRO++'s switches: what stage each needs, and a node layout they can use."""
        if par.ranks_per_node is not None and (par.ranks_per_node < 1 or world % par.ranks_per_node):
            fail(f"{FLAG.ranks_per_node} {par.ranks_per_node} must divide the world size {world}: "
                  f"pick a divisor of {world}")
        if self.quantized_weights and self.zero_stage != 3:
            fail(f"{FLAG.quantized_weights} quantizes ZeRO-3's parameter all-gathers: use {FLAG.zero_stage} 3 "
                  f"(got {self.zero_stage}) or drop the flag")
        hpz = FLAG.hpz_partition_size
        if self.hpz_partition_size < 1:
            fail(f"{hpz} must be >= 1 (1: off), got {self.hpz_partition_size}")
        if self.hpz_partition_size > 1:
            if self.zero_stage != 3:
                fail(f"{hpz} applies to {FLAG.zero_stage} 3 only (got {self.zero_stage}): use stage 3 or drop the flag")
            if par.dp is not None and par.dp % self.hpz_partition_size:
                fail(f"{hpz} {self.hpz_partition_size} must divide the data-parallel size {par.dp}: "
                      f"use the number of dp ranks per node")
            ep = par.expert_model_parallel_size
            if par.dp is not None and ep > 1 and (par.dp // ep) % self.hpz_partition_size:
                fail(f"{hpz} {self.hpz_partition_size} must divide the expert-data-parallel size {par.dp // ep} (dp "
                      f"{par.dp} / {FLAG.expert_model_parallel_size} {ep}): the experts' secondary shards are cut "
                      f"from it; use a divisor of {par.dp // ep}")
        if self.quantized_gradients and self.zero_stage not in (2, 3):
            fail(f"{FLAG.quantized_gradients} replaces the gradient reduce-scatter of {FLAG.zero_stage} 2 or 3 "
                 f"(got {self.zero_stage}; DeepSpeed applies it to stage 3): use {FLAG.zero_stage} 2 or 3 or drop "
                 f"the flag")
        if self.quantization_block_size < 1:
            fail(f"{FLAG.quantization_block_size} must be >= 1, got {self.quantization_block_size}")
        if self.hpz_partition_size > 1 and par.dp is not None and not par.dp % self.hpz_partition_size:
            self._check_hpz_nodes(par, world)

    def _check_hpz_nodes(self, par: ParallelConfig, world: int) -> None:
        """hpZ's secondary partitions (K consecutive dp ranks) each lie on one node: that is what makes its
        backward gathers cheap. Nodes are blocks of --ranks-per-node (default torchrun's LOCAL_WORLD_SIZE)."""
        rpn = par.ranks_per_node or local_world_size() or world
        if world % rpn:
            return                                  # the topology refuses this layout, naming the ranks per node
        try:
            grid = rank_grid(world, par.tp, par.pp, par.dp, par.order, rpn, par.expert_model_parallel_size)
        except ValueError:
            return                                  # a layout the parallel checks refuse, naming their flag
        for part in dp_partitions(grid, self.hpz_partition_size):
            if len({r // rpn for r in part}) > 1:
                fail(f"{FLAG.hpz_partition_size} {self.hpz_partition_size} puts ranks {part} of nodes of {rpn} "
                     f"ranks in one secondary partition, which spans nodes: use the number of dp ranks per node "
                     f"(or fewer), or drop the flag")

    def settle_gradient_accumulation_fusion(self, precision: PrecisionConfig, parallel: ParallelConfig,
                                            fp8_enabled: bool, compiling: bool) -> None:
        """``wgrad_into_main_grad``: ``gradient_accumulation_fusion`` (default on) where it applies (after
        :meth:`fill_defaults`); refused, with the reason, where it was asked for and does not apply. The flag's
        own value stays as given, so a validated job validated again with other settings is settled afresh."""
        blocker = self._fusion_blocker(precision, parallel, fp8_enabled, compiling)
        if self.gradient_accumulation_fusion and blocker:
            fail(f"{FLAG.gradient_accumulation_fusion} needs {blocker}: drop it")
        self.wgrad_into_main_grad = blocker is None and self.gradient_accumulation_fusion is not False

    def _fusion_blocker(self, precision: PrecisionConfig, parallel: ParallelConfig, fp8_enabled: bool,
                        compiling: bool) -> str | None:
        """What gradient-accumulation fusion would need and this job lacks, or None."""
        if not (precision.bf16 or precision.fp16) or not self.accumulate_allreduce_grads_in_fp32:
            return (f"bf16 or fp16 parameters with fp32 gradients ({FLAG.bf16} or {FLAG.fp16}, "
                    f"{FLAG.accumulate_allreduce_grads_in_fp32})")
        if self.zero_stage not in (0, 1):
            return f"{FLAG.zero_stage} 0 or 1 (persistent gradient buffers)"
        if fp8_enabled:
            return f"linear layers in the parameters' precision (no {FLAG.fp8_format})"
        if compiling:
            return f"eager layers (no {FLAG.compile})"
        if parallel.pipeline_schedule in ZERO_BUBBLE_SCHEDULES:
            return "a backward that is not split (no zero-bubble pipeline schedule)"
        return None

    def fill_defaults(self, model: ModelConfig, precision: PrecisionConfig, tp: int) -> None:
        """ZeRO settings whose defaults come from other sections: fp32 gradient buckets on with bf16
        (Megatron's main grads), and DeepSpeed's prefetch bucket and live-parameter cap (elements) as whole
        layers."""
        if self.accumulate_allreduce_grads_in_fp32 is None:
            self.accumulate_allreduce_grads_in_fp32 = precision.bf16
        per_layer = max(1, (4 * model.hidden_size ** 2 + 2 * model.hidden_size * model.ffn_hidden_size) // tp)
        if self.prefetch_bucket_elements is not None:
            self.prefetch_layers = max(1, self.prefetch_bucket_elements // per_layer)
        if self.max_live_elements is not None:       # gathered at once: the layer computing and the prefetched ones
            self.prefetch_layers = min(self.prefetch_layers, max(0, self.max_live_elements // per_layer - 1))
