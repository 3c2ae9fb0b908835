"""Inductor: a graph holding saved-tensor offload ops keeps the order the inliner gave it.

Upstream counterpart: ``reorder_for_peak_memory`` in ``torch/_inductor/memory.py``.  It
tries a few topological orders of the scheduler's nodes and keeps the one whose estimated
peak is lowest.  Its estimate counts each node's outputs, all of them as device memory:

* the host copy ``saved_tensors_hooks::offload`` returns counts as if it stayed on the
  device, so issuing an offload early looks like no gain;
* the device tensor ``saved_tensors_hooks::reload_start`` allocates (and ``reload_wait``
  returns later) is invisible where it is allocated: ``reload_start`` outputs a 0-d CPU
  ticket, so issuing it early looks free.

Measured on an H100 (torch 2.11, mlp8 8192 x 4096 fp32, ``cpu_offload()``,
``benchmarks/gpu_offload_profile.py``): the chosen order moved every ``reload_start`` (and
the reloads of the block inputs) to the start of the backward, which then held every
reloaded tensor at once: a peak of 1.00x of no hooks, against 0.55x in the inliner's order.
In such a graph the inliner's placement *is* the memory plan (each offload right after the
saved tensor's last forward use, each reload a bounded distance before its first backward
use), so the pass runs with no candidate orders: it still prepares the planning
information later passes read, and keeps the baseline order.  Every other graph is
reordered as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from torch_patches._logging import artifact_logger

#: Name of ``reorder_for_peak_memory``'s parameter holding the candidate orderings.
_METHODS = "methods"
_METHODS_POSITION = 5  # nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, methods


#: The ops whose device memory Inductor's peak-memory model cannot follow (schema names).
OFFLOAD_OPS = frozenset(f"saved_tensors_hooks::{op}" for op in ("offload", "reload_start", "reload_wait"))


def offload_nodes(nodes: Iterable[Any]) -> list[str]:
    """Names of the buffers of the scheduler ``nodes`` that run one of :data:`OFFLOAD_OPS`
    (a fallback kernel each)."""
    found = []
    for snode in nodes:
        for inner in snode.get_nodes():
            op = getattr(getattr(inner, "node", None), "op_overload", None)
            schema_name = getattr(getattr(op, "_schema", None), "name", None)
            if schema_name in OFFLOAD_OPS:
                found.append(inner.get_name())
    return found


def make_reorder_for_peak_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch._inductor.memory.reorder_for_peak_memory``: graphs holding offload ops
    are planned (the planning information is still assigned) but keep their order."""

    @functools.wraps(original)
    def reorder_for_peak_memory(nodes: Any, *args: Any, **kwargs: Any) -> Any:
        held = offload_nodes(nodes)
        if held:
            artifact_logger("torch._inductor.memory").info(
                "reorder_for_peak_memory keeps the inliner's order of this graph: it holds %d "
                "offload/reload ops (%s), whose device memory the reorder's model cannot see",
                len(held),
                ", ".join(held[:4]) + (", ..." if len(held) > 4 else ""),
            )
            if len(args) >= _METHODS_POSITION:
                args = (*args[: _METHODS_POSITION - 1], [], *args[_METHODS_POSITION:])
            else:
                kwargs = {**kwargs, _METHODS: []}
        return original(nodes, *args, **kwargs)

    return reorder_for_peak_memory
