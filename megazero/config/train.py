"""The training section: batch sizes, the run's length (and its wall-clock limit), the seed, and the evaluation
and logging rhythm.
Its rules check the batch against the layout (micro-batches per step, enough of them to fill the
pipeline) and fill ``global_batch_size`` and ``train_iters``.
"""
from __future__ import annotations

from argparse import BooleanOptionalAction
from dataclasses import dataclass

from megazero.config.fields import FLAG, flag, flag_field, setting
from megazero.config.model import ACTIVATION_MEMORY_FIELDS, ModelConfig
from megazero.config.parallel import ParallelConfig
from megazero.config.rules import fail, positive, positive_float


@dataclass
class TrainConfig:
    """Batch sizes, iterations and the evaluation and logging rhythm."""

    micro_batch_size: int = flag_field(8, "--micro-batch-size", type=int, group="training",
                                       help="sequences per micro-batch on each rank")
    global_batch_size: int | None = flag_field(None, "--global-batch-size", type=int, group="training",
                                               help="sequences per step (default micro x dp x pp)")
    step_batch_size_schedule: str | None = flag_field(
        None, "--step-batch-size-schedule", type=str, group="training", metavar="SCHEDULE",
        help="a global batch that grows in steps (Megatron-LM's): 'THRESHOLD:BATCH ...', thresholds in tokens "
             "consumed (K/M/B/T suffixes: 1e3..1e12), the first 0; each step trains at the batch of the last "
             "threshold reached; --global-batch-size, when given, must be the last batch")
    batch_schedule: tuple[tuple[int, int], ...] | None = None   # filled: (threshold in samples, global batch)
    gradient_accumulation_steps: int | None = None   # (DeepSpeed / Accelerate configs) global = micro * this * dp
    train_iters: int | None = flag_field(None, "--train-iters", type=int, group="training",
                                         help="training iterations (default 400, or from --train-samples)")
    train_samples: int | None = flag_field(
        None, "--train-samples", type=int, group="training",
        help="train this many samples: that // --global-batch-size iterations (a sample-based run)")
    exit_duration_in_mins: float | None = flag_field(
        None, "--exit-duration-in-mins", type=float, group="training", metavar="MINUTES",
        help="stop once this many minutes have passed since the process started, after the step that passes them: "
             "save a checkpoint (with --save) and exit with status 0, to be resumed from it")
    seed: int = flag_field(1234, "--seed", type=int, group="training", help="the random seed")
    eval_interval: int = flag_field(100, "--eval-interval", type=int, group="training",
                                    help="iterations between evaluations")
    eval_iters: int = flag_field(10, "--eval-iters", type=int, group="training",
                                 help="batches per evaluation (0: none)")
    log_interval: int = flag_field(10, "--log-interval", type=int, group="training",
                                   help="iterations between log lines")
    memory_budget_gib: float | None = flag_field(
        None, "--memory-budget-gib", type=float, group="activation memory",
        help="let the memory planner pick the cheapest recompute / offload plan whose estimated peak per rank fits "
             "this many GiB (megazero/memory/planner.py); not with the recompute and offload flags")
    check_for_nan_in_loss_and_grad: bool = flag_field(
        True, "--check-for-nan-in-loss-and-grad", action=BooleanOptionalAction, group="training",
        help="stop the run on a non-finite loss or gradient (default on; off: such steps are skipped)")

    def check(self, par: ParallelConfig, model: ModelConfig | None = None) -> None:
        """Batch sizes against the layout (``par.dp`` resolved); fills ``global_batch_size``. A memory
        budget leaves recompute and offload to the planner: with ``model``, its flags for them are refused
        beside it (two sources would decide the same thing)."""
        positive(self.micro_batch_size, "micro_batch_size")
        if self.memory_budget_gib is not None:
            positive_float(self.memory_budget_gib, "memory_budget_gib")
            conflict = model is not None and planner_conflict(model, FLAG.memory_budget_gib)
            if conflict:
                fail(conflict)
        steps = self.gradient_accumulation_steps              # no flag: a DeepSpeed or Accelerate config sets it
        if steps is not None:
            if steps < 1:
                fail(f"{setting('gradient_accumulation_steps')} must be a positive integer, got {steps}")
            implied = self.micro_batch_size * steps * par.dp
            if self.global_batch_size is None:
                self.global_batch_size = implied
            elif self.global_batch_size != implied:
                fail(f"{FLAG.global_batch_size} {self.global_batch_size} is not micro-batch {self.micro_batch_size} x "
                      f"gradient accumulation steps {steps} x dp {par.dp} = {implied}: make them agree")
        if self.step_batch_size_schedule is not None:
            self._check_batch_schedule(par, model.seq_length if model is not None else None)
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * par.dp * par.pp
        positive(self.global_batch_size, "global_batch_size")
        self._check_global_batch(self.global_batch_size, par, FLAG.global_batch_size)
        self._fill_train_iters()
        limit = self.exit_duration_in_mins
        if limit is not None and limit <= 0:       # nan and inf: validate() refuses them first
            fail(f"{FLAG.exit_duration_in_mins} must be a positive number of minutes, got {limit:g}: give the minutes "
                 f"the run may last (it saves and exits once they have passed), or drop the flag")
        if not 0 <= self.seed < 2 ** 32:
            fail(f"{FLAG.seed} must be in [0, 2**32), got {self.seed}: the data order and the initial weights are "
                  f"drawn from it; pick a non-negative seed")
        for name in ("eval_interval", "log_interval"):
            positive(getattr(self, name), name)
        if self.eval_iters < 0:
            fail(f"{FLAG.eval_iters} must be >= 0, got {self.eval_iters}")

    def _check_global_batch(self, batch: int, par: ParallelConfig, source: str) -> None:
        """One global batch (``source`` names where it comes from) against the layout: whole micro-batches on
        every data-parallel rank, enough of them to fill the pipeline, and the interleaved schedule's multiple."""
        per_step = self.micro_batch_size * par.dp
        if batch % per_step:
            fail(f"{source} {batch} is not divisible by {FLAG.micro_batch_size} "
                  f"{self.micro_batch_size} * dp {par.dp} = {per_step}: use a multiple of {per_step}")
        m = batch // per_step
        lead, target = ("", source) if source == FLAG.global_batch_size else (f"{source} {batch}: ", "that batch")
        if par.pp > 1 and par.pipeline_schedule in ("1f1b", "interleaved", "zb-h1", "zb-v") and m < par.pp:
            fail(f"{lead}{m} micro-batches per step is fewer than {par.pp} pipeline stages, which leaves the "
                  f"{par.pipeline_schedule} pipeline mostly idle: raise {target} to at least "
                  f"{par.pp * per_step} (micro-batches = global / (micro * dp))")
        if par.pipeline_schedule == "interleaved" and m % par.pp:
            fail(f"{lead}the interleaved schedule needs micro-batches ({m}) divisible by {FLAG.pp} {par.pp}: "
                  f"make {target} a multiple of {par.pp * per_step}")

    def _check_batch_schedule(self, par: ParallelConfig, seq_length: int | None) -> None:
        """``--step-batch-size-schedule``: parsed into ``batch_schedule`` (thresholds in samples), each batch
        checked against the layout; ``global_batch_size`` is its last batch (given, it must be that one)."""
        if self.gradient_accumulation_steps is not None:
            fail(f"{FLAG.step_batch_size_schedule} sets the global batch step by step; a gradient accumulation "
                 f"count fixes it: drop one of them")
        try:
            schedule = parse_batch_size_schedule(self.step_batch_size_schedule, seq_length)
        except ValueError as e:
            fail(f"{FLAG.step_batch_size_schedule} {e}")
        for entry, (_, batch) in zip(self.step_batch_size_schedule.replace(",", " ").split(), schedule):
            self._check_global_batch(batch, par, f"{FLAG.step_batch_size_schedule} entry '{entry}': batch")
        last = schedule[-1][1]
        if self.global_batch_size is not None and self.global_batch_size != last:
            fail(f"{FLAG.global_batch_size} {self.global_batch_size} is not the last batch of "
                 f"{FLAG.step_batch_size_schedule} ({last}): drop {FLAG.global_batch_size} or make it {last}")
        self.global_batch_size, self.batch_schedule = last, schedule

    @property
    def largest_global_batch(self) -> int:
        """The largest global batch a step trains at (the schedule's largest, else the constant one)."""
        if self.batch_schedule is None:
            return self.global_batch_size
        return max(batch for _, batch in self.batch_schedule)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` (the schedule's, else the
        constant one)."""
        if self.batch_schedule is None:
            return self.global_batch_size
        return batch_size_at(self.batch_schedule, consumed_samples)

    def lr_position(self, iteration: int, consumed_samples: int) -> float:
        """Where the learning-rate schedule stands for the step after ``iteration`` steps and ``consumed_samples``
        samples, in iterations: ``iteration``, or under a batch-size schedule the samples consumed by the end of
        that step in units of the last (full) global batch, less one -- Megatron-LM steps its LR schedule by
        samples, its warmup and decay lengths being iterations of the full batch, so smaller early batches
        advance it less. The two agree at a constant batch."""
        if self.batch_schedule is None:
            return iteration
        return (consumed_samples + self.global_batch_at(consumed_samples)) / self.global_batch_size - 1

    def _fill_train_iters(self) -> None:
        """The training length: ``--train-iters`` (default 400), or ``--train-samples`` // the global batch (a
        sample-based run, as Megatron counts it); not both."""
        if self.train_samples is None:
            self.train_iters = 400 if self.train_iters is None else self.train_iters
            positive(self.train_iters, "train_iters")
            return
        if self.train_iters is not None:
            fail(f"{FLAG.train_iters} and {FLAG.train_samples} are exclusive (iteration- or sample-based): keep one")
        positive(self.train_samples, "train_samples")
        if self.batch_schedule is not None:         # Megatron: steps until the samples are consumed
            steps, consumed = 0, 0
            while consumed < self.train_samples:
                consumed += batch_size_at(self.batch_schedule, consumed)
                steps += 1
            self.train_iters = steps
            return
        self.train_iters = self.train_samples // self.global_batch_size
        if self.train_iters < 1:
            fail(f"{FLAG.train_samples} {self.train_samples} is less than one {FLAG.global_batch_size} "
                 f"({self.global_batch_size}): no iteration to train")


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _count(text: str) -> int:
    """A count with an optional K/M/B/T suffix ("2.4B" -> 2_400_000_000), as Megatron reads them."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = float(text[:-1] if scale > 1 else text)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError
    return int(number * scale)


def parse_batch_size_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """``'THRESHOLD:BATCH ...'`` (spaces or commas between entries) as ((threshold in samples, batch), ...):
    thresholds are tokens divided by ``seq_length`` (samples when it is None), as Megatron-LM converts them.
    Raises ValueError naming the first bad entry: not THRESHOLD:BATCH, a batch below 1, the first threshold
    not 0, thresholds not increasing."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError("is empty: give 'THRESHOLD:BATCH ...', the first threshold 0")
    schedule: list[tuple[int, int]] = []
    for entry in entries:
        threshold_text, _, batch_text = entry.partition(":")
        try:
            threshold, batch = _count(threshold_text), _count(batch_text)
        except ValueError:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH (numbers, K/M/B/T suffixes allowed)") from None
        if batch < 1 or threshold < 0:
            raise ValueError(f"entry {entry!r}: the threshold must be >= 0 and the batch >= 1")
        samples = threshold // seq_length if seq_length else threshold
        if not schedule and samples != 0:
            raise ValueError(f"entry {entry!r}: the first threshold must be 0 (the batch the run starts at)")
        if schedule and samples <= schedule[-1][0]:
            raise ValueError(f"entry {entry!r}: thresholds must increase ({samples} samples is not past "
                             f"{schedule[-1][0]})")
        schedule.append((samples, batch))
    return tuple(schedule)


def batch_size_at(schedule: tuple[tuple[int, int], ...], consumed_samples: int) -> int:
    """The batch of the last threshold at or below ``consumed_samples``."""
    batch = schedule[0][1]
    for threshold, size in schedule:
        if threshold > consumed_samples:
            break
        batch = size
    return batch


def planner_conflict(model: ModelConfig, budget: str) -> str | None:
    """Why a memory budget (``budget``: the flag that gave it) cannot stand beside ``model``'s recompute or
    activation-offload flags -- the planner chooses those, so two sources would decide the same thing --
    or None when the model gives none."""
    given = [name for name in ACTIVATION_MEMORY_FIELDS
             if getattr(model, name) not in (None, False) and name != "recompute_modules"]
    if not given:
        return None
    return f"{budget} lets the planner choose recompute and offload; {flag(given[0])} chooses too: drop one of them"
