"""Pretrain a GPT (or any registered model family, ``--model-family``) with tensor, pipeline and data
parallelism and a ZeRO-sharded optimizer.

    python pretrain_gpt.py                                   # tiny GPT on the bundled sample corpus
    torchrun --nproc-per-node 8 pretrain_gpt.py --tp 2 --pp 2 --dp 2 --zero-stage 1

The program is :mod:`megazero.cli` (parse -> preflight -> plan -> build -> train); ``--help`` lists every
flag, docs/flags.md explains them.
"""
from megazero.cli.main import main_process

if __name__ == "__main__":
    main_process()
