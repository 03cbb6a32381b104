"""Chaos harness for torchft replica groups on CPU: scripted faults, restarts, and the checks that matter.

    python -m tools.chaos --groups 3 --faults 20 --out /tmp/chaos

starts a torchft lighthouse and ``--groups`` replica groups of the tiny GPT, each its own torchrun of
``--ranks`` processes (``--fault-tolerance torchft``, ``--ft-param-checksums``), then injects faults one
at a time, each into one group, cycling through :data:`FAULTS`:

    kill-rank         SIGKILL of one rank (torchrun then ends the group)
    kill-group        SIGKILL of the group's torchrun and every rank
    kill-in-backward  SIGKILL of one rank half a step after the step's start (inside forward/backward)
    kill-in-save      SIGKILL of the group that announced it saves, as it writes the checkpoint
    stop-continue     SIGSTOP of every rank past --ft-timeout-seconds, then SIGCONT (the group heals itself)
    stop-kill         SIGSTOP past the timeout, then SIGKILL

A killed group is restarted (the others never are) and heals from a live peer before its first step.
Checks, each fault summarised in one line and a verdict at the end (exit status 1 if any fails):
no group the harness did not kill stops; survivors lose at most the one step a fault interrupts; the
restarted group's weights equal its peers' bitwise before its first step (checksums per rank and
iteration); every --save-interval checkpoint is written (by group 0, or whichever is first in the quorum;
when kill-in-save kills the saver, the group first in the next quorum writes it again);
the final loss (the mean over the last --loss-window iterations) is within 1% of a fault-free run of the same
length (run first, same flags; or given by
``--reference-loss`` from an earlier run; ``--no-reference`` runs the faults only and leaves the loss unchecked).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("kill-rank", "kill-group", "kill-in-backward", "kill-in-save", "stop-continue", "stop-kill")
CHECKSUM = re.compile(r" ft checksum: group (\d+) rank (\d+) iteration (\d+) params (\w+)( healed)?")
STEP = re.compile(r" iteration +(\d+)/ *(\d+) \|.* loss ([0-9.]+)")
SAVES = re.compile(r" ft: replica group (\d+) saves iteration (\d+)")
NOT_COMMITTED = re.compile(r" ft: iteration (\d+) not committed")
# The tiny GPT on the bundled corpus (its tokenizer's 4,000 words). Not --mock-data: a model this small learns
# that data in sudden drops (3.3 to 2.1 to 0.6) whose timing moves with the last bit of rounding, so two runs'
# final losses would differ by which drops each has taken, not by what the faults did.
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--lr-decay-style", "cosine",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "7", "--zero-stage", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(port: int, min_replicas: int, log_path: Path, heartbeat_ms: int = 1500,
                     join_ms: int = 500) -> subprocess.Popen:
    """torchft's lighthouse on loopback ``port``: a quorum needs ``min_replicas`` groups, waits ``join_ms`` for
    stragglers and drops a group silent for ``heartbeat_ms``."""
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    cmd = [str(exe), "--min_replicas", str(min_replicas), "--quorum_tick_ms", "50", "--join_timeout_ms", str(join_ms),
           "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"127.0.0.1:{port}"]
    return subprocess.Popen(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def trainer_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}


def group_argv(gid: int, groups: int, lighthouse: str, iters: int, save: Path, save_interval: int,
               timeout_s: float, batch: int) -> list[str]:
    """The trainer's flags for replica group ``gid``."""
    return TINY + ["--train-iters", str(iters), "--global-batch-size", str(batch), "--save", str(save), "--load", str(save),
                   "--save-interval", str(save_interval), "--fault-tolerance", "torchft", "--ft-replica-groups",
                   str(groups), "--ft-replica-id", str(gid), "--ft-lighthouse", lighthouse,
                   "--ft-timeout-seconds", str(timeout_s), "--ft-param-checksums", "--distributed-timeout-minutes", "5"]


@dataclass
class Group:
    """One replica group: its torchrun (this generation's), what its log said, when."""

    gid: int
    argv: list[str]
    ranks: int
    log_path: Path
    proc: subprocess.Popen | None = None
    generation: int = 0
    killed_generations: set = field(default_factory=set)   # the generations the harness killed
    interrupted_saves: list = field(default_factory=list)   # iterations whose save kill-in-save interrupted
    checksums: list = field(default_factory=list)    # (time, generation, rank, iteration, checksum, healed)
    steps: list = field(default_factory=list)        # (time, generation, iteration, loss)
    saves: list = field(default_factory=list)        # (time, generation, iteration)
    uncommitted: list = field(default_factory=list)  # (time, generation, iteration)
    exits: list = field(default_factory=list)        # (generation, status, killed by the harness)
    faulted: set = field(default_factory=set)        # generations the harness injected a fault into

    def start(self) -> None:
        self.generation += 1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.ranks),
               str(ROOT / "pretrain_gpt.py"), *self.argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=trainer_env(),
                                     start_new_session=True)
        threading.Thread(target=self._follow, args=(self.proc, self.generation), daemon=True).start()

    def _follow(self, proc: subprocess.Popen, generation: int) -> None:
        with open(self.log_path, "a") as out:
            out.write(f"==== generation {generation}\n")
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                out.write(line)
                out.flush()
                now = time.monotonic()
                if m := CHECKSUM.search(line):
                    self.checksums.append((now, generation, int(m[2]), int(m[3]), m[4], bool(m[5])))
                elif m := STEP.search(line):
                    self.steps.append((now, generation, int(m[1]), float(m[3])))
                elif m := SAVES.search(line):
                    self.saves.append((now, generation, int(m[2])))
                elif m := NOT_COMMITTED.search(line):
                    self.uncommitted.append((now, generation, int(m[1])))
        status = proc.wait()
        self.exits.append((generation, status, generation in self.killed_generations))

    def iteration(self) -> int:
        """The latest iteration this generation started (-1 before its first step)."""
        mine = [c[3] for c in self.checksums if c[1] == self.generation]
        return max(mine) if mine else -1

    def mark_killed(self) -> None:
        """This generation's end is the harness's doing (kept per generation: the restart that follows
        must not make an exit seen later look unprovoked)."""
        self.killed_generations.add(self.generation)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def workers(self) -> dict[int, int]:
        """{rank: pid} of this generation's ranks (torchrun's children, by their RANK)."""
        out = {}
        for pid in _children(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
            if ranks:
                out[int(ranks[0])] = pid
        return out

    def signal_ranks(self, sig: int, ranks=None) -> None:
        for rank, pid in self.workers().items():
            if ranks is None or rank in ranks:
                _signal(pid, sig)

    def kill_all(self) -> None:
        """SIGKILL of every rank and the torchrun (its whole session; ranks first: a stopped rank would not act on
        the SIGTERM its launcher's death sends, and would keep the group's --save lock)."""
        self.mark_killed()
        self.signal_ranks(signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_for(what, timeout: float, poll: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(poll)
    return False


def inject(kind: str, victim: Group, groups: list[Group], timeout_s: float, rng: random.Random) -> str:
    """Do fault ``kind`` to ``victim``; returns what was done. The victim is killed (and left to restart)
    unless the fault is stop-continue."""
    rank = rng.randrange(victim.ranks)
    if kind == "kill-rank":
        victim.mark_killed()
        victim.signal_ranks(signal.SIGKILL, [rank])
        return f"SIGKILL rank {rank} at iteration {victim.iteration()}"
    if kind == "kill-group":
        at = victim.iteration()
        victim.kill_all()
        return f"SIGKILL of the whole group at iteration {at}"
    if kind == "kill-in-backward":
        start = victim.iteration()
        wait_for(lambda: victim.iteration() > start, 30, poll=0.005)     # a step just started
        step_s = _step_seconds(victim)
        time.sleep(step_s / 2)
        victim.mark_killed()
        victim.signal_ranks(signal.SIGKILL, [rank])
        return f"SIGKILL rank {rank} {step_s / 2 * 1000:.0f} ms into iteration {victim.iteration() + 1}"
    if kind in ("stop-continue", "stop-kill"):
        at = victim.iteration()
        victim.signal_ranks(signal.SIGSTOP)
        time.sleep(timeout_s + 2)
        if kind == "stop-continue":
            victim.signal_ranks(signal.SIGCONT)
            return f"SIGSTOP at iteration {at} for {timeout_s + 2:g} s, then SIGCONT"
        victim.kill_all()
        return f"SIGSTOP at iteration {at} for {timeout_s + 2:g} s, then SIGKILL"
    raise ValueError(kind)


def _step_seconds(group: Group) -> float:
    recent = [c[0] for c in group.checksums if c[1] == group.generation and c[2] == 0][-6:]
    return (recent[-1] - recent[0]) / (len(recent) - 1) if len(recent) > 1 else 0.1


def kill_in_save(groups: list[Group], rng: random.Random, timeout: float) -> tuple[Group | None, str]:
    """Wait for a group to announce a save, SIGKILL it at once (its checkpoint being written)."""
    seen = {g.gid: len(g.saves) for g in groups}
    found: list[Group] = []
    wait_for(lambda: found.extend(g for g in groups if len(g.saves) > seen[g.gid]) or found, timeout, poll=0.002)
    if not found:
        return None, "no save announced"
    victim = found[0]
    at = victim.saves[-1][2]
    victim.kill_all()
    victim.interrupted_saves.append(at)
    return victim, f"SIGKILL of the whole group while it saves iteration {at}"


def healthy(groups: list[Group], past: int) -> bool:
    """Every group running and past iteration ``past`` in its current generation."""
    return all(g.alive() and g.iteration() > past for g in groups)


def rejoin_check(victim: Group, groups: list[Group], generation: int, timeout: float) -> tuple[bool, str]:
    """The victim's first checksum per rank after ``generation`` started equals its peers' at that iteration."""
    ok = wait_for(lambda: len({c[2] for c in victim.checksums if c[1] == generation}) == victim.ranks, timeout)
    if not ok:
        return False, "did not start a step"
    results = []
    for rank in range(victim.ranks):
        first = next(c for c in victim.checksums if c[1] == generation and c[2] == rank)
        iteration, digest = first[3], first[4]
        wait_for(lambda: any(c[2] == rank and c[3] == iteration for g in groups if g is not victim
                             for c in g.checksums), 10)
        peers = {c[4] for g in groups if g is not victim for c in g.checksums if c[2] == rank and c[3] == iteration}
        results.append((rank, iteration, "bitwise equal" if peers == {digest} else "DIFFERS" if peers else
                        "no live peer took that iteration", first[5]))
    good = all(r[2] == "bitwise equal" for r in results)
    how = ", ".join(f"rank {r} at iteration {i} {same}{' (healed)' if healed else ''}" for r, i, same, healed in results)
    return good, how


def run_groups(args, out: Path, name: str, faults: list[str]) -> tuple[list[Group], list[str], bool]:
    """A lighthouse and the groups; the faults injected one at a time. Returns (groups, fault lines, ok)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    lighthouse = start_lighthouse(port, 1, out / f"{name}-lighthouse.log", heartbeat_ms=args.heartbeat_ms)
    address = f"http://127.0.0.1:{port}"
    groups = [Group(g, group_argv(g, args.groups, address, args.iters, out / f"{name}-save", args.save_interval,
                                  args.timeout, args.batch), args.ranks, out / f"{name}-group{g}.log")
              for g in range(args.groups)]
    rng = random.Random(args.seed)
    lines, ok = [], True
    try:
        for g in groups:
            g.start()
        if not wait_for(lambda: healthy(groups, 0), 300):
            raise SystemExit(f"chaos: the {name} groups did not start (logs in {out})")
        for number, kind in enumerate(faults, 1):
            target = max(g.iteration() for g in groups) + args.gap
            if not wait_for(lambda: healthy(groups, target), 600):
                lines.append(f"fault {number}: the groups did not all get going again")
                ok = False
                break
            started = time.monotonic()
            for g in groups:
                g.faulted.discard(g.generation)
            if any(g.iteration() >= args.iters - 2 * args.gap for g in groups):
                lines.append(f"fault {number} {kind}: not injected (the run is ending: raise --iters)")
                ok = False
                break
            if kind == "kill-in-save":
                victim, did = kill_in_save(groups, rng, 120)
            else:
                victim = rng.choice(groups)
                did = inject(kind, victim, groups, args.timeout, rng)
            if victim is not None:
                victim.faulted.add(victim.generation)
            if victim is None:
                lines.append(f"fault {number} {kind}: not injected ({did})")
                ok = False
                continue
            ended_itself = False
            if kind == "stop-continue":       # it steps again, or its Manager lost the quorum and it ends itself
                wait_for(lambda: not victim.alive() or any(c[0] > started + args.timeout + 3 for c in victim.checksums
                                                           if c[1] == victim.generation), 120)
                ended_itself = not victim.alive()
                if ended_itself:
                    did += "; the group ended itself (its quorum timed out)"
            if kind != "stop-continue" or ended_itself:
                if not wait_for(lambda: not victim.alive(), 20):      # torchrun ends a group that lost a rank
                    victim.kill_all()
                victim.mark_killed()
                victim.start()
            generation = victim.generation
            survivors = [g for g in groups if g is not victim]
            back, how = rejoin_check(victim, groups, generation, 300) if kind != "stop-continue" or ended_itself \
                else _resumed(victim, started, groups)
            lost = max((sum(1 for u in g.uncommitted if u[0] >= started) for g in survivors), default=0)
            stopped = [g.gid for g in survivors if g.proc.poll() not in (None, 0)]
            good = back and lost <= 1 and not stopped
            ok &= good
            lines.append(f"fault {number:2d} {kind:16s} group {victim.gid}: {did}; survivors lost {lost} step(s)"
                         f"{', STOPPED ' + str(stopped) if stopped else ''}; rejoined: {how} -> {'ok' if good else 'FAILED'}")
            print(lines[-1], flush=True)
        wait_for(lambda: not any(g.alive() for g in groups), 1800)
    finally:
        for g in groups:
            if g.alive():
                g.kill_all()
        lighthouse.kill()
    return groups, lines, ok


def _resumed(victim: Group, since: float, groups: list[Group]) -> tuple[bool, str]:
    """After SIGCONT: the group takes steps again and its weights equal its peers' at a later iteration."""
    if not wait_for(lambda: any(c[0] > since + 1 for c in victim.checksums if c[2] == 0), 120):
        return False, "took no step after SIGCONT"
    time.sleep(1)
    later = [c for c in victim.checksums if c[0] > since + 1]
    rank, iteration, digest = later[-1][2], later[-1][3], later[-1][4]
    wait_for(lambda: any(c[2] == rank and c[3] == iteration for g in groups if g is not victim for c in g.checksums), 10)
    peers = {c[4] for g in groups if g is not victim for c in g.checksums if c[2] == rank and c[3] == iteration}
    healed = any(c[5] for c in later)
    same = peers == {digest}
    return same, (f"rank {rank} at iteration {iteration} {'bitwise equal' if same else 'DIFFERS'}"
                  f"{' (healed)' if healed else ''}")


def final_loss(groups: list[Group], iters: int, window: int) -> float | None:
    """The run's final loss: the mean of the losses the groups logged over the last ``window`` iterations
    (each group's latest line for an iteration it logged twice, across a restart). One step's loss at this
    batch varies by a few percent from step to step; the mean over 100 steps by a few tenths."""
    last = {(g.gid, s[2]): s[3] for g in groups for s in g.steps if iters - window < s[2] <= iters}
    return sum(last.values()) / len(last) if last else None


def checkpoint_report(groups: list[Group], save: Path, iters: int, interval: int) -> tuple[bool, str]:
    """Every --save-interval checkpoint exists in some group's directory: one whose saver was killed while
    writing it is written again by the group first in the next quorum (those are named); each group's
    latest is readable."""
    from megazero.checkpoint.distributed import latest_iteration
    from megazero.checkpoint.offline import read_model

    dirs = sorted(save.glob("replica-group-*"))
    have = {int(p.name.removeprefix("iter_")): d.name for d in dirs for p in d.glob("iter_*")
            if (p / "index.json").exists() or any(p.iterdir())}
    wanted = list(range(interval, iters + 1, interval))
    if iters not in wanted:
        wanted.append(iters)
    interrupted = sorted({i for g in groups for i in g.interrupted_saves})
    missing = [i for i in wanted if i not in have]
    readable = []
    for d in dirs:
        if latest_iteration(d) is not None:
            read_model(d)
            readable.append(f"{d.name}@{latest_iteration(d)}")
    by = sorted({have[i] for i in wanted if i in have})
    ok = not missing
    rewritten = ", ".join(f"{i} by {have[i]}" for i in interrupted if i in have)
    return ok, (f"{len(wanted) - len(missing)}/{len(wanted)} checkpoints written (by {', '.join(by)}); "
                f"missing {missing or 'none'}; saves interrupted by a kill: {interrupted or 'none'}"
                f"{' (written: ' + rewritten + ')' if rewritten else ''}; latest readable: {', '.join(readable)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="processes per replica group (default 2)")
    p.add_argument("--faults", type=int, default=6, help="faults to inject, cycling through the kinds")
    p.add_argument("--kinds", default=",".join(FAULTS), help="comma-separated fault kinds, in order")
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--batch", type=int, default=4, help="each replica group's global batch")
    p.add_argument("--save-interval", type=int, default=50)
    p.add_argument("--gap", type=int, default=10, help="iterations every group takes between faults")
    p.add_argument("--timeout", type=float, default=4.0, help="--ft-timeout-seconds")
    p.add_argument("--heartbeat-ms", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("chaos-out"))
    p.add_argument("--loss-window", type=int, default=100,
                   help="the final loss is the mean over the groups' last this many iterations (default 100)")
    p.add_argument("--reference-loss", type=float, default=None,
                   help="the fault-free run's final loss, from an earlier run of the same flags (that run is then skipped)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the fault-free run: the faults and their checks only, the final loss not compared")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = args.kinds.split(",")
    faults = [kinds[i % len(kinds)] for i in range(args.faults)]
    t0 = time.monotonic()
    reference, base_ok = args.reference_loss, True
    if reference is None and not args.no_reference:
        base, _, base_ok = run_groups(args, args.out, "baseline", [])
        reference = final_loss(base, args.iters, args.loss_window)
        print(f"chaos: fault-free run of {args.iters} iterations: final loss {reference} ({time.monotonic() - t0:.0f} s)",
              flush=True)
    groups, lines, ok = run_groups(args, args.out, "chaos", faults)
    stopped = [(g.gid, e) for g in groups for e in g.exits if e[1] != 0 and not e[2] and e[0] not in g.faulted]
    done = all(any(s[2] == args.iters for s in g.steps) for g in groups)
    loss = final_loss(groups, args.iters, args.loss_window)
    close = args.no_reference or (loss is not None and reference is not None and abs(loss - reference) <= 0.01 * reference)
    ckpt_ok, ckpt = checkpoint_report(groups, args.out / "chaos-save", args.iters, args.save_interval)
    print(f"chaos: survivors: {'no group stopped unless killed' if not stopped else f'STOPPED {stopped}'}; "
          f"every group finished: {done}", flush=True)
    print(f"chaos: checkpoints: {ckpt}", flush=True)
    print(f"chaos: final loss {loss} vs fault-free {reference} ({(loss - reference) / reference * 100:+.2f}%)"
          if loss is not None and reference else f"chaos: final loss {loss}, not compared (no fault-free run)"
          if args.no_reference else "chaos: no final loss", flush=True)
    verdict = ok and base_ok and not stopped and done and close and ckpt_ok
    unchecked = " (final loss not compared)" if args.no_reference else ""
    print(f"chaos: verdict {'PASS' if verdict else 'FAIL'}{unchecked}: {len(lines)} faults over {args.groups} replica "
          f"groups x {args.ranks} ranks, {time.monotonic() - t0:.0f} s", flush=True)
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
