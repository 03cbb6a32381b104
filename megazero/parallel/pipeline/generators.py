"""Schedule generators: ``(pp, m, v, forward_only) -> one action list per pipeline rank``.

A generator is a pure function (no torch, no process group) that writes down, for every pipeline
rank, the forwards, backwards and p2p batches of one step (``actions.py``). ``executor.py`` runs a
rank's list; ``simulate.py`` checks a whole set of lists for deadlock and data dependencies before
the first one runs, and draws them. Adding a schedule is one generator plus its test: put the
function here (or in a module of its own, like ``interleaved.py``) and name it in ``GENERATORS`` (a
generator that places the chunks other than in the loop of interleaved 1F1B says so with a
``stage_shape`` attribute: ``zero_bubble_v.zb_v.stage_shape = partition.V``).

1F1B for pp=4, m=8 (``simulate.render``: one time unit per forward and per backward, '.' idle)::

    rank 0: F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7
    rank 1: .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 ..
    rank 2: .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 .. ..
    rank 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. ..

GPipe runs the same bubble with all m forwards first (holding m activation sets; 1F1B holds at
most pp - r on rank r). The bubble (idle fraction) of both is (p-1)/(m+p-1) ~ (p-1)/m. Interleaved
1F1B gives each rank v chunks and cuts it to (p-1)/(v*m+p-1) for v times more p2p traffic (the
pictures of all three are in docs/parallelism.md).
"""
from __future__ import annotations

from megazero.config import FLAG
from megazero.parallel.pipeline.actions import P2P, Action, B, F, Op, batch
from megazero.parallel.pipeline.executor import stage_shape_of
from megazero.parallel.pipeline.interleaved import interleaved_one_f_one_b
from megazero.parallel.pipeline.zero_bubble import zb_h1
from megazero.parallel.pipeline.zero_bubble_v import zb_v


def no_pipelining(pp: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """pp = 1: forward and backward of each micro-batch in turn (gradient accumulation)."""
    if pp != 1 or v != 1:
        raise ValueError("no_pipelining runs one chunk with pp=1; use gpipe, 1f1b or interleaved for pp > 1")
    return [[a for i in range(m) for a in ([F(0, i)] if forward_only else [F(0, i), B(0, i)])]]


def gpipe(pp: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """All forwards, then all backwards (Huang et al. 2019). Holds every micro-batch's activations."""
    _one_chunk(v, "gpipe")
    lists = []
    for r in range(pp):
        first, last, acts = r == 0, r == pp - 1, []
        for i in range(m):
            acts += _recv_act(first, i) + [F(0, i)] + _send_act(last, i)
        for i in range(0 if forward_only else m):
            acts += _recv_grad(last, i) + [B(0, i)] + _send_grad(first, i)
        lists.append(acts)
    return lists


def one_f_one_b(pp: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """1F1B (PipeDream-flush): ``pp - r - 1`` warmup forwards on rank r, then one forward and one
    backward alternately, then the remaining backwards. At most ``pp - r`` micro-batches held.

    Each steady step is two batches: [send activation i on, receive the gradient of j] between the
    forward of i and the backward of j, then [receive activation i+1, send the gradient of j back]."""
    _one_chunk(v, "1f1b")
    lists = []
    for r in range(pp):
        first, last, acts = r == 0, r == pp - 1, []
        warmup = m if forward_only else min(pp - r - 1, m)
        steady = m - warmup
        for i in range(warmup):                                      # warmup: forwards only
            acts += _recv_act(first, i) + [F(0, i)] + _send_act(last, i)
        if steady:
            acts += _recv_act(first, warmup)
        for j in range(steady):                                      # steady: 1F, 1B
            i = warmup + j
            acts += [F(0, i)] + batch(_op(not last, Op.SEND_NEXT, i), _op(not last, Op.RECV_NEXT, j))
            acts += [B(0, j)] + batch(_op(not first and j < steady - 1, Op.RECV_PREV, i + 1),
                                      _op(not first, Op.SEND_PREV, j))
        for j in range(steady, steady if forward_only else m):       # cooldown: drain the backwards
            acts += _recv_grad(last, j) + [B(0, j)] + _send_grad(first, j)
        lists.append(acts)
    return lists


def _op(cond: bool, op: Op, micro: int, chunk: int = 0) -> P2P | None:
    return P2P(op, chunk, micro) if cond else None


def _recv_act(first: bool, i: int) -> list:
    return batch(_op(not first, Op.RECV_PREV, i))


def _send_act(last: bool, i: int) -> list:
    return batch(_op(not last, Op.SEND_NEXT, i))


def _recv_grad(last: bool, i: int) -> list:
    return batch(_op(not last, Op.RECV_NEXT, i))


def _send_grad(first: bool, i: int) -> list:
    return batch(_op(not first, Op.SEND_PREV, i))


def _one_chunk(v: int, name: str) -> None:
    if v != 1:
        raise ValueError(f"the {name} schedule runs one model chunk per rank, got {v}: use the "
                         f"interleaved schedule ({FLAG.num_layers_per_virtual_pipeline_stage}) for several")


GENERATORS = {"1f1b": one_f_one_b, "gpipe": gpipe, "interleaved": interleaved_one_f_one_b, "zb-h1": zb_h1,
              "zb-v": zb_v, "none": no_pipelining}


def schedule_by_name(name: str):
    """The generator that ``--pipeline-schedule NAME`` asks for."""
    if name not in GENERATORS:
        raise ValueError(f"{FLAG.pipeline_schedule} must be one of {', '.join(n for n in GENERATORS if n != 'none')}; "
                         f"got {name!r}")
    return GENERATORS[name]


def get_schedule(parallel_cfg):
    """The generator a ``ParallelConfig`` asks for: :func:`no_pipelining` at pp = 1, otherwise its
    ``pipeline_schedule`` ('interleaved' is what ``config.validate`` picks when
    --num-layers-per-virtual-pipeline-stage is given)."""
    if parallel_cfg.pp == 1:
        return no_pipelining
    return schedule_by_name(parallel_cfg.pipeline_schedule)


def stage_shape(parallel_cfg) -> str:
    """How the schedule a ``ParallelConfig`` asks for places the virtual stages on the ranks
    (``partition.V`` for zb-v, else ``partition.LOOP``): what the model builders pass to
    ``partition.placements``."""
    return stage_shape_of(get_schedule(parallel_cfg))


def default_schedule(pp: int, num_chunks: int):
    """What run_schedule uses when not told: no pipelining at pp=1, interleaved for several chunks,
    else 1F1B."""
    if pp == 1:
        return no_pipelining
    return schedule_by_name("interleaved" if num_chunks > 1 else "1f1b")
