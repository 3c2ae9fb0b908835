"""Inductor: a boxed backward's incoming gradients are freed at their last use.

Upstream counterpart: ``is_nonfreeable_buffers`` in ``torch/_inductor/utils.py``, which tells
Inductor's peak-memory model (``memory.py``: ``reorder_for_peak_memory`` picks, among a few
topological orders, the one whose estimated peak is lowest) which graph inputs live to the
graph's end: by name, ``primals_*``, ``arg*``, the RNG states and ``tangents_*``.

The incoming gradients of a compiled backward do not.  Since torch 2.13 autograd hands a
compiled backward its gradients in a list (``BackwardCFunction.apply_boxed``) that the
backward empties, and Inductor's code frees each input after its last use: a gradient dies
where its last reader runs, like any buffer of the graph.  Counted as living to the end, a
large one costs nothing to read late, so the model picks orders that do: under torchtitan's
call (the loss compiled apart, 32,768 tokens of vocabulary, Llama 2 x 256, batch 2 x 512) the
body's backward computed the LM head's weight gradient last, holding the logits' gradient
(128 MiB) through the whole backward, a step peak of 201.8 MiB where an order that reads it
first peaks at 174.4 MiB (CPU, torch 2.13).  Here the incoming gradients of a top-level
backward graph are freeable; the primals (parameters and inputs the caller holds) and
subgraphs' inputs (their parent holds them) are as before, and so is every input before torch
2.13, where autograd holds the gradients until the backward returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: The prefix AOTAutograd names a backward graph's incoming gradients with.
INCOMING_GRADIENT_PREFIX = "tangents"


def frees_incoming_gradients(graph: Any) -> bool:
    """Whether ``graph`` (a ``GraphLowering``) is a top-level backward whose incoming
    gradients its code frees at their last use: where autograd hands them over boxed."""
    # Imported here: Inductor's utils are imported long before AOTAutograd's.
    from torch_patches._functorch._aot_autograd.utils import incoming_gradients_boxed

    return bool(getattr(graph, "is_backward", False)) and getattr(graph, "name", None) is None and incoming_gradients_boxed()


def make_is_nonfreeable_buffers(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch._inductor.utils.is_nonfreeable_buffers``: an incoming gradient of a
    top-level backward graph is freeable (see the module)."""

    @functools.wraps(original)
    def is_nonfreeable_buffers(dep: Any) -> bool:
        if not original(dep):
            return False
        from torch._inductor.virtualized import V

        return not (dep.name.startswith(INCOMING_GRADIENT_PREFIX) and frees_incoming_gradients(V.graph))

    return is_nonfreeable_buffers
