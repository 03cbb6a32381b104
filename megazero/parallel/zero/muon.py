"""Muon over ZeRO's flat shards: each matrix orthogonalised once, whole, on one owner rank.

Muon (``--optimizer muon``) steps every ``layer_matrix`` parameter (the 2-D weights of the transformer
layers, :mod:`megazero.parallel.params`) with the arithmetic of ``torch.optim.Muon``::

    B  = lerp(B, G, 1 - momentum)                     (the momentum buffer)
    U  = lerp(G, B, momentum)  if nesterov  else  B
    O  = newton_schulz(U)                             (needs the whole matrix)
    W *= 1 - lr * weight_decay;   W -= adjusted_lr(lr, shape of the whole matrix) * O

The other parameters keep AdamW (:mod:`.adamw`), under the same schedule. The momentum buffer lives where
AdamW keeps its first moment (``exp_avg``, sharded like it; ``exp_avg_sq`` stays zero there), so a
checkpoint holds it under that name and ZeRO's model-state bytes per parameter do not grow.

Everything but Newton-Schulz is elementwise and runs on each rank's flat shard. Newton-Schulz needs the
whole matrix, which ZeRO (over dp) and tensor parallelism (over tp) have cut up, so every matrix has an
owner, a (dp rank, tp rank) pair chosen to balance Newton-Schulz FLOPs over the ranks. The update U
travels to its owner in bf16 (the type Newton-Schulz casts it to first, so nothing is rounded that it
would not round itself), and O travels back:

1. over dp (sharded stages only): every rank sends its piece of each matrix to the matrix's dp owner (one
   all-to-all per bucket group); the owner concatenates the pieces in rank order: its tp shard, whole;
2. over tp (split matrices only): the dp owners of a matrix at every tp rank send their tp shards to the
   tp owner, which concatenates them along the split dim: the whole matrix (tp-replicated matrices, like
   the router, skip this step: every tp rank orthogonalises its copy, as on one rank);
3. the owner runs Newton-Schulz, and O goes back the same way: tp shards, then dp pieces.

Worked example, dp 2, tp 2, ZeRO-1, one layer: ``qkv`` [96, 32] column-parallel (tp shard [48, 32]),
``proj`` [32, 32] row-parallel (tp shard [32, 16]); shard boundaries cut both flat shards in two. Owners
(largest first, least loaded): qkv -> (dp 0, tp 0), proj -> (dp 1, tp 0)::

    dp rank 0, tp t:  sends its half of proj's tp-shard t to dp 1; receives dp 1's half of qkv shard t
    tp rank 1, dp 0:  sends qkv shard 1 to tp 0;    tp 0 (dp 0) orthogonalises qkv [96, 32]
    tp rank 1, dp 1:  sends proj shard 1 to tp 0;   tp 0 (dp 1) orthogonalises proj [32, 32]

At stage 0 every dp rank holds every matrix whole (over dp) and orthogonalises its own (only the tp step
runs), as DDP users run Muon. ``torch.optim.Muon`` with AdamW on the same parameter split is the oracle
(tests/test_muon.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megazero.config import OptimizerConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.params import attribute, split_dim

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)       # torch.optim.Muon's (Keller Jordan's quintic)
NS_EPS = 1e-7
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}     # --muon-ns-dtype


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16, coefficients=NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised ``update`` (a whole 2-D matrix), computed in ``dtype``: ``torch.optim.Muon``'s
    quintic Newton-Schulz iteration op for op (in bf16 it equals torch's bitwise)."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, mode: str, shape: tuple[int, int]) -> float:
    """The learning rate of a whole ``shape`` matrix's update (``--muon-adjust-lr``; torch.optim.Muon's
    ``adjust_lr_fn``): ``match_rms_adamw`` 0.2 sqrt(max(A, B)) (Moonlight: AdamW's lr and decay carry over),
    ``original`` sqrt(max(1, A / B))."""
    rows, cols = shape
    if mode == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1.0, rows / cols))


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """Multiply-add FLOPs of :func:`newton_schulz` on a whole ``shape`` matrix (m <= n after the
    transpose): per step x x^T 2 m^2 n, the gram polynomial 2 m^3, its product with x 2 m^2 n."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass
class MuonMatrix:
    """One ``layer_matrix`` parameter of one bucket group, as this rank sees it.

    ``k``: the optimizer range (:class:`.optimizer.RangeState`) holding this rank's piece, elements
    [lo, hi) of it (lo == hi: none); ``pieces[p]``: dp rank p's piece as [a, b) of the flattened tp-local
    tensor (sharded stages; one piece [0, numel) otherwise); ``local_shape`` its tp-local shape,
    ``split`` the dim tp splits (-1: replicated over tp), ``shape`` the whole matrix's;
    ``dp_owner``/``tp_owner`` who orthogonalises it."""

    name: str
    k: int
    lo: int
    hi: int
    pieces: list[tuple[int, int]]
    local_shape: torch.Size
    split: int
    shape: tuple[int, int]
    dp_owner: int = 0
    tp_owner: int = 0

    def piece_len(self, dp_rank: int) -> int:
        a, b = self.pieces[dp_rank]
        return b - a


@dataclass
class MuonGroup:
    """The matrices of one bucket group (one grad sync: its dp group, e.g. the experts' over
    expert-data-parallel ranks) and where they are orthogonalised."""

    sync: object
    sharded: bool
    matrices: list[MuonMatrix] = field(default_factory=list)


class Muon:
    """Muon's half of the ZeRO optimizer's step (:class:`.optimizer.BucketAdamW` drives it): which range
    elements it owns (:meth:`ranges`, AdamW steps the rest) and the step over them (:meth:`step`)."""

    def __init__(self, opt, cfg: OptimizerConfig):
        self.cfg = cfg
        self.orthogonalised = 0                     # matrices this rank ran Newton-Schulz on in the last step
        self.dtype = NS_DTYPES[cfg.muon_ns_dtype]
        self.comm_log = opt.comm_log
        self.groups: list[MuonGroup] = []
        for sync in opt.syncs:
            group = MuonGroup(sync, opt.publish.sharded)
            for k, r in enumerate(opt.ranges):
                if r.sync is not sync:
                    continue
                for slot in r.bucket.slots:
                    if attribute(slot.param, "layer_matrix"):
                        group.matrices.append(self._matrix(slot, k, r, sync, group.sharded))
            _assign_owners(group, cfg.muon_ns_steps)
            self.groups.append(group)
        self._ranges = [[] for _ in opt.ranges]
        for group in self.groups:
            for m in group.matrices:
                if m.lo < m.hi:
                    self._ranges[m.k].append((m.lo, m.hi))

    @staticmethod
    def _matrix(slot, k: int, r, sync, sharded: bool) -> MuonMatrix:
        local = torch.Size(slot.shape)
        dim = split_dim(slot.param) if sync.tp.size > 1 else -1
        shape = list(local)                        # the slot's shape: a ZeRO-3 parameter holds no storage
        if dim >= 0:
            shape[dim] *= sync.tp.size
        if sharded:
            pieces = []
            for p in range(sync.dp_size):
                a, b = r.bucket.shard_range(p)
                a, b = max(a, slot.start), min(b, slot.end)
                pieces.append((a - slot.start, b - slot.start) if a < b else (0, 0))
        else:
            pieces = [(0, slot.end - slot.start)]
        lo, hi = max(r.lo, slot.start) - r.lo, min(r.hi, slot.end) - r.lo
        return MuonMatrix(slot.name, k, lo, max(lo, hi), pieces, local, dim, (shape[0], shape[1]))

    def ranges(self, k: int) -> list[tuple[int, int]]:
        """The elements of optimizer range k that Muon steps (sorted, disjoint)."""
        return sorted(self._ranges[k])

    def counts(self) -> tuple[int, int]:
        """(matrices, elements of whole matrices) Muon steps in this rank's model chunks."""
        seen = {m.name: math.prod(m.shape) for g in self.groups for m in g.matrices}
        return len(seen), sum(seen.values())

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], masters: list[torch.Tensor], momenta: list[torch.Tensor], *,
             lr: float, weight_decay: float) -> None:
        """One Muon step of every matrix piece this rank holds, in place on the flat fp32 ``masters`` and
        ``momenta`` (``grads``: the clipped, unscaled fp32 gradients), all indexed by optimizer range.
        Collective over each bucket group's dp and tp groups."""
        momentum, nesterov = self.cfg.muon_momentum, self.cfg.muon_nesterov
        self.orthogonalised = 0
        for group in self.groups:
            updates = []
            for m in group.matrices:
                g, buf = grads[m.k][m.lo:m.hi], momenta[m.k][m.lo:m.hi]
                buf.lerp_(g, 1 - momentum)
                updates.append((g.lerp(buf, momentum) if nesterov else buf).to(self.dtype))
            for m, o in zip(group.matrices, self._orthogonalise(group, updates)):
                if m.lo == m.hi:
                    continue
                w = masters[m.k][m.lo:m.hi]
                w.mul_(1 - lr * weight_decay)
                w.add_(o, alpha=-adjusted_lr(lr, self.cfg.muon_adjust_lr, m.shape))

    def _orthogonalise(self, group: MuonGroup, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces of O for the group's matrices, from its pieces of U (see the module doc)."""
        steps, sync, log = self.cfg.muon_ns_steps, group.sync, self.comm_log
        like = torch.empty(0, dtype=self.dtype, device=sync.dp.device)
        whole = _to_dp_owners(group, updates, log, like) if group.sharded else \
            {m.name: u for m, u in zip(group.matrices, updates)}
        mine = [m for m in group.matrices if m.name in whole]
        split = [m for m in mine if m.split >= 0]
        shards = {m.name: whole[m.name].view(m.local_shape) for m in mine}
        full = _to_tp_owners(split, shards, sync.tp, log, like) if split else {}
        done = {m.name: newton_schulz(shards[m.name], steps, self.dtype).reshape(-1) for m in mine if m.split < 0}
        self.orthogonalised += len(done) + len(full)
        if split:
            ortho = {name: newton_schulz(x, steps, self.dtype) for name, x in full.items()}
            done.update(_from_tp_owners(split, ortho, sync.tp, log, like))
        if not group.sharded:
            return [done[m.name] for m in group.matrices]
        return _from_dp_owners(group, done, log, like)


def _assign_owners(group: MuonGroup, steps: int) -> None:
    """Owners balancing Newton-Schulz FLOPs: the largest matrices first, each to the least loaded (dp, tp)
    owner (a tp-replicated matrix loads every tp rank of its dp owner). The same on every rank of the
    group and of its tp group: it reads only names, shapes and sizes."""
    dp_size = group.sync.dp_size if group.sharded else 1
    tp_size = group.sync.tp.size
    load = [[0] * tp_size for _ in range(dp_size)]
    order = sorted(group.matrices, key=lambda m: -newton_schulz_flops(m.shape, steps))
    for m in order:
        cost = newton_schulz_flops(m.shape, steps)
        if m.split >= 0:
            d, t = min(((d, t) for d in range(dp_size) for t in range(tp_size)), key=lambda dt: load[dt[0]][dt[1]])
            load[d][t] += cost
        else:
            d = min(range(dp_size), key=lambda d: max(load[d]))
            t = 0
            load[d] = [x + cost for x in load[d]]
        m.dp_owner = d if group.sharded else group.sync.dp_rank
        m.tp_owner = t


def _exchange(sends: list[list[torch.Tensor]], receive_lens: list[int], group, log, tag: str,
              like: torch.Tensor) -> list[torch.Tensor]:
    """All-to-all of flat pieces: ``sends[q]`` go to group rank q; returns what each rank p sent here
    (``receive_lens[p]`` elements), one flat tensor per source rank, of ``like``'s dtype and device."""
    flat = [x for row in sends for x in row]
    inp = torch.cat(flat) if flat else like.new_empty(0)
    out = like.new_empty(sum(receive_lens))
    comm.all_to_all(out, inp, group, log, tag, output_splits=list(receive_lens),
                    input_splits=[sum(x.numel() for x in row) for row in sends])
    return list(out.split(receive_lens))


def _to_dp_owners(group: MuonGroup, updates: list[torch.Tensor], log, like: torch.Tensor) -> dict:
    """Step 1: every dp rank's pieces to the matrices' dp owners; {name: the flat tp-local update} for the
    matrices this rank owns."""
    dp = group.sync.dp
    sends = [[] for _ in range(dp.size)]
    for m, u in zip(group.matrices, updates):
        sends[m.dp_owner].append(u)
    mine = [m for m in group.matrices if m.dp_owner == dp.rank]
    received = _exchange(sends, [sum(m.piece_len(p) for m in mine) for p in range(dp.size)], dp.group, log,
                         "muon", like)
    pieces = {m.name: [] for m in mine}
    for p, chunk in enumerate(received):
        at = 0
        for m in mine:
            pieces[m.name].append(chunk[at:at + m.piece_len(p)])
            at += m.piece_len(p)
    return {name: torch.cat(parts) for name, parts in pieces.items()}


def _from_dp_owners(group: MuonGroup, done: dict, log, like: torch.Tensor) -> list[torch.Tensor]:
    """Step 3's second half: each owner sends every dp rank its piece of O; this rank's pieces, in the
    group's matrix order."""
    dp = group.sync.dp
    mine = [m for m in group.matrices if m.dp_owner == dp.rank]
    sends = [[done[m.name][slice(*m.pieces[p])] for m in mine] for p in range(dp.size)]
    receive = [[m for m in group.matrices if m.dp_owner == q] for q in range(dp.size)]
    received = _exchange(sends, [sum(m.piece_len(dp.rank) for m in ms) for ms in receive], dp.group, log, "muon",
                         like)
    out = {}
    for ms, chunk in zip(receive, received):
        at = 0
        for m in ms:
            out[m.name] = chunk[at:at + m.piece_len(dp.rank)]
            at += m.piece_len(dp.rank)
    return [out[m.name] for m in group.matrices]


def _to_tp_owners(split: list[MuonMatrix], shards: dict, tp, log, like: torch.Tensor) -> dict:
    """Step 2: the tp shards of each split matrix to its tp owner; {name: the whole matrix} for those this
    rank owns. Every rank of the tp group holds the same matrices here (the dp owners are the same at
    every tp rank)."""
    sends = [[] for _ in range(tp.size)]
    for m in split:
        sends[m.tp_owner].append(shards[m.name].reshape(-1))
    mine = [m for m in split if m.tp_owner == tp.rank]
    size = sum(math.prod(m.local_shape) for m in mine)
    received = _exchange(sends, [size] * tp.size, tp.group, log, "muon", like)
    parts = {m.name: [] for m in mine}
    for chunk in received:
        at = 0
        for m in mine:
            n = math.prod(m.local_shape)
            parts[m.name].append(chunk[at:at + n].view(m.local_shape))
            at += n
    return {m.name: torch.cat(parts[m.name], dim=m.split) for m in mine}


def _from_tp_owners(split: list[MuonMatrix], ortho: dict, tp, log, like: torch.Tensor) -> dict:
    """Step 3's first half: each tp owner sends every tp rank its shard of O; {name: flat tp-local O}."""
    mine = [m for m in split if m.tp_owner == tp.rank]
    sends = [[ortho[m.name].chunk(tp.size, dim=m.split)[t].contiguous().reshape(-1) for m in mine]
             for t in range(tp.size)]
    receive = [[m for m in split if m.tp_owner == q] for q in range(tp.size)]
    received = _exchange(sends, [sum(math.prod(m.local_shape) for m in ms) for ms in receive], tp.group, log,
                         "muon", like)
    out = {}
    for ms, chunk in zip(receive, received):
        at = 0
        for m in ms:
            n = math.prod(m.local_shape)
            out[m.name] = chunk[at:at + n]
            at += n
    return out
