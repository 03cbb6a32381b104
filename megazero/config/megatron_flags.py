"""Megatron-LM's flags and what each one is here: the one home of that table.

A Megatron-LM launch script runs with ``pretrain_gpt.py`` unchanged apart from its launcher line, or stops
with one line for each flag that has no meaning here. Every Megatron flag this module lists is one of:

``as-is``           megazero has the flag under Megatron's name and meaning (declared on its config field in
                    :mod:`megazero.config.sections`; :data:`AS_IS` lists them so the table is complete)
``mapped``          the flag sets our settings under other names (:data:`MAPPED`:
                    ``--use-distributed-optimizer`` is ``--zero-stage 1``)
``implementation``  the flag only tunes Megatron's implementation (kernels, fusions, loaders, allocator) and ignoring
                    it cannot change the numbers (:data:`IMPLEMENTATION`): accepted, all of them named in one
                    line at start
``restated``        accepted when it restates what the model already is (:data:`RESTATED`: ``--kv-channels``
                    equal to hidden size / attention heads), refused in one line otherwise
``refused``         no meaning here (:data:`REFUSED`): one line naming our equivalent, or saying it does not exist

plus :data:`MEGATRON_TOKENIZERS`, Megatron's ``--tokenizer-type`` names that are not ours. The parser
(:mod:`megazero.cli.arguments`) and ``docs/megatron-flags.md`` (generated from here) both read these tables, and
``tests/test_megatron_flags.py`` checks every row against what the parser does.
"""
from __future__ import annotations

import difflib
from argparse import SUPPRESS
from dataclasses import dataclass, field

from megazero.config.fields import dest, flag
from megazero.errors import ConfigError

# Megatron-LM flags that are ours under the same name and meaning (each is a spelling of a config field).
AS_IS = (
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
    "--max-position-embeddings", "--vocab-size", "--make-vocab-size-divisible-by",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "--hidden-dropout", "--init-method-std",
    "--norm-epsilon", "--layernorm-epsilon", "--position-embedding-type", "--rotary-base", "--rotary-percent",
    "--use-rope-scaling", "--rope-scaling-factor", "--normalization", "--apply-layernorm-1p", "--swiglu",
    "--group-query-attention", "--num-query-groups", "--disable-bias-linear", "--add-qkv-bias",
    "--num-experts", "--moe-router-topk", "--moe-layer-freq", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
    "--moe-expert-capacity-factor", "--moe-grouped-gemm", "--expert-model-parallel-size", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-router-score-function", "--moe-router-topk-scaling-factor",
    "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "--moe-router-load-balancing-type",
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
    "--v-head-dim", "--mtp-num-layers", "--mtp-loss-scaling-factor", "--rope-type", "--rotary-scaling-factor",
    "--mscale", "--mscale-all-dim",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--context-parallel-size", "--cp-comm-type",
    "--sequence-parallel", "--distributed-timeout-minutes", "--overlap-grad-reduce", "--overlap-param-gather",
    "--accumulate-allreduce-grads-in-fp32", "--no-gradient-accumulation-fusion",
    "--micro-batch-size", "--global-batch-size", "--step-batch-size-schedule", "--train-iters", "--train-samples",
    "--exit-duration-in-mins",
    "--seed", "--eval-interval", "--eval-iters", "--log-interval", "--check-for-nan-in-loss-and-grad",
    "--lr", "--min-lr", "--decoupled-lr", "--decoupled-min-lr", "--lr-warmup-iters", "--lr-warmup-fraction",
    "--lr-warmup-samples", "--lr-decay-iters", "--lr-decay-samples", "--lr-decay-style", "--weight-decay",
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad",
    "--optimizer", "--muon-momentum", "--muon-use-nesterov", "--muon-num-ns-steps", "--num-distributed-optimizer-instances",
    "--bf16", "--fp16", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis",
    "--data-path", "--split", "--mock-data", "--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model",
    "--data-cache-path", "--eod-mask-loss",
    "--save", "--load", "--save-interval", "--finetune", "--async-save", "--no-load-optim", "--no-load-rng",
    "--use-checkpoint-args", "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler",
    "--tensorboard-dir",
    "--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks",
    "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
)


@dataclass(frozen=True)
class Mapped:
    """A Megatron flag (a switch) that sets our settings ``sets`` ({config field: value}); ``hint`` ends the
    refusal when the command line gives one of those settings another value."""

    sets: dict
    help: str
    hint: str = "drop one"


MAPPED: dict[str, Mapped] = {
    "--use-distributed-optimizer": Mapped(
        {"zero_stage": 1}, "Megatron's distributed optimizer (optimizer state sharded over the data-parallel ranks): "
                           "--zero-stage 1", "for ZeRO stage 2 or 3 drop --use-distributed-optimizer"),
    "--grad-reduce-in-bf16": Mapped(
        {"accumulate_allreduce_grads_in_fp32": False}, "gradients reduced in bf16, as Megatron's: "
                                                       "--no-accumulate-allreduce-grads-in-fp32"),
    "--checkpoint-activations": Mapped(
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        "older Megatron's full recompute: --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1"),
    "--use-rotary-position-embeddings": Mapped({"position_embedding_type": "rope"},
                                               "older Megatron's RoPE switch: --position-embedding-type rope"),
}
# Megatron spellings of options that are not config fields: {Megatron's: ours}.
ALIASES = {"--distributed-backend": "--backend"}


@dataclass(frozen=True)
class Implementation:
    """A Megatron flag that only tunes Megatron's implementation. ``note``: what runs here instead (its row in
    docs/megatron-flags.md and its help); a switch when ``choices`` and ``type`` are None. ``refused``: values
    that are not an implementation choice here ({value: why}); ``requires``: {config field: value} under which
    ignoring it cannot change the numbers, ``why`` the reason said when the job has another value."""

    note: str
    choices: tuple | None = None
    type: type | None = None
    refused: dict = field(default_factory=dict)
    requires: dict = field(default_factory=dict)
    why: str = ""

    def why_refused(self, value) -> str | None:
        """Why ``value`` is refused, or None when it is accepted."""
        return self.refused.get(value)


_SDPA = "attention runs through torch's scaled_dot_product_attention, which takes a flash kernel where the device " \
        "and dtype allow"
_OWN = "megazero's own model code is used (it has no Megatron-core / legacy choice)"
IMPLEMENTATION: dict[str, Implementation] = {
    "--use-mcore-models": Implementation(_OWN),
    "--use-legacy-models": Implementation(_OWN),
    "--transformer-impl": Implementation("megazero's own layers are used (no Transformer Engine)",
                                         choices=("local", "transformer_engine")),
    "--use-flash-attn": Implementation(_SDPA),
    "--attention-backend": Implementation(_SDPA, choices=("auto", "flash", "fused", "unfused", "local")),
    "--no-masked-softmax-fusion": Implementation("the attention softmax is scaled_dot_product_attention's "
                                                 "(no Megatron softmax kernel to turn off)"),
    "--no-bias-gelu-fusion": Implementation("bias and GELU are torch operations (no fused kernel to turn off)"),
    "--no-bias-swiglu-fusion": Implementation("SwiGLU is torch operations (no fused kernel to turn off)"),
    "--no-bias-dropout-fusion": Implementation("bias, dropout and residual are torch operations (no fused kernel "
                                               "to turn off)"),
    "--no-rope-fusion": Implementation("RoPE is torch operations (no fused kernel to turn off)"),
    "--no-persist-layer-norm": Implementation("the norms are torch's or apex's (the kernels line below says which)"),
    "--no-async-tensor-model-parallel-allreduce": Implementation("tensor-parallel all-reduces are megazero's own"),
    "--use-cpu-initialization": Implementation("parameters are built on the meta device and given their values "
                                               "where they live (--sharded-init)"),
    "--use-contiguous-parameters-in-local-ddp": Implementation("gradients always live in contiguous buckets"),
    "--empty-unused-memory-level": Implementation("torch's caching allocator is left alone", type=int),
    "--num-workers": Implementation("data is read in the training process (no loader workers)", type=int),
    "--log-throughput": Implementation("every log line shows throughput (tokens/s, TFLOP/s per rank)"),
    "--use-pytorch-profiler": Implementation("--profile always records with the torch profiler"),
    "--data-impl": Implementation("indexed datasets are read memory-mapped", choices=("mmap", "infer", "lazy", "cached")),
    "--dataloader-type": Implementation(
        "Megatron's single loader: each sample once, in the dataset's shuffled order", choices=("single", "cyclic",
                                                                                              "external"),
        refused={"cyclic": "megazero's loader is Megatron's 'single' (each sample once, in the dataset's shuffled "
                           "order): drop --dataloader-type cyclic",
                 "external": "an external loader does not exist here: drop --dataloader-type external"}),
    "--muon-scalar-optimizer": Implementation("the parameters Muon does not step are stepped by AdamW",
                                              choices=("adam", "lion"),
                                              refused={"lion": "Lion does not exist here: drop "
                                                               "--muon-scalar-optimizer lion (AdamW steps them)"}),
    "--muon-tp-mode": Implementation(
        "each tensor-parallel matrix is gathered whole on one owner rank and orthogonalised there",
        choices=("blockwise", "duplicated", "distributed"),
        refused={"blockwise": "orthogonalising each tensor-parallel shard on its own does not exist here (each "
                              "matrix is orthogonalised whole, as on one rank): drop --muon-tp-mode blockwise"}),
    "--no-position-embedding": Implementation("RoPE uses no position-embedding table",
                                              requires={"position_embedding_type": "rope"},
                                              why="a model with no positions does not exist here"),
    "--manual-gc": Implementation("Python's garbage collector runs on its own schedule"),
    "--tiktoken-pattern": Implementation("only TikTokenizer reads it, and that tokenizer is refused here",
                                         choices=("v1", "v2")),
    "--no-create-attention-mask-in-dataloader": Implementation("attention is causal inside the kernel; the loader "
                                                               "builds no mask tensor"),
    "--no-mmap-bin-files": Implementation("indexed datasets are read memory-mapped (the same tokens)"),
    "--calculate-per-token-loss": Implementation(
        "every micro-batch holds seq-length x micro-batch loss tokens, so the mean over the step's tokens is the "
        "mean of the micro-batch means used here", requires={"eod_mask_loss": False},
        why="masked tokens make micro-batches hold different numbers of loss tokens, and a mean over all the "
            "step's tokens instead of over each micro-batch does not exist here"),
    "--ckpt-format": Implementation(
        "torch_dist, Megatron-LM's default: checkpoints are written in megazero's own format (docs/checkpoints.md)",
        choices=("torch_dist", "torch", "torch_dcp", "fsdp_dtensor", "zarr"),
        refused=dict.fromkeys(("torch", "torch_dcp", "fsdp_dtensor", "zarr"),
                              "Megatron-LM's other checkpoint formats are not written here; checkpoints are in "
                              "megazero's own format (docs/checkpoints.md): drop it")),
}


@dataclass(frozen=True)
class Restated:
    """A Megatron flag that restates a property of the model (``model_property``, read on the model config);
    accepted when equal, refused with ``why`` otherwise."""

    model_property: str
    help: str
    why: str


RESTATED: dict[str, Restated] = {
    "--kv-channels": Restated("head_dim", "the head size: accepted when it equals --hidden-size / "
                                          "--num-attention-heads, refused otherwise",
                              "the head size here is hidden size / attention heads"),
}

_NO_TB_CHOICE = "TensorBoard (--tensorboard-dir) receives the log line's metrics; choosing them does not exist here"
REFUSED: dict[str, str] = {
    "--rampup-batch-size": "a linear batch-size ramp-up does not exist here: train at --global-batch-size, or "
                           "grow the batch in steps with --step-batch-size-schedule",
    "--fp8-hybrid": "Megatron-LM's older spelling: use --fp8-format hybrid",
    "--muon-scale-mode": "the update's scale is --muon-adjust-lr here (match_rms_adamw: 0.2 sqrt(max(A, B)), or "
                         "original: sqrt(max(1, A / B)))",
    "--muon-extra-scale-factor": "the update's scale is --muon-adjust-lr here (match_rms_adamw already carries "
                                 "Moonlight's 0.2)",
    "--muon-fp32-matmul-prec": "Newton-Schulz runs at full fp32 precision here by default: drop it (or "
                               "--muon-ns-dtype bf16 for torch.optim.Muon's bf16 iteration)",
    "--muon-split-qkv": "the fused query/key/value matrix is orthogonalised as one matrix here, as "
                        "torch.optim.Muon steps it: drop it",
    "--fp8-interval": "deprecated in Megatron-LM too (scales are updated every step): drop it",
    "--use-torch-fsdp2": "use --zero-stage 3 (parameters, gradients and optimizer state sharded, as FSDP does)",
    "--no-save-optim": "checkpoints here always hold the optimizer state (to load without it: --no-load-optim)",
    "--no-save-rng": "checkpoints here always hold the random states (to load without them: --no-load-rng)",
    "--exit-on-missing-checkpoint": "--load without a checkpoint stops the run here already, except --load equal "
                                    "to --save (a first start that resumes after a restart): drop it",
    "--train-data-path": "separate training / validation / test data do not exist here: --data-path with --split",
    "--valid-data-path": "separate training / validation / test data do not exist here: --data-path with --split",
    "--test-data-path": "separate training / validation / test data do not exist here: --data-path with --split",
    "--attention-softmax-in-fp32": "the softmax precision is scaled_dot_product_attention's: drop it",
    "--apply-query-key-layer-scaling": "the attention scale is 1/sqrt(head size) with no per-layer factor: drop it",
    "--distribute-saved-activations": "does not exist here (see --recompute-granularity and --cpu-offloading)",
    "--log-timers-to-tensorboard": _NO_TB_CHOICE, "--log-validation-ppl-to-tensorboard": _NO_TB_CHOICE,
    "--log-batch-size-to-tensorboard": _NO_TB_CHOICE, "--tensorboard-queue-size": _NO_TB_CHOICE,
    "--tensorboard-log-interval": _NO_TB_CHOICE, "--timing-log-level": _NO_TB_CHOICE,
    "--log-params-norm": "the log line shows the gradient norm only",
    "--log-num-zeros-in-grad": "the log line shows the gradient norm only",
}

# Megatron's --tokenizer-type names that are not ours: {name: (our tokenizer or None: refused, the note or why)}.
MEGATRON_TOKENIZERS: dict[str, tuple[str | None, str]] = {
    "GPTSentencePieceTokenizer": ("SentencePieceTokenizer", "the same model file"),
    "Llama2Tokenizer": ("SentencePieceTokenizer", "its vocabulary and end-of-document id (data preprocessed by "
                                                  "Megatron-LM keeps its BOS ids)"),
    "TikTokenizer": (None, "use HuggingFaceTokenizer with the model's tokenizer.json"),
    "BertWordPieceLowerCase": (None, "a BERT vocabulary: megazero trains decoders"),
    "BertWordPieceCase": (None, "a BERT vocabulary: megazero trains decoders"),
    "MultimodalTokenizer": (None, "multimodal models do not exist here"),
}


def add_arguments(parser) -> None:
    """The mapped, implementation and restated flags, in a help group of their own; each stores under the dest
    ``megatron:<flag>`` only when given (read back by :func:`from_command_line`)."""
    group = parser.add_argument_group("Megatron-LM compatibility (docs/megatron-flags.md)")
    for name, m in MAPPED.items():
        group.add_argument(name, dest=f"megatron:{name}", action="store_true", default=SUPPRESS, help=m.help)
    for name, impl in IMPLEMENTATION.items():
        kwargs = dict(help=f"accepted: {impl.note}".replace("%", "%%"), dest=f"megatron:{name}", default=SUPPRESS)
        if impl.choices is None and impl.type is None:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(choices=impl.choices, type=impl.type, metavar=None if impl.choices else "N")
        group.add_argument(name, **kwargs)
    for name, r in RESTATED.items():
        group.add_argument(name, dest=f"megatron:{name}", type=int, metavar="N", default=SUPPRESS, help=r.help)


def from_command_line(given: dict[str, object], cli: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """Apply the Megatron flags ``given`` ({flag: value}) to the command line's settings ``cli``
    ({"section.field": value}, changed in place). Returns the lines to say at start (one naming every
    implementation flag given) and {dest: the Megatron flag that set it} for messages. A mapped flag whose
    setting the command line also gives with another value, and a refused value, raise :class:`ConfigError`."""
    taken, set_by = [], {}
    for name, value in given.items():
        if name in MAPPED:
            for name_of_field, target in MAPPED[name].sets.items():
                key = dest(name_of_field)
                if key in cli and cli[key] != target and key not in set_by:
                    raise ConfigError(f"{name} means {flag(name_of_field)} {target}, but {flag(name_of_field)} "
                                      f"{cli[key]} is given: {MAPPED[name].hint}")
                cli[key], set_by[key] = target, name
            continue
        if name in RESTATED:
            continue
        if IMPLEMENTATION[name].why_refused(value):
            raise ConfigError(value_refusals({name: value})[name])
        taken.append(name if value is True else f"{name} {value}")
    notes = [f" Megatron-LM implementation flags taken as no-ops here (what runs instead: docs/megatron-flags.md): "
             f"{', '.join(taken)}"] if taken else []
    return notes, set_by


def value_refusals(given: dict[str, object]) -> dict[str, str]:
    """{flag: its one line} for the implementation flags ``given`` with a value that is refused here."""
    return {name: f"{name} {value}: {IMPLEMENTATION[name].why_refused(value)}" for name, value in given.items()
            if name in IMPLEMENTATION and IMPLEMENTATION[name].why_refused(value)}


def check_requirements(given: dict[str, object], job) -> None:
    """The settings of the job (a :class:`~megazero.config.JobConfig` of every source's settings) under which
    the implementation flags ``given`` change nothing, and the restated flags equal to what the model is."""
    for name, value in given.items():
        if name in RESTATED:
            r = RESTATED[name]
            ours = getattr(job.model, r.model_property) if job.model.num_attention_heads > 0 else value
            if value != ours:
                raise ConfigError(f"{name} {value}: {r.why} ({flag('hidden_size')} {job.model.hidden_size} / "
                                  f"{flag('num_attention_heads')} {job.model.num_attention_heads} = {ours}), and "
                                  f"another does not exist: drop it or give {ours}")
            continue
        impl = IMPLEMENTATION.get(name)
        for name_of_field, want in getattr(impl, "requires", {}).items():
            if _setting_of(job, name_of_field) == want:
                continue
            if want is False:
                raise ConfigError(f"{name} and {flag(name_of_field)} do not go together here ({impl.why}): drop one")
            raise ConfigError(f"{name} needs {flag(name_of_field)} {want} ({impl.why}): add it or drop {name}")


def _setting_of(job, name_of_field: str):
    """The value of the config field ``name_of_field`` in whichever section of ``job`` has it."""
    sections = (getattr(job, s) for s in vars(job))
    return next(getattr(s, name_of_field) for s in sections if hasattr(s, name_of_field))


def sequence_parallel_at_tp1(values: dict[str, object]) -> list[str]:
    """Megatron-LM's rule for ``--sequence-parallel`` at tensor-parallel size 1: turned off (in ``values``,
    the combined settings, in place) with the warning line returned, as Megatron-LM does."""
    sp, tp = dest("sequence_parallel"), dest("tp")
    if not values.get(sp) or values.get(tp, 1) != 1:
        return []
    values[sp] = False
    return [f"{flag('sequence_parallel')} turned off: it splits activations over the tensor-parallel ranks and "
            f"{flag('tp')} is 1 (as Megatron-LM does)"]


def canonical_tokenizer(values: dict[str, object]) -> list[str]:
    """Replace a Megatron ``--tokenizer-type`` name that is not ours by our tokenizer (in place), or name
    GPT2BPETokenizer for a vocab and merge file given alone; returns the line to say at start, if any. A Megatron tokenizer with no counterpart raises :class:`ConfigError`."""
    key = dest("tokenizer_type")
    name = values.get(key)
    if name is None and values.get(dest("vocab_file")) and values.get(dest("merge_file")):
        values[key] = "GPT2BPETokenizer"          # Megatron-LM's GPT-2 scripts name only the two files
        return [f" {flag('vocab_file')} and {flag('merge_file')} without {flag('tokenizer_type')}: GPT2BPETokenizer"]
    if name not in MEGATRON_TOKENIZERS:
        return []
    ours, note = MEGATRON_TOKENIZERS[name]
    if ours is None:
        raise ConfigError(f"{flag('tokenizer_type')} {name} does not exist here: {note}")
    values[key] = ours
    return [f" {flag('tokenizer_type')} {name}: read as {ours} ({note})"]


def refusal_lines(argv: list[str], extras: list[str], given: dict[str, object], known: list[str]) -> list[str]:
    """One line for each flag of ``argv`` that stops the run, in its order: among the unparsed tokens ``extras``,
    a Megatron flag with no meaning here says why and any other unknown flag names the closest of the ``known``
    spellings; a parsed Megatron flag ``given`` ({flag: value}) with a refused value says why. Values are
    skipped."""
    lines, by_value = [], value_refusals(given)
    unparsed = {token.split("=", 1)[0] for token in extras if token.startswith("--")}
    for token in argv:
        name = token.split("=", 1)[0]
        if not token.startswith("--") or name not in unparsed | set(by_value):
            continue
        unparsed.discard(name)
        if name in by_value:
            lines.append(by_value.pop(name))
        elif name in REFUSED:
            lines.append(f"{name}: {REFUSED[name]}")
        else:
            close = close_flags(name, known)
            hint = f": did you mean {' or '.join(close)}?" if close else " (pretrain_gpt.py --help lists the flags)"
            lines.append(f"unrecognized argument {name}{hint}")
    return lines


def close_flags(name: str, known: list[str]) -> list[str]:
    """Up to three of the ``known`` flags that ``name`` is plausibly a misspelling of: a near-identical spelling
    (difflib ratio 0.85 or more, or a letter in four, at most two, changed, added, dropped or swapped), a flag ``name`` begins (``--hidden`` ->
    ``--hidden-size``), or a flag holding all of ``name``'s words in order (``--tensor-parallel`` ->
    ``--tensor-model-parallel-size``). Flags that merely share a word or a few letters
    are not suggested."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.85)
    bare = name.lstrip("-")
    close += [c for c in known if c not in close and _edits(bare, c.lstrip("-")) <= min(2, len(bare) // 4)]
    words = name.lstrip("-").split("-")
    holding = [c for c in known if c not in close and (c.startswith(name + "-") or len(words) >= 2 and
                                                       _in_order(words, c.lstrip("-").split("-")))]
    close += sorted(holding, key=lambda c: -difflib.SequenceMatcher(None, name, c).ratio())
    return close[:3]


def _in_order(words: list[str], candidate: list[str]) -> bool:
    """Whether every one of ``words`` appears in ``candidate``, in the same order."""
    rest = iter(candidate)
    return all(word in rest for word in words)


def _edits(a: str, b: str) -> int:
    """The number of single-letter insertions, deletions, substitutions and adjacent swaps from ``a`` to ``b``."""
    previous, row = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, row = row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(before[j] + 1, row[j - 1] + 1, before[j - 1] + (a[i - 1] != b[j - 1]))
            if previous and i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], previous[j - 2] + 1)
        previous = before
    return row[-1]
