"""Guard compiled frames on the *content* of the saved-tensors hooks around them.

Upstream counterpart: ``GuardBuilder.AUTOGRAD_SAVED_TENSORS_HOOKS`` in
``torch/_dynamo/guards.py``, which compares the hooks' ``id()``: a training loop that
recreates an identical hook every step recompiles every step, and non-inlineable hooks
are indistinguishable from no hooks at all.  We compare
``hooks_guard_key``: None (no hooks), ("eager",) (Python hooks: their identity does
not matter to the graph, only that they run), or ("inline", pack digest, unpack
digest) for hooks baked into the graphs.
"""

from __future__ import annotations

from typing import Any

from torch_patches._functorch._aot_autograd import utils as hook_utils


def _current_key() -> Any:
    return hook_utils.hooks_guard_key(hook_utils.top_saved_tensors_hooks())


def AUTOGRAD_SAVED_TENSORS_HOOKS(self: Any, guard: Any) -> None:
    from torch._dynamo.guards import get_verbose_code_parts

    expected = _current_key()
    code = [f"torch_patches saved_tensors_hooks content key == {expected!r}"]
    self._set_guard_export_info(guard, code)

    def check(_: object) -> bool:
        return _current_key() == expected

    self.guard_manager.root.add_lambda_guard(
        check, get_verbose_code_parts(code, guard), guard.user_stack
    )
