"""The step's peak: what a fitted plan predicts (:func:`predicted_peak`) and what a
partition holds without one (:func:`unplanned_peak`), its saved storages beside what the
graphs themselves hold (:mod:`.working_set`), forward and backward, with where (compile
time, pure fx).
"""

from __future__ import annotations

import collections
from collections.abc import Set
from typing import Any

import torch.fx as fx

from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.activation_budget.inductor_order import inductor_order
from torch_patches._functorch._aot_autograd.activation_budget.working_set import (
    dropped_tangents,
    held_bytes,
    kernel_ends,
    kernels_reading,
    materialized,
    pointwise,
)
from torch_patches._functorch._aot_autograd.utils import nbytes_of

__all__ = ["predicted_peak", "unplanned_peak"]


def predicted_peak(
    plan: Any, fw_g: fx.Graph, bw_g: fx.Graph, saved: list[fx.Node], bw_saved: list[fx.Node], donated: Set[fx.Node] = frozenset()
) -> tuple[int, str]:
    """The most ``plan``'s saved storages and the graphs' own tensors hold at once, and
    where (in words).  ``saved``: the forward's saved tensors, ``bw_saved``: their backward
    inputs; ``donated``: saved graph inputs the plan keeps that the backward writes their
    gradients over (``donated_inputs``).  In the forward a planned storage is full until the
    kernel of its last forward use has run (a fused use runs in the kernel of what reads
    it), and its stored form (bf16, int8, fp8) is written beside it there, where the pack
    reads it; a pointwise op read only in fused kernels is never made at full size when
    packed (Inductor computes it in its pack's kernel).  A storage the plan cannot store
    otherwise is full from where it is made.  In the backward each storage is as the plan's
    timeline has it."""
    fw_nodes = list(fw_g.nodes)
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    fw_held = held_bytes(fw_g, saved, inputs=False)
    fw_ends = kernel_ends(fw_g)
    # A storage the forward makes and returns once, as a saved tensor, reaches the backward
    # donated; one it also returns as an output (or a view of it), saves twice, or takes as
    # an input (an activation another graph made), does not.
    returned = (
        collections.Counter(act_inputs.storage_root(a) for a in fw_nodes[-1].args[0] if isinstance(a, fx.Node))
        if fw_nodes and fw_nodes[-1].op == "output"
        else collections.Counter()
    )
    diff = [0] * (len(fw_nodes) + 1)
    planned = set()
    for c in plan.choices:
        roots = {act_inputs.storage_root(m) for m in c.members}
        planned |= roots
        born = min(fw_pos[r] for r in roots)
        used = max([fw_pos[u] for m in c.members for u in m.users if u.op != "output"] + [born])
        stored = c.chosen.device_bytes
        if stored == c.nbytes:  # kept as it is
            diff[born] += c.nbytes
        elif stored and all(not materialized(r, packed=True) and returned[r] == 1 for r in roots):  # saved, not an output
            diff[born] += stored
        else:
            diff[born] += c.nbytes
            diff[used] += stored
            diff[fw_ends[used] + 1] -= c.nbytes
    for root in {act_inputs.storage_root(s) for s in saved} - planned:
        if root.op != "placeholder":  # graph inputs are held by the caller before the step
            diff[fw_pos[root]] += nbytes_of(root)
    best, where, total = -1, "", 0
    for i, d in enumerate(diff[: len(fw_nodes)]):
        total += d
        if total + fw_held[i] > best:
            best, where = total + fw_held[i], f"forward node {fw_nodes[i].name}"
    # In the order Inductor runs the backward in: its own order or one its reorder estimates
    # to hold less (reorder_for_peak_memory; :mod:`.inductor_order`).
    dropped = dropped_tangents(bw_g)
    peak, at = _backward_peak(plan, bw_g, bw_saved, returned, dropped, inductor_order(bw_g), donated)
    return (peak, at) if peak > best else (best, where)


def _backward_peak(
    plan: Any,
    bw_g: fx.Graph,
    bw_saved: list[fx.Node],
    returned: collections.Counter,
    dropped: set[fx.Node],
    order: list[fx.Node],
    donated_inputs: Set[fx.Node] = frozenset(),
) -> tuple[int, str]:
    """The backward's part of :func:`predicted_peak`, its nodes run in ``order``
    (:func:`~.inductor_order.inductor_order`): a storage's span runs from the first to the
    last kernel reading it in that order (the plan's span, in the graph's positions, where no
    kernel reads it)."""
    graph_nodes = list(bw_g.nodes)
    bw_nodes = order
    rank = {n: i for i, n in enumerate(bw_nodes)}
    bw_held = held_bytes(bw_g, bw_saved, dropped=dropped, order=order)
    bw_ends = kernel_ends(bw_g, order)
    by_name = {b.name: b for b in bw_saved}
    readers = kernels_reading(bw_g)

    def span_of(members: Any, span: Any) -> tuple[int, int]:
        ranks = [rank[k] for m in members if m.name in by_name for k in readers.get(by_name[m.name], ()) if k in rank]
        if ranks:
            return min(ranks), max(ranks)
        at = lambda i: rank[graph_nodes[i]] if i < len(graph_nodes) else len(graph_nodes)  # noqa: E731
        return at(span.first), at(span.last)

    def freed(last: int, nbytes: int = 0) -> int:
        """After the kernel of its last reader; for a donated storage (``nbytes`` given)
        whose last reader's kernel is a pointwise one with an output of its bytes, at it:
        Inductor writes the output in place of the dying input."""
        if last >= len(bw_nodes):
            return len(bw_nodes)
        kernel = bw_ends[last]
        node = bw_nodes[kernel]
        if nbytes and pointwise(node) and materialized(node) and nbytes_of(node) == nbytes:
            return kernel
        return min(len(bw_nodes), kernel + 1)

    diff = [0] * (len(bw_nodes) + 1)
    for c in plan.choices:
        first, last = span_of(c.members, c.span)
        diff[0] += c.chosen.device_bytes
        first = min(first, len(bw_nodes))
        diff[first] += c.nbytes
        # A stored form (bf16, int8, fp8) is read by its unpack's kernel, which writes the
        # full-size tensor beside it: freed after it.
        diff[min(first + 1, len(bw_nodes)) if c.chosen.device_bytes not in (0, c.nbytes) else first] -= c.chosen.device_bytes
        # The backward may write over a storage it owns: one the forward made and returned
        # once, a graph input donated to it, or any storage the plan stores otherwise than
        # kept (its unpack, a reload or a dequantisation, makes the backward's own tensor).
        owned = c.chosen.device_bytes != c.nbytes
        roots = [(m, act_inputs.storage_root(m)) for m in c.members]
        donated = all(returned[r] == 1 and (r.op != "placeholder" or m in donated_inputs or owned) for m, r in roots)
        diff[freed(last, c.nbytes if donated else 0)] -= c.nbytes
    for span, nbytes in plan.fixed:
        diff[0] += nbytes
        diff[freed(span_of((), span)[1])] -= nbytes
    best, where, total = -1, "", plan.ahead_bytes
    for i, d in enumerate(diff[: len(bw_nodes)]):
        total += d
        if total + bw_held[i] > best:
            best, where = total + bw_held[i], f"backward node {bw_nodes[i].name}"
    return best, where


def unplanned_peak(fw_g: fx.Graph, bw_g: fx.Graph, saved: list[fx.Node], bw_saved: list[fx.Node]) -> tuple[int, int, str]:
    """The step's peak of a partition as it is, without a plan: every saved tensor held
    from where the forward makes it to its last backward use (the compiled backward takes
    them in a list it empties); with the graphs' own tensors as :func:`predicted_peak`
    counts them.  Returns the peak, the bytes the saved tensors hold at the forward's end
    (storages once, graph inputs not counted), and where the peak is, in words."""
    fw_nodes = list(fw_g.nodes)
    fw_held = held_bytes(fw_g, (), inputs=False)
    # Saved graph inputs (parameters, the batch) are the caller's before the step.
    by_name = {n.name: n for n in saved}
    held_by_caller = [b for b in bw_saved if act_inputs.storage_root(by_name.get(b.name, b)).op == "placeholder"]
    dropped = dropped_tangents(bw_g) | set(bw_saved)
    best, where = -1, ""
    for i, held in enumerate(fw_held):
        if held > best:
            best, where = held, f"forward node {fw_nodes[i].name}"
    # In the order Inductor runs the backward in (:mod:`.inductor_order`).
    order = inductor_order(bw_g)
    bw_held = held_bytes(bw_g, held_by_caller, dropped=dropped, order=order, donated=set(bw_saved) - set(held_by_caller))
    top = max(range(len(bw_held)), key=bw_held.__getitem__, default=None)
    if top is not None and bw_held[top] > best:
        best, where = bw_held[top], f"backward node {order[top].name}"
    roots = {act_inputs.storage_root(s) for s in saved}
    at_end = sum(nbytes_of(r) for r in roots if r.op != "placeholder")
    return best, at_end, where
