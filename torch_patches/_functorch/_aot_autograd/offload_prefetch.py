"""Reloads that start a graph ahead: CPU offload across graphs compiled apart.

Upstream counterpart: none yet (upstream's activation offloading, like the inliner's
``reload_start`` placement here, overlaps a reload only with the compute of its own graph;
this belongs beside ``CompiledFunction`` in ``torch/_functorch/_aot_autograd/runtime_wrappers.py``).

With each decoder layer compiled on its own (FSDP2, torchtitan, ``module.compile()`` per
layer), the first reloads of a layer's backward have nothing of their own graph to hide
behind: the copies start when the layer's backward starts.  Autograd runs the layers'
backward nodes one after the other, so while layer ``i``'s backward runs, the reloads of
layer ``i - 1`` (the graph autograd runs next) can be under way.

* **Compile time** (:func:`mark`): the inliner marks a graph whose backward reloads
  offloaded tensors, with their bytes, on its ``ViewAndMutationMeta`` (the compiled
  function's ``metadata``, pickled with it by AOTAutogradCache).  The mark also says that the
  graph's saved tensors carry no Python hooks (its hooks were inlined), so reading them runs
  no user code.
* **Per call, forward** (:func:`link`): a marked graph's runtime wrapper registers a pre-hook
  on the graph's backward node (its outputs' ``grad_fn``).  One attribute lookup per output
  until the node is found (the first output, unless it aliases), and the registration.
* **Per call, backward** (:func:`_start_next_reloads`, the pre-hook): when the node's
  backward is about to run, it follows autograd's edges (``next_functions``) to the nearest
  marked nodes, at most ``config.offload_prefetch_graphs`` marked graphs deep, through at
  most :data:`MAX_NODES` nodes (parameters' ``AccumulateGrad`` end a path at once), and
  starts the reloads of their offloaded saved tensors, newest offload first
  (``torch_patches.hooks.offload.prefetch``), until ``config.offload_prefetch_bytes`` are
  under way.  The reload's ticket stays with the host tensor; that graph's own
  ``reload_start`` takes it.

Nothing links the graphs but autograd's graph and the tensors it holds: the pre-hook lives on
the node, the tickets on the saved host tensors.  A backward that raises, stops early
(``torch.autograd.grad(inputs=...)``) or is never run drops the started reloads with the
graph; ``retain_graph=True`` starts them again in the next backward (a taken ticket is gone).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import torch

from torch_patches import config
from torch_patches.hooks import offload as offload_ops

__all__ = ["MAX_NODES", "Reloads", "link", "mark", "prefetching", "reloads_of"]

#: The most autograd nodes one backward pre-hook looks at to find the graphs autograd runs
#: next (a decoder layer's node has one edge per parameter and one per activation input).
MAX_NODES = 64

RELOADS_ATTR = "_saved_tensors_hooks_reloads"


@dataclasses.dataclass(frozen=True)
class Reloads:
    """A compiled graph whose backward reloads offloaded saved tensors: how many, and their
    bytes on the device."""

    count: int
    nbytes: int


def mark(metadata: Any, count: int, nbytes: int) -> None:
    """Compile time: the graph with runtime ``metadata`` (its ``ViewAndMutationMeta``)
    reloads ``count`` offloaded tensors of ``nbytes`` device bytes in its backward."""
    setattr(metadata, RELOADS_ATTR, Reloads(count, nbytes) if count else None)


def reloads_of(metadata: Any) -> Reloads | None:
    return getattr(metadata, RELOADS_ATTR, None)


def _graph_metadata(node: Any) -> Any:
    """The ``ViewAndMutationMeta`` of the compiled graph whose backward ``node`` is (None for
    any other node)."""
    return getattr(getattr(node, "_forward_cls", None), "metadata", None)


def prefetching(runtime_metadata: Any) -> Any:
    """At runtime-wrapper creation: the function to call with each forward's outputs to start
    the next graph's reloads from this graph's backward, or None (the graph reloads nothing,
    or ``config.offload_prefetch_graphs`` is 0)."""
    graphs = int(config.offload_prefetch_graphs)
    if reloads_of(runtime_metadata) is None or graphs <= 0:
        return None
    limit = config.offload_prefetch_bytes
    hook = functools.partial(_start_next_reloads, graphs, None if limit is None else int(limit))
    return functools.partial(link, runtime_metadata, hook)


def link(metadata: Any, hook: Any, outputs: Any) -> None:
    """Per forward call of a marked graph: register ``hook`` to run when the graph's backward
    node (found from ``outputs``) is about to run."""
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        fn = getattr(out, "grad_fn", None)
        if fn is None:
            continue
        if _graph_metadata(fn) is metadata:
            fn.register_prehook(hook)
            return
        # An output that is a view of an intermediate is regenerated outside the compiled
        # function: its grad_fn is the view's, whose first edge is the graph's node.
        edges = fn.next_functions
        if edges and _graph_metadata(edges[0][0]) is metadata:
            edges[0][0].register_prehook(hook)
            return


def _saved_tensors(node: Any) -> tuple[torch.Tensor, ...]:
    """A marked graph's saved tensors (AOTAutograd keeps those without a version check
    apart), or () once its backward has freed them."""
    try:
        return (*node.saved_tensors, *getattr(node, "_tensors_no_vc_check", ()))
    except RuntimeError:  # already freed (its backward ran)
        return ()


def _start_next_reloads(graphs: int, limit: int | None, grad_outputs: Any) -> None:
    """The backward pre-hook of a marked graph: start the reloads of the ``graphs`` nearest
    marked graphs autograd reaches from it (at most ``limit`` bytes)."""
    node = torch._C._current_autograd_node()
    if node is None or torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return
    started, visited = 0, 0
    seen = {node}
    queue = collections.deque((edge, 0) for edge, _ in node.next_functions if edge is not None)
    while queue and visited < MAX_NODES:
        nxt, depth = queue.popleft()
        if nxt in seen:
            continue
        seen.add(nxt)
        visited += 1
        if reloads_of(_graph_metadata(nxt)) is not None:
            order = [(offload_ops.offload_order(t), t) for t in _saved_tensors(nxt)]
            for _, t in sorted(((o, t) for o, t in order if o is not None), key=lambda p: -p[0]):
                if limit is not None and started >= limit:
                    return
                started += offload_ops.prefetch(t)
            depth += 1
            if depth >= graphs:
                continue
        queue.extend((edge, depth) for edge, _ in nxt.next_functions if edge is not None)
