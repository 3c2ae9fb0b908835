"""Guards, compile-cache keys and runtime inputs of ``saved_tensors_hooks`` scopes entered in
a compiled region.

Used by the Dynamo variable of such a scope (``variables/ctx_manager.py``) when the scope is
entered: the tensors each hook reads (``hook_inputs.find_inputs``) become graph inputs at
sources built from the hook's own source (``L['hooks'][0].__closure__[0].cell_contents.scale``),
so Dynamo guards their metadata and each call reads them as they are; each hook is guarded on its
content at its source (``hook_identity``, with those tensors keyed by metadata: a hook
recreated every step does not recompile, a changed dependency does), and the scope's hook pair
is registered for the inliner (on the compilation's facts) with a stand-in subgraph carrying
the pair's content digest, so AOTAutogradCache keys on it.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
import torch.fx as fx

from torch_patches._dynamo import output_graph, symbolic_convert
from torch_patches._functorch._aot_autograd import compile_facts, hook_identity as hook_keys, hook_inputs, hook_tracing, hook_walk


def _source_name(source: Any) -> str:
    name = getattr(source, "name", None)
    return str(name() if callable(name) else name)


def _source_at(base: Any, fn: Any, path: tuple[Any, ...]) -> Any:
    """The Dynamo source of what ``path`` leads to from ``fn``, which is read at ``base``
    (the accesses ``hook_inputs.resolve`` makes, as sources)."""
    from torch._dynamo.source import AttrSource, GetItemSource

    source, v = base, fn
    for step in path:
        for how, key in step.accesses(v):
            source = AttrSource(source, key) if how == "attr" else GetItemSource(source, key)
        v = hook_inputs.resolve(v, (step,))
    return source


def lift_scope_inputs(tx: Any, hooks: list[tuple[str, Any, Any]]) -> list[tuple[Any, Any]]:
    """Make the tensors a scope's hooks read (``hooks``: role, hook, the hook's source) inputs
    of the frame's graph, read at sources built from the hook's: ``(LiftedTensor, Dynamo
    placeholder)`` for each path. Those Dynamo reads as constants stay keyed by value."""
    sources = {id(fn): source for _, fn, source in hooks}
    lifted, _ = symbolic_convert.lift_inputs(
        tx, [(role, fn) for role, fn, _ in hooks], lambda fn, t: (_source_at(sources[id(fn)], fn, t.path), t.tensor)
    )
    return lifted


def guard_hook_content(source: Any, fn: Any, lift: Any = False) -> None:
    """Guard ``source`` (a hook entered in a compiled region) on every dependency of the hook
    (``hook_identity``), not its id.

    Installed whether or not Dynamo also guards the source: Dynamo's own guard on a
    function is its identity, which does not see a module attribute or a captured object
    the hook reads change.  The guard also holds the torch_patches config it was compiled
    under, as the ambient hooks' guard does.
    """
    from torch._dynamo.guards import get_verbose_code_parts, install_guard
    from torch._guards import Guard

    digest, check = hook_keys.hook_content_check(fn, lift)

    def SAVED_TENSORS_HOOK_CONTENT(builder: Any, guard: Any) -> None:  # noqa: N802
        code = [f"torch_patches saved tensors hook key of {_source_name(source)} == {digest!r} and torch_patches.config unchanged"]
        builder.get_guard_manager(guard).add_lambda_guard(check, get_verbose_code_parts(code, guard), guard.user_stack)

    install_guard(Guard(source, SAVED_TENSORS_HOOK_CONTENT))


def _scope_stand_in(key: str) -> None:
    """Stands for an in-graph hooks scope in the compile caches' key; never run."""
    raise RuntimeError("saved tensors hooks scope subgraphs are cache keys, never run")


def lifted_paths(lifted: list[tuple[Any, Any]], role: str) -> frozenset[Any]:
    """The paths from the ``role`` hook of the tensors in ``lifted``."""
    return frozenset(t.path for t, _ in lifted if t.role == role)


def register_hooks_scope(tx: Any, pair: Any, lifted: list[tuple[Any, Any]]) -> str:
    """Register the hooks of a scope entered in the compiled region for the inliner (on the
    compilation's facts), with the graph inputs ``lifted`` for the tensors they read, and
    install its cache-key stand-in subgraph on the graph; returns the scope key (the pair's
    content digest and the inputs' sources, or a process-local key)."""
    lift = (lifted_paths(lifted, "pack"), lifted_paths(lifted, "unpack"))
    digest, reasons = hook_keys.hooks_cache_key(pair.pack, pair.unpack, lift)
    if digest is None:
        # No key valid across processes: a key that can never hit, and no cache entry.
        key = f"local-{uuid.uuid4().hex}"
        compile_facts.mark_not_cacheable(f"saved tensors hooks scope {pair.names}: " + "; ".join(reasons))
    else:
        # Two scopes whose hooks read different tensors of the same metadata have one
        # content digest: which inputs they read tells them apart.
        key = "scope-" + hook_walk.digest((digest, tuple(node.name for _, node in lifted)))
    output = tx.output
    found = compile_facts.facts(output.tracing_context)
    installed = found.scopes  # for the inliner
    if key not in installed:
        graph = fx.Graph()
        graph.output(graph.call_function(_scope_stand_in, (key,)))
        name = output.install_subgraph(
            "saved_tensors_hooks_scope",
            fx.GraphModule(torch.nn.Module(), graph, class_name="saved_tensors_hooks_scope"),
        )
        names = output.saved_tensors_hooks_subgraph_names
        if names is None:
            output.saved_tensors_hooks_subgraph_names = names = []
        names.append(name)
        installed[key] = hook_tracing.HookPair(pair.pack, pair.unpack, name)
        output_graph.key_input_leafness_of(output)
        found.hook_inputs.extend((name, t, node) for t, node in lifted)
    return key
