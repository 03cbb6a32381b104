"""DeepSpeed as its users write it: ``deepspeed.initialize`` with a JSON-style config (ZeRO stage,
AdamW, clipping, the batch), then ``engine.backward`` / ``engine.step`` per micro-batch.

    torchrun --nproc-per-node 4 bench/peers/deepspeed_zero.py --stage 3 [shape flags]
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

from plain import init, masked_mean_loss, parse, plain_model, timed_loop  # noqa: E402

STAGE = int(sys.argv[sys.argv.index("--stage") + 1])
del sys.argv[sys.argv.index("--stage"):sys.argv.index("--stage") + 2]
a = parse(__doc__)
rank, world = init()
model = plain_model(a)
num_params = sum(p.numel() for p in model.parameters())
config = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": a.micro_batches,
          "gradient_clipping": a.clip_grad, "zero_optimization": {"stage": STAGE},
          "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": a.weight_decay,
                                                    "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def step(micro):
    total = 0.0
    for mb in micro:
        loss = masked_mean_loss(engine, mb)
        engine.backward(loss)
        engine.step()
        total += loss.item() / len(micro)
    return total


timed_loop(a, f"ds-zero{STAGE}", step, num_params)
