"""Inductor's FX graph cache: graphs whose code our patches change are keyed on them.

Upstream counterpart: ``FxGraphHashDetails`` in ``torch/_inductor/codecache.py``, everything
an FX graph cache key is made of (the graph, its inputs, Inductor's config, custom passes'
``uuid()``...).  Among them ``torch_key()``, a digest of torch's own source: Inductor's code
changes what it generates, so an entry written by another torch is never served.

The patch set changes what Inductor generates for graphs holding the offload ops
(``saved_tensors_hooks::offload`` / ``reload_start`` / ``reload_wait``): the offload
lowering frees, never reuses, the buffer a copy still reads (``lowering.py``,
``codegen/wrapper.py``) and such graphs keep the inliner's order (``memory.py``).  That code
is ours, not torch's, so ``torch_key()`` does not cover it: a process of another release of
the patch set, sharing the cache directory (the default keeps it across upgrades), would be
served the code generated under the other release's lowering and order.  The details of a
graph holding one of those ops also hold the digest of our source
(``hook_walk.own_source_digest``, which AOTAutogradCache's key of hooks holds too); other
graphs' keys are unchanged.  Upstream, where these changes are torch's own source, the digest
is empty and nothing is added.

The same holds for the order of a backward graph's nodes where its incoming gradients are
freed at their last use (``utils.py``): the details of a top-level backward graph that reads
incoming gradients also say so (:data:`FREED_GRADIENTS_ATTR`), so that an entry written by a
process without that rule (stock torch sharing the cache directory, or an earlier release of
the patch set) is not served to one with it, nor the other way round.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from torch_patches._functorch._aot_autograd.hook_walk import own_source_digest
from torch_patches._functorch._aot_autograd.utils import is_incoming_gradient
from torch_patches._inductor.memory import OFFLOAD_OPS

#: The attribute of ``FxGraphHashDetails`` holding the digest (part of the pickled key).
OFFLOAD_DIGEST_ATTR = "saved_tensors_hooks_offload_source"
#: The attribute of ``FxGraphHashDetails`` that marks a backward graph whose incoming
#: gradients its memory model frees at their last use.
FREED_GRADIENTS_ATTR = "incoming_gradients_freed_at_last_use"


def holds_offload_ops(gm: Any) -> bool:
    """Whether the FX graph ``gm`` (or a subgraph of it) calls one of :data:`OFFLOAD_OPS`."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and getattr(getattr(node.target, "_schema", None), "name", None) in OFFLOAD_OPS:
                return True
    return False


def make_fx_graph_hash_details_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FxGraphHashDetails.__init__``: the details of a graph holding offload ops
    also hold the digest of our source (see the module)."""

    @functools.wraps(original)
    def __init__(self: Any, gm: Any, *args: Any, **kwargs: Any) -> None:
        original(self, gm, *args, **kwargs)
        digest = own_source_digest()
        if not digest or gm is None:
            return
        if holds_offload_ops(gm):
            setattr(self, OFFLOAD_DIGEST_ATTR, digest)
        fx_kwargs = args[1] if len(args) > 1 else kwargs.get("fx_kwargs", {})
        if fx_kwargs.get("is_backward") and memory_model_frees_incoming_gradients() and reads_incoming_gradients(gm):
            setattr(self, FREED_GRADIENTS_ATTR, True)

    return __init__


def memory_model_frees_incoming_gradients() -> bool:
    """Whether Inductor's memory model, as this process has it, frees a top-level backward's
    incoming gradients at their last use (``utils.py``'s patch applied): asked of the model."""
    from torch._inductor import utils
    from torch._inductor.virtualized import V

    with V.set_graph_handler(types.SimpleNamespace(is_backward=True, name=None)):  # type: ignore[arg-type]
        return not utils.is_nonfreeable_buffers(types.SimpleNamespace(name="tangents_1"))  # type: ignore[arg-type]


def reads_incoming_gradients(gm: Any) -> bool:
    """Whether the FX graph ``gm`` has an incoming gradient among its inputs."""
    return any(map(is_incoming_gradient, gm.graph.find_nodes(op="placeholder")))
