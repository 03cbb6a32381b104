"""The split backward of zero-bubble pipeline schedules (Qi et al., ICLR 2024): ``I``, the backward of
one micro-batch through one model chunk that computes only what the previous stage waits for (the
gradient of the chunk's input), and ``W``, run later when the pipeline would otherwise sit idle, that
computes the parameters' gradients::

    out = chunk(x)                                   # x: the received activation, requires grad
    work = backward_input(out, dy, x)                # I: x.grad; no parameter gradient yet
    ...                                              # send x.grad back, run other micro-batches
    work.run()                                       # W: every parameter's gradient into .grad

It works on the autograd graph, so every layer kind splits the same way, with no layer code of its
own: linear (column/row-parallel, sequence parallel), attention, LayerNorm/RMSNorm, embeddings
(vocab-parallel, position), MoE experts and router. Before ``I`` the graph of ``out`` is walked once:

- the *input path* is every node from which the gradient reaches ``x``; ``I`` is
  ``torch.autograd.backward(out, dy, inputs=[x])``, which runs those nodes and no other, each computing
  only the gradients of its inputs on the path (a linear's ``dY @ W``, not its ``dY^T @ X``);
- a *boundary* is an input-path node with an edge leaving the path (towards parameters only: a node
  off the path cannot reach ``x``): a matmul whose other operand is a weight, a norm's affine step, the
  add of a position embedding. A pre-hook keeps the gradient each boundary receives during ``I``.

``W`` runs in two parts: each boundary again from its kept gradient, asked only for the gradients
along its edges off the path (``torch.autograd.grad`` with ``GradientEdge``: the weight half of the
matmul, and nothing of the input path, which ``I`` did), then one ``torch.autograd.backward`` from
those edges down to the parameters. That second part accumulates through autograd's own
``AccumulateGrad``, so the parameters' post-accumulate-grad hooks fire as in a full backward: the ZeRO
gradient sync counts its buckets down and launches their reductions from ``W`` (the caller brackets
``W`` with the grad sync's ``weight_grad``). The kernels are the ones the full backward runs, so
``I`` + ``W`` gives the full backward's gradients bit for bit (tests/test_pipeline_split_backward.py,
per layer kind). A node whose backward does not split (a custom ``autograd.Function`` with a weight,
e.g. ``RMSNormFunction``) computes both halves in ``I`` and again in ``W`` and keeps one each time:
exact, at the price of that node's extra work.

Where ``x`` is None (the first virtual stage, whose input is token ids) or ``out`` does not depend on
it, ``I`` has nothing to compute and ``W`` is the whole backward. Between ``I`` and ``W`` the graph
(the micro-batch's activations) stays alive: a zero-bubble schedule holds a micro-batch until its W,
which is what ``simulate.py`` and ``PipelineStats`` count.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class WeightGradWork:
    """The ``W`` of one micro-batch: what :func:`backward_input` left to compute."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None, boundaries: list | None):
        self._out, self._grad = out, grad
        self._boundaries = boundaries           # [(node, [(child, input_nr)])]; None: the whole backward
        self._kept: dict = {}                   # node -> the gradients of its outputs seen in I
        self.done = False

    def keep(self, node, grad_outputs) -> None:
        self._kept[node] = tuple(grad_outputs)

    def run(self) -> None:
        """Compute the parameters' gradients, accumulated into ``.grad`` through autograd."""
        if self.done:
            raise RuntimeError("this weight-gradient work (W) has run already")
        self.done = True
        if self._boundaries is None:
            torch.autograd.backward(self._out, self._grad)
        else:
            edges, grads = self._edge_grads()
            if edges:
                torch.autograd.backward(edges, grads)
        self._out = self._grad = self._boundaries = None
        self._kept = {}

    def _edge_grads(self) -> tuple[list, list]:
        """The gradient along each edge that leaves the input path (the part of each boundary node's
        backward that ``I`` skipped)."""
        found: dict = {}
        for node, leaving in self._boundaries:
            kept = self._kept.get(node)
            if kept is None:                    # I never reached the node: no gradient flows there
                continue
            roots = [(GradientEdge(node, k), g) for k, g in enumerate(kept) if g is not None]
            if not roots:
                continue
            targets = [GradientEdge(child, nr) for child, nr in leaving]
            got = torch.autograd.grad([e for e, _ in roots], targets, [g for _, g in roots],
                                      retain_graph=True, allow_unused=True)
            for (child, nr), g in zip(leaving, got):
                if g is None:
                    continue
                key = (child, nr)
                found[key] = g if key not in found else found[key] + g   # a parameter used twice
        return [GradientEdge(c, nr) for c, nr in found], list(found.values())


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
    handles = [node.register_prehook(lambda go, node=node: work.keep(node, go)) for node, _ in boundaries]
    try:
        torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return work


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
