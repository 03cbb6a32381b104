"""Pipeline schedules: the order in which each rank runs forwards and backwards of micro-batches.

Each schedule is a plain function ``(runner, comm) -> None`` with visible warmup / steady /
cooldown loops; :class:`StageRunner` does the compute and bookkeeping, :class:`StageComm` the
exchanges. Pictures for pp=4, m=8 (numbers are micro-batches; F forward, B backward)::

    GPipe      rank 0: F0 F1 F2 F3 F4 F5 F6 F7 . . . . . . B0 B1 ...   holds m = 8 activation sets
    1F1B       rank 0: F0 F1 F2 | F3 B0 F4 B1 F5 B2 ... F7 B4 | B5 B6 B7   warmup pp-r-1 = 3, holds <= 4
               rank 3: F0 B0 F1 B1 F2 B2 ... F7 B7                        warmup 0, holds <= 1

The bubble (idle fraction) of both is (p-1)/(m+p-1) ~ (p-1)/m; 1F1B bounds the memory. Interleaved
1F1B gives each rank v chunks and cuts the bubble to ~(p-1)/(v*m) for v times more p2p traffic.
"""
from __future__ import annotations

from megazero.parallel.pipeline.interleaved import interleaved_one_f_one_b
from megazero.parallel.pipeline.p2p import StageComm
from megazero.parallel.pipeline.runner import StageRunner


def no_pipelining(runner: StageRunner, comm: StageComm | None = None) -> None:
    """pp = 1: forward and backward of each micro-batch in turn (gradient accumulation)."""
    if runner.v != 1 or runner.pipeline.size != 1:
        raise ValueError("no_pipelining runs one chunk with pp=1; use gpipe, 1f1b or interleaved for pp > 1")
    for _ in range(runner.num_micro):
        runner.forward(0, None)
        if not runner.forward_only:
            runner.backward(0, None)


def gpipe(runner: StageRunner, comm: StageComm) -> None:
    """All forwards, then all backwards (Huang et al. 2019). Holds every micro-batch's activations."""
    _one_chunk(runner, "gpipe")
    for _ in range(runner.num_micro):
        x = comm.recv_forward()
        comm.send_forward(runner.forward(0, x))
    if runner.forward_only:
        return
    for _ in range(runner.num_micro):
        dy = comm.recv_backward()
        comm.send_backward(runner.backward(0, dy))


def one_f_one_b(runner: StageRunner, comm: StageComm) -> None:
    """1F1B (PipeDream-flush): ``pp - pp_rank - 1`` warmup forwards, then one forward and one backward
    alternately, then the remaining backwards. At most ``pp - pp_rank`` micro-batches held."""
    _one_chunk(runner, "1f1b")
    m, pp, r = runner.num_micro, runner.pipeline.size, runner.pipeline.rank
    warmup = m if runner.forward_only else min(pp - r - 1, m)
    steady = m - warmup

    for _ in range(warmup):                                   # warmup: forwards only
        x = comm.recv_forward()
        comm.send_forward(runner.forward(0, x))

    x = comm.recv_forward() if steady else None
    for i in range(steady):                                   # steady: 1F, 1B
        dy = comm.send_forward_recv_backward(runner.forward(0, x))
        dx = runner.backward(0, dy)
        if i == steady - 1:
            comm.send_backward(dx)
        else:
            x = comm.send_backward_recv_forward(dx)

    if runner.forward_only:
        return
    for _ in range(warmup):                                   # cooldown: drain the backwards
        dy = comm.recv_backward()
        comm.send_backward(runner.backward(0, dy))


def _one_chunk(runner: StageRunner, name: str) -> None:
    if runner.v != 1:
        raise ValueError(f"the {name} schedule runs one model chunk per rank, got {runner.v}: use the "
                         f"interleaved schedule (--num-layers-per-virtual-pipeline-stage) for several")


def get_schedule(parallel_cfg):
    """The schedule function a ``ParallelConfig`` asks for.

    pp = 1 -> :func:`no_pipelining`; otherwise by ``pipeline_schedule``: '1f1b' -> :func:`one_f_one_b`,
    'gpipe' -> :func:`gpipe`, 'interleaved' -> :func:`interleaved_one_f_one_b` (what
    ``config.validate`` picks when --num-layers-per-virtual-pipeline-stage is given).
    """
    if parallel_cfg.pp == 1:
        return no_pipelining
    return schedule_by_name(parallel_cfg.pipeline_schedule)


def schedule_by_name(name: str):
    table = {"1f1b": one_f_one_b, "gpipe": gpipe, "interleaved": interleaved_one_f_one_b,
             "none": no_pipelining}
    if name not in table:
        raise ValueError(f"--pipeline-schedule must be one of 1f1b, gpipe, interleaved; got {name!r}")
    return table[name]


def default_schedule(pp: int, num_chunks: int):
    """What run_schedule uses when not told: no pipelining at pp=1, interleaved for several chunks,
    else 1F1B."""
    if pp == 1:
        return no_pipelining
    return schedule_by_name("interleaved" if num_chunks > 1 else "1f1b")
