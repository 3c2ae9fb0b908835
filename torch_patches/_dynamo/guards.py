"""Guard compiled frames on what the saved-tensors hooks around them compute.

Upstream counterpart: ``GuardBuilder.AUTOGRAD_SAVED_TENSORS_HOOKS`` in
``torch/_dynamo/guards.py``, which compares the hooks' ``id()``: a training loop that
recreates an identical hook every step recompiles every step, a hook object freed and
recreated at the same address with another setting passes, and entering Python hooks
around a graph compiled without them recompiles although the graph is the same.

We compare ``hooks_guard_state``'s key: None for no hooks and for hooks that run as Python
hooks (the graph does not depend on them), or ("inline", pack key, unpack key, config) for
hooks baked into the graphs, where each key holds every dependency of the hook
(``torch_patches._functorch._aot_autograd.hook_identity``: code, closures, globals, attributes of modules and
objects, captured tensors, recursively). The guard holds the objects keyed by identity
(large captured tensors) so their ids cannot be reused while it lives.
"""

from __future__ import annotations

from typing import Any

from torch_patches._functorch._aot_autograd import hook_identity as hook_keys, utils as hook_utils


def _current_state() -> tuple[Any, tuple[Any, ...]]:
    return hook_keys.hooks_guard_state(hook_utils.ambient_saved_tensors_hooks())


def _guard_code(expected: Any) -> list[str]:
    return [f"torch_patches saved_tensors_hooks key == {hook_keys.describe_guard_key(expected)}"]


def AUTOGRAD_SAVED_TENSORS_HOOKS(self: Any, guard: Any) -> None:
    from torch._dynamo.guards import get_verbose_code_parts

    expected, pins = _current_state()
    code = _guard_code(expected)
    self._set_guard_export_info(guard, code)

    check = _guard_check(expected)
    check.pins = pins  # type: ignore[attr-defined]  # alive as long as the guard
    self.guard_manager.root.add_lambda_guard(check, get_verbose_code_parts(code, guard), guard.user_stack)


# ===================================================================== per compiled call
# What runs at every call of a compiled graph (ARCHITECTURE.md, "What runs per compiled
# call"): lookups against what compiling recorded, never a walk, an input search or a trace
# (test_hook_guards.TestPerCallPath counts them).


def current_key() -> Any:
    """What the guard compares at every compiled call: a lookup per hook (``hook_identity``
    walks a hook object once, then re-checks what it read), not a walk."""
    return hook_keys.hooks_guard_key(hook_utils.ambient_saved_tensors_hooks())


def _guard_check(expected: Any) -> Any:
    """The guard's lambda: the ambient hooks' key now against the one compiled for."""

    def check(_: object) -> bool:
        return current_key() == expected

    return check
