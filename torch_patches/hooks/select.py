"""Which saved tensors a hook pair compresses: a compile-time predicate with context.

A compiled graph's saved tensors are the partitioner's choice, not eager's: it may save an
input of a cheap op and recompute the op in the backward (RoPE angles instead of their
cos/sin, logits instead of the softmax).  A lossy hook on such a tensor can move the
gradient far more than on what eager saves (a bf16 angle of 511 is off by a whole radian).
``select(pack, unpack, where=...)`` attaches a predicate to any hook pair::

    from torch_patches.hooks import bf16, select

    pack, unpack = select(*bf16(), where=lambda t: t.nbytes >= 1 << 20)

While compiling, the inliner calls ``where`` once per saved tensor with a
:class:`SavedTensorInfo` (producer op, dtype, shape, bytes, the backward ops that read it,
through recompute chains): no runtime cost; the predicate's code and what it reads are part
of the hook's identity (guards, caches).  Tensors it rejects are saved as they are.  As
eager hooks the same pair asks the same predicate with what eager knows at pack time
(producer from ``grad_fn``, dtype, shape, bytes; no backward consumers: ``None``).

:func:`numerics_safe` is the default of the ready-made lossy hooks (``bf16``,
``fp8_rowwise``, ``int8_rowwise`` and chains holding them): the numerics allowlist
(``torch_patches/hooks/numerics.py``).  A tensor is compressed only where every op reading it
in the backward is known to carry a relative error of it into a proportional error of
the gradient; unknown ops, statistics and tensors too small to pay stay exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from torch_patches import config
from torch_patches.hooks import numerics
from torch_patches.hooks._inlineable import inlineable, is_inlineable
from torch_patches.hooks.markers import OTHERWISE_ATTR, SELECT_ATTR, SavedTensorInfo, decode
from torch_patches.hooks.numerics import BF16, EXACT, FP8, INT8

__all__ = [
    "BF16",
    "EXACT",
    "FP8",
    "INT8",
    "HookPair",
    "OTHERWISE_ATTR",
    "SELECT_ATTR",
    "SavedTensorInfo",
    "numerics_safe",
    "select",
    "select_otherwise",
    "tolerate",
    "unwrap_select",
]


class _Kept:
    """A saved tensor the predicate rejected (eager hooks): stored as it is."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Otherwise:
    """A saved tensor the predicate rejected, packed by the ``otherwise`` pair (eager)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


#: A ``(pack, unpack)`` pair as ``torch.autograd.graph.saved_tensors_hooks`` takes it (the
#: library's pairs; the compiler's ``hook_tracing.HookPair`` is such a pair with its scope).
HookPair = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def select(
    pack: Callable[[torch.Tensor], Any],
    unpack: Callable[[Any], torch.Tensor],
    where: Callable[[SavedTensorInfo], bool],
    otherwise: HookPair | None = None,
) -> HookPair:
    """``(pack, unpack)`` applied only to the saved tensors ``where(info)`` accepts; the
    others are saved as they are, or packed by the ``otherwise`` pair.

    The result is inlineable when ``pack`` and ``unpack`` (and ``otherwise``'s) are
    (``fx.GraphModule`` or marked with :func:`~torch_patches.hooks.inlineable`); the inliner
    then evaluates ``where`` at compile time and traces ``pack``/``unpack`` for the
    accepted tensors only (``otherwise``, which may select in turn, for the others).
    ``where`` must be a pure function of its argument (and of what it reads, which is keyed
    like a hook's code).  Nested ``select``\\ s combine: both predicates must accept.

    ``otherwise`` gives precision where it pays: ``select(*fp8_rowwise(where=None),
    where=functools.partial(numerics_safe, storage="fp8"), otherwise=bf16())`` stores in fp8
    what tolerates fp8 and in bf16 what tolerates less (``fp8_rowwise()`` is the same).
    """
    if not callable(where):
        raise TypeError(f"select: where must be callable, got {type(where).__name__}")
    if otherwise is not None and not (isinstance(otherwise, (tuple, list)) and len(otherwise) == 2 and all(map(callable, otherwise))):
        raise TypeError("select: otherwise must be a (pack, unpack) pair of callables")
    inner = unwrap_select((pack, unpack))
    if inner is not None and select_otherwise((pack, unpack)) is None:
        pack, unpack, outer = inner
        where = functools.partial(_both, outer, where)
    other = None if otherwise is None else (otherwise[0], otherwise[1])

    def select_pack(t: torch.Tensor) -> Any:
        if where(SavedTensorInfo.from_tensor(t)):
            return pack(t)
        return _Kept(t) if other is None else _Otherwise(other[0](t))

    def select_unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        if isinstance(packed, _Otherwise):
            return other[1](packed.packed)  # type: ignore[index]
        return unpack(packed)

    parts = (pack, unpack, where)
    for fn in (select_pack, select_unpack):
        setattr(fn, SELECT_ATTR, parts)
        setattr(fn, OTHERWISE_ATTR, other)
    if all(is_inlineable(f) for f in (pack, unpack, *(other or ()))):
        return inlineable(select_pack, select_unpack)
    return select_pack, select_unpack


def _both(first: Callable[[Any], bool], second: Callable[[Any], bool], info: Any) -> bool:
    return bool(first(info)) and bool(second(info))


def select_otherwise(hooks: Any) -> HookPair | None:
    """The ``otherwise`` pair of a :func:`select` pair (None: none, or not a select pair)."""
    selection = decode(hooks).selection
    return None if selection is None else selection.otherwise


def unwrap_select(hooks: Any) -> tuple[Any, Any, Callable[[SavedTensorInfo], bool]] | None:
    """``(pack, unpack, where)`` of a :func:`select` pair, else None."""
    selection = decode(hooks).selection
    return None if selection is None else (selection.pack, selection.unpack, selection.where)


# --------------------------------------------------------------- numerics-safe default


def numerics_safe(info: SavedTensorInfo, storage: str = BF16) -> bool:
    """The default ``where=`` of the ready-made lossy hooks: the numerics allowlist.

    Accepts a tensor when it may be stored in ``storage`` (``"bf16"``, the default and the
    least lossy, ``"int8"`` or ``"fp8"``): its :attr:`SavedTensorInfo.tolerance` is at least
    that (every op reading it in the backward has an allowlist entry for the argument it
    reads it as, see ``torch_patches/hooks/numerics.py``), and it is large enough for row-wise
    compression to pay (a last dimension of at least 2, at least ``config.lossy_min_bytes``).
    The ready-made hooks pass their own storage (``fp8_rowwise()`` asks for ``"fp8"``).

    ``torch_patches.config.lossy_hooks_numerics_safe = False`` accepts every tensor.
    """
    if not config.lossy_hooks_numerics_safe:
        return True
    if info.nbytes < config.lossy_min_bytes or not info.shape or info.shape[-1] < 2:
        return False
    return numerics.tolerates(info.tolerance, numerics.check_level(storage, "numerics_safe"))


def tolerate(op: Any, *args: str, storage: str = INT8) -> None:
    """Add an entry to the numerics allowlist: an error of the arguments ``args`` of ``op``
    stored in ``storage`` reaches the gradient proportionally.

    ``op``: an ``OpOverload`` (``torch.ops.mylib.attn_backward.default``: that overload), an
    ``OpOverloadPacket`` (every overload) or its name (``"mylib::attn_backward"``);
    ``args``: schema argument names, or ``"*"`` for every tensor argument; ``storage``:
    the lossiest level an error of them tolerates where they meet a gradient, ``"int8"``
    (the default, as the built-in entries of a gradient's coefficients), ``"fp8"``, ``"bf16"``
    or ``"exact"`` (overrides a built-in entry).
    The entry goes to ``torch_patches.config.numerics_allowlist``, which is part of every
    compiled graph's identity: graphs compiled before recompile.  Use
    ``config.patch(numerics_allowlist=...)`` for a scoped change.
    """
    numerics.check_level(storage, "tolerate")
    if not args:
        raise ValueError("tolerate: name at least one argument (or '*')")
    if isinstance(op, torch._ops.OpOverload):
        key = f"{op._schema.name}.{op._overloadname}"
        schemas = [op._schema]
    elif isinstance(op, torch._ops.OpOverloadPacket):
        key = op._qualified_op_name
        schemas = [getattr(op, o)._schema for o in op.overloads()]
    elif isinstance(op, str) and "::" in op:
        key, schemas = op, []
    else:
        raise TypeError(f"tolerate: op must be an OpOverload, an OpOverloadPacket or 'namespace::name', got {op!r}")
    known = {a.name for schema in schemas for a in schema.arguments}
    unknown = [a for a in args if a != numerics.ALL_ARGS and schemas and a not in known]
    if unknown:
        raise ValueError(f"tolerate: {key} has no argument {unknown[0]!r} (its arguments: {sorted(known)})")
    entries = {k: dict(v) for k, v in config.numerics_allowlist.items()}
    entries.setdefault(key, {}).update(dict.fromkeys(args, storage))
    # Sorted: the same entries are the same config (guards and cache keys read its repr).
    config.numerics_allowlist = {k: dict(sorted(v.items())) for k, v in sorted(entries.items())}


def op_base_name(op: str) -> str:
    """``"aten.sin.default"`` -> ``"sin"``; ``"SinBackward0"`` -> ``"sin"``; ``"getitem:1 of
    aten.native_layer_norm.default"`` -> ``"native_layer_norm"``."""
    return numerics.base_name(op)
