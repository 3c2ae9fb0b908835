"""torch_patches: saved-tensor hooks as first-class citizens of torch.compile.

    import torch_patches
    torch_patches.apply()

After :func:`apply`, activation-memory hooks (``torch.autograd.graph.saved_tensors_hooks``)
are inlined into the compiled forward and backward graphs where the saved tensors are
used, keyed by content in guards and compile caches, and checked so they never corrupt
gradients.  See README.md.

Importing this package changes nothing in torch; :func:`apply` patches (all or nothing),
:func:`unapply` restores every original object by identity.
"""

from torch_patches._errors import SavedTensorsHookConfigError, SavedTensorsHookError, SavedTensorsHookWarning
from torch_patches._registry import (
    SUPPORTED_TORCH,
    Patch,
    PatchError,
    PatchStatus,
    UnapplyError,
    applied_patches,
    apply,
    get_original,
    installed_effects,
    is_applied,
    status,
    unapply,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ``torch_patches.config`` and ``torch_patches.hooks`` after a plain ``import
    # torch_patches`` (importing them changes nothing in torch either).
    if name in ("config", "hooks"):
        import importlib

        return importlib.import_module(f"torch_patches.{name}")
    if name in ("report", "MemoryReport"):
        # torch_patches.report(step, budget=0.5): where one step's activation memory goes.
        from torch_patches import memory_report

        return getattr(memory_report, name)
    raise AttributeError(f"module 'torch_patches' has no attribute {name!r}")


__all__ = [
    "MemoryReport",
    "Patch",
    "PatchError",
    "PatchStatus",
    "SUPPORTED_TORCH",
    "SavedTensorsHookConfigError",
    "SavedTensorsHookError",
    "SavedTensorsHookWarning",
    "UnapplyError",
    "apply",
    "applied_patches",
    "get_original",
    "installed_effects",
    "is_applied",
    "report",
    "status",
    "unapply",
]
