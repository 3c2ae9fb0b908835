"""``inlineable(pack, unpack)``: the marker of traceable plain-function hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch_patches.hooks.markers import is_inlineable_hook, mark_inlineable

F = TypeVar("F", bound=Callable[..., Any])


def inlineable(pack: F, unpack: Callable[..., Any]) -> tuple[F, Callable[..., Any]]:
    """Mark ``(pack, unpack)`` as traceable saved-tensor hooks; returns the pair."""
    return mark_inlineable(pack), mark_inlineable(unpack)


def is_inlineable(fn: Any) -> bool:
    """True for fx.GraphModules and functions marked with :func:`inlineable`."""
    return is_inlineable_hook(fn)
