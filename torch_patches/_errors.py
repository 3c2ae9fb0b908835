"""Errors torch_patches raises to users."""

from __future__ import annotations


class SavedTensorsHookError(RuntimeError):
    """A saved-tensors hook cannot be used as written.

    Raised when an inlineable hook cannot be traced into the compiled graphs (under
    ``fullgraph=True``, or with ``config.untraceable_hook = "error"``), or when an unpack
    hook returns a tensor that does not match the saved tensor it stands for.  The
    message names the hook, the saved tensor and the reason.
    """

    def __init__(self, message: str, *, hook: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.hook = hook
        self.reason = reason


class SavedTensorsHookWarning(UserWarning):
    """A saved-tensors hook works, but not as well as it could: it runs as an eager hook
    instead of being inlined, a tensor it reads is a constant of the graph, an activation
    memory budget cannot be met, a budget is entered around eager code.  The message names
    the hook (or scope) and the reason; ``warnings.filterwarnings("error",
    category=SavedTensorsHookWarning)`` makes them errors."""


class SavedTensorsHookConfigError(ValueError):
    """A config knob the inliner reads holds a value it does not accept
    (``torch_patches.config.hook_placement``, ``hooked_saved_tensor_dtypes``,
    ``activation_budget_bounds``, upstream's ``saved_tensors_hooks_filtering_mode``).

    A user's error, raised while compiling like :class:`SavedTensorsHookError`: the
    inliner's fallback from its own internal errors never swallows it."""
