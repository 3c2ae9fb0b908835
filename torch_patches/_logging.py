"""Logging through torch._logging.

* ``TORCH_LOGS="torch_patches"`` (in code, after :func:`torch_patches.apply`:
  ``torch._logging.set_logs(modules={"torch_patches": True})``) enables the
  ``torch_patches`` artifact: per saved tensor placements and the forward and backward
  graphs after inlining.  Artifact loggers live under the upstream module a patch stands
  in for, as upstream code would log.
* ``TORCH_LOGS="+torch_patches"`` adds torch_patches' debug lines: which hooks were
  inlined or kept eager and why, which saved tensors were left unhooked.

The artifact is registered by :func:`torch_patches.apply` (the registry effect
``logging.torch_patches_artifact``), never at import time.  Upstream it is registered with
the others in ``torch/_logging/_registrations.py`` (:func:`registration`, the effect's
upstream form), before ``TORCH_LOGS`` is read.
"""

from __future__ import annotations

import logging
import os

from torch._logging._internal import register_artifact

ARTIFACT = "torch_patches"
_DESCRIPTION = "torch_patches: saved-tensor hook inlining decisions, placements and the forward/backward graphs after inlining"


def register() -> None:
    """Register the ``torch_patches`` artifact with torch._logging (idempotent)."""
    from torch._logging import _internal

    if ARTIFACT in _internal.log_registry.artifact_names:
        return
    register_artifact(ARTIFACT, _DESCRIPTION, off_by_default=True)
    # TORCH_LOGS is parsed when torch is imported, before this artifact existed.
    names = {name.strip().lstrip("+-") for name in os.environ.get("TORCH_LOGS", "").split(",") if name.strip()}
    if ARTIFACT in names:
        _internal.log_state.enable_artifact(ARTIFACT)


def registration() -> None:
    """Register the ``torch_patches`` log artifact with the others.

    ``TORCH_LOGS="torch_patches"`` then logs, per compiled graph, every saved tensor's record (its storage, the hooks that
    pack it and where they run) and the forward and backward graphs after the hooks are
    inlined.
    """
    # The registry effect logging.torch_patches_artifact (install_artifact) does this when
    # the patch set is applied; upstream it is a statement of torch/_logging/_registrations.py.
    register_artifact(
        ARTIFACT,
        _DESCRIPTION,
        off_by_default=True,
    )


def artifact_logger(module_qname: str) -> logging.Logger:
    """The ``torch_patches`` artifact logger for an (upstream) module name."""
    import torch._logging

    # upstream: not exported
    register()
    return torch._logging.getArtifactLogger(module_qname, ARTIFACT)


def install_artifact() -> None:
    """Registry effect ``logging.torch_patches_artifact``: :func:`register`. Cannot be undone
    (torch._logging has no unregister); once unapplied nothing logs to it."""
    register()
