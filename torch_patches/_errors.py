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
