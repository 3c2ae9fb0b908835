"""``saved_tensors_hooks`` entered inside a compiled region.

Upstream counterpart: ``torch/_dynamo/variables/ctx_manager.py``.  Stock Dynamo treats
``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` as a user class whose
``__init__`` is skipped: a graph break (an error under ``fullgraph=True``).  With the
patch, entering it with inlineable hooks (``fx.GraphModule`` or functions marked
``torch_patches.hooks.inlineable``) records a *scope* instead:

* every FX node created inside the ``with`` block carries the scope's key in
  ``node.meta["custom"]`` (through ``torch.fx.traceback.annotate``, exactly like
  Dynamo's ``FxTracebackAnnotateVariable``); AOTAutograd copies it onto the forward
  nodes and onto the backward nodes derived from them, nested scopes overwrite the key
  (inner wins);
* AOTAutograd's inliner (``saved_tensor_selection.hooks_for_saved``) gives each saved tensor the
  hooks of the scope of the backward op that reads it first -- the forward op that saved
  it, eager's rule (see :func:`scope_of`);
* the hooks are guarded on their content at their source (a hook recreated every step
  does not recompile), and a stand-in subgraph carrying the scope's content digest in its
  code is installed on the graph so AOTAutogradCache keys on it (both in
  ``torch_patches/_dynamo/region_scopes.py``).

Hooks are trial-traced when the scope is entered: a hook that cannot be inlined is an
error naming the hook and the reason under ``fullgraph=True``; otherwise the ``with``
block graph-breaks and runs as eager code with eager hooks (one warning).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.variables.base import VariableTracker
from torch._dynamo.variables.ctx_manager import ContextWrappingVariable

from torch_patches._dynamo import region_scopes
from torch_patches._functorch._aot_autograd import compile_facts, graph_compile, hook_tracing, utils as hook_utils
from torch_patches._functorch._aot_autograd.hook_scopes import SCOPE_KEY
from torch_patches.hooks.markers import is_inlineable_hook

log = logging.getLogger(__name__)

_GB_TYPE = "torch_patches: untraceable saved tensors hook"


# ------------------------------------------------------------------ hook resolution


def _region_devices(tx: Any, lifted: list[tuple[Any, Any]]) -> list[torch.device]:
    """Where the scope's activations can live, in order (the trial trace's stand-ins go
    there): the devices of the tensors its hooks read (``lifted``), then of the region's
    tensor inputs so far."""
    vals = [t.tensor for t, _ in lifted] + [n.meta.get("example_value") for n in tx.output.graph.find_nodes(op="placeholder")]
    return list(dict.fromkeys(v.device for v in vals if isinstance(v, torch.Tensor)))


def _source_name(source: Any) -> str:
    name = getattr(source, "name", None)
    return str(name() if callable(name) else name)


def _python_value(tx: Any, vt: VariableTracker) -> tuple[Any, Any, bool]:
    """(hook object, its source or None, whether its guards are ours to install)."""
    from torch._dynamo.variables.lazy import LazyVariableTracker

    if isinstance(vt, LazyVariableTracker) and not vt.is_realized() and vt.source is not None:
        # Not realized: Dynamo installed no identity guard on it; we guard on content.
        return vt.peek_value(), vt.source, True
    vt = vt.realize() if isinstance(vt, LazyVariableTracker) else vt
    for get in (
        lambda: vt.get_function(),  # UserFunctionVariable
        lambda: tx.output.get_submodule(vt.module_key),  # NNModuleVariable
        lambda: vt.value,  # UnspecializedNNModuleVariable, UserDefinedObjectVariable
        lambda: vt.as_python_constant(),
    ):
        try:
            value = get()
        except Exception:  # noqa: BLE001 - try the next way of reading it
            continue
        if value is not None:
            return value, vt.source, False
    return None, vt.source, False


# ----------------------------------------------------------------------- the scope


class SavedTensorsHooksVariable(ContextWrappingVariable):
    """``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` inside a compiled region."""

    _nonvar_fields = {"pair", "scope_key", "_first_node", *ContextWrappingVariable._nonvar_fields}

    def __init__(self, pair: Any, scope_key: str, **kwargs: Any) -> None:
        super().__init__(target_values=(), initial_values=None, **kwargs)
        self.pair = pair
        self.scope_key = scope_key
        self._first_node: fx.Node | None = None

    @staticmethod
    def create(tx: Any, args: list[VariableTracker], kwargs: dict[str, VariableTracker]) -> VariableTracker:
        from torch._dynamo.exc import unimplemented

        try:
            bound = inspect.signature(torch.autograd.graph.saved_tensors_hooks.__init__).bind(None, *args, **kwargs)
        except TypeError as e:
            unimplemented(
                gb_type="torch_patches: bad saved_tensors_hooks arguments",
                context=str(e),
                explanation=f"torch.autograd.graph.saved_tensors_hooks(...): {e}",
                hints=[],
            )
        hooks = []
        for role in ("pack", "unpack"):
            value, source, guard_here = _python_value(tx, bound.arguments[f"{role}_hook"])
            if not is_inlineable_hook(value):
                what = (
                    "a function defined inside the compiled region"
                    if value is None
                    else f"{hook_utils.hook_name(value)}, which is neither an fx.GraphModule nor marked with torch_patches.hooks.inlineable"
                )
                unimplemented(
                    gb_type="torch_patches: saved_tensors_hooks with non-inlineable hooks",
                    context=f"{role} hook: {what}",
                    explanation=(
                        "saved_tensors_hooks entered inside a compiled region must have "
                        f"inlineable hooks; the {role} hook is {what}. Mark pure, traceable "
                        "hooks with torch_patches.hooks.inlineable(pack, unpack) (defined "
                        "outside the compiled function), or enter the hooks outside it."
                    ),
                    hints=[],
                )
            if source is None:
                unimplemented(
                    gb_type="torch_patches: saved_tensors_hooks with hooks Dynamo cannot guard",
                    context=f"{role} hook: {hook_utils.hook_name(value)}",
                    explanation=(
                        f"the {role} hook {hook_utils.hook_name(value)} was not read from a "
                        "variable, attribute or argument Dynamo can guard, so a change to it "
                        "could not be detected. Pass the hooks in, or read them from a global."
                    ),
                    hints=[],
                )
            hooks.append((value, source, guard_here))
        (pack, pack_src, pack_guard), (unpack, unpack_src, unpack_guard) = hooks

        pair = hook_tracing.HookPair(pack, unpack, "scope")
        # The tensors the hooks read become graph inputs (guarded on metadata); the hooks are
        # guarded on the rest of their content.
        lifted = region_scopes.lift_scope_inputs(tx, [(role, fn, source) for role, (fn, source, _) in zip(("pack", "unpack"), hooks)])
        error = hook_tracing.trial_trace(pair, _region_devices(tx, lifted))
        if error is not None:
            if not hook_tracing.dynamo_fullgraph():
                graph_compile.warn_untraceable_once(
                    error,
                    "The saved_tensors_hooks block runs as eager code with eager hooks (a graph break)",
                )
            unimplemented(
                gb_type=_GB_TYPE,
                context=str(error),
                explanation=f"{error}",
                hints=["Make the hook pure and traceable (no .item(), I/O, data-dependent control flow)."],
                from_exc=error,
            )
        for role, (fn, source, _) in zip(("pack", "unpack"), hooks):
            region_scopes.guard_hook_content(source, fn, region_scopes.lifted_paths(lifted, role))

        key = region_scopes.register_hooks_scope(tx, pair, lifted)
        return SavedTensorsHooksVariable(compile_facts.facts(tx.output.tracing_context).scopes[key], key)

    def enter(self, tx: Any, *args: VariableTracker) -> VariableTracker:
        from torch._dynamo import variables
        from torch._dynamo.exc import unimplemented

        message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
        if message is not None:
            # Eager raises this when hooks are registered under disable_saved_tensors_hooks.
            unimplemented(
                gb_type="torch_patches: saved_tensors_hooks under disable_saved_tensors_hooks",
                context=message,
                explanation=f"saved_tensors_hooks entered while saved tensors hooks are disabled: {message}",
                hints=[],
            )
        stack = contextlib.ExitStack()
        stack.enter_context(torch.fx.traceback.annotate({SCOPE_KEY: self.scope_key}))
        stack.enter_context(torch.fx.traceback.preserve_node_meta())
        self._first_node = tx.output.graph._root.prev  # the last node before the scope
        self.set_cleanup_hook(tx, stack.close)
        return variables.ConstantVariable.create(None)

    def exit(self, tx: Any, *args: VariableTracker) -> VariableTracker:
        from torch._dynamo.exc import unimplemented

        disabled = _disable_inside(tx, self._first_node)
        result = super().exit(tx, *args)
        if disabled is not None:
            # Eager raises when disable_saved_tensors_hooks is entered under active hooks.
            unimplemented(
                gb_type="torch_patches: disable_saved_tensors_hooks inside saved_tensors_hooks",
                context=str(disabled),
                explanation=(f"disable_saved_tensors_hooks entered inside a saved_tensors_hooks scope (eager raises: {disabled})"),
                hints=[],
            )
        return result

    def supports_graph_breaks(self) -> bool:
        # The scope cannot be rebuilt in a resume function: a graph break inside it runs
        # the whole frame eagerly (with eager hooks), an error under fullgraph=True.
        return False

    def module_name(self) -> str:
        return "torch.autograd.graph"

    def fn_name(self) -> str:
        return "saved_tensors_hooks"

    def python_type(self) -> type:
        return torch.autograd.graph.saved_tensors_hooks

    def reconstruct_type(self, codegen: Any) -> None:
        from torch._dynamo.exc import unimplemented

        unimplemented(
            gb_type="torch_patches: saved_tensors_hooks escaped the compiled region",
            context=str(self),
            explanation="an in-graph saved_tensors_hooks scope cannot be returned or graph-broken out of",
            hints=[],
        )


def _disable_inside(tx: Any, first: fx.Node | None) -> Any:
    """The message of a disable_saved_tensors_hooks traced since ``first``, if any."""
    disable = torch._C._autograd._saved_tensors_hooks_disable
    root = tx.output.graph._root
    node = first.next if first is not None else root.next
    while node is not root:
        if node.target is disable:
            return node.args[0] if node.args else ""
        node = node.next
    return None
