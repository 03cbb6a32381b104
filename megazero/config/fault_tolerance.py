"""The fault-tolerance section: data-parallel replica groups that survive each other's failures (torchft).

With ``--fault-tolerance torchft`` every replica group is its own job (its own torchrun; its world is
tp x pp x dp of one replica), and the replica dimension runs across the jobs through torchft's Manager:
a quorum each step, the gradients averaged over the replica groups that take part, the optimizer
stepped only when every participant finished the step, and a restarted group healed from a live peer
before its first step. The flags follow torchtitan's ``--fault_tolerance.*`` (``replica_id``,
``group_size``, ``min_replica_size``) in our spelling::

    --fault-tolerance torchft --ft-replica-groups 3 --ft-replica-id 1 --ft-min-replicas 1 --ft-lighthouse HOST:29510

``--global-batch-size`` is each replica group's batch: the run's is that times ``--ft-replica-groups``.
While a group is out, ``--ft-batch-policy keep`` (the default) has the groups taking part split the
step's micro-batches between them, so every step trains on the samples of the fault-free run; ``shrink``
leaves the missing groups' samples out (the step's batch is the present groups' share).
What runs and how it is proven: docs/faults.md.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from megazero.config.fields import FLAG, flag, flag_field
from megazero.config.rules import fail, one_of

FAULT_TOLERANCE_KINDS = ("torchft",)
BATCH_POLICIES = ("keep", "shrink")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"        # torchft's own default for the lighthouse address
# torchft reads these over the Manager's arguments; both are given --ft-quorum-timeout-seconds (the Manager's
# own waits: the quorum and the commit vote), the process group's --ft-timeout-seconds (read by no variable).
TIMEOUT_ENVS = (("TORCHFT_TIMEOUT_SEC", "ft_quorum_timeout_seconds"),
                ("TORCHFT_QUORUM_TIMEOUT_SEC", "ft_quorum_timeout_seconds"))

_FT = "fault tolerance"


def torchft_importable() -> bool:
    """Is torchft installed (the ``ft`` extra)?"""
    return importlib.util.find_spec("torchft") is not None


def _same_seconds(text: str, seconds: float) -> bool:
    """Does a torchft timeout variable (whole seconds: torchft reads it with ``int``) say ``seconds``?"""
    try:
        return int(text) == seconds
    except ValueError:
        return False


@dataclass
class FaultToleranceConfig:
    """Replica groups as separate jobs joined by torchft (off unless ``fault_tolerance``)."""

    fault_tolerance: str | None = flag_field(
        None, "--fault-tolerance", choices=FAULT_TOLERANCE_KINDS, group=_FT,
        help="torchft: this job is one data-parallel replica group of several, each its own torchrun; a failed "
             "group is left out of the steps and healed from a live one when it restarts (default: off)")
    ft_replica_id: int | None = flag_field(
        None, "--ft-replica-id", type=int, group=_FT, metavar="ID",
        help="this job's replica group, 0 to --ft-replica-groups - 1 (torchtitan's fault_tolerance.replica_id)")
    ft_replica_groups: int | None = flag_field(
        None, "--ft-replica-groups", type=int, group=_FT, metavar="G",
        help="how many replica groups the run has; the data is sharded over G x dp (torchtitan's "
             "fault_tolerance.group_size)")
    ft_min_replicas: int = flag_field(
        1, "--ft-min-replicas", type=int, group=_FT, metavar="M",
        help="a step commits only with at least M replica groups taking part (default 1; torchtitan's "
             "fault_tolerance.min_replica_size)")
    ft_lighthouse: str | None = flag_field(
        None, "--ft-lighthouse", group=_FT, metavar="ADDR",
        help="the torchft lighthouse, e.g. http://host:29510 (default: the TORCHFT_LIGHTHOUSE environment variable)")
    ft_timeout_seconds: float = flag_field(
        60.0, "--ft-timeout-seconds", type=float, group=_FT,
        help="how long a replica group waits on its peers in the gradient average and in healing before it "
             "leaves them out of the step (default 60)")
    ft_quorum_timeout_seconds: float | None = flag_field(
        None, "--ft-quorum-timeout-seconds", type=float, group=_FT,
        help="how long a rank waits for the step's quorum and commit vote, which gather its group's ranks; "
             "above --ft-timeout-seconds, since one of them may sit out a whole gradient average that timed out "
             "(default 2 x --ft-timeout-seconds)")

    ft_batch_policy: str = flag_field(
        "keep", "--ft-batch-policy", choices=BATCH_POLICIES, group=_FT,
        help="while a replica group is out: keep (the groups taking part split the step's micro-batches, "
             "gradients weighted by each one's share: every step sees the fault-free run's samples) or shrink "
             "(the missing groups' samples are left out of the step) (default keep)")

    ft_param_checksums: bool = flag_field(
        False, "--ft-param-checksums", action="store_true", group=_FT,
        help="every rank logs a checksum of its weights before each step (peers' must agree; the chaos harness "
             "reads them)")

    @property
    def enabled(self) -> bool:
        return self.fault_tolerance is not None

    def check(self, par, zero, train) -> None:
        """Replica-group settings only with ``--fault-tolerance``; torchft importable; the id within the
        groups; at least one replica group required per step and no more than there are; no second replica
        dimension inside the job, nor what the sum across groups is not built for; a lighthouse to join
        (the flag or ``TORCHFT_LIGHTHOUSE``, filled in); the batch policy one of :data:`BATCH_POLICIES`,
        ``keep`` not with the interleaved schedule. ``par``, ``zero``, ``train``: the parallel, ZeRO and
        training sections (checked)."""
        one_of(self, "ft_batch_policy")
        if not self.enabled:
            given = [name for name in ("ft_replica_id", "ft_replica_groups", "ft_lighthouse",
                                       "ft_quorum_timeout_seconds")
                     if getattr(self, name) is not None]
            given += ["ft_min_replicas"] if self.ft_min_replicas != 1 else []
            given += ["ft_param_checksums"] if self.ft_param_checksums else []
            given += ["ft_batch_policy"] if self.ft_batch_policy != "keep" else []
            if given:
                fail(f"{flag(given[0])} sets up torchft replica groups: add {FLAG.fault_tolerance} torchft, or drop it")
            return
        if not torchft_importable():
            fail(f"{FLAG.fault_tolerance} torchft needs torchft, which is not installed: pip install megazero[ft]")
        groups, replica = self.ft_replica_groups, self.ft_replica_id
        if groups is None or groups < 1:
            fail(f"{FLAG.fault_tolerance} torchft needs {FLAG.ft_replica_groups} G (a positive integer, got {groups}): "
                 f"the replica groups the run has, over which the data is sharded")
        if replica is None or not 0 <= replica < groups:
            fail(f"{FLAG.ft_replica_id} must be 0 to {groups - 1} ({FLAG.ft_replica_groups} {groups}), got {replica}")
        if not 1 <= self.ft_min_replicas <= groups:
            fail(f"{FLAG.ft_min_replicas} must be 1 to {FLAG.ft_replica_groups} {groups}, got {self.ft_min_replicas}: "
                 f"no step could ever commit")
        if par.data_parallel_replicas > 1:
            fail(f"{FLAG.fault_tolerance} torchft makes each job one replica group; {FLAG.data_parallel_replicas} "
                 f"{par.data_parallel_replicas} adds a second replica dimension inside it: drop {FLAG.data_parallel_replicas}")
        self._check_not_built(par, zero, train)
        if self.ft_batch_policy == "keep" and par.pp > 1 and par.pipeline_schedule == "interleaved":
            fail(f"{FLAG.ft_batch_policy} keep with the interleaved pipeline schedule is not built (a group's share "
                 f"of a step's micro-batches need not be a multiple of {FLAG.pp} {par.pp}): add "
                 f"{FLAG.ft_batch_policy} shrink")
        self._check_timeouts()
        self.ft_lighthouse = self.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not self.ft_lighthouse:
            fail(f"{FLAG.fault_tolerance} torchft needs a lighthouse: give {FLAG.ft_lighthouse} http://HOST:PORT or set "
                 f"{LIGHTHOUSE_ENV} (start one with torchft_lighthouse --min_replicas 1)")

    def _check_timeouts(self) -> None:
        """Both timeouts positive, the quorum's (filled in: twice the other) above the gradient average's, and
        no torchft environment variable that would replace one of them behind the flags' back (torchft reads
        ``TORCHFT_TIMEOUT_SEC`` and ``TORCHFT_QUORUM_TIMEOUT_SEC`` over what it is given).

        Why the quorum waits longer: a replica group's ranks ask for the quorum, and vote on the commit,
        together (the group's first rank gathers them), and after a peer group dies or stops mid-average one
        rank may learn it at once, from its dead neighbour, while another waits out the whole
        ``--ft-timeout-seconds``; with equal timeouts the first rank's call expires just as the second
        arrives, and the surviving group stops."""
        if not self.ft_timeout_seconds > 0:
            fail(f"{FLAG.ft_timeout_seconds} must be > 0, got {self.ft_timeout_seconds}")
        if self.ft_quorum_timeout_seconds is None:
            self.ft_quorum_timeout_seconds = 2 * self.ft_timeout_seconds
        if not self.ft_quorum_timeout_seconds > self.ft_timeout_seconds:
            fail(f"{FLAG.ft_quorum_timeout_seconds} must be above {FLAG.ft_timeout_seconds} "
                 f"{self.ft_timeout_seconds:g}, got {self.ft_quorum_timeout_seconds:g}: a group's ranks reach the "
                 f"quorum up to one gradient-average timeout apart (leave it out for twice the timeout)")
        for env, name in TIMEOUT_ENVS:
            given = os.environ.get(env)
            if given is not None and not _same_seconds(given, getattr(self, name)):
                fail(f"{env}={given} in the environment would replace {flag(name)} {getattr(self, name):g} inside "
                     f"torchft: unset {env}, or give {flag(name)} {given}")

    @staticmethod
    def _check_not_built(par, zero, train) -> None:
        """What the average across replica groups does not cover: experts and split sequences (their own
        groups), ZeRO++ (its own groups), a host copy of the gradients taken before the average, a global
        batch that changes step by step (the groups' shares follow one batch)."""
        unbuilt = [(par.cp > 1, f"{FLAG.cp} {par.cp}"),
                   (par.expert_model_parallel_size > 1, f"{FLAG.expert_model_parallel_size} {par.expert_model_parallel_size}"),
                   (zero.offload_optimizer != "none", f"{FLAG.offload_optimizer} {zero.offload_optimizer}"),
                   (zero.hpz_partition_size > 1, FLAG.hpz_partition_size),
                   (zero.quantized_weights, FLAG.quantized_weights),
                   (zero.quantized_gradients, FLAG.quantized_gradients),
                   (train.step_batch_size_schedule is not None, FLAG.step_batch_size_schedule)]
        for on, what in unbuilt:
            if on:
                fail(f"{FLAG.fault_tolerance} torchft with {what} is not built: drop one of them")

    def save_dir(self, save: str | None) -> str | None:
        """Where this replica group writes its checkpoints: a directory of its own under ``--save`` (one run
        holds a save directory's lock; the group taking part as the quorum's first saves)."""
        if not self.enabled or save is None:
            return save
        return os.path.join(save, f"replica-group-{self.ft_replica_id}")
