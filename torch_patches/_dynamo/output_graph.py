"""Install the hooks active around a compiled call as subgraphs of the Dynamo graph.

Upstream counterpart: ``OutputGraph.maybe_install_saved_tensors_hooks_subgraphs`` in
``torch/_dynamo/output_graph.py``.  The subgraphs (``saved_tensors_hooks_pack_0`` /
``saved_tensors_hooks_unpack_0``) are not called by the graph: they tell the compile caches
which hooks the graph was compiled for.  Upstream installs a GraphModule hook itself, so
AOTAutogradCache bypasses the most common hooks (``symbolic_trace`` records tensor methods
as ``call_method`` on placeholders without example values) and cannot see plain-function
hooks at all.  We install, for every inlineable hook (GraphModule or function marked
``torch_patches.hooks.inlineable``), one opaque leaf call carrying the pair's identity
digest as ``user_cache_hash`` (``hooks_cache_key``: every dependency of both hooks, walked
by ``torch_patches._functorch._aot_autograd.hook_identity``, and the whole torch_patches config): the same hooks hit
in a fresh process, any changed dependency misses.  Where part of the key is process-local
(a large captured tensor, keyed by identity), no ``user_cache_hash`` is set, so
AOTAutogradCache bypasses (lookup and save), and we log why; hooks that cannot be keyed at
all are not installed (the inliner reports them and they run as eager hooks).
Hooks that stay eager say why, once per compilation, in the debug log.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import compile_facts, hook_identity as hook_keys, loss_head, utils as hook_utils
from torch_patches.hooks.markers import decode

log = logging.getLogger(__name__)


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


def _forget_stand_ins_as_fx_leaves() -> None:
    """Drop the leaf-function registrations our stand-ins' GraphModules made.

    A call marked ``is_wrapped`` (which AOTAutogradCache needs to read its
    ``user_cache_hash``) makes FX's codegen call ``torch.fx.wrap`` in the module it
    generates: every GraphModule holding a stand-in, and every copy of one, registers the
    stand-in under that module's globals, held for the life of the process
    (``torch.fx._symbolic_trace._wrapped_fns_to_patch``), and every later trace (make_fx,
    symbolic_trace: AOTAutograd's and the inliner's) patches and restores each entry. A
    process compiling a hooked step a thousand times made every trace walk two thousand
    entries (and kept two thousand dicts alive). The stand-ins are never traced through
    (no graph calls them), so the entries serve nothing: forgotten at each install.
    """
    from torch.fx import _symbolic_trace

    registry = getattr(_symbolic_trace, "_wrapped_fns_to_patch", None)
    if not isinstance(registry, dict):
        return
    stand_ins = set(map(id, _STAND_INS.values()))
    for key, module_globals in list(registry.items()):
        if isinstance(key, tuple) and len(key) == 2 and id(module_globals.get(key[1])) in stand_ins:
            del registry[key]


def hook_subgraph(fn: Any, role: str, cache_key: tuple[str | None, list[str]]) -> fx.GraphModule:
    """A GraphModule standing for one inlineable hook in the compile caches' key.

    ``cache_key`` is ``hooks_cache_key(pack, unpack)`` of the pair: both hooks and the whole
    torch_patches config (the same function keys in-region scopes).
    """
    graph = fx.Graph()
    x = graph.placeholder("x")
    call = graph.create_node("call_function", _STAND_INS[role], (x,), name=role)
    call.meta["is_wrapped"] = True
    digest, reasons = cache_key
    if digest is None:
        log.info(
            "saved tensors hooks %s have no cache key valid across processes, so AOTAutogradCache will bypass this graph: %s",
            hook_utils.hook_name(fn),
            "; ".join(reasons),
        )
    else:
        call.meta["user_cache_hash"] = f"torch_patches:{role}:{digest}"
    graph.output(call)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    gm = fx.GraphModule(torch.nn.Module(), graph, class_name=f"saved_tensors_{role}_hook_{name}")
    _forget_stand_ins_as_fx_leaves()
    return gm


#: The stand-in subgraph carrying which graph inputs autograd produced (:func:`key_input_leafness`).
INPUT_LEAVES_SUBGRAPH = "saved_tensors_hooks_input_leaves"


def _input_leaves_stand_in(leaves: str) -> None:
    """Stands for the leafness of the graph's inputs in the compile caches' key; never run."""
    raise RuntimeError("saved tensors hooks subgraphs are cache keys, never run")


def key_input_leafness(gm: fx.GraphModule) -> None:
    """A graph finalizer of frames whose hooks are inlined: guard, and key, whether each
    input that requires grad is a leaf.

    The inliner reads it (``ViewAndMutationMeta.input_info``, from the example input): an
    input autograd produced is an activation its hooks may pack (``activation_inputs``), and
    a graph with one is one of several in its step, where a budget bounds the forward's end
    (``activation_budget.GraphFacts.bounds``); a leaf is kept by the caller (a recomputation
    may read it).  Dynamo guards ``requires_grad`` but not leafness, and AOTAutogradCache's
    key holds neither: here each such input's ``is_leaf`` is guarded at its source (one
    attribute compared per call), and the leafness of all of them is the code of a stand-in
    subgraph of ``gm`` (:data:`INPUT_LEAVES_SUBGRAPH`), which the cache's key holds as it
    holds the hooks' stand-ins.  Parameters are leaves by construction: not guarded."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource

    leaves = []
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        value = node.meta.get("example_value")
        arg = node.meta.get("grapharg")
        if (
            not isinstance(value, torch.Tensor)
            or not value.requires_grad
            or isinstance(value, torch.nn.Parameter)
            or getattr(arg, "source", None) is None
        ):
            continue
        install_guard(AttrSource(arg.source, "is_leaf").make_guard(GuardBuilder.EQUALS_MATCH))
        leaves.append((i, value.is_leaf))
    graph = fx.Graph()
    graph.output(graph.call_function(_input_leaves_stand_in, (repr(leaves),)))
    setattr(gm, INPUT_LEAVES_SUBGRAPH, fx.GraphModule(torch.nn.Module(), graph, class_name=INPUT_LEAVES_SUBGRAPH))


def key_input_leafness_of(output: Any) -> None:
    """Register :func:`key_input_leafness` for the graphs ``output`` compiles (once)."""
    if key_input_leafness not in output.register_finalizer_fns:
        output.add_graph_finalizer(key_input_leafness)


def chunk_loss_heads(gm: fx.GraphModule) -> None:
    """A graph finalizer of frames compiled under an ambient budget pair: its loss heads
    computed in chunks (``loss_head.rewrite_loss_heads``), before AOTAutograd traces the
    graph and the caches key it.  Not where scopes entered inside the region plan parts of
    the graph."""
    spec = decode(hook_utils.ambient_saved_tensors_hooks()).budget
    found = compile_facts.facts()
    if spec is None or (found is not None and found.scopes):
        return
    loss_head.rewrite_loss_heads(gm, spec.memory)


def maybe_install_saved_tensors_hooks_subgraphs(self: Any) -> list[str] | None:
    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return None
    hooks = hook_utils.ambient_saved_tensors_hooks()
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
    unkeyable = hook_keys.unkeyable_reasons(hooks)
    if unkeyable:
        # The inliner reports these (a warning, or an error under fullgraph) and the graph
        # keeps eager hook semantics: nothing for the caches to key.
        log.debug("saved tensors hooks %s cannot be keyed: %s", hook_utils.hook_name(pack), "; ".join(unkeyable))
        return None
    cache_key = hook_keys.hooks_cache_key(pack, unpack, lift=True)
    names = [
        self.install_subgraph(f"saved_tensors_hooks_{role}", hook_subgraph(fn, role, cache_key))
        for role, fn in (("pack", pack), ("unpack", unpack))
    ]
    if names != ["saved_tensors_hooks_pack_0", "saved_tensors_hooks_unpack_0"]:
        raise AssertionError(f"saved tensors hooks installed as {names}")
    key_input_leafness_of(self)
    if decode(hooks).budget is not None and chunk_loss_heads not in self.register_finalizer_fns:
        self.add_graph_finalizer(chunk_loss_heads)
    return names
