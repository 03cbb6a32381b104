"""Which samples each data-parallel rank reads, and how a sample becomes a training micro-batch.

The dataset is already shuffled (``gpt_dataset``), so the global order is simply 0, 1, 2, ...
A step starting after ``consumed`` samples covers samples ``[consumed, consumed + global_batch)``;
micro-step ``m`` of it covers ``micro_batch * dp`` consecutive samples, rank ``r`` taking the
``r``-th block of ``micro_batch``. Example, micro_batch 2, dp 2, global batch 8 (2 micro-steps),
consumed 16:

    rank 0: [16, 17], [20, 21]        rank 1: [18, 19], [22, 23]

The order depends only on the seed (via the dataset) and ``consumed``: a run resumed with the
saved ``consumed_samples`` reads exactly what the uninterrupted run would have read.

Context parallelism: the cp ranks of a data-parallel rank read the same samples and each keeps its
load-balanced slice of every sequence (:func:`megazero.parallel.context.rank_slice`: chunks r and
2cp-1-r of 2cp) of the tokens, labels and loss mask alike; no extra sample is read.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from megazero.config import FLAG
from megazero.data.gpt_dataset import build_train_valid_test_datasets
from megazero.parallel.context_layout import rank_slice


def micro_batch_sample_ids(consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                           global_batch_size: int, share: tuple[int, int] = (0, 1)) -> list[np.ndarray]:
    """Sample ids of this rank's micro-batches for the step that starts after ``consumed_samples``.

    The step's micro-batches of a data-parallel rank are numbered 0, 1, ... in sample order; ``share``
    ``(position, count)`` takes every ``count``-th of them from ``position`` (default: all), so that
    ``count`` jobs reading the same data (torchft replica groups) split the step's samples between them:
    the same samples form the step whoever takes part."""
    per_micro_step = micro_batch_size * dp_size
    if global_batch_size % per_micro_step:
        raise ValueError(f"{FLAG.global_batch_size} {global_batch_size} is not divisible by "
                         f"{FLAG.micro_batch_size} {micro_batch_size} * dp {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    position, count = share
    if not 0 <= position < count:
        raise ValueError(f"share position {position} outside [0, {count})")
    first = consumed_samples + dp_rank * micro_batch_size
    return [first + m * per_micro_step + np.arange(micro_batch_size)
            for m in range(position, global_batch_size // per_micro_step, count)]


def samples_to_batch(samples: np.ndarray, eod: int | None = None, eod_mask_loss: bool = False) -> dict:
    """[b, s+1] token ids -> {"tokens", "labels": [b, s] int64, "loss_mask": [b, s] float32}.

    ``labels`` are ``tokens`` shifted by one. With ``eod_mask_loss`` the loss is masked (0) at
    positions whose input token is ``eod``: the model is not asked to guess the first token of the
    next, unrelated document.
    """
    import torch  # imported here so that preprocessing tools never load torch

    data = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.int64))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        if eod is None:
            raise ValueError("eod_mask_loss needs the tokenizer's eod id")
        loss_mask[tokens == eod] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


class MicroBatchIterator:
    """This data-parallel rank's micro-batches, step after step, resumable from ``consumed_samples``.

    ``next_step()`` returns the list of micro-batch dicts of one optimizer step and advances
    ``consumed_samples`` by the step's global batch, ``batch_at(consumed_samples)`` (default: always
    ``global_batch_size``; a batch-size schedule varies it), the same on every rank, so it is what a
    checkpoint stores. ``wrap=True`` (evaluation) cycles through the dataset instead of stopping at its end.
    ``share`` (None: every micro-batch of the step): called at each step, the ``(position, count)`` of
    :func:`micro_batch_sample_ids` this rank's job takes of the step (torchft replica groups).
    """

    def __init__(self, dataset, *, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, consumed_samples: int = 0, eod: int | None = None,
                 eod_mask_loss: bool = False, wrap: bool = False, cp_rank: int = 0, cp_size: int = 1,
                 batch_at: Callable[[int], int] | None = None):
        self.dataset, self.micro_batch_size, self.global_batch_size = dataset, micro_batch_size, global_batch_size
        self.batch_at = batch_at or (lambda consumed: global_batch_size)
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.dp_rank, self.dp_size, self.consumed_samples = dp_rank, dp_size, consumed_samples
        self.eod, self.eod_mask_loss, self.wrap = eod, eod_mask_loss, wrap
        self.share: Callable[[], tuple[int, int]] | None = None
        micro_batch_sample_ids(0, micro_batch_size, dp_rank, dp_size, global_batch_size)  # validate

    def next_step(self) -> list[dict]:
        n = len(self.dataset)
        batch = self.batch_at(self.consumed_samples)
        if not self.wrap and self.consumed_samples + batch > n:
            raise StopIteration(f"dataset of {n} samples exhausted after {self.consumed_samples} consumed "
                                f"(a step takes {batch}): build it with more samples")
        ids = micro_batch_sample_ids(self.consumed_samples, self.micro_batch_size, self.dp_rank,
                                     self.dp_size, batch, self.share() if self.share is not None else (0, 1))
        batches = [samples_to_batch(np.stack([self.dataset[int(i) % n] for i in m]), self.eod, self.eod_mask_loss)
                   for m in ids]
        self.consumed_samples += batch
        if self.cp_size > 1:
            batches = [{key: rank_slice(t, 1, self.cp_rank, self.cp_size) for key, t in batch.items()}
                       for batch in batches]
        return batches

    def __iter__(self):
        while True:
            try:
                step = self.next_step()
            except StopIteration:
                return
            yield from step

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def _train_samples(train_iters: int, global_batch_size: int, batch_at: Callable[[int], int] | None) -> int:
    """The training split's size: ``train_iters * global_batch_size`` as Megatron sizes it (so the same sample
    order), or more when ``batch_at``'s steps (a schedule with a batch above its last) consume more."""
    consumed = 0
    for _ in range(train_iters if batch_at is not None else 0):
        consumed += batch_at(consumed)
    return max(consumed, train_iters * global_batch_size)


def build_data_iterators(data_cfg, *, seq_length: int, seed: int, micro_batch_size: int, global_batch_size: int,
                         dp_rank: int, dp_size: int, train_iters: int, eval_iters: int, eval_interval: int,
                         vocab_size: int, eod: int | None, consumed_train_samples: int = 0,
                         is_writer: bool = True, barrier=None, cp_rank: int = 0, cp_size: int = 1,
                         batch_at: Callable[[int], int] | None = None) -> tuple:
    """(train, valid, test) :class:`MicroBatchIterator` for a run (``None`` for an empty split).

    Sample counts as Megatron sizes them: train ``train_iters * global_batch``; valid enough for an
    evaluation every ``eval_interval`` steps plus one at the end; test one evaluation. Valid and
    test iterators wrap around. ``is_writer``/``barrier``: see ``build_train_valid_test_datasets``;
    ``cp_rank``/``cp_size``: each micro-batch cut to this context-parallel rank's slice. ``batch_at``: the
    training steps' global batch by consumed samples (a batch-size schedule's; the training split holds at
    least what its steps consume); evaluation keeps ``global_batch_size``.
    """
    evals = train_iters // eval_interval + 1
    num_samples = (_train_samples(train_iters, global_batch_size, batch_at), evals * eval_iters * global_batch_size,
                   eval_iters * global_batch_size)
    datasets = build_train_valid_test_datasets(data_cfg, seq_length=seq_length, seed=seed, num_samples=num_samples,
                                               vocab_size=vocab_size, is_writer=is_writer, barrier=barrier)
    kw = dict(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, dp_rank=dp_rank,
              dp_size=dp_size, eod=eod, eod_mask_loss=getattr(data_cfg, "eod_mask_loss", False), cp_rank=cp_rank,
              cp_size=cp_size)
    return tuple(None if ds is None else
                 MicroBatchIterator(ds, consumed_samples=consumed_train_samples if k == 0 else 0, wrap=k > 0,
                                    batch_at=batch_at if k == 0 else None, **kw)
                 for k, ds in enumerate(datasets))
