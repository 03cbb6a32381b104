"""The model section every family shares, and the registry of model families' config classes.

A model family (``--model-family``, :mod:`megazero.spec`) owns its configuration: a dataclass that
extends :class:`ModelConfig` with the family's own fields (each a flag, :func:`flag_field`) and rules
(its ``check``, which calls ``super().check`` first). The GPT family's is
:class:`megazero.models.gpt.GPTConfig` (RoPE, SwiGLU, grouped-query attention, MoE, ...); a family of
one's own::

    @dataclass
    class SoftcapConfig(ModelConfig):
        logit_softcap: float = flag_field(30.0, "--logit-softcap", type=float, group="model",
                                          help="logits = c tanh(logits / c) (Gemma 2's soft cap)")

        def check(self, parallel):
            super().check(parallel)
            positive_float(self.logit_softcap, "logit_softcap")

Registering the family's spec (:func:`megazero.spec.register_model_spec`) registers the class here
(:func:`register_family`), so the command line parses its flags, ``JobConfig.from_dict`` builds it and
:func:`megazero.config.validate` runs its rules. Built-in families are the packages of
``megazero/models/``, each registering its spec when imported: they are found and imported the first time a
family is looked up by name (:func:`load_builtin_families`), so importing the configuration imports no model
and adding a family touches no file outside its package.

What this base class holds is what code outside a family reads of any model: the decoder's sizes
(layers, width, heads, MLP width, sequence, vocabulary), its tied or untied head, dropout and init,
and the activation-memory choices (Megatron-core's recompute and offload flags; their meaning is
:mod:`megazero.spec.recompute`'s).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar

from megazero.config.fields import FLAG, fields_changed, flag, flag_field, flag_fields
from megazero.config.rules import fail, one_of, positive, positive_float
from megazero.errors import ConfigError

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe_act", "layernorm")   # megazero/spec/recompute.py says what each keeps

# The fields that choose what activations are kept, recomputed or offloaded (what the memory planner sets).
ACTIVATION_MEMORY_FIELDS = ("recompute_activations", "recompute_granularity", "recompute_method",
                            "recompute_num_layers", "recompute_modules", "cpu_offloading", "cpu_offloading_num_layers")

_MODEL, _ACT = "model", "activation memory"


@dataclass
class ModelConfig:
    """The sizes and activation-memory choices of a decoder, whatever its family. ``vocab_size`` is the
    tokenizer's; the embedding is padded (:meth:`padded_vocab_size`). The defaults, with the other
    sections', are the embedded default run (``python pretrain_gpt.py``): a 1.3M-parameter GPT."""

    model_family: str = flag_field("gpt", "--model-family", group=_MODEL, metavar="NAME", help=(
        "the model family to build, by name (a registered model spec; default gpt: GPT-2 and the Llama family)"))
    num_layers: int = flag_field(4, "--num-layers", type=int, group=_MODEL, help="transformer layers")
    hidden_size: int = flag_field(128, "--hidden-size", type=int, group=_MODEL, help="model width")
    num_attention_heads: int = flag_field(4, "--num-attention-heads", type=int, group=_MODEL,
                                          help="attention heads per layer")
    ffn_hidden_size: int | None = flag_field(None, "--ffn-hidden-size", type=int, group=_MODEL,
                                             help="default 4 * hidden size")
    seq_length: int = flag_field(128, "--seq-length", type=int, group=_MODEL, help="tokens per training sequence")
    max_position_embeddings: int | None = flag_field(
        None, "--max-position-embeddings", type=int, group=_MODEL,
        help="positions the model can embed (default: the sequence length)")
    vocab_size: int = flag_field(512, "--vocab-size", type=int, group=_MODEL,
                                 help="with --mock-data; else the tokenizer's")
    make_vocab_size_divisible_by: int = flag_field(128, "--make-vocab-size-divisible-by", type=int, group=_MODEL,
                                                   help="the embedding is padded to a multiple of this x tp")
    untie_embeddings_and_output_weights: bool = flag_field(
        False, "--untie-embeddings-and-output-weights", action="store_true", group=_MODEL,
        help="an output layer of its own instead of the input embedding's weights")
    attention_dropout: float = flag_field(0.0, "--attention-dropout", type=float, group=_MODEL,
                                          help="dropout on the attention probabilities")
    hidden_dropout: float = flag_field(0.0, "--hidden-dropout", type=float, group=_MODEL,
                                       help="dropout on the embeddings and each attention and MLP output")
    init_method_std: float = flag_field(0.02, "--init-method-std", type=float, group=_MODEL,
                                        help="standard deviation of the normal weight initialisation")
    # Activation memory (Megatron-core's flag names and meanings; megazero/spec/recompute.py, docs/memory.md).
    recompute_activations: bool = flag_field(
        False, "--recompute-activations", action="store_true", group=_ACT,
        help="full recompute of every layer: the same as --recompute-granularity full --recompute-method uniform "
             "--recompute-num-layers 1")
    recompute_granularity: str | None = flag_field(
        None, "--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, group=_ACT,
        help="full: layers keep only their input (with --recompute-method and --recompute-num-layers); "
             "selective: the --recompute-modules are recomputed")
    recompute_method: str | None = flag_field(
        None, "--recompute-method", choices=RECOMPUTE_METHODS, group=_ACT,
        help="full recompute: uniform (each chunk's layers in groups of --recompute-num-layers, a group keeping "
             "its input) or block (the first --recompute-num-layers layers of each chunk, the rest not)")
    recompute_num_layers: int | None = flag_field(None, "--recompute-num-layers", type=int, group=_ACT,
                                                  help="the group size (uniform) or layer count (block)")
    recompute_modules: list[str] | None = flag_field(
        None, "--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, group=_ACT,
        help="selective recompute: core_attn (default), mlp, moe_act, layernorm")
    cpu_offloading: bool = flag_field(False, "--cpu-offloading", "--offload-activations", action="store_true",
                                      group=_ACT, help="keep the saved activations of layers in host memory "
                                                       "between their forward and their backward")
    cpu_offloading_num_layers: int | None = flag_field(
        None, "--cpu-offloading-num-layers", type=int, group=_ACT,
        help="with --cpu-offloading: the first N layers of each model chunk (default: all of them)")

    # The field of a family's class that counts the routed experts of an MoE layer (None: no experts).
    experts_field: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.recompute_activations and self.recompute_granularity is None:    # Megatron's full recompute
            self.recompute_granularity = "full"
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
        if self.recompute_granularity == "selective" and self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]                                # Megatron's default

    # ---- what code outside the family reads of any model ------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (one per query head unless the family groups them)."""
        return self.num_attention_heads

    @property
    def routed_experts(self) -> int:
        """Experts of each MoE layer (0: a dense model)."""
        return int(getattr(self, self.experts_field) or 0) if self.experts_field else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Does global layer ``layer`` hold experts instead of a dense MLP?"""
        return False

    @property
    def layer_period(self) -> int:
        """The layers' pattern repeats every this many layers (the memory estimate extrapolates in whole
        periods)."""
        return 1

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    # ---- rules ---------------------------------------------------------------------------------------
    def check(self, parallel) -> None:
        """The rules of any family: the sizes against the tensor-, sequence-, context- and expert-parallel
        layout (``parallel``: a checked :class:`~megazero.config.parallel.ParallelConfig`), dropout and
        init, and the activation-memory flags. A family's class extends it (``super().check(parallel)``
        first)."""
        if not isinstance(self.model_family, str) or not self.model_family.strip():
            fail(f"{FLAG.model_family} must name a model family, got {self.model_family!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                     "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by"):
            positive(getattr(self, name), name)
        if self.hidden_size % self.num_attention_heads:
            fail(f"{FLAG.hidden_size} {self.hidden_size} is not divisible by {FLAG.num_attention_heads} "
                 f"{self.num_attention_heads}: choose a head count that divides the hidden size")
        self._check_tensor_parallel(parallel)
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        positive_float(self.init_method_std, "init_method_std")
        self._check_experts(parallel)
        self._check_context_parallel(parallel)
        self._check_activation_memory()

    def _check_tensor_parallel(self, par) -> None:
        """Whole heads and MLP columns on each tp rank; the vocabulary and (sequence parallel) the sequence
        split evenly."""
        if self.num_attention_heads % par.tp:
            fail(f"{FLAG.num_attention_heads} {self.num_attention_heads} is not divisible by {FLAG.tp} {par.tp}: "
                 f"each tensor-parallel rank needs whole heads; use a tp that divides the head count")
        if self.ffn_hidden_size % par.tp:
            fail(f"{FLAG.ffn_hidden_size} {self.ffn_hidden_size} is not divisible by {FLAG.tp} {par.tp}: "
                 f"choose an ffn size that is a multiple of tp")
        if self.padded_vocab_size(par.tp) % par.tp:
            fail(f"padded vocab {self.padded_vocab_size(par.tp)} is not divisible by {FLAG.tp} {par.tp}: "
                 f"set {FLAG.make_vocab_size_divisible_by} to a multiple of tp")
        if self.max_position_embeddings < self.seq_length:
            fail(f"{FLAG.max_position_embeddings} {self.max_position_embeddings} is smaller than {FLAG.seq_length} "
                 f"{self.seq_length}: raise it to at least the sequence length")
        if par.sequence_parallel and self.seq_length % par.tp:
            fail(f"{FLAG.sequence_parallel} needs {FLAG.seq_length} ({self.seq_length}) divisible by {FLAG.tp} "
                 f"{par.tp}: change the sequence length or drop {FLAG.sequence_parallel}")

    def _check_experts(self, par) -> None:
        """Expert parallelism needs experts, and splits each MoE layer's into equal whole shares."""
        ep, experts = par.expert_model_parallel_size, self.routed_experts
        if ep > 1 and not experts:
            needs = (f"needs {flag(self.experts_field)}" if self.experts_field
                     else f"needs experts, and {FLAG.model_family} {self.model_family} has none")
            fail(f"{FLAG.expert_model_parallel_size} {ep} {needs}: there are no experts to split")
        if experts and experts % ep:
            fail(f"{flag(self.experts_field)} {experts} is not divisible by {FLAG.expert_model_parallel_size} {ep}: "
                 f"each expert-parallel rank holds the same number of whole experts")

    def _check_context_parallel(self, par) -> None:
        """The sequence cuts into 2 x cp equal chunks (causal load balancing: cp rank r holds chunks r and
        2cp-1-r), Ulysses' all-to-all needs whole heads and key/value groups per cp rank, and what is not
        built for a split sequence is refused by name."""
        cp = par.cp
        if cp == 1:
            return
        if self.seq_length % (2 * cp):
            fail(f"{FLAG.cp} {cp} needs {FLAG.seq_length} ({self.seq_length}) divisible by 2 x cp = {2 * cp} (each cp "
                 f"rank holds two of 2 x cp equal chunks, for causal load balancing): use a multiple of {2 * cp}")
        if par.sequence_parallel and (self.seq_length // cp) % par.tp:
            fail(f"{FLAG.sequence_parallel} with {FLAG.cp} {cp} needs each cp rank's {self.seq_length // cp} tokens "
                 f"divisible by {FLAG.tp} {par.tp}: use a {FLAG.seq_length} that is a multiple of {cp * par.tp}")
        if par.cp_comm_type == "a2a":
            heads = self.num_attention_heads // par.tp
            groups = self.kv_heads // par.tp if self.kv_heads >= par.tp else 1
            if heads % cp or groups % cp:
                fail(f"{FLAG.cp_comm_type} a2a (Ulysses) gives each cp rank whole heads: the {heads} query heads and "
                     f"{groups} key/value group(s) per tp rank must divide by {FLAG.cp} {cp}; use a cp that divides "
                     f"both, or {FLAG.cp_comm_type} p2p")
        if self.attention_dropout > 0:
            fail(f"{FLAG.attention_dropout} {self.attention_dropout} with {FLAG.cp} {cp}: context-parallel attention "
                 f"has no dropout; set {FLAG.attention_dropout} 0")

    def _check_activation_memory(self) -> None:
        """The recompute and activation-offload flags (Megatron-core's rules, which ``__post_init__`` has
        already applied to ``--recompute-activations`` and to selective's default modules)."""
        g = self.recompute_granularity
        if self.recompute_activations and g != "full":
            fail(f"{FLAG.recompute_activations} is full recompute; with {FLAG.recompute_granularity} {g} drop it")
        if g is None and (self.recompute_method or self.recompute_num_layers is not None or self.recompute_modules):
            fail(f"{FLAG.recompute_method}, {FLAG.recompute_num_layers} and {FLAG.recompute_modules} apply with "
                 f"{FLAG.recompute_granularity}: add it (full or selective) or drop them")
        if g is not None:
            one_of(self, "recompute_granularity")
        if g == "full":
            self._check_full_recompute()
        if g == "selective":
            self._check_selective_recompute()
        if self.cpu_offloading and g == "full":
            fail(f"{FLAG.cpu_offloading} with {FLAG.recompute_granularity} full: a recomputed layer keeps only its "
                 f"input, so there is nothing to offload; choose one (or selective recompute with offload)")
        if self.cpu_offloading_num_layers is not None:
            if not self.cpu_offloading:
                fail(f"{FLAG.cpu_offloading_num_layers} applies with {FLAG.cpu_offloading}: add it or drop the count")
            if not isinstance(self.cpu_offloading_num_layers, int) or self.cpu_offloading_num_layers < 1:
                fail(f"{FLAG.cpu_offloading_num_layers} must be a positive integer, got "
                     f"{self.cpu_offloading_num_layers}")

    def check_chunk_layers(self, parallel) -> None:
        """The per-chunk layer counts of the recompute and activation-offload flags fit a model chunk
        (``parallel``: after :meth:`~megazero.config.parallel.ParallelConfig.check_layers`, which fills
        ``virtual_stages``): counting past a chunk's last layer means nothing."""
        chunk = self.num_layers // (parallel.pp * parallel.virtual_stages)
        where = (f"{FLAG.num_layers} {self.num_layers} over {FLAG.pp} {parallel.pp}"
                 + (f" x {parallel.virtual_stages} virtual stages" if parallel.virtual_stages > 1 else ""))
        for name in ("recompute_num_layers", "cpu_offloading_num_layers"):
            n = getattr(self, name)
            if n is not None and n > chunk:
                fail(f"{flag(name)} {n} counts layers of each model chunk, which holds {chunk} ({where}): "
                     f"use at most {chunk}")

    def _check_full_recompute(self) -> None:
        if self.recompute_method is None or self.recompute_num_layers is None:
            fail(f"{FLAG.recompute_granularity} full needs {FLAG.recompute_method} (uniform or block) and "
                 f"{FLAG.recompute_num_layers} N (or use {FLAG.recompute_activations} for every layer)")
        one_of(self, "recompute_method")
        if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
            fail(f"{FLAG.recompute_num_layers} must be a positive integer, got {self.recompute_num_layers}")
        if self.recompute_modules:
            fail(f"{FLAG.recompute_modules} applies with {FLAG.recompute_granularity} selective; full recompute "
                 f"recomputes every module of the chosen layers")

    def _check_selective_recompute(self) -> None:
        if self.recompute_method is not None or self.recompute_num_layers is not None:
            fail(f"{FLAG.recompute_method} and {FLAG.recompute_num_layers} apply with {FLAG.recompute_granularity} "
                 f"full; selective recompute chooses modules ({FLAG.recompute_modules})")
        allowed = RECOMPUTE_MODULES
        if not self.recompute_modules or any(x not in allowed for x in self.recompute_modules):
            fail(f"{FLAG.recompute_modules} takes some of {', '.join(allowed)}, got "
                 f"{' '.join(map(str, self.recompute_modules)) or 'none'}")
        if "moe_act" in self.recompute_modules and not self.routed_experts:
            needs = flag(self.experts_field) if self.experts_field else "experts"
            fail(f"{FLAG.recompute_modules} moe_act recomputes the experts' activation: it needs {needs}")


# ---- the registry of model families -------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """A registered model family as the configuration sees it: its config class and what its layers can
    take (a sequence split over context-parallel ranks; regions ``--compile`` compiles), and its spec
    (:class:`megazero.spec.ModelSpec`, handed out by :func:`megazero.spec.get_model_spec`)."""

    name: str
    config: type[ModelConfig]
    context_parallel: bool = False
    compilable: bool = False
    fp8: bool = False
    spec: Any = None


# The package whose sub-packages are megazero's own families: each registers its spec when imported.
MODELS_PACKAGE = "megazero.models"
_FAMILIES: dict[str, Family] = {}
_BUILTINS_LOADED = False
_REGISTERING = False


def register_family(entry: Family) -> Family:
    """Make ``entry`` findable by name; registering a name again replaces it (a test re-registering its
    model in a reused worker process). Its config class must extend :class:`ModelConfig` and declare no
    flag another section or family spells differently."""
    if not (isinstance(entry.config, type) and issubclass(entry.config, ModelConfig)):
        raise TypeError(f"model family {entry.name!r}: its config must be a ModelConfig subclass, got {entry.config}")
    global _REGISTERING
    previous = _FAMILIES.get(entry.name)
    _FAMILIES[entry.name] = entry
    fields_changed()
    _REGISTERING = True                         # the check reads the families registered so far, finds none
    try:
        list(flag_fields())                     # a clash of flags is the family author's error, said now
    except RuntimeError:
        if previous is None:
            del _FAMILIES[entry.name]
        else:
            _FAMILIES[entry.name] = previous
        raise
    finally:
        _REGISTERING = False
        fields_changed()                        # the next lookup's table holds every family
    return entry


def load_builtin_families() -> None:
    """Import every package of ``megazero/models/`` once (each registers its family's spec on import)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED or _REGISTERING:        # a family's import registering it imports no other family
        return
    _BUILTINS_LOADED = True
    models = importlib.import_module(MODELS_PACKAGE)
    for entry in pkgutil.iter_modules(models.__path__, f"{MODELS_PACKAGE}."):
        if entry.ispkg:
            importlib.import_module(entry.name)


def family(name: str) -> Family:
    """The family registered as ``name``; a ConfigError naming ``--model-family`` and the known names."""
    if name not in _FAMILIES:
        load_builtin_families()
    if name not in _FAMILIES:
        raise ConfigError(f"{FLAG.model_family} {name!r} is not a registered model: use one of "
                          f"{', '.join(family_names())} (or register a ModelSpec of that name first)")
    return _FAMILIES[name]


def family_names() -> list[str]:
    load_builtin_families()
    return sorted(_FAMILIES)


def builtin_families() -> list[Family]:
    """The families megazero comes with, by name: each defined in its own package ``megazero/models/<name>/``
    (a family registered elsewhere under another name, with a built-in family's config class, is not one)."""
    load_builtin_families()
    return [entry for name, entry in sorted(_FAMILIES.items())
            if entry.config.__module__.startswith(f"{MODELS_PACKAGE}.{name}.")]


def registered_families() -> list[Family]:
    """Every family, the built-in ones loaded first."""
    load_builtin_families()
    return list(_FAMILIES.values())


def model_config(values: dict, *, strict: bool = True) -> ModelConfig:
    """The model section of ``values`` (``{field: value}``) as its family's config class, from the class
    defaults. A field the family does not have is an error naming its flag (``strict=False`` drops it: a
    config saved by a newer version)."""
    name = values.get("model_family", ModelConfig.model_family)
    cls = family(name).config if isinstance(name, str) else ModelConfig
    known = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(values) - known)
    if extra and strict:
        named = ", ".join(_setting_of(n) for n in extra)
        raise ConfigError(f"{named}: not a setting of {FLAG.model_family} {name} (its {cls.__name__} has no "
                          f"such field): drop it, or choose the model family that has it")
    return cls(**{k: v for k, v in values.items() if k in known})


def _setting_of(name: str) -> str:
    try:
        return flag(name)
    except KeyError:
        return repr(name)


def check_family(job) -> Family:
    """``job.model`` is of its registered family's class, and the layout and compilation ask nothing of
    the family's layers that they cannot do (called by :func:`megazero.config.validate`)."""
    entry = family(job.model.model_family)
    if not isinstance(job.model, entry.config):
        raise ConfigError(f"{FLAG.model_family} {entry.name}: the model section is a {type(job.model).__name__}, "
                          f"not the family's {entry.config.__name__}: build it with that class")
    if job.parallel.cp > 1 and not entry.context_parallel:
        raise ConfigError(f"{FLAG.cp} {job.parallel.cp}: {FLAG.model_family} {entry.name} cannot take a "
                          f"sequence split over ranks (ModelSpec.context_parallel): drop {FLAG.cp}")
    if job.fp8.enabled and not entry.fp8:
        raise ConfigError(f"{FLAG.model_family} {entry.name} declares no layers that run in FP8 (ModelSpec.fp8_layers): "
                          f"drop {FLAG.fp8_format}")
    if job.compilation.compile and not entry.compilable:
        raise ConfigError(f"{FLAG.model_family} {entry.name} names no regions to compile (ModelSpec.compile_regions): "
                          f"drop {FLAG.compile}")
    return entry
