"""Cache keys for opaque calls inside saved-tensor hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch_patches.hooks.markers import CACHE_HASH_ATTR

F = TypeVar("F", bound=Callable[..., Any])


def cache_hash(value: str) -> Callable[[F], F]:
    """Give an ``fx.wrap`` leaf function a ``user_cache_hash`` for the compile caches.

    A hook traced with ``torch.fx.symbolic_trace`` keeps ``fx.wrap``-ed functions as opaque
    calls. Without a hash, torch_patches keys such a leaf by its code (walked like the hook's
    own: defaults, closures, globals, attributes it names). A ``user_cache_hash`` replaces
    that walk with your promise: use it for a leaf whose behaviour depends on what the walk
    cannot see (a compiled extension, a file). Decorate the leaf with a value that changes
    whenever its behaviour does (a version string, a hash of its source and constants)::

        @torch_patches.hooks.cache_hash("quantize-v2")
        def quantize(x): ...

        torch.fx.wrap("quantize")

    Same value in a fresh process: a hit. A different value: a miss. (``node.meta
    ["user_cache_hash"]`` set on the traced node directly works too and takes precedence.)
    """
    if not isinstance(value, str) or not value:
        raise TypeError(f"cache_hash needs a non-empty string, got {value!r}")

    def mark(fn: F) -> F:
        setattr(fn, CACHE_HASH_ATTR, value)
        return fn

    return mark
