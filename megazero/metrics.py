"""What a training run reports: peak memory, the GPUs' peak FLOP/s, and the log/metrics writers (a
model's FLOPs per token are its spec's: ``ModelSpec.flops_per_token``).

Rank 0 writes everything (console line, ``--metrics-file`` JSON lines, ``--tensorboard-dir``
scalars); other ranks construct a :class:`MetricsLog` that does nothing.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys

import torch



def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024 if sys.platform != "darwin" else kib


def device_peak_tflops(device: torch.device, dtype_name: str) -> float | None:
    """Dense peak TFLOP/s of known GPUs for MFU; None when unknown (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    half = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
    for key, value in half.items():
        if key in name:
            return value if dtype_name != "fp32" else value / 16  # fp32 without TF32, roughly
    return None


class MetricsLog:
    """Console line + JSON lines + TensorBoard scalars, written by rank 0 only."""

    def __init__(self, metrics_file: str | None, tensorboard_dir: str | None, enabled: bool):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional extra
                raise SystemExit("--tensorboard-dir needs the tensorboard package: "
                                 "pip install 'megazero[tensorboard]'") from e
            self._tb = SummaryWriter(tensorboard_dir)

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def record(self, record: dict, step: int) -> None:
        """Append one JSON object to the metrics file and its numbers to TensorBoard."""
        if not self.enabled:
            return
        if self._file:  # strict JSON: a non-finite number (an fp16 overflow's norm) becomes null
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        if self._tb:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()
