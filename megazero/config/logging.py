"""The logging section: where a run's metrics go and how it is watched (log files, TensorBoard, W&B,
MFU's peak, the torch profiler). Whether its paths can be written and wandb is installed is the
pre-launch check's (:mod:`megazero.cli.preflight`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.fields import FLAG, flag, flag_field
from megazero.config.rules import fail, positive_float
from megazero.config.train import TrainConfig

PROFILE_DEFAULTS = {"profile_step_start": 10, "profile_step_end": 12, "profile_ranks": [0]}   # Megatron's


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

    # (no flag) what --deepspeed-config / --accelerate-config resolved, by file (the entry point fills it):
    # {source: {field: {"value": ..., "auto" or "default": ...}}}, the metrics file's first record.
    config_files: dict | None = None

    def check(self, train: TrainConfig | None = None, world_size: int | None = None) -> None:
        """The profiler's settings apply with ``--profile`` and W&B's with ``--wandb-project``; with
        ``--profile``, fills Megatron's defaults (steps 10 to 12, rank 0) and checks that a step of the
        window is trained (against ``train``), that the ranks exist (against ``world_size``) and that it leaves
        the last two iterations to ``--measure-live-bytes`` (one profiler at a time). Whether the
        paths can be written and wandb is installed is the preflight's (:mod:`megazero.cli.preflight`)."""
        if self.peak_tflops is not None:
            positive_float(self.peak_tflops, "peak_tflops")
        for name in ("wandb_exp_name", "wandb_save_dir"):
            if getattr(self, name) and not self.wandb_project:
                fail(f"{flag(name)} applies with {FLAG.wandb_project}: add {FLAG.wandb_project} NAME or drop "
                     f"{flag(name)}")
        if not self.profile:
            for name in (*PROFILE_DEFAULTS, "profile_dir"):
                if getattr(self, name) is not None:
                    fail(f"{flag(name)} applies with {FLAG.profile}: add {FLAG.profile} or drop {flag(name)}")
            return
        for name, default in PROFILE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, list(default) if isinstance(default, list) else default)
        start, end = self.profile_step_start, self.profile_step_end
        if start < 0:
            fail(f"{FLAG.profile_step_start} must be >= 0, got {start}")
        if end <= start:
            fail(f"{FLAG.profile_step_end} {end} must be above {FLAG.profile_step_start} {start}: the steps after "
                 f"iteration {start} up to iteration {end} are profiled")
        if train is not None and start >= train.train_iters:
            fail(f"{FLAG.profile_step_start} {start} is not below {FLAG.train_iters} {train.train_iters}: nothing "
                 f"would be profiled; choose a smaller {FLAG.profile_step_start} (and {FLAG.profile_step_end})")
        if world_size is not None:
            outside = [r for r in self.profile_ranks if not 0 <= r < world_size]
            if outside:
                ranks = " ".join(map(str, self.profile_ranks))
                fail(f"{FLAG.profile_ranks} {ranks}: rank(s) {', '.join(map(str, outside))} "
                     f"not in this world of {world_size} (ranks 0-{world_size - 1})")
        if self.measure_live_bytes and train is not None and start < train.train_iters and end > train.train_iters - 2:
            fail(f"{FLAG.measure_live_bytes} and {FLAG.profile} would both run torch's profiler over iterations "
                 f"{train.train_iters - 1}-{train.train_iters} (live bytes: the last two; profiled: "
                 f"{start + 1}-{end}): end the profiled window before iteration {train.train_iters - 1} or drop "
                 f"one of them")
