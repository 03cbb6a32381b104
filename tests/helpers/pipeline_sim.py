"""A strict, thread-based stand-in for the pipeline's p2p and compute, to run the real executor fast.

Each pipeline rank is a thread running ``executor.execute`` on its action list (from
``checked_schedule``, so the package's simulator has passed them first) with a fake runner and a
fake comm. Tensors are replaced by labels ("act", virtual_stage, micro) / ("grad", virtual_stage,
micro) so every tensor the executor hands to a chunk is checked against what that chunk expects.
Exchanges have rendezvous semantics like NCCL and gloo: a batch returns only when every send in it
has met its receive and vice versa, matched in order per (sender, receiver) pair; an executor that
would hang raises instead (after ``timeout`` seconds).
"""
from __future__ import annotations

import threading
from collections import defaultdict

from megazero.parallel.groups import PipelineLayout
from megazero.parallel.pipeline.executor import checked_schedule, execute, stage_shape_of
from megazero.parallel.pipeline.partition import LOOP, virtual_stage
from megazero.parallel.pipeline.runner import PipelineStats


def layout(pp: int, r: int) -> PipelineLayout:
    """Stage r of a pipeline of pp ranks 0..pp-1 (no process group: the network below carries the messages)."""
    return PipelineLayout(None, tuple(range(pp)), r, pp)


class Network:
    def __init__(self, timeout: float = 5.0):
        self.cv = threading.Condition()
        self.sends = defaultdict(list)    # (src, dst) -> payloads in send order
        self.recv_posted = defaultdict(int)
        self.timeout = timeout

    def batch(self, me: int, ops: list) -> list:
        """ops: ("send", peer, payload) | ("recv", peer). Returns payloads of the receives."""
        with self.cv:
            slots = []
            for op in ops:
                if op[0] == "send":
                    key = (me, op[1])
                    slots.append(("send", key, len(self.sends[key])))
                    self.sends[key].append(op[2])
                else:
                    key = (op[1], me)
                    slots.append(("recv", key, self.recv_posted[key]))
                    self.recv_posted[key] += 1
            self.cv.notify_all()
            done = lambda: all((self.recv_posted[k] > n) if kind == "send" else (len(self.sends[k]) > n)
                               for kind, k, n in slots)
            if not self.cv.wait_for(done, timeout=self.timeout):
                raise TimeoutError(f"rank {me} blocked in exchange {ops} (deadlock)")
            return [self.sends[k][n] for kind, k, n in slots if kind == "recv"]


class _Arrived:
    def __init__(self, payload):
        self.payload = payload

    def get(self):
        return self.payload


class FakeComm:
    def __init__(self, net: Network, pipeline: PipelineLayout, ring: bool):
        self.net, self.me = net, pipeline.rank
        p, r = pipeline.size, pipeline.rank
        self.prev, self.next = ((r - 1) % p, (r + 1) % p) if ring else (pipeline.prev_rank, pipeline.next_rank)

    def exchange(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait=True):
        ops, want = [], []
        if send_next is not None and self.next is not None:
            ops.append(("send", self.next, send_next))
        if recv_prev and self.prev is not None:
            ops.append(("recv", self.prev)); want.append("prev")
        if send_prev is not None and self.prev is not None:
            ops.append(("send", self.prev, send_prev))
        if recv_next and self.next is not None:
            ops.append(("recv", self.next)); want.append("next")
        got = dict(zip(want, self.net.batch(self.me, ops))) if ops else {}
        if not wait:                      # received already (rendezvous): wrap like p2p.Incoming
            got = {k: _Arrived(v) for k, v in got.items()}
        return got.get("prev"), got.get("next")


class FakeRunner:
    """Same interface as StageRunner; checks every input is the right (virtual stage, micro-batch)."""

    def __init__(self, pipeline: PipelineLayout, v: int, m: int, forward_only: bool = False, shape: str = LOOP):
        self.pipeline, self.v, self.num_micro, self.forward_only, self.shape = pipeline, v, m, forward_only, shape
        self.stats = PipelineStats()
        self.forwarded, self.backwarded = set(), set()

    def vs(self, c):
        return virtual_stage(self.pipeline.rank, self.pipeline.size, c, self.shape)

    def is_first(self, c):
        return self.vs(c) == 0

    def is_last(self, c):
        return self.vs(c) == self.pipeline.size * self.v - 1

    def forward(self, c, i, x):
        assert (c, i) not in self.forwarded and 0 <= i < self.num_micro, f"forward of chunk {c} micro {i} twice"
        self.forwarded.add((c, i))
        expected = None if self.is_first(c) else ("act", self.vs(c) - 1, i)
        assert x == expected, f"rank {self.pipeline.rank} chunk {c} micro {i}: got {x}, expected {expected}"
        self.stats.order.append(("F", c, i))
        if not self.forward_only:
            self.stats.in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
        return None if self.is_last(c) else ("act", self.vs(c), i)

    def backward(self, c, i, dy):
        assert (c, i) in self.forwarded and (c, i) not in self.backwarded
        self.backwarded.add((c, i))
        expected = None if self.is_last(c) else ("grad", self.vs(c) + 1, i)
        assert dy == expected, f"rank {self.pipeline.rank} chunk {c} micro {i}: got {dy}, expected {expected}"
        self.stats.order.append(("B", c, i))
        self.stats.in_flight -= 1
        return None if self.is_first(c) else ("grad", self.vs(c), i)

    def backward_input(self, c, i, dy):
        assert (c, i) in self.forwarded and (c, i) not in self.backwarded
        self.backwarded.add((c, i))
        expected = None if self.is_last(c) else ("grad", self.vs(c) + 1, i)
        assert dy == expected, f"rank {self.pipeline.rank} chunk {c} micro {i}: got {dy}, expected {expected}"
        self.stats.order.append(("I", c, i))
        return None if self.is_first(c) else ("grad", self.vs(c), i)

    def backward_weight(self, c, i):
        assert ("I", c, i) in self.stats.order and ("W", c, i) not in self.stats.order
        self.stats.order.append(("W", c, i))
        self.stats.in_flight -= 1


def run_on_threads(generator, pp: int, m: int, v: int = 1, forward_only: bool = False,
                   timeout: float = 5.0) -> list[FakeRunner]:
    """Run ``generator``'s lists through the executor on pp threads (the p2p is a ring when v > 1 in
    the loop shape, as in ``run_schedule``); return each rank's runner (its stats hold the order)."""
    lists = checked_schedule(generator, pp, m, v, forward_only)
    shape = stage_shape_of(generator)
    net = Network(timeout)
    runners = [FakeRunner(layout(pp, r), v, m, forward_only, shape) for r in range(pp)]
    errors = [None] * pp

    def main(r):
        try:
            execute(lists[r], runners[r], FakeComm(net, runners[r].pipeline, ring=v > 1 and shape == LOOP))
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r}: {e!r}") from e
    everything = {(c, i) for c in range(v) for i in range(m)}
    for r, run in enumerate(runners):
        assert run.forwarded == everything, f"rank {r} forwards {sorted(run.forwarded)}"
        assert run.backwarded == (set() if forward_only else everything), f"rank {r} backwards {sorted(run.backwarded)}"
    with net.cv:                          # every message sent was received, and nothing more
        for key, sent in net.sends.items():
            assert net.recv_posted[key] == len(sent), f"unreceived messages on {key}"
        for key, n in net.recv_posted.items():
            assert len(net.sends[key]) == n, f"receives without sends on {key}"
    return runners

