"""What a training run reports: peak memory, the GPUs' peak FLOP/s, the time of day and durations,
and the log/metrics writers (a model's FLOPs per token are its spec's: ``ModelSpec.flops_per_token``).

Rank 0 writes everything (console line, ``--metrics-file`` JSON lines, ``--tensorboard-dir``
scalars, ``--wandb-project`` logs); other ranks construct a :class:`MetricsLog` that does nothing.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys

import torch

from megazero.config import FLAG


def wandb_missing() -> str:
    """What a run with ``--wandb-project`` says where wandb is not installed."""
    return f"{FLAG.wandb_project} needs the wandb package, which is not installed: pip install wandb"


def tensorboard_missing() -> str:
    """What a run with ``--tensorboard-dir`` says where tensorboard is not installed."""
    return (f"{FLAG.tensorboard_dir} needs the tensorboard package, which is not installed: "
            f"pip install 'megazero[tensorboard]'")


def timestamp() -> str:
    """The local time of day with its UTC offset, to the second (ISO 8601: ``2025-05-01T14:03:59+02:00``)."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def duration(seconds: float) -> str:
    """``h:mm:ss`` (``1 day, 2:03:04`` past a day): how the log line gives the elapsed time and the ETA."""
    return str(datetime.timedelta(seconds=round(seconds)))


def wandb_settings(lg, save: str | None, config: dict) -> dict | None:
    """``wandb.init``'s arguments for ``--wandb-project`` (a ``LoggingConfig``), None without it: the run's
    name (``--wandb-exp-name``), its local directory (``--wandb-save-dir``, else ``SAVE/wandb``, else
    wandb's default ``./wandb``) and the job's settings as the run's config."""
    if not lg.wandb_project:
        return None
    directory = lg.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
    return {"project": lg.wandb_project, "name": lg.wandb_exp_name, "dir": directory, "config": config}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024 if sys.platform != "darwin" else kib


def device_peak_tflops(device: torch.device, dtype_name: str, given: float | None = None) -> float | None:
    """The peak TFLOP/s for MFU: ``given`` (``--peak-tflops``) when set, else the dense peak of known GPUs;
    None when unknown, as on a CPU (MFU is then not reported)."""
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    half = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
    for key, value in half.items():
        if key in name:
            return value if dtype_name != "fp32" else value / 16  # fp32 without TF32, roughly
    return None


class MetricsLog:
    """Console line + JSON lines + TensorBoard scalars + W&B, written by rank 0 only.

    ``wandb``: :func:`wandb_settings` (the arguments of ``wandb.init``), or None for no W&B."""

    def __init__(self, metrics_file: str | None, tensorboard_dir: str | None, enabled: bool,
                 wandb: dict | None = None):
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError as e:  # the preflight said it before any process group; a library caller here
                raise SystemExit(wandb_missing()) from e
            if wandb.get("dir"):
                os.makedirs(wandb["dir"], exist_ok=True)
            self._wandb = wandb_module.init(**wandb)
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # the preflight said it before any process group; a library caller here
                raise SystemExit(tensorboard_missing()) from e
            self._tb = SummaryWriter(tensorboard_dir)

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def record(self, record: dict, step: int) -> None:
        """Append one JSON object to the metrics file (with a ``timestamp``, :func:`timestamp`, unless it
        has one) and its numbers to TensorBoard and W&B, at ``step``."""
        if not self.enabled:
            return
        if self._file:  # strict JSON: a non-finite number (an fp16 overflow's norm) becomes null
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            clean.setdefault("timestamp", timestamp())
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
        if self._tb:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
            self._wandb = None
