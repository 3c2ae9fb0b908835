"""Guards and compile-cache keys of ``saved_tensors_hooks`` scopes entered in a compiled region.

Used by the Dynamo variable of such a scope (``variables/ctx_manager.py``) when the scope is
entered: each hook is guarded on its content at its source (``hook_identity``: a hook
recreated every step does not recompile, a changed dependency does), and the scope's hook
pair is registered for the inliner (on the compilation's facts) with a stand-in subgraph
carrying the pair's content digest, so AOTAutogradCache keys on it.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
import torch.fx as fx

from torch_patches import _compile_facts, _hook_identity as hook_keys
from torch_patches._functorch._aot_autograd import graph_compile, hook_tracing


def _source_name(source: Any) -> str:
    name = getattr(source, "name", None)
    return str(name() if callable(name) else name)


def guard_hook_content(source: Any, fn: Any) -> None:
    """Guard ``source`` (a hook entered in a compiled region) on every dependency of the hook
    (``hook_identity``), not its id.

    Installed whether or not Dynamo also guards the source: Dynamo's own guard on a
    function is its identity, which does not see a module attribute or a captured object
    the hook reads change.  The guard also holds the torch_patches config it was compiled
    under, as the ambient hooks' guard does.
    """
    from torch._dynamo.guards import get_verbose_code_parts, install_guard
    from torch._guards import Guard

    digest, check = hook_keys.hook_content_check(fn)

    def SAVED_TENSORS_HOOK_CONTENT(builder: Any, guard: Any) -> None:  # noqa: N802
        code = [
            f"torch_patches saved tensors hook key of {_source_name(source)} == {digest!r}"
            " and torch_patches.config unchanged"
        ]
        builder.get_guard_manager(guard).add_lambda_guard(
            check, get_verbose_code_parts(code, guard), guard.user_stack
        )

    install_guard(Guard(source, SAVED_TENSORS_HOOK_CONTENT))


def _scope_stand_in(key: str) -> None:
    """Stands for an in-graph hooks scope in the compile caches' key; never run."""
    raise RuntimeError("saved tensors hooks scope subgraphs are cache keys, never run")


def register_hooks_scope(tx: Any, pair: Any) -> str:
    """Register the hooks of a scope entered in the compiled region for the inliner (on the
    compilation's facts) and install its cache-key stand-in subgraph on the graph; returns
    the scope key (the pair's content digest, or a process-local key)."""
    digest, reasons = hook_keys.hooks_cache_key(pair.pack, pair.unpack)
    if digest is None:
        # No key valid across processes: a key that can never hit, and no cache entry.
        key = f"local-{uuid.uuid4().hex}"
        graph_compile.mark_not_cacheable(
            f"saved tensors hooks scope {pair.names}: " + "; ".join(reasons)
        )
    else:
        key = "scope-" + digest
    output = tx.output
    installed = _compile_facts.facts(output.tracing_context).scopes  # for the inliner
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
    return key
