"""Run a test body on N CPU processes joined by a gloo process group.

    from helpers import run_on_ranks

    def _body(rank, world_size, x):          # module-level, so it pickles
        ...                                   # dist is initialised; build Topology etc.
        return something_small

    def test_it():
        results = run_on_ranks(4, _body, 3)   # list of the 4 return values, by rank

Workers are started once per world size and reused by later tests (starting 8 Python processes that
import torch costs several seconds on 2 cores, so they are forked from a server that imported it once).
A pool is discarded whenever a body fails or times out, so a later test never inherits a broken
process group. Failures raise with the traceback of the rank that failed first; a hang raises after
``timeout`` seconds naming the ranks that did not finish.
Workers run with OMP_NUM_THREADS=1 and one torch thread.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

# Workers are forked from a server process that imported torch once (its environment is this process's
# when the first pool starts): a worker then starts in a fraction of the time a fresh interpreter takes
# to import torch, several seconds of CPU each on 2 cores. Nothing else is inherited: the server imports
# no test module and holds no process group.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed"])
_POOLS: dict[int, "_Pool"] = {}


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
        _destroy_subgroups(dist)
    dist.destroy_process_group()


def _destroy_subgroups(dist) -> None:
    """Destroy the groups a body created (every Topology makes several): each gloo group keeps its
    threads and sockets until destroyed, and a reused worker would otherwise gather hundreds. A group
    still referenced from a reference cycle (a model's hooks and its engine) lives, threads polling,
    until the cycle is collected, which a worker between bodies may not do for many tests: collect now."""
    import gc

    default = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    gc.collect()


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        fd, self.init_file = tempfile.mkstemp(prefix="megazero_pg_")
        os.close(fd)
        os.unlink(self.init_file)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.procs = [_CTX.Process(target=_worker, daemon=True,
                                   args=(r, world_size, self.init_file, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout: float) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world_size:
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in out]
            try:
                rank, ok, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died without reporting "
                                       f"(exit codes {[self.procs[r].exitcode for r in dead]})")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out))
                    raise TimeoutError(f"{fn.__name__} did not finish within {timeout:.0f}s on rank(s) "
                                       f"{missing} of {self.world_size} (deadlock or mismatched collective?)")
                continue
            if not ok:
                raise AssertionError(f"rank {rank} of {self.world_size} failed in {fn.__name__}:\n{payload}")
            out[rank] = payload
        return [out[r] for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


def run_on_ranks(world_size: int, fn, *args, timeout: float = 240.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(graceful=False)
        raise


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close(graceful=True)
    _POOLS.clear()


