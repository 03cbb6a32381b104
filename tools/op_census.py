"""Count the kernels one training step runs besides the GEMMs, per layer and micro-batch (on this CPU), and
predict a GPU step's time at a named shape from the counts.

    python -m tools.op_census --bf16 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --vocab-size 256 --micro-batch-size 2
    python -m tools.op_census --bf16 ... --swiglu --normalization RMSNorm --position-embedding-type rope --json
    python -m tools.op_census --shape llama-1.5B            # the GPU issue's shapes, extrapolated (a few minutes)

Takes the trainer's flags (one process: tp, pp and dp 1) and runs the trainer's step four times (at
``--num-layers`` and twice that, with one and two micro-batches) under the op census
(``megazero/census.py``): prints what each transformer layer adds per micro-batch and per step, and the rest
of a step, with the non-GEMM kernels by name. ``tests/test_census.py`` pins the per-layer counts.

``--shape NAME`` takes one of :data:`SHAPES` (flags given after it override its own): the step's census at that
whole shape, extrapolated from small runs at its widths (:func:`megazero.census.shape_census`), and the time
the GPU time model (:class:`megazero.census.TimeModel`) predicts for it on one H200.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import torch.distributed as dist

from megazero.census import TimeModel, layer_census, shape_census
from megazero.cli.arguments import build_parser
from megazero.cli.job import job_from_args

# The shapes measured on one H200 in bf16 (the GPU issue): one micro-batch a step.
SHAPES = {
    "gpt2-350M": "--bf16 --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                 "--max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 8 --global-batch-size 8",
    "llama-1.5B": "--bf16 --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
                  "--num-query-groups 8 --ffn-hidden-size 8192 --swiglu --normalization RMSNorm "
                  "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
                  "--vocab-size 128256 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 "
                  "--global-batch-size 4",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser("tools/op_census.py", __doc__.split("\n\n")[0])
    group = parser.add_argument_group("census")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    group.add_argument("--shape", choices=sorted(SHAPES),
                       help="a named shape's whole step, extrapolated, with the GPU time model's prediction")
    shape = parser.parse_known_args(argv)[0].shape
    if shape:
        argv = SHAPES[shape].split() + argv
    args = parser.parse_args(argv)
    job = job_from_args(parser, args, 1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            if shape:
                return _print_shape(shape, shape_census(job), args.json)
            census = layer_census(job, layers=job.model.num_layers)
        finally:
            dist.destroy_process_group()
    parts = {"per layer per micro-batch": census.per_layer_micro, "per layer per step": census.per_layer_step,
             f"rest of a step ({census.layers} layers, {census.micro} micro-batch)": census.rest}
    if args.json:
        print(json.dumps({name: _as_dict(c) for name, c in parts.items()}))
        return 0
    for name, c in parts.items():
        print(f"{name}: {c.line()}")
        print("    " + ", ".join(f"{op} {n:g}" for op, n in c.by_op.most_common()))
    return 0


def _as_dict(c) -> dict:
    return {**{k: v for k, v in dataclasses.asdict(c).items() if k != "by_op"}, "by_op": dict(c.by_op)}


def _print_shape(name: str, parts, as_json: bool) -> int:
    """The named shape's step census, its parts, and the time model's seconds for it."""
    step = parts.step(parts.layers, parts.micro)
    times = TimeModel().seconds(step)
    named = {"per layer per micro-batch": parts.per_layer_micro, "per layer per step": parts.per_layer_step,
             "embedding, head and loss per micro-batch": parts.rest_micro, "rest once a step": parts.rest_step}
    if as_json:
        print(json.dumps({"shape": name, "step": _as_dict(step), "predicted_seconds": times,
                          **{part: _as_dict(c) for part, c in named.items()}}))
        return 0
    for part, c in named.items():
        print(f"{part}: {c.line()}")
        print("    " + ", ".join(f"{op} {n:.0f}" for op, n in c.by_op.most_common(10)))
    print(f"{name}, one step ({parts.layers} layers, {parts.micro} micro-batch): {step.line()}")
    print(f"    cast bytes {step.cast_bytes / 2**20:.1f} MiB; " + ", ".join(
        f"{op} {n:.0f}" for op, n in step.by_op.most_common(12)))
    print("predicted on one H200: " + ", ".join(f"{part} {s * 1e3:.1f} ms" for part, s in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
