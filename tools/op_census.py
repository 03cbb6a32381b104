"""Count the kernels one training step runs besides the GEMMs, per layer and micro-batch (on this CPU).

    python -m tools.op_census --bf16 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --vocab-size 256 --micro-batch-size 2
    python -m tools.op_census --bf16 ... --swiglu --normalization RMSNorm --position-embedding-type rope --json

Takes the trainer's own flags (one process: tp, pp and dp 1) and runs the trainer's step four times (at
``--num-layers`` and twice that, with one and two micro-batches) under the op census
(``megazero/census.py``): prints what each transformer layer adds per micro-batch and per step, and the rest
of a step, with the non-GEMM kernels by name. ``tests/test_census.py`` pins the per-layer counts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import torch.distributed as dist

from megazero.census import layer_census
from megazero.cli.arguments import build_parser
from megazero.cli.job import job_from_args


def main(argv=None) -> int:
    parser = build_parser("tools/op_census.py", __doc__.split("\n\n")[0])
    parser.add_argument_group("census").add_argument("--json", action="store_true",
                                                      help="print one JSON object instead of the lines")
    args = parser.parse_args(argv)
    job = job_from_args(parser, args, 1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            census = layer_census(job, layers=job.model.num_layers)
        finally:
            dist.destroy_process_group()
    parts = {"per layer per micro-batch": census.per_layer_micro, "per layer per step": census.per_layer_step,
             f"rest of a step ({census.layers} layers, {census.micro} micro-batch)": census.rest}
    if args.json:
        print(json.dumps({name: {**{k: v for k, v in dataclasses.asdict(c).items() if k != "by_op"},
                                 "by_op": dict(c.by_op)} for name, c in parts.items()}))
        return 0
    for name, c in parts.items():
        print(f"{name}: {c.line()}")
        print("    " + ", ".join(f"{op} {n:g}" for op, n in c.by_op.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
