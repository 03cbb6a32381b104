"""Convert checkpoints: megazero (any layout) <-> HuggingFace (GPT-2, Llama, Qwen2, Mixtral; Mistral read), or
re-split megazero files.

    python tools/convert_checkpoint.py --input ckpt/ --output my-hf/ --to hf --check
    python tools/convert_checkpoint.py --input Llama-3-8B/ --output ckpt-tp2pp2/ --to megazero --target-tp 2 --target-pp 2

``--input`` is a megazero save directory (its latest checkpoint), an ``iter_*`` directory, or (for
``--to megazero``) an HF model directory: config.json with the weights as model.safetensors, sharded
safetensors (model.safetensors.index.json) or pytorch_model.bin. The HF format follows the model:
learned position embeddings give ``GPT2LMHeadModel`` (Conv1D [in, out] weights, q/k/v as consecutive
blocks, the GELU variant in ``activation_function``); RoPE gives ``LlamaForCausalLM`` (q/k/v and
gate/up projections apart, ``num_key_value_heads`` the query groups), ``Qwen2ForCausalLM`` with a
QKV-only bias, or ``MixtralForCausalLM`` with experts. Weights above ``--max-shard-size`` are sharded
with model.safetensors.index.json; the run's tokenizer is written so that AutoTokenizer gives its ids
(tokenizer_config.json, bos/eos ids in config.json). megazero output is a weights-only checkpoint
(iteration 0): train from it with ``--load DIR --finetune``; the input's tokenizer (tokenizer.json,
vocab.json + merges.txt, or tokenizer.model) is recorded as its tokenizer (tools/generate.py uses it).
Persistent buffers (an MoE router's expert bias, HF ``e_score_correction_bias``) travel both ways, as
``model.buffer/<name>`` in megazero checkpoints. Configurations the other side cannot express are refused. ``--check`` runs transformers' model and
megazero's on the written weights and compares their logits and tokenizers (docs/checkpoints.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import torch

from megazero.checkpoint.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    load_hf,
    persistent_buffers,
    save_hf,
)
from megazero.checkpoint.hf_compare import DEFAULT_TEXT, Comparison, compare_with_hf
from megazero.checkpoint.hf_tokenizer import tokenizer_of
from megazero.checkpoint.offline import read_model, saved_job, write_weights_checkpoint
from megazero.config import JobConfig, ParallelConfig, flag, validate
from megazero.config.model import ACTIVATION_MEMORY_FIELDS
from megazero.errors import (
    CheckpointError,
    ConfigError,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def shard_size(text: str) -> int:
    """'5GB' (10^9 bytes, as HF counts), '500MiB', or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MiB or 1000000")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="megazero save/iter directory, or an HF model directory")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--to", required=True, choices=["megazero", "hf"])
    p.add_argument("--target-tp", type=int, default=1, help="megazero output: files split for this tp")
    p.add_argument("--target-pp", type=int, default=1, help="megazero output: files split for this pp")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written tensors")
    p.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_MAX_SHARD_BYTES,
                   help="HF output: largest safetensors file before sharding (default 5GB)")
    p.add_argument("--seq-length", type=int, help="HF input: training sequence length to record "
                                                   "(default max_position_embeddings)")
    p.add_argument(flag("apply_layernorm_1p"), action="store_true",
                   help="HF input, --to megazero: store the norm weights zero-centred (scale - 1), for a run "
                        "with this flag (a megazero checkpoint records it; an HF export holds the scale)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (refused otherwise)")
    p.add_argument("--check", action="store_true",
                   help="after converting, run transformers' model on the HF side and megazero's on the same "
                        "written weights, on a test text: print the max logit difference and whether "
                        "AutoTokenizer gives megazero's ids; exit 1 over --check-tolerance (needs transformers)")
    p.add_argument("--check-tolerance", type=float, default=1e-4, metavar="ABS",
                   help="largest max |logit difference| --check accepts (fp32 on both sides; default 1e-4)")
    p.add_argument("--check-text", default=DEFAULT_TEXT, metavar="TEXT", help="the text --check runs")
    return p.parse_args(argv)


def check_output(args: argparse.Namespace) -> None:
    """Refuse to write over anything: an existing HF model, a checkpoint or a training run's
    directory (its tracker would move back) is kept unless --overwrite; bad target sizes, and a
    --check with no HF side, are refused."""
    for name in ("target_tp", "target_pp"):
        if getattr(args, name) < 1:
            raise CheckpointError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--output {out} is a file: give a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"--output {out} already exists and is not empty: choose a new directory, or pass "
                              f"--overwrite to replace what is there")
    if Path(args.input).resolve() == out.resolve():
        raise CheckpointError("--output is --input: write the conversion to another directory")
    if args.check and args.to == "megazero" and not (Path(args.input) / "config.json").is_file():
        raise CheckpointError("--check compares a conversion with HF: it needs --to hf, or an HF --input")
    if args.apply_layernorm_1p and not (args.to == "megazero" and (Path(args.input) / "config.json").is_file()):
        raise CheckpointError(f"{flag('apply_layernorm_1p')} applies to an HF --input converted --to megazero: a "
                              f"megazero checkpoint keeps the norm weights as its run stored them")
    if args.check and args.check_tolerance < 0:
        raise CheckpointError(f"--check-tolerance must be >= 0, got {args.check_tolerance}")


def convert(args: argparse.Namespace) -> tuple[Path, Comparison | None]:
    """Convert; with ``--check``, also compare the HF side with megazero's model on the written weights."""
    check_output(args)
    src, dtype = Path(args.input), DTYPES[args.dtype]
    if args.to == "hf":
        if (src / "config.json").is_file():
            raise CheckpointError(f"{src} is already an HF model directory")
        cfg, tensors, index = read_model(src)
        data = saved_job(index).data
        out = save_hf(args.output, tensors, cfg, dtype, max_shard_bytes=args.max_shard_size, data_cfg=data)
        return out, _check(args, out, cfg, tensors, data)
    if (src / "config.json").is_file():
        cfg, tensors = load_hf(src, args.seq_length, {"apply_layernorm_1p": True} if args.apply_layernorm_1p else None)
        job = JobConfig(model=cfg, data=tokenizer_of(src))
    else:
        _, tensors, index = read_model(src)
        job = saved_job(index)
    try:       # the model at the target layout, by the trainer's own rules; how a run keeps its activations
        layout = ParallelConfig(tp=args.target_tp, pp=args.target_pp)          # is that run's, not the weights'
        kept = {f.name: f.default for f in dataclasses.fields(job.model) if f.name in ACTIVATION_MEMORY_FIELDS}
        validate(JobConfig(model=dataclasses.replace(job.model, **kept), parallel=layout),
                 args.target_tp * args.target_pp)
    except ConfigError as e:
        raise CheckpointError(str(e).replace(flag("tp"), "--target-tp").replace(flag("pp"), "--target-pp")) from None
    buffers = persistent_buffers(job.model)          # model state kept in its own dtype (an fp32 expert bias)
    tensors = {k: v if k in buffers else v.to(dtype) for k, v in tensors.items()}
    out = write_weights_checkpoint(args.output, tensors, job, tp=args.target_tp, pp=args.target_pp)
    hf_side = src if (src / "config.json").is_file() else None
    return out, _check(args, hf_side, job.model, tensors, job.data)


def _check(args, hf_dir: Path | None, cfg, tensors, data) -> Comparison | None:
    """``--check``: the comparison of the HF directory with megazero's model on the written weights."""
    if not args.check or hf_dir is None:
        return None
    written = {k: v.to(DTYPES[args.dtype]) for k, v in tensors.items()}
    return compare_with_hf(hf_dir, cfg, written, data, args.check_text)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out, comparison = convert(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    if comparison is not None:
        print(comparison.describe(args.check_tolerance))
        return 0 if comparison.passed(args.check_tolerance) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
