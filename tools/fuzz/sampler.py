"""Seeded draws from the layout space: a tiny model and a parallel layout, as a ``pretrain_gpt.py`` command.

    d = draw(17)                      # the same seed gives the same draw, on any machine
    d.world, d.axes["zero"]           # 8, 3
    d.command()                       # "torchrun --standalone --nproc-per-node 8 pretrain_gpt.py --mock-data ..."
    d.resume_axes, d.resume_world     # the second layout, which resumes the first one's checkpoint

Every axis is drawn independently from its values (:data:`MODEL_AXES`, :data:`LAYOUT_AXES`, and FP8's,
:data:`FP8_MODEL_AXES` and :data:`FP8_LAYOUT_AXES`, and the MoE router's :data:`ROUTER_AXES`, each from its
own stream; the model family from every built-in family's tiny models, :func:`switch_family`); the draw is
turned into flags, parsed by the trainer's own parser and checked by the trainer's own
:func:`~megazero.config.validate` (and the model family's rules) at its world size. A refused draw is
drawn again: which combinations are allowed is never written down here, so a rule added to the
configuration checks narrows the fuzzer's space by itself. The only limit of its own is the machine's:
``tp * cp * pp * dp <= MAX_WORLD``.
"""
from __future__ import annotations

import functools
import random
import shlex
from dataclasses import dataclass, field

from megazero import config
from megazero.cli.arguments import build_parser, flag_values, job_from_values
from megazero.config import OFFLOAD_DEVICES, SCHEDULES, JobConfig, ModelConfig
from megazero.config.fp8 import FP8_FORMATS, FP8_RECIPES
from megazero.config.model import builtin_families
from megazero.config.parallel import BUILT_CP_COMM_TYPES
from megazero.errors import ConfigError

MAX_WORLD = 8
STEPS_PER_LEG = 2              # iterations before the save, and again after the resume
NOT_APPLICABLE = "-"           # an axis without meaning in a draw (a schedule at pp 1)

# The tiny model every draw shares (the model axes below change it); fp32 runs compare to ~1e-5.
# adam-eps 1e-6: a gradient that is analytically zero (the key bias) is rounding noise of a sign that
# depends on the layout; a smaller epsilon would turn that noise into lr-sized updates.
COMMON = ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "16", "--hidden-size", "32",
          "--num-attention-heads", "4", "--seq-length", "16", "--lr", "5e-3", "--lr-warmup-iters", "1",
          "--lr-decay-iters", str(2 * STEPS_PER_LEG), "--adam-eps", "1e-6", "--clip-grad", "0.5",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "7"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


DEEPSEEK_ROUTER = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                   "--moe-router-bias-update-rate", "0.01", "--moe-router-topk-scaling-factor", "2.5",
                   "--moe-shared-expert-intermediate-size", "32"]


def every(values: tuple, **weights: int) -> tuple[tuple, tuple]:
    """(values, weights) of an axis whose values are the configuration's own list (a schedule or a device
    added there is drawn at once), each of weight 1 unless named: ``every(OFFLOAD_DEVICES, none=6)``."""
    return tuple(values), tuple(weights.get(v, 1) for v in values)


# axis -> (values, weights). The model axes are shared by both layouts of a draw (and its serial twin).
MODEL_AXES: dict[str, tuple[tuple, tuple]] = {
    "family": (("gpt", "llama"), (1, 1)),
    "layers": ((4, 8), (1, 1)),
    "experts": ((0, 2, 4), (3, 1, 1)),            # 0: dense MLPs
    "topk": ((1, 2), (1, 1)),
    "aux_loss": ((0.0, 0.01), (2, 1)),
    "capacity": ((0.0, 1.0, 1.25), (2, 1, 1)),   # expert capacity factor (token dropping); 0: dropless
    "precision": (("fp32", "bf16", "fp16"), (3, 1, 1)),
    "micro_batch": ((1, 2), (1, 1)),
    "micro_batches": ((4, 8), (1, 1)),           # per step, before the data-parallel split
}
# The model family: the default family's two shapes above, replaced in FAMILY_SWITCH of the draws by a tiny
# model of another built-in family (:func:`switch_family`, from the seed's own stream ``family/<seed>``, so that
# a seed not switched keeps its draw).
FAMILY_SWITCH = 0.25


@functools.cache
def other_families() -> dict[str, tuple[str, ...]]:
    """Family axis value -> its model flags, for the tiny models of every built-in family but the default one
    (:attr:`~megazero.spec.ModelSpec.tiny_models`: ``<family>`` for the plain one, ``<family>+<variant>``
    for the others; a family that gives none is drawn with the shared flags alone)."""
    out = {}
    for entry in builtin_families():
        if entry.name != ModelConfig.model_family:
            for variant, flags in entry.spec.tiny_models or (("", ()),):
                out[entry.name + (f"+{variant}" if variant else "")] = ("--model-family", entry.name, *flags)
    return out


def switch_family(rng: random.Random, family: str) -> str:
    """``family`` (a value of MODEL_AXES' family axis), or with probability FAMILY_SWITCH one of
    :func:`other_families`' tiny models, each equally likely."""
    others = sorted(other_families())
    return rng.choice(others) if others and rng.random() < FAMILY_SWITCH else family


# The MoE router, drawn from its own stream (``router/<seed>``) so that the other axes of a seed stay as they were.
ROUTER_AXES: dict[str, tuple[tuple, tuple]] = {
    "router": (("softmax", "deepseek"), (2, 1)),   # deepseek: sigmoid scores, expert bias, scaling, shared experts
}
LAYOUT_AXES: dict[str, tuple[tuple, tuple]] = {
    "tp": ((1, 2, 4), (2, 2, 1)),
    "sp": ((False, True), (1, 1)),
    "cp": ((1, 2, 4), (2, 2, 2)),               # cp 4 leaves tp * pp * dp <= 2: often refused
    "cp_comm": every(BUILT_CP_COMM_TYPES),
    "pp": ((1, 2, 4), (2, 2, 1)),
    "schedule": every(SCHEDULES),
    "virtual": ((2, 4), (1, 1)),                  # chunks per rank, with the interleaved schedule
    "dp": ((1, 2, 4, 8), (1, 2, 1, 1)),
    "order": (("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-cp-tp-pp"), (3, 1, 1, 1)),   # cp after tp unless named
    "zero": ((0, 1, 2, 3), (1, 1, 1, 1)),
    "keep_gathered": ((False, True), (3, 1)),
    "reduce_each_mb": ((False, True), (3, 1)),
    "overlap_param_gather": ((False, True), (3, 1)),
    "small_buckets": ((False, True), (1, 1)),
    "ep": ((1, 2, 4), (1, 1, 1)),
    "offload_optimizer": every(OFFLOAD_DEVICES, none=6, cpu=2),   # nvme: swap files in the run's directory
    "offload_params": every(OFFLOAD_DEVICES, none=6, cpu=2),
    "qwz": ((False, True), (5, 1)),
    "hpz": ((1, 2), (4, 1)),
    "qgz": ((False, True), (5, 1)),
    "recompute": (("none", "full-uniform", "full-block", "selective"), (3, 1, 1, 1)),
    "recompute_modules": (("core_attn", "mlp", "layernorm", "core_attn mlp", "moe_act"), (1, 1, 1, 1, 1)),
    "activation_offload": ((False, True), (5, 1)),
}
# FP8 (docs/fp8.md): the model axes go to the serial twin too; the parameter all-gather is a layout's. Drawn
# from a stream of their own (:func:`draw_fp8`), after the layouts, so adding them moved no earlier axis of any
# seed. An FP8 axis reads ``-`` when FP8 is off, and the parameter all-gather where the rules refuse it.
FP8_MODEL_AXES: dict[str, tuple[tuple, tuple]] = {
    "fp8": (("off",) + FP8_FORMATS, (4,) + (1,) * len(FP8_FORMATS)),
    "fp8_recipe": every(FP8_RECIPES),
    "fp8_head": ((False, True), (2, 1)),
}
FP8_LAYOUT_AXES: dict[str, tuple[tuple, tuple]] = {"fp8_param_gather": ((False, True), (1, 1))}
AXES = {**MODEL_AXES, **ROUTER_AXES, **LAYOUT_AXES, **FP8_MODEL_AXES, **FP8_LAYOUT_AXES}
FP8_OFF = {"fp8": "off", "fp8_recipe": NOT_APPLICABLE, "fp8_head": NOT_APPLICABLE}

# The optimizer a draw steps with, with its settings (the serial twin and the resumed layout step with the same
# one), drawn from its own stream of the seed so that the other axes of every seed stay as they were; a draw
# whose layouts refuse it (Muon with --offload-optimizer) keeps AdamW. Newton-Schulz in fp32 only: in bf16 it
# rounds an input whose last bit depends on the layout's reduction order.
OPTIMIZERS: dict[str, list[str]] = {
    "adamw": [],
    "muon": ["--optimizer", "muon"],
    "muon-plain": ["--optimizer", "dist_muon", "--no-muon-nesterov", "--muon-momentum", "0.9", "--muon-ns-steps",
                   "3", "--muon-adjust-lr", "original"],
}
OPTIMIZER_WEIGHTS = (2, 1, 1)
LOSSY_SWITCHES = ("qwz", "qgz")                   # ZeRO++'s int8 transfers: not bit-faithful by design


def model_flags(a: dict) -> list[str]:
    """The model, precision and batch flags of model axes ``a`` (the serial twin runs exactly these)."""
    out = ["--num-layers", str(a["layers"])] + (LLAMA if a["family"] == "llama" else
                                                 list(other_families().get(a["family"], ())))
    if a["experts"]:
        out += ["--num-experts", str(a["experts"]), "--moe-router-topk", str(a["topk"])]
        if a["aux_loss"]:
            out += ["--moe-aux-loss-coeff", str(a["aux_loss"])]
        if a["capacity"]:
            out += ["--moe-expert-capacity-factor", str(a["capacity"])]
        if a.get("router", "softmax") == "deepseek":
            out += DEEPSEEK_ROUTER
    out += {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "1024"]}[a["precision"]]
    if a.get("fp8", "off") != "off":
        out += ["--fp8-format", a["fp8"], "--fp8-recipe", a["fp8_recipe"]] + (["--fp8-head"] if a["fp8_head"] else [])
    return out + ["--micro-batch-size", str(a["micro_batch"]),
                  "--global-batch-size", str(a["micro_batch"] * a["micro_batches"])]


def layout_flags(a: dict, layers: int) -> list[str]:
    """The parallelism, ZeRO and activation-memory flags of layout axes ``a``."""
    out = ["--tp", str(a["tp"]), "--pp", str(a["pp"]), "--dp", str(a["dp"]), "--zero-stage", str(a["zero"])]
    if a["cp"] > 1:
        out += ["--cp", str(a["cp"]), "--cp-comm-type", a["cp_comm"]]
    if a["order"] != "tp-dp-pp":
        out += ["--parallel-order", a["order"]]
    if a["sp"]:
        out.append("--sequence-parallel")
    if a["schedule"] == "interleaved":
        out += ["--num-layers-per-virtual-pipeline-stage", str(max(1, layers // (a["pp"] * a["virtual"])))]
    elif a["schedule"] != NOT_APPLICABLE:
        out += ["--pipeline-schedule", a["schedule"]]
    switches = {"keep_gathered": "--zero3-keep-params-gathered", "reduce_each_mb": "--zero2-reduce-each-microbatch",
                "overlap_param_gather": "--overlap-param-gather", "qwz": "--zero-quantized-weights",
                "qgz": "--zero-quantized-gradients", "activation_offload": "--cpu-offloading"}
    out += [flag for name, flag in switches.items() if a[name]]
    if a["small_buckets"]:
        out += ["--bucket-size", "2000"]
    if a["ep"] > 1:
        out += ["--expert-model-parallel-size", str(a["ep"])]
    for name in ("offload_optimizer", "offload_params"):
        if a[name] != "none":
            out += ["--" + name.replace("_", "-"), a[name]]
    if "nvme" in (a["offload_optimizer"], a["offload_params"]):
        out += ["--nvme-path", "."]             # the run's own directory (the checker's, or the user's)
    if a["hpz"] > 1:
        out += ["--zero-hpz-partition-size", str(a["hpz"])]
    if a["recompute"].startswith("full"):
        out += ["--recompute-granularity", "full", "--recompute-method", a["recompute"][5:],
                "--recompute-num-layers", "1"]
    elif a["recompute"] == "selective":
        out += ["--recompute-granularity", "selective", "--recompute-modules", *a["recompute_modules"].split()]
    return out


@functools.cache
def _parser():
    """The trainer's parser, built once: building it costs ~30 times a parse, and rejection draws many."""
    return build_parser()


def parse_and_validate(argv: list[str], world: int) -> JobConfig:
    """The JobConfig ``pretrain_gpt.py argv`` would run at ``world`` ranks, by the trainer's own parser,
    :func:`~megazero.config.validate` (the model family's rules with it); :class:`ConfigError` when refused."""
    return config.validate(job_from_values(flag_values(_parser().parse_args(argv))[0]), world)


def pick_axes(rng: random.Random, axes: dict) -> dict:
    """One value of each axis, independently, by the axes' weights."""
    return {name: rng.choices(values, weights)[0] for name, (values, weights) in axes.items()}


def _applicable(model: dict, layout: dict) -> dict:
    """Axes that mean nothing in this draw read ``-`` (no flag is given for them), so that coverage
    counts what was exercised: a schedule without pipeline stages, virtual stages without interleaving,
    recompute modules without selective recompute, the router's axes without experts."""
    model, layout = dict(model), dict(layout)
    if layout["pp"] == 1:
        layout["schedule"] = NOT_APPLICABLE
    if layout["schedule"] != "interleaved":
        layout["virtual"] = NOT_APPLICABLE
    if layout["recompute"] != "selective":
        layout["recompute_modules"] = NOT_APPLICABLE
    if layout["cp"] == 1:
        layout["cp_comm"] = NOT_APPLICABLE
    if not model["experts"]:
        model["topk"] = model["aux_loss"] = model["capacity"] = model["router"] = NOT_APPLICABLE
    return {**model, **layout}


def draw_layout(rng: random.Random, model: dict, max_tries: int = 20000) -> tuple[dict, int, list[str]]:
    """A layout the configuration rules accept for model axes ``model``: (axes, world, layout flags)."""
    for _ in range(max_tries):
        layout = pick_axes(rng, LAYOUT_AXES)
        world = layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"]
        if world > MAX_WORLD:
            continue
        axes = _applicable(model, layout)
        flags = layout_flags(axes, model["layers"])
        try:
            job = parse_and_validate(COMMON + model_flags(model) + flags, world)
        except ConfigError:
            continue
        if axes["schedule"] == "interleaved":
            axes["virtual"] = job.parallel.virtual_stages      # what the flags give, not what was asked
        return axes, world, flags
    raise RuntimeError(f"no valid layout in {max_tries} tries for model axes {model}")


def draw_fp8(rng: random.Random, model: dict, layouts: list[tuple[dict, int, list[str]]],
             optimizer: list[str] = (), max_tries: int = 20) -> tuple[dict, list[str]]:
    """FP8 axes for model axes ``model`` and its ``layouts`` ((axes, world, layout flags) each), stepping with
    the ``optimizer`` flags: (the model's FP8 axes, ``fp8_param_gather`` of each layout). A pick is kept when the serial twin and every layout
    accept it (the trainer's own rules: :meth:`~megazero.config.FP8Config.check` refuses FP8 without torchao,
    so then FP8 is never drawn); after ``max_tries`` refused picks, FP8 is off. The parameter all-gather reads
    ``-`` in a layout that refuses it (ZeRO stage 0, row-wise scales, ZeRO++'s int8 weights)."""
    fp8 = dict(FP8_OFF)
    for _ in range(max_tries):
        pick = pick_axes(rng, FP8_MODEL_AXES)
        if pick["fp8"] == "off":
            break
        try:
            flags = model_flags({**model, **pick}) + list(optimizer)
            parse_and_validate(COMMON + flags, 1)
            for _, world, layout in layouts:
                parse_and_validate(COMMON + flags + layout, world)
        except ConfigError:
            continue
        fp8 = pick
        break
    gathers = []
    for _, world, layout in layouts:
        wanted = pick_axes(rng, FP8_LAYOUT_AXES)["fp8_param_gather"]
        allowed = fp8["fp8"] != "off"
        if allowed:
            try:
                parse_and_validate(COMMON + model_flags({**model, **fp8}) + list(optimizer) + layout
                                   + ["--fp8-param-gather"], world)
            except ConfigError:
                allowed = False
        gathers.append(wanted if allowed else NOT_APPLICABLE)
    return fp8, gathers


def with_fp8(axes: dict, flags: list[str], fp8: dict, gather) -> tuple[dict, list[str]]:
    """A layout's axes and flags with the draw's FP8 axes and its parameter all-gather choice."""
    return {**axes, **fp8, "fp8_param_gather": gather}, flags + (["--fp8-param-gather"] if gather is True else [])


@dataclass(frozen=True)
class Draw:
    """One fuzz point: the model (shared), the layout that trains and saves, and the layout that resumes."""

    seed: int
    axes: dict
    world: int
    model_args: list[str]
    layout_args: list[str]
    resume_axes: dict = field(default_factory=dict)
    resume_world: int = 1
    resume_layout_args: list[str] = field(default_factory=list)
    common: list[str] = field(default_factory=lambda: list(COMMON))     # flags before the model's
    optimizer: str = "adamw"                                             # a key of OPTIMIZERS, in model_args

    @property
    def args(self) -> list[str]:
        return self.common + self.model_args + self.layout_args

    @property
    def resume_args(self) -> list[str]:
        return self.common + self.model_args + self.resume_layout_args

    @property
    def serial_args(self) -> list[str]:
        return self.common + self.model_args

    @property
    def fp8(self) -> bool:
        """FP8 products (both layouts and the serial twin share them): compared at the FP8 tolerance."""
        return self.axes.get("fp8", "off") != "off"

    @property
    def lossy(self) -> bool:
        """ZeRO++ quantization in either layout: compared at the quantized tolerance."""
        return any(a.get(s) is True for a in (self.axes, self.resume_axes) for s in LOSSY_SWITCHES)

    def command(self, which: str = "first", extra: list[str] = ()) -> str:
        """The one-line command of a layout (``first``, ``resume`` or ``serial``) as a user runs it."""
        args, world = {"first": (self.args, self.world), "resume": (self.resume_args, self.resume_world),
                       "serial": (self.serial_args, 1)}[which]
        launch = ["python"] if world == 1 else ["torchrun", "--standalone", "--nproc-per-node", str(world)]
        return shlex.join([*launch, "pretrain_gpt.py", *args, *extra])

    def describe(self, which: str = "first") -> str:
        """The non-default axes of a layout, in one short line."""
        axes = self.axes if which == "first" else {**self.axes, **self.resume_axes}
        defaults = {name: values[0] for name, (values, _) in AXES.items()}
        shown = " ".join(f"{k}={v}" for k, v in axes.items() if v not in (defaults[k], NOT_APPLICABLE))
        return shown + (f" optimizer={self.optimizer}" if self.optimizer != "adamw" else "")


def draw_optimizer(seed: int, model_args: list[str], layouts: list[tuple[list[str], int]]) -> str:
    """The optimizer (a key of :data:`OPTIMIZERS`) of seed ``seed``'s draw, whose model flags are ``model_args``
    and whose layouts are ``layouts`` ([(layout flags, world)]): AdamW where the configuration's rules refuse
    the drawn one for the serial twin or either layout."""
    name = random.Random(f"optimizer {seed}").choices(tuple(OPTIMIZERS), OPTIMIZER_WEIGHTS)[0]
    try:
        for flags, world in [([], 1), *layouts]:
            parse_and_validate(COMMON + model_args + OPTIMIZERS[name] + flags, world)
    except ConfigError:
        return "adamw"
    return name


# Switches drawn per layout, half the time each, from its own random stream (so the other axes are drawn as
# before), where the configuration accepts them. The serial twin runs without them, so each is checked
# against what it replaces: the fused loss against the unfused one, grouped experts against the loop.
LAYOUT_SWITCHES = {"--cross-entropy-loss-fusion": "loss fusion", "--moe-grouped-gemm": "grouped gemm"}


def draw_layout_switches(seed: int, which: str, model_args: list[str], layout: list[str], world: int) -> list[str]:
    """The :data:`LAYOUT_SWITCHES` drawn for one layout (``which``: first or resume) of seed ``seed``'s draw."""
    out = []
    for flag, stream in LAYOUT_SWITCHES.items():
        if random.Random(f"{stream} {which} {seed}").random() < 0.5:
            continue
        try:
            parse_and_validate(COMMON + model_args + layout + [flag], world)
        except ConfigError:
            continue
        out.append(flag)
    return out


def draw(seed: int, fp8: bool = True, families: bool = True) -> Draw:
    """The draw of ``seed``: model axes, then a valid first layout and a valid resume layout for them, then
    their FP8 axes (``fp8=False``: FP8 off, the draw as it was before FP8 joined the space;
    ``families=False``: the default family's two shapes only, the draw as it was before other families
    joined it; fixed-seed tests written then pin those layouts)."""
    rng = random.Random(seed)
    for _ in range(1000):
        model = pick_axes(rng, MODEL_AXES)
        model.update(pick_axes(random.Random(f"router/{seed}"), ROUTER_AXES))
        if families:
            model["family"] = switch_family(random.Random(f"family/{seed}"), model["family"])
        try:
            parse_and_validate(COMMON + model_flags(model), 1)      # the serial twin must run too
        except ConfigError:
            continue
        axes, world, flags = draw_layout(rng, model)
        resume_axes, resume_world, resume_flags = draw_layout(rng, model)
        optimizer = draw_optimizer(seed, model_flags(model), [(flags, world), (resume_flags, resume_world)])
        fp8, (gather, resume_gather) = (
            draw_fp8(random.Random(f"fp8/{seed}"), model,
                     [(axes, world, flags), (resume_axes, resume_world, resume_flags)], OPTIMIZERS[optimizer]) if fp8
            else (dict(FP8_OFF), [NOT_APPLICABLE, NOT_APPLICABLE]))
        axes, flags = with_fp8(axes, flags, fp8, gather)
        resume_axes, resume_flags = with_fp8(resume_axes, resume_flags, fp8, resume_gather)
        flags, resume_flags = (layout + draw_layout_switches(seed, which, model_flags({**model, **fp8}), layout, size)
                               for which, layout, size in (("first", flags, world), ("resume", resume_flags,
                                                                                     resume_world)))
        return Draw(seed, axes, world, model_flags({**model, **fp8}) + OPTIMIZERS[optimizer], flags, resume_axes,
                    resume_world, resume_flags, optimizer=optimizer)
    raise RuntimeError(f"seed {seed}: no valid model in 1000 tries")
