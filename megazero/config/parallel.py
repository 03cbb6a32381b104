"""The parallel section: how the world splits into tensor-, context-, pipeline-, data- and expert-parallel
ranks, and the pipeline schedule. Its rules check the layout against the world size and the model's
layers over the stages; the rank order is read by :func:`megazero.ranks.parse_order`, the one reading
of ``--parallel-order``::

    par = ParallelConfig(tp=2, pp=2); par.check(world_size=8)           # par.dp == 2
    par.check_layers(num_layers=8)                                      # 4 layers a stage
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.fields import FLAG, flag_field
from megazero.config.rules import fail, one_of, positive
from megazero.ranks import parse_order

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")     # Megatron's --cp-comm-type values (the parser's choices)
BUILT_CP_COMM_TYPES = ("p2p", "a2a", "allgather")          # of those, built here; a2a+p2p is refused by name
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-v")
VIRTUAL_STAGE_SCHEDULES = ("interleaved", "zb-v")           # the schedules that run several chunks per rank
BACKENDS = ("gloo", "nccl")

_PAR = "parallelism"


@dataclass
class ParallelConfig:
    """Layout of the tensor-, pipeline- and data-parallel dimensions."""

    tp: int = flag_field(1, "--tensor-model-parallel-size", "--tp", type=int, group=_PAR,
                         help="tensor-parallel size: ranks that split each layer's weight matrices")
    pp: int = flag_field(1, "--pipeline-model-parallel-size", "--pp", type=int, group=_PAR,
                         help="pipeline-parallel size: stages the layers are split into")
    dp: int | None = flag_field(None, "--data-parallel-size", "--dp", type=int, group=_PAR,
                                help="default: the world / (tp x cp x pp)")
    order: str = flag_field("tp-cp-dp-pp", "--parallel-order", group=_PAR, metavar="ORDER",
                            help="rank order, fastest first (default tp-cp-dp-pp; cp may be left out)")
    cp: int = flag_field(1, "--context-parallel-size", "--cp", type=int, group=_PAR,
                         help="context-parallel size: ranks that split each sequence (2 chunks each, causal "
                              "load balancing)")
    cp_comm_type: str | None = flag_field(
        None, "--cp-comm-type", choices=CP_COMM_TYPES, metavar="{" + ",".join(BUILT_CP_COMM_TYPES) + "}", group=_PAR,
        help="context-parallel attention (default p2p; with --context-parallel-size above 1): p2p (ring), a2a "
             "(Ulysses all-to-all), allgather (gather keys/values); Megatron's a2a+p2p is not built and is refused")
    num_layers_per_virtual_pipeline_stage: int | None = flag_field(
        None, "--num-layers-per-virtual-pipeline-stage", type=int, group=_PAR,
        help="interleaved 1F1B: layers per model chunk")
    pipeline_schedule: str = flag_field(
        "1f1b", "--pipeline-schedule", choices=SCHEDULES, group=_PAR,
        help="interleaved is implied by virtual pipeline stages (gpipe and zb-h1 run one chunk per rank and refuse "
             "them); zb-h1: zero-bubble ZB-H1 (1F1B's memory, a third of its bubble); zb-v: zero-bubble ZB-V (two "
             "chunks per rank in a V, 1F1B's memory, about half ZB-H1's bubble); the zero-bubble ones need pp 2 or "
             "more")
    sequence_parallel: bool = flag_field(False, "--sequence-parallel", action="store_true", group=_PAR,
                                         help="split the activations outside the tensor-parallel regions "
                                              "along the sequence over the tp ranks")
    expert_model_parallel_size: int = flag_field(1, "--expert-model-parallel-size", type=int,
                                                 group="mixture of experts",
                                                 help="experts split over this many dp ranks (default 1)")
    data_parallel_replicas: int = flag_field(
        1, "--data-parallel-replicas", "--num-distributed-optimizer-instances", type=int, group=_PAR, metavar="R",
        help="split the data-parallel ranks into R replicas of dp / R consecutive ranks (HSDP): ZeRO shards within "
             "a replica, gradients are averaged across replicas (default 1: ZeRO shards over all of dp)")
    virtual_stages: int = 1                     # model chunks per rank (v); derived by validate()
    distributed_timeout_minutes: float = flag_field(
        10.0, "--distributed-timeout-minutes", type=float, group=_PAR,
        help="a collective waiting longer ends the job with an error (default 10)")
    ranks_per_node: int | None = flag_field(
        None, "--ranks-per-node", type=int, group=_PAR,
        help="ranks on each node (default: torchrun's LOCAL_WORLD_SIZE); lets one machine act as several nodes")

    @property
    def dp_x_cp(self) -> int:
        """Ranks holding the same weights (dp x cp): the dense parameters' gradients are reduced and their
        ZeRO states sharded over them, and expert-parallel groups are carved out of them (ep must divide it).
        Needs ``dp`` (filled by :meth:`check`)."""
        return self.dp * self.cp

    def check(self, world_size: int) -> None:
        """tp x cp x pp x dp is the world size; fills ``dp`` (world // (tp * cp * pp)) when it is None."""
        positive(self.tp, "tp")
        positive(self.pp, "pp")
        positive(self.cp, "cp")
        positive(self.expert_model_parallel_size, "expert_model_parallel_size")
        self._check_cp_comm_type()
        self._fill_dp(world_size)
        if not self.distributed_timeout_minutes > 0:
            fail(f"{FLAG.distributed_timeout_minutes} must be > 0, got {self.distributed_timeout_minutes}")
        try:
            parse_order(self.order)
        except ValueError:
            fail(f"{FLAG.order} {self.order!r} must name tp, dp and pp once each (and cp at most once), e.g. "
                 f"'tp-cp-dp-pp'")
        if self.sequence_parallel and self.tp < 2:
            fail(f"{FLAG.sequence_parallel} splits activations over the tensor-parallel ranks and does nothing at "
                 f"{FLAG.tp} {self.tp}: drop it, or use {FLAG.tp} 2 or more")
        self._check_replicas()
        ep, cp = self.expert_model_parallel_size, self.cp
        if self.dp_x_cp % ep:
            over = f"data-parallel size {self.dp}" if cp == 1 else f"dp x cp = {self.dp} x {cp} = {self.dp_x_cp}"
            fail(f"{over} is not divisible by {FLAG.expert_model_parallel_size} {ep}: expert groups are carved out "
                 f"of the data{'' if cp == 1 else ' x context'}-parallel group; choose EP dividing {self.dp_x_cp}")

    @property
    def shard_size(self) -> int:
        """The data-parallel ranks ZeRO shards over: dp / ``data_parallel_replicas``. Needs ``dp``."""
        return self.dp // self.data_parallel_replicas

    def _check_replicas(self) -> None:
        """The replica dimension: R divides dp; with context or expert parallelism it is not built."""
        r = self.data_parallel_replicas
        positive(r, "data_parallel_replicas")
        if r == 1:
            return
        if self.dp % r:
            fail(f"{FLAG.data_parallel_replicas} {r} must divide the data-parallel size {self.dp}: each replica holds "
                 f"dp / R ranks")
        for size, name in ((self.cp, FLAG.cp), (self.expert_model_parallel_size, FLAG.expert_model_parallel_size)):
            if size > 1:
                fail(f"{FLAG.data_parallel_replicas} with {name} {size} is not built: drop one of them")

    def _check_cp_comm_type(self) -> None:
        """A given ``--cp-comm-type`` is a built one and has a split sequence to act on (at cp 1 it means
        nothing); fills the default, p2p, where there is one (cp above 1; at cp 1 it stays None, so a
        validated job validates again)."""
        if self.cp_comm_type is None:
            self.cp_comm_type = "p2p" if self.cp > 1 else None
            return
        one_of(self, "cp_comm_type")
        if self.cp_comm_type not in BUILT_CP_COMM_TYPES:
            fail(f"{FLAG.cp_comm_type} {self.cp_comm_type} is not built: use p2p (ring), a2a (Ulysses) or allgather")
        if self.cp == 1:
            fail(f"{FLAG.cp_comm_type} {self.cp_comm_type} chooses how context-parallel ranks share keys and values "
                 f"and does nothing at {FLAG.cp} 1: drop it, or use {FLAG.cp} 2 or more")

    def _fill_dp(self, world: int) -> None:
        mp = self.tp * self.cp * self.pp
        sizes = f"tp*cp*pp = {self.tp}*{self.cp}*{self.pp}" if self.cp > 1 else f"tp*pp = {self.tp}*{self.pp}"
        if self.dp is None:
            if world % mp:
                fail(f"world size {world} is not divisible by {sizes} = {mp}: "
                     f"launch a multiple of {mp} processes (e.g. --nproc-per-node {mp * max(1, world // mp)}) "
                     f"or change {FLAG.tp} / {FLAG.pp}" + (f" / {FLAG.cp}" if self.cp > 1 else ""))
            self.dp = world // mp
        positive(self.dp, "dp")
        if mp * self.dp != world:
            fail(f"{sizes}*dp = {mp * self.dp} (dp {self.dp}) does not equal the "
                 f"world size {world}: launch {mp * self.dp} processes or change "
                 f"{FLAG.dp} (or leave it out to infer it)")

    def check_layers(self, num_layers: int) -> None:
        """The model's layers over the pipeline stages (and virtual chunks); fills ``virtual_stages`` and,
        with virtual chunks, the interleaved schedule."""
        one_of(self, "pipeline_schedule")
        per_virtual = self.num_layers_per_virtual_pipeline_stage
        virtual = FLAG.num_layers_per_virtual_pipeline_stage
        if self.pipeline_schedule in ZERO_BUBBLE_SCHEDULES and self.pp < 2:
            fail(f"{FLAG.pipeline_schedule} {self.pipeline_schedule} is a zero-bubble pipeline schedule and does "
                 f"nothing at {FLAG.pp} {self.pp}: drop it, or use {FLAG.pp} 2 or more")
        if self.pipeline_schedule == "zb-v":
            self._check_zb_v(num_layers)
        elif per_virtual is not None:
            positive(per_virtual, "num_layers_per_virtual_pipeline_stage")
            if self.pipeline_schedule in ("gpipe", "zb-h1"):
                fail(f"{FLAG.pipeline_schedule} {self.pipeline_schedule} runs one model chunk per rank: drop "
                     f"{virtual}, or use a schedule with virtual stages ({' or '.join(VIRTUAL_STAGE_SCHEDULES)})")
            if self.pp < 2:
                fail(f"{virtual} needs {FLAG.pp} >= 2 (got {self.pp}): drop it or use pipeline parallelism")
            if num_layers % (self.pp * per_virtual):
                fail(f"{FLAG.num_layers} {num_layers} is not divisible by {FLAG.pp} {self.pp} * "
                     f"{virtual} {per_virtual}: each rank needs whole chunks")
            self.virtual_stages = num_layers // (self.pp * per_virtual)
            if self.virtual_stages < 2:
                fail(f"{virtual} {per_virtual} gives one chunk per rank "
                     f"({num_layers} layers / pp {self.pp}): use a smaller value or drop it")
            self.pipeline_schedule = "interleaved"
        elif self.pipeline_schedule == "interleaved":
            fail(f"{FLAG.pipeline_schedule} interleaved needs {virtual}")
        if num_layers % self.pp:
            fail(f"{FLAG.num_layers} {num_layers} is not divisible by {FLAG.pp} {self.pp}: "
                 f"each pipeline stage needs the same number of layers")

    def _check_zb_v(self, num_layers: int) -> None:
        """zb-v: two chunks per rank in a V (``virtual_stages = 2``), so num-layers / (2 * pp) layers per chunk."""
        per_virtual, virtual = self.num_layers_per_virtual_pipeline_stage, FLAG.num_layers_per_virtual_pipeline_stage
        if num_layers % (2 * self.pp):
            fail(f"{FLAG.pipeline_schedule} zb-v puts two chunks on each of the {self.pp} pipeline ranks: "
                 f"{FLAG.num_layers} {num_layers} must be divisible by 2 * {FLAG.pp} {self.pp} = {2 * self.pp}")
        if per_virtual is not None and per_virtual * 2 * self.pp != num_layers:
            fail(f"{FLAG.pipeline_schedule} zb-v runs two chunks per rank ({num_layers // (2 * self.pp)} layers "
                 f"each), but {virtual} {per_virtual} gives {num_layers / (self.pp * per_virtual):g}: drop {virtual}")
        self.virtual_stages = 2
