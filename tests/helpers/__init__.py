"""Shared test helpers; test modules import from here, never from each other.

    multiproc.py   run_on_ranks(n, fn, ...): a test body on n CPU processes joined by gloo
    data.py        paths of the test data carried in tests/data/
    tinynet.py     a tiny data-parallel model and its single-process reference (ZeRO 0-2, precision)
    gpt_parity.py  the test GPT, its batches and single-process reference (tp x pp x dp x ZeRO parity)
    trainer.py     pretrain_gpt.main on n ranks, metrics files, loss comparisons (end to end), trainer
                   parity with checkpoints compared tensor by tensor, the fuzz checker's launcher on the
                   reused workers
"""
from helpers.multiproc import run_on_ranks

__all__ = ["run_on_ranks"]
