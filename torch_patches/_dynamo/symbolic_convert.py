"""Dynamo: the tensors an ambient saved-tensors hook reads become inputs of the frame's graph.

Upstream counterpart: ``InstructionTranslator.__init__`` in ``torch/_dynamo/symbolic_convert.py``
(the root translator of a frame).  After it is built, for the inlineable hooks active around
the compiled call, every tensor the hooks read (``torch_patches._functorch._aot_autograd.hook_inputs.find_inputs``: closure
cells, globals, defaults, attributes...) is added as a graph input, the way Dynamo adds a
global tensor the frame reads: its source calls a function installed in the frame's globals
that follows the tensor's path from the hooks active *at that call* and returns an alias of it
with a version counter of its own (``hook_inputs.current_input``).  Dynamo guards the
input's metadata (``TENSOR_MATCH``), never its values or identity: updating the tensor in
place, or rebinding the name to another tensor of the same metadata, recompiles nothing, and
each call passes the tensor the hook would read then.  An unused ``aten.detach`` of it keeps
the input in the graph (:func:`add_hook_input`, also used for in-region scopes by
``region_scopes``); the inliner (``graph_compile``) traces the hooks with the tensor as an
input, maps it to the forward's input and saves it for the backward.  Which inputs were
lifted travels to the inliner on the compilation's facts (``CompileFacts.hook_inputs``);
what cannot be lifted is said once per hook and reason (:func:`warn_not_lifted`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torch_patches._errors import SavedTensorsHookWarning
from torch_patches._functorch._aot_autograd import compile_facts, hook_identity as hook_keys, hook_inputs, hook_walk, utils as hook_utils


def add_hook_input(tx: Any, source: Any, value: torch.Tensor) -> Any:
    """Make ``value``, read at ``source``, an input of ``tx``'s frame graph; its Dynamo
    placeholder, or None where Dynamo made it something else (a constant attribute)."""
    from torch._dynamo.variables.builder import VariableBuilder

    variable = VariableBuilder(tx, source)(value)
    try:
        proxy = variable.as_proxy()
    except NotImplementedError:
        return None
    if not isinstance(proxy, torch.fx.Proxy) or proxy.node.op != "placeholder":
        return None
    # A use keeps the input (Dynamo prunes unused ones); AOTAutograd drops the op and keeps
    # the input.  An aten op, so the compile caches accept the graph.
    keep = tx.output.create_proxy("call_function", torch.ops.aten.detach.default, (proxy,), {})
    keep.node.meta["example_value"] = proxy.node.meta["example_value"].detach()
    return proxy.node


_warned: set[Any] = set()


def warn_not_lifted(fn: Any, reasons: list[str]) -> None:
    """Say once per hook and reason why a tensor it reads stays a constant of the graphs."""
    if not reasons:
        return
    digest = hook_keys.hook_identity(fn).digest
    for reason in reasons:
        if (digest, reason) in _warned:
            continue
        _warned.add((digest, reason))
        warnings.warn(
            f"torch_patches: saved tensors hook {hook_utils.hook_name(fn)}: {reason}; its "
            "values are part of the compiled graph's key, so changing them recompiles",
            SavedTensorsHookWarning,
            stacklevel=2,
        )


def lift_inputs(
    tx: Any, hooks: list[tuple[str, Any]], read_at: Callable[[Any, Any], tuple[Any, torch.Tensor]]
) -> tuple[list[tuple[Any, Any]], list[Any]]:
    """Make the tensors ``hooks`` (role, hook) read graph inputs of ``tx``'s frame, one input
    per tensor, each read as ``read_at(hook, LiftedTensor)`` says (its source, and the value
    the source gives now): ``(LiftedTensor, Dynamo placeholder)`` for each path, and the
    tensors Dynamo did not make inputs. What cannot be lifted is warned about (it stays keyed
    by value)."""
    lifted: list[tuple[Any, Any]] = []
    constants: list[Any] = []
    node_of: dict[int, Any] = {}
    for role, fn in hooks:
        found, refused = hook_inputs.find_inputs(fn, role)
        for t in found:
            node = node_of.get(id(t.tensor))
            if node is None:
                node = add_hook_input(tx, *read_at(fn, t))
            if node is None:
                refused.append(f"{t.describe()}: Dynamo reads it as a constant of the graph")
                constants.append(t)
                continue
            node_of[id(t.tensor)] = node
            lifted.append((t, node))
        warn_not_lifted(fn, refused)
    return lifted, constants


#: The attribute of an installed fetch function naming what it fetches: (role, path).
_FETCHES = "__saved_tensors_hook_input__"


def install_fetch(output: Any, role: str, path: tuple[Any, ...]) -> tuple[str, Callable[[], Any]]:
    """Install in the frame's globals the function that fetches the tensor at ``path`` from
    the ``role`` hook active at each call (``hook_inputs.current_input``); its name, and it.

    The name is the role's and the path's, never a process-wide counter (Dynamo's
    ``install_global``): it is part of the input's source, which AOTAutogradCache's key holds
    (``aot_autograd_arg_pos_to_source``), so a counter made the key of the same graph depend
    on what the process compiled before it.  Compiled codes of one module reading a tensor
    at the same path share the one global (the function depends on the role and the path
    only); each holds it, and the last one freed removes it, as Dynamo's own cleanup does."""
    name = f"__saved_tensors_hook_input_{role}_{hook_walk.digest(path)}"
    scope = output.global_scope
    fetch = scope.get(name)
    if getattr(fetch, _FETCHES, None) != (role, path):
        # Run by the guards and the compiled frame at each call: never traced itself.
        fetch = torch._dynamo.disable(
            functools.partial(hook_inputs.current_input, role, path, hook_utils.ambient_saved_tensors_hooks),
            reason="reads the tensor a saved-tensors hook reads now (torch_patches)",
        )
        if name in scope:  # someone else's global of that name: a name of Dynamo's making
            return output.install_global("__saved_tensors_hook_input", fetch), fetch
        setattr(fetch, _FETCHES, (role, path))
        fetch.holders = 0  # type: ignore[attr-defined]
        scope[name] = fetch
    if name not in output.installed_globals:
        output.installed_globals.add(name)
        fetch.holders += 1  # type: ignore[attr-defined]
        output.cleanups.append(functools.partial(_release_fetch, scope, name, fetch))
    return name, fetch


def _release_fetch(scope: dict[str, Any], name: str, fetch: Any) -> None:
    """A compiled code holding ``fetch`` was freed: the last one removes it."""
    fetch.holders -= 1
    if fetch.holders == 0 and scope.get(name) is fetch:
        del scope[name]


def lift_hook_inputs(tx: Any) -> None:
    """Add the tensors the ambient hooks read as graph inputs of ``tx``'s frame."""
    from torch._dynamo.source import CallFunctionNoArgsSource, GlobalSource

    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return
    hooks = hook_utils.ambient_saved_tensors_hooks()
    if not hook_utils.saved_tensors_hooks_are_inlineable(hooks) or hook_keys.unkeyable_reasons(hooks):
        return
    found = compile_facts.facts(tx.output.tracing_context)
    if found is None:
        return

    def read_at(fn: Any, t: Any) -> tuple[Any, torch.Tensor]:
        name, fetch = install_fetch(tx.output, t.role, t.path)
        return CallFunctionNoArgsSource(GlobalSource(name)), fetch()

    lifted, constants = lift_inputs(tx, [("pack", hooks[0]), ("unpack", hooks[1])], read_at)
    if constants:
        # The ambient keys take every tensor the hooks read as an input (lift=True).
        raise AssertionError(f"{constants[0].describe()}: Dynamo did not make it a graph input")
    found.hook_inputs.extend(("ambient", t, node) for t, node in lifted)


def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``InstructionTranslator.__init__``."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from torch._guards import tracing

        with tracing(self.output.tracing_context), self.set_current_tx():
            lift_hook_inputs(self)

    return __init__
