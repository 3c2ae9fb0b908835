"""Install the hooks active around a compiled call as subgraphs of the Dynamo graph.

Upstream counterpart: ``OutputGraph.maybe_install_saved_tensors_hooks_subgraphs`` in
``torch/_dynamo/output_graph.py``.  The subgraphs (``saved_tensors_hooks_pack_0`` /
``saved_tensors_hooks_unpack_0``) are not called by the graph: they tell the compile caches
which hooks the graph was compiled for.  Upstream installs a GraphModule hook itself, so
AOTAutogradCache bypasses the most common hooks (``symbolic_trace`` records tensor methods
as ``call_method`` on placeholders without example values) and cannot see plain-function
hooks at all.  We install, for every inlineable hook (GraphModule or function marked
``torch_patches.hooks.inlineable``), one opaque leaf call carrying the hook's *content*
digest as ``user_cache_hash`` (code, constants, captured values, the ``user_cache_hash`` of
fx.wrap leaves it calls, and the torch_patches config that changes compiled graphs): same
content hits in a fresh process, changed content misses.  Where the digest cannot be
computed across processes (a leaf without a user_cache_hash, a captured tensor keyed by
identity), no ``user_cache_hash`` is set, so AOTAutogradCache bypasses, and we log why.
Hooks that stay eager say why, once per compilation, in the debug log.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import utils as hook_utils


log = logging.getLogger(__name__)


def _compile_config_key() -> str:
    """The torch_patches knobs that change what a compiled graph does with hooks."""
    from torch_patches import config

    return repr(
        (
            config.hook_placement,
            config.unpack_prefetch_distance,
            config.reload_prefetch_distance,
            config.hooked_saved_tensor_dtypes,
            config.validate_unpack,
        )
    )


def saved_tensors_pack_hook(x: Any) -> Any:
    """Stands for the pack hook in an installed subgraph (its content is the cache hash).

    Installed subgraphs are never run: AOTAutograd inlines the hooks active at compile time.
    A module-level function, so the cache key's pickle can name it whatever the hook is
    (a GraphModule, a lambda, a local function).
    """
    raise RuntimeError("saved tensors hook subgraphs are cache keys, never run")


def saved_tensors_unpack_hook(x: Any) -> Any:
    """Stands for the unpack hook in an installed subgraph (see the pack stand-in)."""
    raise RuntimeError("saved tensors hook subgraphs are cache keys, never run")


_STAND_INS = {"pack": saved_tensors_pack_hook, "unpack": saved_tensors_unpack_hook}


def hook_subgraph(fn: Any, role: str) -> fx.GraphModule:
    """A GraphModule standing for one inlineable hook in the compile caches' key."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    call = graph.create_node("call_function", _STAND_INS[role], (x,), name=role)
    call.meta["is_wrapped"] = True
    digest, reasons = hook_utils.hook_cache_hash(fn)
    if digest is None:
        log.info(
            "saved tensors %s hook %s has no cache key valid across processes, so "
            "AOTAutogradCache will bypass this graph: %s. Give fx.wrap leaves a hash with "
            "torch_patches.hooks.cache_hash(...)",
            role,
            hook_utils.hook_name(fn),
            "; ".join(reasons),
        )
    else:
        call.meta["user_cache_hash"] = f"torch_patches:{digest}:{_compile_config_key()}"
    graph.output(call)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return fx.GraphModule(torch.nn.Module(), graph, class_name=f"saved_tensors_{role}_hook_{name}")


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
        self.install_subgraph(f"saved_tensors_hooks_{role}", hook_subgraph(fn, role))
        for role, fn in (("pack", pack), ("unpack", unpack))
    ]
    if names != ["saved_tensors_hooks_pack_0", "saved_tensors_hooks_unpack_0"]:
        raise AssertionError(f"saved tensors hooks installed as {names}")
    return names
