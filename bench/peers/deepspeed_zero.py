"""DeepSpeed as its users write it: ``deepspeed.initialize`` with a JSON-style config (ZeRO stage,
AdamW with weight decay off for biases and norms, clipping, the batch), then ``engine.backward`` /
``engine.step`` per micro-batch. On a CPU it runs over the gloo group torchrun's environment gives.

    torchrun --nproc-per-node 4 -m bench.peers.deepspeed_zero --stage 3 [--bucket-size N] [shape flags]

``--bucket-size``: the reduce / all-gather (and stage-3 prefetch) bucket in elements; DeepSpeed's default
reduce bucket, 5e8 elements, is a 1.9 GiB fp32 buffer whatever the model's size, so the benchmark sets
it to megazero's bucket size.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

from bench.peers.plain import init, masked_mean_loss, parse, plain_model, timed_loop  # noqa: E402


def _take(flag: str, default: int) -> int:
    """The value of ``flag`` (removed from sys.argv for the shared shape parser), else ``default``."""
    if flag not in sys.argv:
        return default
    i = sys.argv.index(flag)
    value = int(sys.argv[i + 1])
    del sys.argv[i:i + 2]
    return value


STAGE, BUCKET = _take("--stage", 3), _take("--bucket-size", 500_000_000)
a = parse(__doc__)
rank, world = init()
model = plain_model(a)
num_params = sum(p.numel() for p in model.parameters())
groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": a.weight_decay},
          {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
zero = {"stage": STAGE, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
if STAGE == 3:
    zero["stage3_prefetch_bucket_size"] = BUCKET
config = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": a.micro_batches,
          "gradient_clipping": a.clip_grad, "zero_optimization": zero, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": a.weight_decay,
                                                    "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)


def step(micro):
    total = 0.0
    for mb in micro:
        loss = masked_mean_loss(engine, mb)
        engine.backward(loss)          # DeepSpeed divides by gradient_accumulation_steps
        engine.step()                  # and steps the optimizer on the accumulation boundary only
        total += loss.item() / len(micro)
    return total


timed_loop(a, f"ds-zero{STAGE}", step, num_params)
