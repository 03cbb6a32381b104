"""megazero: GPT pretraining with Megatron-style 3D parallelism and ZeRO on torch.distributed.

The program is :mod:`megazero.cli` (``pretrain_gpt.py``); the packages, bottom first: ``errors``,
``ranks``, ``config``, ``parallel``, ``spec`` (the model contract), ``memory``, ``data``, ``checkpoint``,
``models``, ``training`` (docs/code-layout.md).
"""
