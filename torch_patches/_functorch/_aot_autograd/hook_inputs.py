"""Tensors a saved-tensors hook reads, lifted into the compiled graphs as runtime inputs.

Tensors an ambient saved-tensors hook reads, lifted into the compiled graphs as runtime
inputs.  A hook that reads a tensor the training loop updates in place every step (a delayed or
learned scale, an amax history, a step counter) would otherwise be a constant of the graph:
keyed by value (or by identity and version) in the guard, so each update recompiles.  Here
such a tensor becomes an input of the Dynamo graph, as a global tensor the traced code reads
does: Dynamo guards its metadata (dtype, shape, strides, device, requires_grad), never its
values or its identity, and each call passes the tensor the hook would read *now*.

:func:`find_inputs` walks a hook the way its code reads the world (closure cells, the
globals its code names, defaults, ``functools.partial`` arguments, a bound method's
object, attributes of user objects and modules its code names, items of containers) and
returns, for every plain tensor it reaches, a :class:`LiftedTensor`: the path from the hook
to it.  At run time :func:`current_input` follows the path again from the hooks active
*then*, so an in-place update is seen and a rebinding (another tensor of the same
metadata under the same name) too.  ``hook_identity(fn, lift=True)`` keys a lifted tensor
by its metadata only; the Dynamo patch (``_dynamo/symbolic_convert.py``) makes it a graph
input; the inliner traces the hooks with it as an input (``hook_tracing.trace_hook``) and
maps it to the forward's input, saved for the backward.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_patches._functorch._aot_autograd.hook_code import _cell_filled, _global_names, _is_library_module, _is_own_module

#: How deep the walk follows references from a hook function.
_LIFT_MAX_DEPTH = 6


#: Steps that read an item of one of the object's attributes.
_HOLDERS = {
    "global": "__globals__",
    "default": "__defaults__",
    "kwdefault": "__kwdefaults__",
    "arg": "args",
    "keyword": "keywords",
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One hop from an object to what it references: ``kind`` and the name or index."""

    kind: str  # closure | global | default | kwdefault | func | self | arg | keyword | attr | item
    key: Any = None

    def accesses(self, v: Any) -> tuple[tuple[str, Any], ...]:
        """The plain accesses the step makes from ``v``: ``("attr", name)`` or ``("item",
        key)``, in order (one description for following it now and for Dynamo's source)."""
        kind, key = self.kind, self.key
        if kind == "closure":
            return (("attr", "__closure__"), ("item", v.__code__.co_freevars.index(key)), ("attr", "cell_contents"))
        if kind in _HOLDERS:
            return (("attr", _HOLDERS[kind]), ("item", key))
        if kind == "func":
            return (("attr", "__func__" if isinstance(v, types.MethodType) else "func"),)
        if kind == "self":
            return (("attr", "__self__"),)
        if kind == "item":
            return (("item", key),)
        if kind == "attr":
            return (("attr", key),)
        raise LookupError(kind)

    def describe(self) -> str:
        if self.kind in ("func", "self"):
            return f".{'__func__' if self.kind == 'func' else '__self__'}"
        if self.kind in ("attr", "closure", "global", "kwdefault", "keyword"):
            return f".{self.key}" if self.kind == "attr" else f" {self.kind} {self.key!r}"
        return f"[{self.key!r}]"


@dataclasses.dataclass(frozen=True)
class LiftedTensor:
    """A tensor a hook reads, by its path from the hook (``role``: ``"pack"``/``"unpack"``)."""

    role: str
    path: tuple[Step, ...]
    tensor: torch.Tensor = dataclasses.field(compare=False, repr=False)

    def describe(self) -> str:
        return f"the {self.role} hook's" + "".join(s.describe() for s in self.path)


def liftable(t: torch.Tensor) -> str | None:
    """None when ``t`` can be a graph input standing for what a hook reads, else why not."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return "a fake tensor (made while tracing) has no value to run with"
    if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        return f"a tensor subclass ({type(t).__qualname__}) is kept as a constant of the graph"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor is kept as a constant of the graph"
    return None


def _own_or_library(module: str | None) -> bool:
    return _is_library_module(module)


#: What the walk follows in full, whatever names code reads (the rest: by those names).
_FOLLOWED_WHOLE = (types.FunctionType, types.MethodType, functools.partial, tuple, list, dict)


def _children(v: Any, names: set[str]) -> list[tuple[Step, Any]]:
    """What ``v`` references that the walk follows, with the step to each."""
    out: list[tuple[Step, Any]] = []
    if isinstance(v, torch.fx.GraphModule):  # its tensors are its own attributes, keyed with it
        return out
    if isinstance(v, types.FunctionType):
        if _own_or_library(v.__module__):
            return out
        for name, cell in zip(v.__code__.co_freevars, v.__closure__ or ()):
            if _cell_filled(cell):
                out.append((Step("closure", name), cell.cell_contents))
        # Our own functions' globals are our code (keyed by our source, as hook_walk does):
        # what such a function was made with is in its closure and defaults.
        for name in () if _is_own_module(v.__module__) else sorted(_global_names(v.__code__)):
            if name in v.__globals__:
                out.append((Step("global", name), v.__globals__[name]))
        for i, d in enumerate(v.__defaults__ or ()):
            out.append((Step("default", i), d))
        for k, d in sorted((v.__kwdefaults__ or {}).items()):
            out.append((Step("kwdefault", k), d))
        names.update(v.__code__.co_names)
        for c in v.__code__.co_consts:
            if isinstance(c, types.CodeType):
                names.update(c.co_names)
    elif isinstance(v, types.MethodType):
        out += [(Step("func"), v.__func__), (Step("self"), v.__self__)]
    elif isinstance(v, functools.partial):
        out.append((Step("func"), v.func))
        out += [(Step("arg", i), a) for i, a in enumerate(v.args)]
        out += [(Step("keyword", k), a) for k, a in sorted(v.keywords.items())]
    elif isinstance(v, (tuple, list)):
        out += [(Step("item", i), x) for i, x in enumerate(v)]
    elif isinstance(v, dict):
        out += [(Step("item", k), x) for k, x in v.items() if isinstance(k, (str, int))]
    elif isinstance(v, types.ModuleType):
        if not _own_or_library(v.__name__):
            out += [(Step("attr", n), getattr(v, n)) for n in sorted(names) if n in vars(v)]
    elif isinstance(v, torch.nn.Module):
        if not _own_or_library(type(v).__module__):
            for n in sorted(names):
                found: Any = v._parameters.get(n, v._buffers.get(n)) if n in v._parameters or n in v._buffers else None
                if found is None and n in vars(v):
                    found = vars(v)[n]
                elif found is None and n in v._modules:
                    found = v._modules[n]
                if found is not None:
                    out.append((Step("attr", n), found))
    elif hasattr(v, "__dict__") and not isinstance(v, type) and not _own_or_library(type(v).__module__):
        state = vars(v)
        out += [(Step("attr", n), state[n]) for n in sorted(names) if n in state]
    return out


def find_inputs(fn: Any, role: str) -> tuple[list[LiftedTensor], list[str]]:
    """Every plain tensor ``fn`` reads (its path from ``fn``), and why the others it reads
    are not lifted (a subclass, a fake tensor)."""
    lifted: list[LiftedTensor] = []
    refused: list[str] = []
    seen: set[int] = set()
    names: set[str] = set()
    # len(names) whenever an object's attributes were chosen by the names known then.
    chosen_with: list[int] = []

    def walk(v: Any, path: tuple[Step, ...]) -> None:
        if id(v) in seen or len(path) > _LIFT_MAX_DEPTH:
            return
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            found = LiftedTensor(role, path, v)
            why = liftable(v)
            if why is None:
                lifted.append(found)
            else:
                refused.append(f"{found.describe()}: {why}")
            return
        if not isinstance(v, _FOLLOWED_WHOLE):
            chosen_with.append(len(names))
        for step, child in _children(v, names):
            walk(child, (*path, step))

    walk(fn, ())
    # Attributes named by code found later in the walk (a method reading self.scale): walk
    # again when an object's attributes were chosen before those names were known.
    if any(n < len(names) for n in chosen_with):
        seen.clear()
        lifted.clear()
        refused.clear()
        walk(fn, ())
    return lifted, refused


# ===================================================================== per compiled call
# What runs at every call of a compiled graph (ARCHITECTURE.md, "What runs per compiled
# call"): lookups against what compiling recorded, never a walk, an input search or a trace
# (test_hook_guards.TestPerCallPath counts them).


def resolve(fn: Any, path: tuple[Step, ...]) -> Any:
    """Follow ``path`` from ``fn`` now; LookupError when it no longer leads anywhere."""
    v = fn
    for step in path:
        try:
            for how, key in step.accesses(v):
                v = getattr(v, key) if how == "attr" else v[key]
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            raise LookupError(f"{step.describe()}: {type(e).__name__}: {e}") from None
    return v


#: The alias :func:`current_input` gave for each tensor, while it lives and its data, sizes
#: and strides stay the same: one object per tensor (Dynamo's no-aliasing guard compares its
#: inputs' ids, and a new object at each call could take a freed one's id).  Keyed by the
#: tensor's ``_cdata`` (its C++ object; ``id()`` and a tensor's hash are audited events,
#: this runs at every call), dropped with the tensor.
_aliases: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def _alias_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage with a version counter of its own (kept per tensor)."""
    key = t._cdata
    held = _aliases.get(key)
    alias = held[1] if held is not None and held[0]() is t else None
    if (
        alias is None
        # The alias holds t's storage: another storage of t cannot start at its address.
        or alias.data_ptr() != t.data_ptr()
        or alias.size() != t.size()
        or alias.stride() != t.stride()
    ):
        with torch.no_grad():
            alias = torch.empty((0,), dtype=t.dtype, device=t.device)
            alias.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        _aliases[key] = (weakref.ref(t, functools.partial(_drop_alias, key)), alias)
    return alias


def _drop_alias(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    held = _aliases.get(key)
    if held is not None and held[0] is ref:
        del _aliases[key]


def current_input(role: str, path: tuple[Step, ...], hooks: Callable[[], Any]) -> torch.Tensor | None:
    """The tensor at ``path`` from the ``role`` hook of ``hooks()`` (the pair active now):
    what the compiled graph is given for it at this call.  None where the path leads
    nowhere now (other hooks, none, a rebinding to a non-tensor): the guard on it then
    fails and the frame recompiles, as for any other change of the hooks.

    Given as a tensor over the same storage with a version counter of its own: the
    backward reads the values of its storage when it runs (an update between forward and
    backward is seen, as eager's unpack sees it) without autograd's saved-tensor version
    check taking the update for a corruption.  (Upstream's no-version-check saved tensors,
    ``saved_tensor_with_no_vc_check``, would say the same, but compiled autograd does not
    pass them to the backward.)"""
    pair = hooks()
    if pair is None:
        return None
    try:
        found = resolve(pair[0] if role == "pack" else pair[1], path)
    except LookupError:
        return None
    return _alias_of(found) if isinstance(found, torch.Tensor) else None
