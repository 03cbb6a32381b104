"""torchft replica groups (``--fault-tolerance torchft``): the replica dimension across separate jobs.

Each replica group is its own job (its own torchrun, its world tp x pp x dp); every rank of it runs a
torchft ``Manager``, and the ranks at the same place in every group (same global rank of their job)
share the Manager's fault-tolerant process group. Who holds what: each rank holds its job's state as
without torchft; the same-rank peers in the other groups hold the same shards of the same state.

Each step (:class:`ReplicaGroups`, driven by :mod:`megazero.training`):

1. ``start_step(state)`` -- a quorum (synchronous) before the first forward. A group behind the others
   (restarted) heals here: each of its ranks fetches weights, optimizer state and the train state
   (iteration, samples consumed, RNG) from the same rank of a live group, over
   :class:`megazero.checkpoint.transport.TensorTransport` (JSON and raw bytes, nothing unpickled).
2. The step's data: with ``--ft-batch-policy keep`` (the default) the groups taking part split the
   step's micro-batches between them by their place in the quorum (:meth:`ReplicaGroups.data_share`),
   so the step trains on the fault-free run's samples whoever is missing; with ``shrink`` each group
   reads its own share and a missing group's samples are left out. Said in the log whenever the count
   of groups taking part changes.
3. The gradient sync reduces within the job, then :class:`ManagerReplicaAverage` (the grad syncs'
   ``replica_reducer``) weights every reduced shard by the group's share of the step's samples and
   averages it over the groups taking part: the mean gradient over the step's samples.
4. ``should_commit()`` -- the optimizer steps only if every participant finished the step; otherwise no
   group applies it, the iteration counter stays, and the step is retried on the same data.

Checkpoints (``--save``): each group writes under its own directory (``DIR/replica-group-<id>``), and
only the group first in the step's quorum saves -- group 0 while it is alive, else whichever is. A saver
that leaves the quorum right after its save may have died writing it: the group first in the next quorum
then saves the same iteration (its state is still that iteration's, no step having run since), so a
fault during a save never leaves the run without that checkpoint. For example, 3 groups, a save at
iteration 500 by group 0, killed while writing: the quorum before iteration 501 holds groups 1 and 2,
and group 1 (first in it) writes ``replica-group-1/iter_0000500`` before stepping.
"""
from __future__ import annotations

import hashlib
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megazero.checkpoint.transport import TensorTransport
from megazero.config import FLAG, FaultToleranceConfig
from megazero.errors import ReplicaGroupLost, TrainingStopped
from megazero.state import TrainState


class ManagerReplicaAverage:
    """A grad sync's ``replica_reducer`` over torchft replica groups: each reduced shard (this group's mean
    gradient over its micro-batches, averaged over the job's dp) times ``weight``, then averaged over the
    groups in the quorum by the Manager's fault-tolerant all-reduce (a sum divided by the participants).
    ``weight`` is ``participants x`` this group's share of the step's samples (1 when the groups take equal
    shares), so the result is the mean gradient over all the step's samples. A failed all-reduce is
    recorded by the Manager (the step then does not commit), never raised here."""

    def __init__(self, manager):
        self.manager = manager
        self.weight = 1.0

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    def combine(self, shard: torch.Tensor) -> None:
        if self.weight != 1.0:
            shard.mul_(self.weight)
        self.manager.allreduce(shard).wait()


def split_shares(micro_batches: int, participants: int) -> list[int]:
    """How many of a step's ``micro_batches`` (of each data-parallel rank) each of ``participants`` groups
    takes, by place in the quorum: every ``participants``-th from its place (the first ones take one more
    when the split is uneven)."""
    return [len(range(position, micro_batches, participants)) for position in range(participants)]


def _manager_store() -> tuple[str, int, object]:
    """(host, port, the store object on rank 0 else None) of a TCP store for this job's Managers, hosted by job rank 0 (the port sent to the
    other ranks over the job's default group): torchft's Managers meet there and peers across jobs reach it."""
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    port = torch.zeros(1, dtype=torch.int64)
    store = None
    if dist.get_rank() == 0:
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, 0)
    return host, int(port.item()), store


class ReplicaGroups:
    """This rank's part in the torchft replica groups (see the module docstring); built after the engine.

    ``cfg``: the fault-tolerance section; ``topo``, ``chunks``, ``engine``: this job's; ``layout``: what
    a peer's state must match to be loaded here (tp, pp, dp, stage, model sizes...); ``global_batch``:
    this group's batch per step, of ``micro_batch_size`` micro-batches; ``say``: rank 0's log (the
    participation lines); ``checksums``: log a parameter checksum per rank each step (``--ft-param-checksums``)."""

    def __init__(self, cfg: FaultToleranceConfig, topo, chunks, engine, layout: dict, global_batch: int, say,
                 checksums: bool = False, micro_batch_size: int = 1):
        from torchft import Manager, ProcessGroupGloo      # the optional extra: imported only when asked for

        self.cfg, self.topo, self.chunks, self.engine, self.layout = cfg, topo, chunks, engine, layout
        self.groups, self.replica_id, self.global_batch = cfg.ft_replica_groups, cfg.ft_replica_id, global_batch
        self.say, self.checksums = say, checksums
        self.state: TrainState | None = None
        self.healed = False
        self.committed = True
        self._participants = None
        self.keeps_batch = cfg.ft_batch_policy == "keep"
        self.step_micro_batches = global_batch * self.groups // (micro_batch_size * topo.dp_size)   # per dp rank
        self._share = (self.replica_id, self.groups)
        self._save = None                            # the checkpoint saver, once :meth:`saver` wraps it
        self._unconfirmed_save: int | None = None   # the iteration another group saved, until the next quorum
        # The gradient average and healing give up on a peer group after --ft-timeout-seconds; what waits on
        # this group's own other ranks (the quorum, the commit vote: the group's first rank gathers them)
        # waits --ft-quorum-timeout-seconds, longer, since one rank may sit out a whole collective timeout.
        timeout = timedelta(seconds=cfg.ft_timeout_seconds)
        group_wait = timedelta(seconds=cfg.ft_quorum_timeout_seconds)
        host, port, self._store = _manager_store()
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self.load_peer_state, state_dict=self.peer_state,
            min_replica_size=cfg.ft_min_replicas, use_async_quorum=False, timeout=group_wait,
            quorum_timeout=group_wait, connect_timeout=timeout, rank=topo.rank, world_size=topo.world_size,
            store_addr=host, store_port=port,
            lighthouse_addr=cfg.ft_lighthouse, replica_id=f"replica_group_{self.replica_id}",
            checkpoint_transport=TensorTransport(timeout), init_sync=False)
        self.average = ManagerReplicaAverage(self.manager)
        engine.combine_replicas_with(self.average)

    # ------------------------------------------------------------ each step
    def start_step(self, state: TrainState) -> bool:
        """The quorum before the step's first forward; True when this group was healed from a peer (its
        weights, optimizer and ``state`` replaced: the caller reads the data from the new position)."""
        self.state, self.healed = state, False
        self.manager.load_state_dict({"step": state.iteration, "batches_committed": self.manager.batches_committed()})
        try:
            self.manager.start_quorum()
        except LayoutMismatch as e:                     # raised by load_peer_state, on this thread
            raise TrainingStopped(str(e)) from None
        except (RuntimeError, TimeoutError) as e:  # torchft's quorum call failed: its Manager cannot go on
            raise self._lost(e) from None
        participants = self.manager.num_participants()
        if self.keeps_batch:
            position = self.manager.participating_rank()
            shares = split_shares(self.step_micro_batches, participants)
            self._share = (position, participants)
            self.average.weight = shares[position] * participants / self.step_micro_batches
        self._save_again_if_saver_left(state, participants)
        if participants != self._participants:
            was = f" (was {self._participants})" if self._participants is not None else ""
            self.say(f" ft: iteration {state.iteration + 1}: {participants} of {self.groups} replica groups take "
                     f"part{was}: {self._batch_policy_words(participants)}")
            self._participants = participants
        if self.healed:
            self.say(f" ft: replica group {self.replica_id} healed from a live peer: at iteration {state.iteration}, "
                     f"{state.consumed_samples} samples consumed")
        if self.checksums:
            print(f" ft checksum: group {self.replica_id} rank {self.topo.rank} iteration {state.iteration} "
                  f"params {self.parameter_checksum()}{' healed' if self.healed else ''}", flush=True)
        return self.healed

    def saved_elsewhere(self, iteration: int) -> None:
        """Another group (the first in the quorum) saves ``iteration``: checked at the next quorum."""
        self._unconfirmed_save = iteration

    def _save_again_if_saver_left(self, state: TrainState, participants: int) -> None:
        """After the quorum: if another group saved this very iteration and the quorum has lost a group
        since (the saver, maybe killed while writing), the group now first in it saves the iteration
        again, under its own directory, before any step changes the state. Redundant when the group
        that left was another one or its save had finished; never skipped when it was the saver."""
        pending, self._unconfirmed_save = self._unconfirmed_save, None
        if (pending is None or self._save is None or self.healed or pending != state.iteration
                or self._participants is None or participants >= self._participants or not self.saves()):
            return
        self.say(f" ft: replica group {self.replica_id} saves iteration {state.iteration} again: a replica group "
                 f"left the quorum right after the save (the saver's may not have finished)")
        self._save(state)

    def data_share(self) -> tuple[int, int]:
        """``(position, count)``: which of the step's micro-batches this group reads (see
        :func:`megazero.data.samplers.micro_batch_sample_ids`): with ``keep``, its place in this step's
        quorum and the groups taking part; with ``shrink``, its replica id and every group."""
        return self._share

    def _batch_policy_words(self, participants: int) -> str:
        """What the step's batch is with ``participants`` groups taking part, for the quorum-change line."""
        if not self.keeps_batch:
            return f"the step's global batch is {participants} x {self.global_batch} samples"
        dp = self.topo.dp_size
        shares = sorted({n * dp for n in split_shares(self.step_micro_batches, participants)}, reverse=True)
        total = self.step_micro_batches * dp
        if len(shares) == 1:
            return f"each takes {shares[0]} of the step's {total} micro-batches"
        return (f"each takes {shares[0]} or {shares[1]} of the step's {total} micro-batches (gradients weighted "
                f"by each group's share)")

    def should_commit(self) -> bool:
        """Did every group in the quorum finish this step (the same answer on every rank of this job)?"""
        try:
            self.committed = self.manager.should_commit()
        except (RuntimeError, TimeoutError) as e:
            raise self._lost(e) from None
        if not self.committed:
            self.say(f" ft: iteration {self.state.iteration + 1} not committed (a replica group failed during it): "
                     f"nothing applied, the step runs again")
        return self.committed

    def _lost(self, error: Exception) -> ReplicaGroupLost:
        """The line of a group whose Manager lost its quorum (e.g. it was stopped past the timeout): torchft
        cannot continue in this process; restarted, the group heals from a live one."""
        return ReplicaGroupLost(f"{FLAG.fault_tolerance}: replica group {self.replica_id} lost its quorum "
                                f"({str(error).splitlines()[0][:200]}): restart this group; it heals from a live one")

    def run_batch(self, group_batch: int) -> int:
        """Samples of the run's data stream one step covers: every group's share, taking part or not."""
        return group_batch * self.groups

    def saves(self) -> bool:
        """Does this group save this step's checkpoint (the first in the quorum)?"""
        return self.manager.participating_rank() == 0

    def saver(self, save):
        """``save`` (a :class:`megazero.training.Saver`) run only by the group first in the step's quorum
        (and again by the next first group when the saver leaves right after its save)."""
        self._save = save
        return FirstGroupSaves(save, self)

    def parameter_checksum(self) -> str:
        """SHA-256 of this rank's weights (every parameter of its chunks, in order), for comparing peers."""
        digest = hashlib.sha256()
        for chunk in self.chunks:
            for p in chunk.parameters():
                digest.update(p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------- healing state
    def peer_state(self) -> dict:
        """What a healing peer's same rank takes: weights and optimizer state by piece, the train state, RNG."""
        state, optimizer = self.state, self.engine.optimizer
        scaler = optimizer.scaler.state_dict() if optimizer.scaler is not None else None
        return {"layout": self.layout,
                "train": {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                          "skipped_iterations": state.skipped_iterations},
                "optimizer": {"step_count": int(optimizer.step_count), "loss_scaler": scaler},
                "rng": capture_rng_state(self.chunks),
                "tensors": {f"{p.name}[{p.lo}:{p.hi}].{key}": t
                            for p in self.engine.loaded_pieces() for key, t in sorted(p.tensors.items())}}

    def load_peer_state(self, sent: dict) -> None:
        """Take a peer's state (:meth:`peer_state`): refused in one line when its layout is not ours."""
        if sent["layout"] != self.layout:
            theirs = sent["layout"]
            differ = "; ".join(f"{k} {theirs.get(k)} there, {self.layout.get(k)} here"
                               for k in sorted(set(theirs) | set(self.layout)) if theirs.get(k) != self.layout.get(k))
            raise LayoutMismatch(
                f"{FLAG.fault_tolerance}: replica group {self.replica_id} cannot heal from a peer with another layout "
                f"({differ}): start every replica group with the same parallel, ZeRO and model flags")
        tensors = sent["tensors"]
        with torch.no_grad():
            for piece in self.engine.loaded_pieces():
                for key, view in piece.tensors.items():
                    view.copy_(tensors[f"{piece.name}[{piece.lo}:{piece.hi}].{key}"].reshape(view.shape))
        self.engine.loaded(sent["optimizer"]["step_count"], sent["optimizer"]["loss_scaler"], weights_only=False)
        train = sent["train"]
        self.state.iteration, self.state.consumed_samples = train["iteration"], train["consumed_samples"]
        self.state.skipped_iterations = train["skipped_iterations"]
        restore_rng_state(sent["rng"], self.chunks)
        self.healed = True


class FirstGroupSaves:
    """A saver that writes only on the replica group first in the step's quorum, and says which group that is."""

    def __init__(self, save, groups: ReplicaGroups):
        self.save, self.groups = save, groups

    def __call__(self, state: TrainState) -> float | None:
        if not self.groups.saves():
            self.groups.saved_elsewhere(state.iteration)
            return None
        self.groups.say(f" ft: replica group {self.groups.replica_id} saves iteration {state.iteration} "
                        f"(first in the quorum)")
        return self.save(state)

    def finish(self) -> None:
        self.save.finish()


class LayoutMismatch(ValueError):
    """A peer's state has another layout than this group's: healing from it cannot work."""
