"""The split backward of zero-bubble pipeline schedules (Qi et al., ICLR 2024): ``I``, the backward of
one micro-batch through one model chunk that computes only what the previous stage waits for (the
gradient of the chunk's input), and ``W``, run later when the pipeline would otherwise sit idle, that
computes the parameters' gradients::

    with deferrable_saves():                         # lets I free what W does not need
        out = chunk(x)                               # x: the received activation, requires grad
    work = backward_input(out, dy, x)                # I: x.grad; no parameter gradient yet
    ...                                              # send x.grad back, run other micro-batches
    work.run()                                       # W: every parameter's gradient into .grad

It works on the autograd graph, so every layer kind splits the same way, with no layer code of its
own: linear (column/row-parallel, sequence parallel), attention, LayerNorm/RMSNorm, embeddings
(vocab-parallel, position), MoE experts and router. Before ``I`` the graph of ``out`` is walked once:

- the *input path* is every node from which the gradient reaches ``x``; ``I`` is one autograd pass
  from ``out`` to ``x`` (``x.grad``), which runs those nodes and no other, each computing only the
  gradients of its inputs on the path (a linear's ``dY @ W``, not its ``dY^T @ X``);
- a *boundary* is an input-path node with an edge leaving the path (towards parameters only: a node
  off the path cannot reach ``x``): a matmul whose other operand is a weight, a norm's affine step, the
  add of a position embedding. A pre-hook keeps the gradient each matmul boundary receives during ``I``.
  The other boundaries (norms, bias adds, custom Functions such as ``RMSNormFunction``) are cheap:
  their edges off the path are inputs of ``I``'s own pass beside ``x``, so ``I`` computes their weight
  halves too, and holds them for ``W``. FP8 linears (``megazero.parallel.fp8``'s ``_FP8Linear``) are such
  Functions: their backward casts the output gradient once for both products, and a Python Function
  is told only at forward time which gradients to compute, so rerunning it in ``W`` would compute the
  input gradient again; ``I`` computes an FP8 linear's weight half (tests/test_fp8_compose.py checks
  ZB-H1 and ZB-V against the serial FP8 run).

``W`` computes each matmul boundary's weight half from its kept gradient. A plain matrix product
(``torch.mm``/``addmm``: every linear layer, column- or row-parallel, whose operands ``deferrable_saves``
holds) is done by hand (``matmul_grads.py``): its own backward formula on its own saved operands
(``X^T dY`` for the weight, ``dY`` for the bias, in the layout autograd's kernel would give), then one
autograd pass from its edges off the path to the parameters. Any other matmul boundary (batched, grouped, a recomputed
region's) runs again through autograd from its kept gradient, down to the parameters it reaches off
the path and nothing else (``torch.autograd.backward`` from ``GradientEdge`` roots with ``inputs`` =
those parameters: the weight half of the matmul, nothing of the input path, which ``I`` did). One
pass per group of boundaries that share nothing off the path (one per weight matmul in a transformer
layer), smallest gradient first, so the gradients go into ``.grad`` as they come, and one pass before
them for the norms' and biases' held gradients. That accumulates through autograd's own ``AccumulateGrad``, so the
parameters' post-accumulate-grad hooks fire as in a full backward, in ``W``: the ZeRO gradient sync
counts its buckets down and launches their reductions from ``W`` (the caller brackets ``W`` with the
grad sync's ``weight_grad``). The kernels are the ones the full backward runs, on the same tensors, so
``I`` + ``W`` gives the full backward's gradients bit for bit (tests/test_pipeline_split_backward.py per
layer kind and matmul layout, tests/test_pipeline_matmul_grads.py against the node). A parameter used
at two depths of one chunk (its gradient reachable from a boundary through the path) is refused in
``W`` with the fix (1F1B), not counted twice.

The output layer is the exception (the model marks its weight, :func:`weight_grad_in_input`): its dY
is the logits gradient, tokens x vocab, the largest of the model, and under ZB-H1 the last stage holds
pp micro-batches waiting for W -- with their head's X and dY its peak was 1.12x 1F1B's at pp 4 (the
bench shape, vocab 4h), against 1.02x at pp 2. Of the ways out, measured or weighed there: computing
its weight gradient in I and sending it straight into ``.grad`` holds nothing more (the gradient
storage exists; 1.03x); keeping only one of X and dY saves little (X is h per token, dY V); holding
its weight gradient for W instead costs V x h per micro-batch, more than X + dY at these shapes; and
capping the W's a rank defers changes the schedule's bubble. So I computes it, in a post-hook of
its matmul node, while ZeRO-3 still holds the weight gathered; its post-accumulate-grad hook fires in
I, where the grad sync counts nothing down, and the step's last W launches its bucket. The last
stage's I grows by the head's weight half (4h^2 per token at vocab 4h, a third of a layer's W).

Where ``x`` is None (the first virtual stage, whose input is token ids) or ``out`` does not depend on
it, ``I`` has nothing to compute and ``W`` is the whole backward, so the micro-batch's activations
stay held until ``W``.

Memory between ``I`` and ``W``: what ``W`` needs, the paper's "X and dY". ``W`` runs only the matmul
boundaries and the nodes off the path, so only their saved tensors are needed after ``I`` (a weight
matmul's input ``X`` and its weight, an embedding's indices), with the kept gradients ``dY``.
Everything else the forward saved (attention scores and probabilities, GeLU/SwiGLU inputs, dropout
masks, the norms' inputs and statistics, the loss's softmax) goes during ``I``, node by node, as a
full backward frees it. For that the forward runs inside :func:`deferrable_saves`: autograd's saved
tensors sit in slots (``saved_tensors_hooks``) that ``I`` empties once the node that unpacked them has
run (the unpack hook asks autograd which node runs; its slots go when the next node starts unpacking),
and ``W`` empties each matmul's in turn; the graph's nodes, which are small, stay until ``W``. For a GPT layer a waiting micro-batch holds
16 sbh elements (X 7, dY 9), about as much as its full activation set with fused attention and no
dropout, less with attention scores or dropout (tests, and the estimator:
``megazero/models/gpt/memory.py``).

Cost: the kernels are the full backward's; what ``I`` + ``W`` add is Python and autograd passes -- one
walk of the graph before ``I``, a pre-hook on each matmul boundary (no hook on the other nodes: a
hook per node cost ~20% of a backward), the save/unpack hooks, and ``W``'s one small pass per weight
(from the weight's edge, not through the matmul node: by hand, ~10% less ``W`` at the bench's tiny
shape). Measured on one process (GPT 4 x 256 last stage, seq 64, batch 1): I + W 1.04-1.10x the full
backward, from 1.18x with ``W`` passing through the matmul nodes and 1.42x with a hook on every node
and two passes per weight; what is left is the graph walk (~0.5 ms), the dY kept per matmul read back
cold in ``W``, and the head's weight gradient moved into ``I``.

Why this and not layer-level deferral (each linear queueing ``(X, dY)`` and computing ``dW = dY^T X``
itself, as Megatron-core's ``delay_wgrad_compute`` does): the split works on the graph, so every layer
kind splits with no layer code of its own, autograd's ``AccumulateGrad`` fires the gradient sync's
hooks in ``W``, and the by-hand matmul above is an optimisation of a node kind autograd already
describes (its saved operands and strides), checked bit for bit against the pass it replaces. A
tensor saved inside a nested hook (recompute's checkpoint, activation offload) follows that hook's
rules instead: a recomputed region keeps its input until ``W``, which recomputes it.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megazero.config import FLAG
from megazero.parallel.pipeline.matmul_grads import operand_grad, saved_operand_names


class _Slot:
    """One tensor autograd saved for backward, held here so that ``I`` can let it go (unless pinned)."""

    __slots__ = ("tensor", "pinned")

    def __init__(self, tensor: torch.Tensor, pinned: bool):
        self.tensor, self.pinned = tensor, pinned


class _Freeing:
    """One ``I`` or ``W`` pass (a ``with`` block): the slots a node unpacks are emptied once that node has
    run -- unless the node is one of ``keep``, which ``W`` runs again. Without a hook per node: the
    unpack hook asks autograd which node is running, and a node's slots go when the next node (in the
    same engine thread) starts unpacking, or when the pass ends. A node reads its saved tensors as it
    starts, so they go before the next one allocates its outputs, as autograd frees them in a full
    backward."""

    def __init__(self, keep=frozenset()):
        self.keep = keep
        self._last: dict = {}                # engine thread -> (the node unpacking in it, its slots)

    def saw(self, slot: _Slot) -> None:
        node = torch._C._current_autograd_node()
        if node is None or node in self.keep:
            return
        thread = threading.get_ident()
        last = self._last.get(thread)
        if last is None or last[0] is not node:
            if last is not None:
                _empty(last[1])
            last = self._last[thread] = (node, [])
        last[1].append(slot)

    def __enter__(self) -> "_Freeing":
        global _open
        self._outer, _open = _open, self
        return self

    def __exit__(self, *exc) -> None:
        global _open
        _open = self._outer
        for _, slots in self._last.values():
            _empty(slots)
        self._last.clear()


def _empty(slots) -> None:
    for slot in slots:
        slot.tensor = None


_open: _Freeing | None = None     # the pass in progress (the executor runs one I or W at a time)


def _pack(tensor: torch.Tensor) -> _Slot:
    # detached: a saved output must not hold its own grad_fn (a cycle)
    return _Slot(tensor.detach(), pinned=_saved_by_checkpoint(sys._getframe(1)))


_CHECKPOINT_SOURCE = os.path.join("utils", "checkpoint.py")


def _saved_by_checkpoint(frame) -> bool:
    """Is this save torch.utils.checkpoint keeping a recomputed region's inputs? (Its own hooks take the
    region's saves; the inputs it saves with ours.) It unpacks them whenever it recomputes the region --
    in ``I`` and again in ``W`` -- from inside whichever node first needs the region, so they must not
    go with that node's tensors."""
    for _ in range(4):
        if frame is None:
            return False
        code = frame.f_code
        found = _IN_CHECKPOINT.get(code)
        if found is None:
            found = _IN_CHECKPOINT[code] = code.co_filename.endswith(_CHECKPOINT_SOURCE)
        if found:
            return True
        frame = frame.f_back
    return False


_IN_CHECKPOINT: dict = {}         # code object -> is it torch.utils.checkpoint's (a save costs a lookup, not a compare)


def _unpack(slot: _Slot) -> torch.Tensor:
    if slot.tensor is None:
        raise RuntimeError("split backward: W reached a node of the input path again, whose saved tensors its I "
                           "freed. A parameter used at two depths of one model chunk (its gradient reachable through "
                           f"the input path) cannot be split into I and W: use {FLAG.pipeline_schedule} 1f1b instead")
    if _open is not None and not slot.pinned:
        _open.saw(slot)
    return slot.tensor


@contextlib.contextmanager
def deferrable_saves():
    """Run a forward whose backward may be split into :func:`backward_input` and ``W``: autograd's
    saved tensors are held in slots that ``I`` empties where ``W`` will not need them (see the module
    docstring). Costs a Python call per saved tensor; with a full backward it changes nothing."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


# Boundaries whose weight half waits for W: the matrix products, whose weight gradient (dY^T X) is as
# much work as their input gradient -- what the schedule moves into the bubbles. Every other boundary
# (a norm's affine step, a bias or position-embedding add, a custom Function such as RMSNorm) computes
# its off-path gradients in I's own pass, while its parameters are at hand (ZeRO-3 releases them after
# I): they are reductions over the tokens, cheap and as small as its parameters, so W holds them instead
# of the node's output gradient and saved input. Only where it is alone in its group (no parameter
# shared with another boundary), so that I's pass computes that node's half and nothing more.
_DEFERRED_NODES = frozenset({"MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "AddbmmBackward",
                             "MatmulBackward", "LinearBackward", "ConvolutionBackward", "_GroupedMmBackward"})


def _deferred(node) -> bool:
    return node.name().rstrip("0123456789") in _DEFERRED_NODES


_IN_INPUT = "weight_grad_in_input"


def weight_grad_in_input(param: torch.Tensor) -> torch.Tensor:
    """Mark ``param`` (a model's declaration) as one whose weight gradient a split backward computes in
    ``I``, straight into ``.grad``, instead of holding its matmul's X and dY for ``W``: the output
    layer's weight (see the module docstring). Honoured where the matmul is the parameter's only use in
    the chunk. Returns ``param``."""
    setattr(param, _IN_INPUT, True)
    return param


def _computed_in_input(leaving) -> bool:
    """Does every path off the input path from these edges end at a parameter marked by
    :func:`weight_grad_in_input`?"""
    params = _leaf_parameters(leaving).values()
    return bool(params) and all(getattr(p, _IN_INPUT, False) for p in params)


class WeightGradWork:
    """The ``W`` of one micro-batch: what :func:`backward_input` left to compute."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None, boundaries: list | None):
        whole = boundaries is None
        self._out, self._grad = (out, grad) if whole else (None, None)   # only the whole backward reruns from out
        self._boundaries = boundaries           # [(node, [(child, input_nr)])]; None: the whole backward
        self._kept: dict = {}                   # node -> the gradients of its outputs seen in I
        self._early: dict = {}                  # node -> [(off-path edge, its gradient)] computed in I
        self._groups: list = []                 # the boundaries in independent groups, in W's order
        self.done = False

    def keep(self, node, grad_outputs) -> None:
        self._kept[node] = tuple(grad_outputs)
        return None

    def run(self) -> None:
        """Compute the parameters' gradients, accumulated into ``.grad`` through autograd."""
        if self.done:
            raise RuntimeError("this weight-gradient work (W) has run already")
        self.done = True
        if self._boundaries is None:
            torch.autograd.backward(self._out, self._grad)
        else:
            # the groups I computed whole (norms, biases: their gradients held) in one pass, no transient
            held, deferred = [], []
            for group in self._groups:
                if all(node in self._early for node, _ in group):
                    held += group
                else:
                    deferred.append(group)
            with _Freeing():                    # each node's saved tensors go once it has run
                self._pass(held)
                for group in deferred:          # a lone plain matmul by hand, anything else through autograd
                    if not (len(group) == 1 and self._matmul_by_hand(*group[0])):
                        self._pass(group)
        self._out = self._grad = self._boundaries = None
        self._kept, self._early, self._groups = {}, {}, []

    def _pass(self, boundaries: list) -> None:
        """One autograd pass for one group: from each boundary's kept output gradients (the part of its
        backward that ``I`` skipped) or from the gradients ``I`` computed along its edges, down to the
        group's parameters only (``inputs``: the engine runs no node of the input path), into ``.grad``.
        The kept gradients are let go as they are used."""
        roots, grads, leaves, got, on_path = [], [], {}, None, False
        for node, leaving in boundaries:
            if node in self._early:
                got = [(GradientEdge(c, nr), g) for (c, nr), g in self._early.pop(node)]
            else:
                kept = self._kept.pop(node, None) or ()   # None: I never reached the node, nothing flows there
                got = [(GradientEdge(node, k), g) for k, g in enumerate(kept) if g is not None]
                on_path = on_path or bool(got)
            for edge, g in got:
                roots.append(edge)
                grads.append(g)
            if got:
                leaves.update(_leaf_parameters(leaving))
        del got
        if roots and leaves:
            # Roots on the input path (a boundary rerun from its kept gradient) need ``inputs`` to stop the
            # engine going down the path; roots off it (edges I computed) reach this group's parameters
            # only, and the engine's search for ``inputs`` would be wasted.
            inputs = list(leaves.values()) if on_path else None
            torch.autograd.backward(roots, grads, inputs=inputs)   # each node of it runs once in W

    def _matmul_by_hand(self, node, leaving) -> bool:
        """W of one boundary that is a plain matrix product (``torch.mm``/``addmm``: every linear layer,
        column- or row-parallel), without an autograd pass through the boundary: its off-path gradients
        (the weight's ``X^T dY``, the bias's ``dY``) computed here with the node's own formula and
        operands, then one pass from its edges off the path, through autograd's ``AccumulateGrad`` as
        before. The same kernels on the same tensors, so the gradients are the full backward's bit for
        bit; what it saves is the engine's pass over the boundary (~0.4 ms a micro-batch at the bench's
        tiny shape). False (nothing done) for any other node, or where the operands it needs are not held
        by :func:`deferrable_saves`' slots (a recomputed region: the pass recomputes it)."""
        names = saved_operand_names(node)
        if names is None:
            return False
        try:                                    # the node's saved operands and its edges' shapes, as torch exposes them
            raws = [getattr(node, "_raw_saved_" + name) for name in names]
            if any(raw.unpack_hook is not _unpack or raw.data.tensor is None for raw in raws):
                return False
            slots = [raw.data for raw in raws]
            targets = [(k, child, nr, child._input_metadata[nr].shape) for k, (child, nr)
                       in enumerate(node.next_functions) if child is not None and (child, nr) in leaving]
        except (AttributeError, IndexError):    # an older torch: the pass does it
            return False
        kept = self._kept.pop(node, None)
        dy = kept[0] if kept else None
        if dy is None:                          # I never reached the node: nothing flows to its weights
            _empty(s for s in slots if not s.pinned)
            return True
        operands, edges, grads, g = [s.tensor for s in slots], [], [], None
        for k, child, nr, shape in targets:
            g = operand_grad(node, k, dy, operands)
            edges.append(GradientEdge(child, nr))
            grads.append(g if g.shape == shape else g.sum_to_size(shape))   # a broadcast bias: as the engine sums
        del dy, kept, g, operands
        _empty(s for s in slots if not s.pinned)
        if edges:
            torch.autograd.backward(edges, grads)
        return True


def _leaf_parameters(leaving) -> dict:
    """{id: tensor} of the leaves (parameters) reached from ``leaving``, the edges off the input path."""
    stack, seen, found = [child for child, _ in leaving], set(), {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found[id(variable)] = variable
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return found


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None) -> WeightGradWork:
    """``I``: the gradient of ``out`` (with ``grad``, None for a scalar loss) back to ``x`` only, into
    ``x.grad``. Returns the :class:`WeightGradWork` (``W``) that computes the rest."""
    if x is None or not x.requires_grad or out.grad_fn is None:
        return WeightGradWork(out, grad, None)
    target = get_gradient_edge(x).node
    order = _post_order(out.grad_fn)
    on_path = set()
    for node in order:                          # children first
        if node is target or any(c in on_path for c, _ in node.next_functions if c is not None):
            on_path.add(node)
    if out.grad_fn not in on_path:
        return WeightGradWork(out, grad, None)
    boundaries = []
    for node in order:
        if node in on_path and node is not target:
            leaving = list(dict.fromkeys((c, nr) for c, nr in node.next_functions
                                         if c is not None and c not in on_path))
            if leaving:
                boundaries.append((node, leaving))
    work = WeightGradWork(out, grad, boundaries)
    work._groups = _independent_groups(boundaries)
    # The early boundaries' off-path gradients are taken in I's own pass, as inputs of it beside x:
    # a boundary alone in its group is the only way to its edges, so the pass computes exactly its half.
    # A marked boundary (weight_grad_in_input) is asked the same way and its gradients go into .grad at
    # the end of I; W has nothing left of it.
    alone = [group[0] for group in work._groups if len(group) == 1]
    now = {node: leaving for node, leaving in alone if _deferred(node) and _computed_in_input(leaving)}
    early = {node: leaving for node, leaving in alone if not _deferred(node) or node in now}
    early_edges = [(node, edge) for node, leaving in early.items() for edge in leaving]
    deferred = {node for node, _ in boundaries if node not in early}
    work._groups = [group for group in work._groups if group[0][0] not in now]
    with _Freeing(keep=deferred), _hooked(deferred, work.keep, now, _into_grad(now)):
        got = torch.autograd.grad(out, [x] + [GradientEdge(c, nr) for _, (c, nr) in early_edges], grad,
                                  retain_graph=True, allow_unused=True)
    if got[0] is not None:                      # into x.grad, as a backward would
        x.grad = got[0] if x.grad is None else x.grad + got[0]
    for (node, edge), g in zip(early_edges, got[1:]):
        if node in now:                         # gone into .grad already (None here)
            continue
        work._early.setdefault(node, [])
        if g is not None:
            work._early[node].append((edge, g))
    return work


def _into_grad(now: dict):
    """A post-hook for the boundaries of ``now`` (node -> its edges off the path): right after the node
    ran in I's pass, its gradients along those edges go down to ``.grad`` (a nested backward, while
    ZeRO-3 still holds the parameters gathered), and are dropped from what the pass returns."""
    def hook(grad_inputs, grad_outputs, node):
        leaving = now.get(node)
        if leaving is None:
            return None
        edges, grads, out = [], [], list(grad_inputs)
        for k, (child, nr) in enumerate(node.next_functions):
            if (child, nr) in leaving and out[k] is not None:
                edges.append(GradientEdge(child, nr))
                grads.append(out[k])
                out[k] = None
        if edges:
            torch.autograd.backward(edges, grads)
        return tuple(out)
    return hook


@contextlib.contextmanager
def _hooked(keeping, keep, changing, change):
    """Inside the block, ``keep(node, grad_outputs)`` runs before each node of ``keeping``, and
    ``change(grad_inputs, grad_outputs, node)`` (whose result replaces ``grad_inputs``) after each of
    ``changing``: hooks on those nodes only (a hook per node of the graph costs Python calls)."""
    handles = [node.register_prehook(lambda go, node=node: keep(node, go)) for node in keeping]
    handles += [node.register_hook(lambda gi, go, node=node: change(gi, go, node)) for node in changing]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _independent_groups(boundaries: list) -> list[list]:
    """``boundaries`` in groups whose parts off the input path share no node (in a transformer layer:
    one group per weight matmul or norm), smallest gradient first. ``W`` runs one autograd pass per group, so
    the weight gradients go into ``.grad`` as they are computed, never all at once, and an edge reached
    from two boundaries (a parameter used twice) still receives their sum in one pass, as in a full
    backward."""
    parent = list(range(len(boundaries)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict = {}                            # node off the path -> the first boundary reaching it
    for i, (_, leaving) in enumerate(boundaries):
        stack = [child for child, _ in leaving]
        while stack:
            node = stack.pop()
            if node in owner:                   # reached before: its whole subgraph is owned already
                parent[root(i)] = root(owner[node])
                continue
            owner[node] = i
            stack.extend(c for c, _ in node.next_functions if c is not None)
    groups: dict = {}
    for i, b in enumerate(boundaries):
        groups.setdefault(root(i), []).append(b)
    return sorted(groups.values(), key=_gradient_bytes)     # stable: boundary order among equals


def _gradient_bytes(group: list) -> int:
    """Bytes of the gradients ``group``'s pass produces along the edges leaving the path (a weight
    matmul: its weight's size), the transient ``W`` adds while that pass runs. ``W`` runs the groups
    smallest first: each pass frees its inputs and kept gradients, so the largest transients come when
    the least is held (bit for bit the same gradients: the groups share no node). 0 where the torch
    version does not expose the edges' metadata (then boundary order)."""
    total = 0
    for _, leaving in group:
        for child, nr in leaving:
            try:
                meta = child._input_metadata[nr]
                total += math.prod(meta.shape) * meta.dtype.itemsize
            except (AttributeError, IndexError, TypeError):
                return 0
    return total


def _post_order(root) -> list:
    """The graph's nodes below ``root`` (inclusive), each after every node it has an edge to."""
    order, seen, stack = [], {root}, [(root, iter(root.next_functions))]
    while stack:
        node, edges = stack[-1]
        for child, _ in edges:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            order.append(node)
            stack.pop()
    return order
