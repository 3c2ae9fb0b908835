"""Packed forms that are tensor subclasses: flattened in the forward, rebuilt in the backward.

A pack hook may return a traceable wrapper subclass (``__tensor_flatten__`` /
``__tensor_unflatten__``, e.g. data and scale in one tensor class).  A compiled graph
cannot carry the wrapper between forward and backward, only plain tensors and symbols, so
the inliner traces pack followed by the subclass's own ``__tensor_flatten__`` (inner
tensors, recursively, then the outer sizes and strides) and unpack preceded by
``__tensor_unflatten__`` on those leaves.  Between the two graphs only the inner tensors
travel; the wrapper exists only inside the traced hooks, as it would inside AOTAutograd's
own subclass handling.  The subclass type and its flatten context are Python values of
the hook's behaviour: keyed with the hook, baked into the traced unpack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@dataclasses.dataclass(frozen=True)
class _Rebuild:
    cls: type[Any]  # a traceable wrapper subclass
    ctx: Any
    attrs: tuple[str, ...]
    inner: tuple[_Rebuild | None, ...]  # per attribute: a nested subclass, or None
    ndim: int


@dataclasses.dataclass(frozen=True)
class SubclassLayout:
    """How pack's output was flattened: its tree spec and, per leaf, how to rebuild it."""

    spec: pytree.TreeSpec
    leaves: tuple[_Rebuild | None, ...]

    def describe(self) -> str:
        names = sorted({r.cls.__qualname__ for r in self.leaves if r is not None})
        return ", ".join(names)


def _flatten_one(t: Any, out: list[Any]) -> _Rebuild:
    attrs, ctx = t.__tensor_flatten__()
    inner: list[_Rebuild | None] = []
    for attr in attrs:
        value = getattr(t, attr)
        if is_traceable_wrapper_subclass(value):
            inner.append(_flatten_one(value, out))
        else:
            out.append(value)
            inner.append(None)
    out.extend(t.size())
    out.extend(t.stride())
    return _Rebuild(type(t), ctx, tuple(attrs), tuple(inner), t.dim())


def flatten_subclasses(packed: Any) -> tuple[Any, SubclassLayout | None]:
    """``packed`` with every traceable wrapper subclass replaced by its leaves (a flat list),
    and the layout to rebuild it; ``packed`` itself and None when it holds no subclass."""
    leaves, spec = pytree.tree_flatten(packed)
    if not any(is_traceable_wrapper_subclass(x) for x in leaves):
        return packed, None
    flat: list[Any] = []
    rebuilds: list[_Rebuild | None] = []
    for leaf in leaves:
        if is_traceable_wrapper_subclass(leaf):
            rebuilds.append(_flatten_one(leaf, flat))
        else:
            flat.append(leaf)
            rebuilds.append(None)
    return flat, SubclassLayout(spec, tuple(rebuilds))


def _rebuild_one(r: _Rebuild, it: Iterator[Any]) -> Any:
    inner = {attr: _rebuild_one(sub, it) if sub is not None else next(it) for attr, sub in zip(r.attrs, r.inner)}
    size = tuple(next(it) for _ in range(r.ndim))
    stride = tuple(next(it) for _ in range(r.ndim))
    return r.cls.__tensor_unflatten__(inner, r.ctx, size, stride)


def rebuild_subclasses(flat: list[Any], layout: SubclassLayout) -> Any:
    """Inverse of :func:`flatten_subclasses`."""
    it = iter(flat)
    leaves = [_rebuild_one(r, it) if r is not None else next(it) for r in layout.leaves]
    return pytree.tree_unflatten(leaves, layout.spec)
