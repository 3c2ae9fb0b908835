"""Install the hooks active around a compiled call as subgraphs of the Dynamo graph.

Upstream counterpart: ``OutputGraph.maybe_install_saved_tensors_hooks_subgraphs`` in
``torch/_dynamo/output_graph.py``.  The subgraphs (``saved_tensors_hooks_pack_0`` /
``saved_tensors_hooks_unpack_0``) are not called by the graph: they record which hooks
the graph was compiled for, for the compile caches.  Differences from upstream:

* plain functions marked ``torch_patches.hooks.inlineable`` are accepted; they are
  recorded as an opaque leaf call carrying the hook's content hash as
  ``user_cache_hash`` (so cache keys follow the hook's content, not its identity);
* a GraphModule hook is copied with its own root, so hooks with constants (get_attr)
  install correctly;
* hooks that stay eager say why, once per compilation, in the debug log.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import utils as hook_utils


log = logging.getLogger(__name__)


def hook_subgraph(fn: Any) -> fx.GraphModule:
    """A GraphModule standing for one inlineable hook."""
    if isinstance(fn, fx.GraphModule):
        return fx.GraphModule(fn, copy.deepcopy(fn.graph), class_name=type(fn).__name__)
    graph = fx.Graph()
    x = graph.placeholder("x")
    call = graph.call_function(fn, (x,))
    call.meta["is_wrapped"] = True
    call.meta["user_cache_hash"] = hook_utils.content_hash(fn)
    graph.output(call)
    return fx.GraphModule(torch.nn.Module(), graph, class_name=getattr(fn, "__name__", "hook"))


def maybe_install_saved_tensors_hooks_subgraphs(self: Any) -> list[str] | None:
    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return None
    hooks = hook_utils.top_saved_tensors_hooks()
    if hooks is None:
        return None
    pack, unpack = hooks
    if not hook_utils.saved_tensors_hooks_are_inlineable(hooks):
        log.debug(
            "saved tensors hooks pack=%s unpack=%s run as eager hooks in this graph: "
            "they are neither fx.GraphModules nor functions marked with "
            "torch_patches.hooks.inlineable",
            hook_utils.hook_name(pack),
            hook_utils.hook_name(unpack),
        )
        return None
    names = [
        self.install_subgraph(f"saved_tensors_hooks_{role}", hook_subgraph(fn))
        for role, fn in (("pack", pack), ("unpack", unpack))
    ]
    if names != ["saved_tensors_hooks_pack_0", "saved_tensors_hooks_unpack_0"]:
        raise AssertionError(f"saved tensors hooks installed as {names}")
    return names
