"""Cheap re-verification of what a hook's walk read: the per-call half of hook identity.

:meth:`Watches.holds` and the checks it runs (the functions above the class) run at every
compiled call; the recording methods run while a hook is walked.

Walking a hook (``hook_walk``) is compile-time work: it follows closures, globals,
defaults, module attributes and object state recursively.  The walk's result must then be
re-checked at every compiled call (the frame's guard) and wherever a key is asked for
again, and that check must cost what Dynamo's own guards cost, not another walk.

So while it walks, the walker records a :class:`Watches`: for every mutable place whose
content the key was built from, the cheapest test that it still holds what was read:

* a dict read as a value (an object's ``__dict__``, a function's ``__kwdefaults__``,
  ``nn.Module._parameters``...): its version (``dict_version``, the CPython dict version tag
  Dynamo's ``DICT_VERSION`` guard reads), which any insertion, deletion or rebinding changes;
* a namespace read by name (a function's globals, a module's attributes): its version,
  and when that moved (a training loop at module level rebinds globals every step) each
  name the walk read still holding the same object, after which the new version is
  remembered;
* a function's code and defaults: that no function's were assigned since (the package's
  audit hook counts such assignments, ``hook_audit``);
* a closure cell, a list, a set, a class namespace, slots,
  an attribute chain of a ``GraphModule``: the objects they hold, by identity;
* a tensor: its metadata, with its version counter and data pointer (keyed by identity) or
  its bytes (keyed by value; small CPU tensors).

Each watch holds what it compares against, so no ``id()`` it tests can be reused by another
object while it lives.  Objects that are immutable (tuples, code, atoms, bound methods)
need no watch of their own: whoever holds them is watched.  A watch that fails means only
that the walk must run again (a rebinding to an equal value walks again and finds the same
key): it never decides a key by itself.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from typing import Any

import torch

from torch_patches._functorch._aot_autograd import hook_audit

_dict_version: Callable[[dict[Any, Any]], int] | None
try:  # The dict version tag Dynamo's DICT_VERSION guard reads (torch 2.11-2.15).
    from torch._C._dynamo.guards import dict_version as _dict_version
except ImportError:  # pragma: no cover - a build without Dynamo's C guards
    _dict_version = None


_MISSING = object()
_EMPTY_CELL = object()


def _items_hold(d: Any, items: tuple[tuple[Any, Any], ...]) -> bool:
    """``d`` maps exactly the keys of ``items`` to the same objects."""
    if len(d) != len(items):
        return False
    get = d.get
    for k, v in items:
        if get(k, _MISSING) is not v:
            return False
    return True


def _names_hold(d: Any, state: list[Any]) -> bool:
    """A namespace still holds, under each name read, the object read (``state``:
    [version or None, ((name, object or _MISSING), ...)])."""
    version = _dict_version(d) if _dict_version is not None and type(d) is dict else None
    if version is not None and version == state[0]:
        return True
    get = d.get
    for k, v in state[1]:
        if get(k, _MISSING) is not v:
            return False
    state[0] = version  # moved, but nothing the walk read: the next check is one lookup
    return True


def _cell_holds(cell: Any, expected: Any) -> bool:
    try:
        return cell.cell_contents is expected
    except ValueError:
        return expected is _EMPTY_CELL


def _counter_is(counter: list[int], expected: int) -> bool:
    return counter[0] == expected


def _sequence_same(seq: Any, expected: tuple[Any, ...]) -> bool:
    return len(seq) == len(expected) and all(map(operator.is_, seq, expected))


def _set_same(s: Any, expected: tuple[tuple[Any, ...], frozenset[int]]) -> bool:
    ids = expected[1]
    return len(s) == len(ids) and all(id(x) in ids for x in s)


def _slots_same(obj: Any, expected: tuple[tuple[str, Any], ...]) -> bool:
    for name, v in expected:
        try:
            if object.__getattribute__(obj, name) is not v:
                return False
        except AttributeError:
            if v is not _MISSING:
                return False
    return True


def _partial_same(p: Any, expected: tuple[Any, Any, Any]) -> bool:
    return p.func is expected[0] and p.args is expected[1] and p.keywords is expected[2]


def _attr_is(obj: Any, expected: tuple[str, Any]) -> bool:
    return getattr(obj, expected[0], _MISSING) is expected[1]


def _type_is(obj: Any, expected: type) -> bool:
    return type(obj) is expected


def _equal(read: Callable[[], Any], expected: Any) -> bool:
    return read() == expected


#: A sparse tensor's strided parts, per layout: its indices and its values.
_SPARSE_PARTS: dict[torch.layout, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_bsr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
    torch.sparse_bsc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


def tensor_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The strided tensors holding ``t``'s values: ``t`` itself, or a sparse tensor's
    indices and values (None for another layout)."""
    if t.layout == torch.strided:
        return (t,)
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is None:
        return None
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisableTorchDispatch():  # read outside tracing
        return parts(t)


def _strided_bytes(t: torch.Tensor) -> bytes:
    data = t.detach().contiguous()
    nbytes = data.numel() * data.element_size()
    if nbytes:
        # Straight from memory: no numpy (torch does not require it).
        return ctypes.string_at(data.data_ptr(), nbytes)
    return repr(data.tolist()).encode()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a (small, CPU) tensor's values, read outside whatever mode is tracing
    (fake, proxy, functional); of a sparse tensor, its indices' and values' (with their
    shapes and dtypes, and whether a COO tensor is coalesced)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisableTorchDispatch():
        if t.layout == torch.strided:
            return _strided_bytes(t)
        parts = tensor_parts(t) or ()
        head = repr((t.is_coalesced() if t.layout == torch.sparse_coo else None, [(p.dtype, p.shape) for p in parts]))
        return b"".join((head.encode(), *map(_strided_bytes, parts)))


def tensor_state(t: torch.Tensor, what: str) -> tuple[Any, ...]:
    """What a tensor's key depends on: its metadata (``"meta"``: a lifted tensor), and its
    version counter and where its data lives (``"version"``: keyed by identity; an in-place
    update bumps the version, ``.data =`` or ``set_`` moves the data), or its values
    (``"bytes"``: keyed by value; ``t.data.mul_()`` changes them without a version bump)."""
    meta: tuple[Any, ...] = (type(t), t.dtype, t.shape, t.device, t.requires_grad, t.layout)
    if t.layout == torch.strided:
        meta += (t.stride(), t.storage_offset())
    if what == "meta":
        return meta
    if what == "bytes":
        return meta + (tensor_bytes(t),)
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no storage (sparse, a subclass)
        ptr = None
    return meta + (t._version, ptr)


def _tensor_same(t: torch.Tensor, expected: tuple[str, tuple[Any, ...]]) -> bool:
    return tensor_state(t, expected[0]) == expected[1]


class Watches:
    """The checks of one walk: ``holds()`` is True while everything the walk read holds."""

    __slots__ = ("checks", "dicts", "versions", "_seen")

    def __init__(self) -> None:
        self.checks: list[tuple[Callable[[Any, Any], bool], Any, Any]] = []
        # Dicts watched by version, checked in one pass (most watches of a hook are these).
        self.dicts: list[dict[Any, Any]] = []
        self.versions: list[int] = []
        self._seen: set[tuple[int, int]] = set()

    def holds(self) -> bool:
        """Per compiled call (the guards, through ``hook_identity``): every check, no walk."""
        # (dicts are watched by version only where the version tag exists)
        if self.dicts and _dict_version is not None and list(map(_dict_version, self.dicts)) != self.versions:
            return False
        for check, obj, expected in self.checks:
            if not check(obj, expected):
                return False
        return True

    def _add(self, check: Callable[[Any, Any], bool], obj: Any, expected: Any) -> None:
        mark = (id(check), id(obj))
        if mark not in self._seen:  # one watch per object and kind (objects reached twice)
            self._seen.add(mark)
            self.checks.append((check, obj, expected))

    # ------------------------------------------------------------ what to watch

    def dict(self, d: dict[Any, Any]) -> None:
        """A dict whose every entry the key holds."""
        if _dict_version is not None and type(d) is dict:
            if (0, id(d)) not in self._seen:
                self._seen.add((0, id(d)))
                self.dicts.append(d)
                self.versions.append(_dict_version(d))
        else:
            self._add(_items_hold, d, tuple(d.items()))

    def names(self, d: Any, names: Any) -> None:
        """A namespace of which the key holds the entries under ``names`` (absent ones
        included: a name that appears changes the key too)."""
        version = _dict_version(d) if _dict_version is not None and type(d) is dict else None
        items = tuple((n, d.get(n, _MISSING)) for n in names)
        self.checks.append((_names_hold, d, [version, items]))

    def mapping(self, m: Any) -> None:
        """A read-only mapping (a class namespace): its entries by identity."""
        self._add(_items_hold, m, tuple(m.items()))

    def cell(self, cell: Any) -> None:
        try:
            contents = cell.cell_contents
        except ValueError:
            contents = _EMPTY_CELL
        self._add(_cell_holds, cell, contents)

    def function(self, fn: Any) -> None:
        """A function's code and defaults (assignable): no assignment to any function's
        since the walk, which the package's audit hook counts (``hook_audit``: reading them
        here would be an audited event itself, a call of every audit hook per read)."""
        writes = hook_audit.function_writes()
        self._add(_counter_is, writes, writes[0])

    def sequence(self, seq: Any) -> None:
        self._add(_sequence_same, seq, tuple(seq))

    def set(self, s: Any) -> None:
        held = tuple(s)
        self._add(_set_same, s, (held, frozenset(map(id, held))))

    def slots(self, obj: Any, names: Any) -> None:
        """Attributes read with ``object.__getattribute__`` (slots, a partial's parts)."""
        held = []
        for name in names:
            try:
                held.append((name, object.__getattribute__(obj, name)))
            except AttributeError:
                held.append((name, _MISSING))
        self._add(_slots_same, obj, tuple(held))

    def partial(self, p: Any) -> None:
        """A ``functools.partial``'s parts (read-only, but ``__setstate__`` replaces them)."""
        self._add(_partial_same, p, (p.func, p.args, p.keywords))

    def attr(self, obj: Any, name: str, value: Any) -> None:
        self.checks.append((_attr_is, obj, (name, value)))

    def type_of(self, obj: Any) -> None:
        """``obj.__class__`` can be assigned."""
        self._add(_type_is, obj, type(obj))

    def tensor(self, t: torch.Tensor, what: str) -> None:
        """``what``: see :func:`tensor_state`."""
        self._add(_tensor_same, t, (what, tensor_state(t, what)))

    def equal(self, read: Callable[[], Any], value: Any) -> None:
        """A value only its equality can vouch for (a copy the walk keyed)."""
        self.checks.append((_equal, read, value))
