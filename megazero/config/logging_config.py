"""The logging section: where a run's metrics go and how it is watched (log files, TensorBoard, W&B,
MFU's peak, the profiler). Its own module beside :mod:`megazero.config.sections`, which holds the other
sections; its fields carry their flags the same way (:func:`~megazero.config.fields.flag_field`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megazero.config import checks
from megazero.config.fields import flag_field

if TYPE_CHECKING:
    from megazero.config.sections import TrainConfig


@dataclass
class LoggingConfig:
    """Where metrics go besides the log lines, and how a run is watched: MFU's peak, the profiler, W&B."""

    tensorboard_dir: str | None = flag_field(None, "--tensorboard-dir", group="logging", metavar="DIR",
                                             help="TensorBoard event files (needs the tensorboard extra)")
    metrics_file: str | None = flag_field(None, "--metrics-file", group="logging", metavar="PATH",
                                          help="JSON lines, one per logged iteration")
    return_freed_memory: bool = flag_field(
        False, "--return-freed-memory", action="store_true", group="logging",
        help="CPU runs: hand freed tensors' memory back to the system at once (glibc's mmap threshold at "
             "1 MiB), so the logged peak resident memory follows the live tensors; every large allocation "
             "then pays fresh page faults (ZeRO-3 steps up to ~1.7x slower). Off: glibc reuses freed memory")
    measure_live_bytes: bool = flag_field(
        False, "--measure-live-bytes", action="store_true", group="logging",
        help="count the peak bytes of live tensors in the last iteration (CPU: the torch profiler's allocation "
             "events, from the iteration before; GPU: peak allocated memory) and log it as peak live / "
             "peak_live_bytes, beside the resident peak; those two iterations run slower, the others as usual")
    peak_tflops: float | None = flag_field(
        None, "--peak-tflops", type=float, group="logging",
        help="the device's peak TFLOP/s for this precision, for MFU (default: known GPUs only; a CPU has none)")
    # The torch profiler (Megatron's flag names; megazero/profiling.py).
    profile: bool = flag_field(False, "--profile", action="store_true", group="logging",
                               help="write a torch profiler trace (chrome trace JSON) of the steps "
                                    "--profile-step-start to --profile-step-end")
    profile_step_start: int | None = flag_field(
        None, "--profile-step-start", type=int, group="logging",
        help="with --profile: profiling starts after this iteration (default 10: iteration 11 is the first profiled)")
    profile_step_end: int | None = flag_field(
        None, "--profile-step-end", type=int, group="logging",
        help="with --profile: the last iteration profiled (default 12)")
    profile_ranks: list[int] | None = flag_field(None, "--profile-ranks", type=int, nargs="+", group="logging",
                                                 help="with --profile: the global ranks profiled (default 0)")
    profile_dir: str | None = flag_field(
        None, "--profile-dir", group="logging",
        help="with --profile: where the traces go (default: --tensorboard-dir, else SAVE/profile, else ./profile)")
    # Weights & Biases (Megatron's flag names): rank 0 logs what the metrics file gets.
    wandb_project: str | None = flag_field(None, "--wandb-project", group="logging",
                                           help="log the metrics to this W&B project (needs: pip install wandb)")
    wandb_exp_name: str | None = flag_field(None, "--wandb-exp-name", group="logging",
                                            help="with --wandb-project: the W&B run's name")
    wandb_save_dir: str | None = flag_field(
        None, "--wandb-save-dir", group="logging",
        help="with --wandb-project: W&B's local files (default: SAVE/wandb, else wandb's own ./wandb)")

    def check(self, train: TrainConfig | None = None, world_size: int | None = None) -> None:
        """The profiler and W&B settings need their switch; the profiled steps and ranks exist; fills the
        profiler's defaults (Megatron's: steps 10 to 12 on rank 0)."""
        checks.check_logging(self, train, world_size)
