"""Dynamo: the tensors an ambient saved-tensors hook reads become inputs of the frame's graph.

Upstream counterpart: ``InstructionTranslator.__init__`` in ``torch/_dynamo/symbolic_convert.py``
(the root translator of a frame).  After it is built, for the inlineable hooks active around
the compiled call, every tensor the hooks read (``torch_patches._hook_identity.find_inputs``: closure
cells, globals, defaults, attributes...) is added as a graph input, the way Dynamo adds a
global tensor the frame reads: its source calls a function installed in the frame's globals
that follows the tensor's path from the hooks active *at that call* and returns it detached
(``_hook_identity.current``).  Dynamo guards the input's metadata (``TENSOR_MATCH``), never its
values or identity: updating the tensor in place, or rebinding the name to another tensor of
the same metadata, recompiles nothing, and each call passes the tensor the hook would read
then.  An unused ``aten.detach`` of it keeps the input in the graph; the inliner
(``graph_compile``) maps the hook trace's constant for the tensor to the forward's input and
saves it for the backward.  Which inputs were lifted travels to the inliner on the
compilation's facts (``CompileFacts.hook_inputs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from torch_patches import _compile_facts, _hook_identity as hook_keys
from torch_patches._functorch._aot_autograd import utils as hook_utils


def lift_hook_inputs(tx: Any) -> None:
    """Add the tensors the ambient hooks read as graph inputs of ``tx``'s frame."""
    from torch._dynamo.source import CallFunctionNoArgsSource, GlobalSource
    from torch._dynamo.variables.builder import VariableBuilder

    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return
    hooks = hook_utils.ambient_saved_tensors_hooks()
    if not hook_utils.saved_tensors_hooks_are_inlineable(hooks) or hook_keys.unkeyable_reasons(hooks):
        return
    found = _compile_facts.facts(tx.output.tracing_context)
    if found is None:
        return
    lifted: dict[int, Any] = {}
    for role, fn in (("pack", hooks[0]), ("unpack", hooks[1])):
        for t in hook_keys.find_inputs(fn, role)[0]:
            if id(t.tensor) in lifted:
                continue
            # Run by the guards and the compiled frame at each call: never traced itself.
            fetch: Callable[[], Any] = torch._dynamo.disable(
                functools.partial(hook_keys.current_input, t.role, t.path, hook_utils.ambient_saved_tensors_hooks),
                reason="reads the tensor a saved-tensors hook reads now (torch_patches)",
            )
            name = tx.output.install_global("__torch_patches_hook_input", fetch)
            variable = VariableBuilder(tx, CallFunctionNoArgsSource(GlobalSource(name)))(fetch())
            proxy = variable.as_proxy()
            # A use keeps the input (Dynamo prunes unused ones); AOTAutograd drops the op
            # and keeps the input.  An aten op, so the compile caches accept the graph.
            keep = tx.output.create_proxy("call_function", torch.ops.aten.detach.default, (proxy,), {})
            keep.node.meta["example_value"] = proxy.node.meta["example_value"].detach()
            lifted[id(t.tensor)] = (t, proxy.node)
    found.hook_inputs = list(lifted.values())


def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``InstructionTranslator.__init__``."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from torch._guards import tracing

        with tracing(self.output.tracing_context), self.set_current_tx():
            lift_hook_inputs(self)

    return __init__
