"""Checkpoints: crash-safe, layout-free save and load (any tp/pp/dp/ZeRO layout reads any other).

    save_checkpoint(save_dir, state, chunks=..., engine=..., topo=..., job=...) -> Path   (collective)
    load_checkpoint(load_dir, chunks=..., engine=..., topo=..., job=..., weights_only=False)
        -> TrainState | None                                                            (collective)
    latest_iteration(save_dir) -> int | None
    resume(job, chunks, engine, topo) -> TrainState          (--load / --finetune / auto-resume rules)
    checkpoint_saver(job, chunks, engine, topo) -> save(state) | None   (--async-save: in a background thread)

A save writes only finite state (:mod:`megazero.checkpoint.finite`); ``--async-save`` writes from a
host snapshot while training goes on (:mod:`megazero.checkpoint.async_save`).
The on-disk format is described in :mod:`megazero.checkpoint.format`; single-process tools read
and write it through :mod:`megazero.checkpoint.offline` (whole tensors by stable name).
"""
from megazero.checkpoint.distributed import (
           check_model_compatible,
           latest_iteration,
           load_checkpoint,
           save_checkpoint,
)
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.resume import checkpoint_saver, resume

__all__ = ["CheckpointReader", "check_model_compatible", "checkpoint_saver", "latest_iteration",
           "load_checkpoint", "resume", "save_checkpoint"]
