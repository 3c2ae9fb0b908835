"""The order Inductor runs a compiled graph in, modelled on the fx graph (compile time, pure fx).

Upstream counterpart: ``reorder_for_peak_memory`` in ``torch/_inductor/memory.py``.  After
fusion Inductor tries a few topological orders of its kernels (least peak memory first,
breadth first, depth first) and keeps the one its own model estimates to peak lowest, its
graph's order on a tie.  The model: a kernel allocates its outputs when it runs; a buffer is
freed once every kernel reading it has run, an input of the graph only where Inductor frees
inputs at all (saved activations, and on torch 2.13 on the incoming gradients under our
patch ``inductor.incoming_gradients_freeable``, never the caller's parameters); the graph's
outputs are never freed and bound the peak from below.

:func:`inductor_order` picks between the graph's order and the least peak memory first one
(:func:`memory_order`) by that estimate (:func:`inductor_estimate`), in
:mod:`.working_set`'s buffers, with Inductor's vertical fusion of pointwise chains
(:func:`fused_kernels`): such a kernel runs once all its members' inputs are made, which
is what keeps a recomputing partition's backward in the graph's order (its rebuilt
residual stream one kernel after every block's up projection).  The step's peak
(:mod:`.step_peak`) is then read in that one order; the lower of two orders, as before,
took an order Inductor does not run.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd.activation_budget.working_set import (
    addmm_add,
    kernel_inputs,
    kernels_reading,
    materialized,
    pointwise,
    storage_of,
)
from torch_patches._functorch._aot_autograd.utils import incoming_gradients_boxed, is_incoming_gradient, nbytes_of

__all__ = ["fused_kernels", "inductor_estimate", "inductor_frees", "inductor_order", "memory_order"]


#: Graph inputs Inductor's peak-memory model never frees (``is_nonfreeable_buffers`` in
#: ``torch/_inductor/utils.py``, by name): the caller's parameters and inputs, the RNG states,
#: the incoming gradients; every other input of a backward (a saved activation) it frees at
#: its last reader.
_NONFREEABLE_INPUTS = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")


def inductor_frees(node: fx.Node) -> bool:
    """Whether Inductor's model frees graph input ``node`` at its last reader: an input not
    named as :data:`_NONFREEABLE_INPUTS`, or an incoming gradient where autograd hands them
    over in a list the backward empties (``torch_patches/_inductor/utils.py``)."""
    if node.op != "placeholder":
        return False
    return not node.name.startswith(_NONFREEABLE_INPUTS) or (is_incoming_gradient(node) and incoming_gradients_boxed())


def _numel(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) and not any(isinstance(d, torch.SymInt) for d in val.shape) else None


def _ancestors(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Per node, the bit set (by position in ``nodes``) of itself and every node it is made from."""
    index = {n: i for i, n in enumerate(nodes)}
    out: dict[fx.Node, int] = {}
    for n in nodes:
        bits = 1 << index[n]
        for a in n.all_input_nodes:
            bits |= out[a]
        out[n] = bits
    return out


def fused_kernels(graph: fx.Graph, ancestors: dict[fx.Node, int] | None = None) -> dict[fx.Node, tuple[fx.Node, ...]]:
    """Nodes Inductor fuses into one kernel with others, each mapped to that kernel's members
    (in the graph's order): a materialised pointwise op and the pointwise kernels reading it
    over the same elements become one kernel writing both outputs (vertical fusion), unless
    another kernel between them reads the first and feeds the second.  Such a kernel runs
    once all its members' inputs are made, and frees them once all its members have run: no
    order runs one member early and makes the others' inputs later (the residual stream a
    recomputing partition rebuilds in the backward: every block's sum in one kernel, after
    every block's up projection).  ``ancestors``: :func:`_ancestors` of the graph's nodes."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    ancestors = _ancestors(nodes) if ancestors is None else ancestors
    leader = {n: n for n in nodes}

    def find(n: fx.Node) -> fx.Node:
        while leader[n] is not n:
            leader[n] = leader[leader[n]]
            n = leader[n]
        return n

    fusible = lambda n: n.op == "call_function" and pointwise(n) and not addmm_add(n) and _numel(n) is not None  # noqa: E731
    for p, kernels in kernels_reading(graph).items():
        if not fusible(p) or not materialized(p):
            continue
        for k in kernels:
            # Another kernel reading p and feeding k would have to run inside the fused one.
            if (
                k is not p
                and fusible(k)
                and _numel(k) == _numel(p)
                and not any(i is not p and find(i) is not find(p) and ancestors[i] >> index[p] & 1 for i in kernel_inputs(k))
            ):
                leader[find(k)] = find(p)
    groups: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for n in nodes:
        groups[find(n)].append(n)
    return {m: tuple(g) for g in groups.values() if len(g) > 1 for m in g}


class _Model:
    """Inductor's peak-memory model of a graph in :mod:`.working_set`'s buffers: a node
    allocates its bytes when it runs; a storage is freed once every kernel reading it has
    run (a fused kernel, :func:`fused_kernels`, once all its members have); of the graph's
    inputs only those Inductor frees count (:func:`inductor_frees`); the graph's outputs are
    never freed.  ``waits``: per member of a fused kernel, the inputs of its other members
    made outside it, which it waits for.  Immutable: :class:`_Run` runs an order on it."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        index = {n: i for i, n in enumerate(self.nodes)}
        ancestors = _ancestors(self.nodes)
        self.fused = fused_kernels(graph, ancestors)
        readers = kernels_reading(graph)
        outputs = {storage_of(a) for n in self.nodes if n.op == "output" for a in n.all_input_nodes}
        counted = lambda r: materialized(r) and (r.op != "placeholder" or inductor_frees(r))  # noqa: E731
        self.freeable = {r: nbytes_of(r) for r in readers if counted(r) and r not in outputs}
        self.alloc = {n: (nbytes_of(n) if materialized(n) and n.op != "placeholder" else 0) for n in self.nodes}
        self.live = sum(nbytes_of(n) for n in self.nodes if n.op == "placeholder" and counted(n))
        self.most = max(self.live, sum(nbytes_of(r) for r in outputs if counted(r)))
        self.reads: dict[Any, set[fx.Node]] = collections.defaultdict(set)
        for r, ks in readers.items():
            for k in ks:
                self.reads[self.fused.get(k, k)].add(r)
        self.waits: dict[fx.Node, set[fx.Node]] = {}
        for members in set(self.fused.values()):
            inside = 0
            for m in members:
                inside |= 1 << index[m]
            outside = {a for m in members for a in m.all_input_nodes if not ancestors[a] & inside}
            for m in members:
                self.waits[m] = outside - set(m.all_input_nodes)


class _Run:
    """One order run on a :class:`_Model`: what is held now, and the most held so far."""

    def __init__(self, model: _Model) -> None:
        self.model, self.live, self.most = model, model.live, model.most
        self.remaining = collections.Counter(r for rs in model.reads.values() for r in rs)
        self.left = {g: len(g) for g in set(model.fused.values())}

    def freed_by(self, node: fx.Node) -> int:
        """The bytes freed once ``node`` has run (its kernel's last member)."""
        key = self.model.fused.get(node, node)
        if isinstance(key, tuple) and self.left[key] > 1:
            return 0
        return sum(self.model.freeable.get(r, 0) for r in self.model.reads.get(key, ()) if self.remaining[r] == 1)

    def run(self, node: fx.Node) -> None:
        """Runs ``node``: allocates its bytes, and frees what its kernel read last."""
        during = self.live + self.model.alloc[node]
        self.most = max(self.most, during)
        self.live = during - self.freed_by(node)
        key = self.model.fused.get(node, node)
        if isinstance(key, tuple):
            self.left[key] -= 1
            if self.left[key]:
                return
        for r in self.model.reads.get(key, ()):
            self.remaining[r] -= 1


def inductor_estimate(graph: fx.Graph, order: list[fx.Node] | None = None, model: _Model | None = None) -> int:
    """The peak Inductor's ``estimate_peak_memory`` puts on ``graph`` run in ``order``
    (default the graph's), in :mod:`.working_set`'s buffers (:class:`_Model`)."""
    state = _Run(_Model(graph) if model is None else model)
    for n in list(graph.nodes) if order is None else order:
        state.run(n)
    return state.most


def inductor_order(graph: fx.Graph) -> list[fx.Node]:
    """The order Inductor's ``reorder_for_peak_memory`` picks for ``graph``: the lower of its
    estimated peaks (:func:`inductor_estimate`) of the graph's own order and of its least peak
    memory first order (:func:`memory_order`); the graph's on a tie, as Inductor keeps its
    baseline."""
    model = _Model(graph)
    lpmf = memory_order(graph, model)
    return lpmf if inductor_estimate(graph, lpmf, model) < inductor_estimate(graph, None, model) else list(graph.nodes)


def memory_order(graph: fx.Graph, model: _Model | None = None) -> list[fx.Node]:
    """An order of ``graph``'s nodes as Inductor's least-peak-memory-first sort
    (``topological_sort_lpmf``) picks it, in :class:`_Model`'s terms: among the nodes ready
    to run, one that stays under the most held so far with the least held after it, else the
    one holding the least while it runs; ties in the graph's order.  The most held so far
    starts at the graph's outputs' bytes (their lower bound), as Inductor's does.  A member
    of a fused kernel is ready once every member's inputs are made."""
    model = _Model(graph) if model is None else model
    nodes = model.nodes
    pos = {n: i for i, n in enumerate(nodes)}
    state = _Run(model)
    waiting: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for n, before in model.waits.items():
        for a in before:
            waiting[a].append(n)
    indegree = {n: len(set(n.all_input_nodes)) + len(model.waits.get(n, ())) for n in nodes}
    ready = [n for n in nodes if indegree[n] == 0]
    out: list[fx.Node] = []
    while ready:
        scored = [((state.live + model.alloc[n], state.live + model.alloc[n] - state.freed_by(n)), pos[n], n) for n in ready]
        under = [t for t in scored if t[0][0] <= state.most]
        pick = (min(under, key=lambda t: (t[0][1], t[1])) if under else min(scored, key=lambda t: (t[0][0], t[1])))[2]
        ready.remove(pick)
        out.append(pick)
        state.run(pick)
        for u in [*pick.users, *waiting.get(pick, ())]:
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    return out if len(out) == len(nodes) else nodes
