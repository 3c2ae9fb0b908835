"""What a saved-tensors hook's compiled graph depends on: the walk that keys a hook.

A compiled graph bakes in what a hook computed while it was traced.  Reusing that graph
(a Dynamo guard passing, an AOTAutogradCache hit in another process) is sound only if
everything the hook's result depends on is the same.  :func:`hook_identity` walks a hook
the way its code reads the world and sorts every dependency into one of three outcomes:

(a) **keyed by value** (``HookIdentity.key``; valid across processes when ``local`` is
    empty): code of the hook and of every user function it can reach (defaults, closures,
    globals, recursively), the attributes of user modules it names, the whole state of
    user objects and classes it reaches (instances, namespaces, ``nn.Module``\\ s with their
    parameters, buffers and submodules, ``functools.partial``, bound methods, callable
    instances, staticmethod/classmethod), fx ``GraphModule`` code and attributes, and small
    CPU tensors by their bytes (a sparse one's indices and values: Dynamo takes no sparse
    graph inputs, so it is never lifted).  A change: one recompile, one cache miss.  The same hook
    recreated: the same key.
(b) **process-local** (``HookIdentity.local`` says why): tensors keyed by value would cost
    too much per guard check (more than ``_TENSOR_VALUE_NUMEL`` elements, or not on the
    CPU, or a subclass), so they are keyed by identity, version counter and metadata.  The
    identity holds them (``pins``): whoever keeps the identity (the guard of a compiled
    frame) keeps them alive, so their ``id()`` cannot be reused by another object while it
    is compared.  Such hooks never key a cross-process cache (AOTAutogradCache bypasses,
    reason logged).  Which tensor is keyed how: :func:`tensor_keying`.
(c) **not keyable** (``HookIdentity.unkeyable`` says why): objects whose state Python cannot
    see (C-extension objects without ``__dict__``, file handles), I/O, values nested too
    deep or too large to walk.  Such hooks are not inlined: the graph keeps eager hook
    semantics (one warning; an error under ``fullgraph=True``).

Why our own walk rather than Dynamo's guards: ambient hooks (entered around the compiled
call) are not reachable from the frame Dynamo traces, so there is no Dynamo source to
hang guards on; and the compile caches need a key *before* AOTAutograd traces the hook.
The walk is conservative where a source-based guard would be precise:

* it keys *all* state of user objects and classes it reaches (not just the attributes read);
* of a user module it keys the attributes whose names occur in any reachable code
  (``co_names`` and string constants, so ``getattr(mod, "NAME")`` is seen too), and *every*
  attribute once reachable code reads attributes by a computed name (``getattr(obj, name)``
  with a non-constant ``name``, ``vars()``, ``globals()``, ``__dict__``, ``attrgetter``);
* modules a hook imports in its body (``import cfg`` inside the function) are walked like
  its globals; a hook that imports by a computed name (``importlib.import_module``,
  ``__import__``) is not keyable;
* installed libraries (torch, the standard library, numpy, other site-packages) are fixed
  by their version: their functions and classes are keyed by qualified name and the
  distribution's version (torch's and Python's are in every compile-cache key already),
  their module-level data that the code names by value (``math.pi``, ``torch.bfloat16``,
  ``os.environ``, dicts and lists), and a function a library's factory made (a nested
  function) also by what it was made with (its closure and defaults, by value).
  Monkeypatching a library function at runtime is not seen;
* functions whose result changes at every call (``random``, ``time``, ``uuid``,
  ``secrets``, ``numpy.random``, ``os.urandom``, ``datetime.now``) make a hook not keyable:
  a compiled graph would replay the one value seen while tracing;
* torch_patches' own functions (the ready-made hooks) are keyed by qualified name and a
  digest of the package's source, with their closures and defaults by value (what a
  factory such as ``bf16(where=...)`` was called with): the guard does not re-walk our
  code at every call.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import hashlib
import io
import os
import sys
import types
from typing import Any

import torch

from torch_patches._functorch._aot_autograd.hook_code import (
    _ATOMS,
    _CLASS_DICT_SKIP,
    _OWN_ROOT,
    ALL_ATTRS,
    _cell_filled,
    _code_info,
    _global_names,
    _instance_dict,
    _is_library_module,
    _is_own_module,
    _library_version,
    _resolve_import,
    _slot_values,
    _volatile_name,
)
from torch_patches._functorch._aot_autograd.hook_watch import Watches, tensor_bytes, tensor_parts
from torch_patches.hooks.markers import CACHE_HASH_ATTR

# Tensors up to this many elements (on the CPU) are keyed by value; larger ones by identity.
_TENSOR_VALUE_NUMEL = 4096


# Values nested deeper than this, or walks visiting more values, are not keyable.
_MAX_DEPTH = 48


_MAX_VALUES = 200_000


_REPR_ATOMS = (
    torch.dtype,
    torch.device,
    torch.Size,
    torch.memory_format,
    torch.layout,
    range,
    slice,
)


class Keying(enum.Enum):
    """How the walk keys a tensor a hook captures (outcomes (a) and (b) above)."""

    LIFTED = "lifted"  # a runtime input of the graphs: by its metadata (Dynamo guards it)
    VALUE = "value"  # a plain CPU tensor (strided or sparse) of few elements: by its bytes
    IDENTITY = "identity"  # any other: by identity and version, pinned by the identity


def tensor_keying(t: torch.Tensor, lifted: frozenset[int] = frozenset()) -> Keying:
    """The one rule: how a captured tensor ``t`` is keyed (``lifted``: ``id()`` of the
    tensors the graphs take as inputs).  The walker keys by it, the identity pins by it."""
    if id(t) in lifted:
        return Keying.LIFTED
    if t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        parts = tensor_parts(t)
        if parts is not None and sum(p.numel() for p in parts) <= _TENSOR_VALUE_NUMEL:
            return Keying.VALUE
    return Keying.IDENTITY


@functools.lru_cache(maxsize=1)
def own_source_digest() -> str:
    """Digest of this package's Python sources: what our own code does, across processes.

    Part of every compile-cache key of hooks (``hooks_cache_key``), so entries written by
    another version of torch_patches are never served.  Empty in the upstream form (torch's
    version keys torch's own code).
    """
    if _OWN_ROOT == "torch":
        return ""
    root = os.path.dirname(os.path.abspath(sys.modules[_OWN_ROOT].__file__ or ""))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:24]


@dataclasses.dataclass(frozen=True, eq=False)
class HookIdentity:
    """The key of one hook (see the module docstring for the three outcomes)."""

    key: Any
    local: tuple[str, ...] = ()
    unkeyable: tuple[str, ...] = ()
    pins: tuple[Any, ...] = ()

    @functools.cached_property
    def digest(self) -> str:
        return digest(self.key)

    def same_as(self, other: HookIdentity) -> bool:
        return self.key == other.key


def digest(key: Any) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:24]


class _Walker:
    def __init__(self, attrs: frozenset[str], lifted: frozenset[int] = frozenset()) -> None:
        self.attrs = attrs  # attribute names any reachable code may read
        self.lifted = lifted  # id() of tensors the graphs take as runtime inputs
        self.names: set[str] = set()  # names found in code walked
        self.seen: dict[int, int] = {}
        self.local: list[str] = []
        self.unkeyable: list[str] = []
        self.pins: list[Any] = []
        self.identity_keyed: list[torch.Tensor] = []  # what the identity pins (tensor_keying)
        self.count = 0
        self.watches = Watches()  # how to re-check cheaply what the key was built from
        self.reentered = False  # the walk reached the hook it started from again

    # -------------------------------------------------------------- dispatch

    def value(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, _ATOMS):
            return (type(v).__name__, v)
        if isinstance(v, _REPR_ATOMS):
            return (type(v).__name__, repr(v))
        self.count += 1
        if depth > _MAX_DEPTH or self.count > _MAX_VALUES:
            self.unkeyable.append(
                f"it reaches values nested too deeply or too many to key ({type(v).__qualname__}), "
                "so a compiled graph could not tell when they change"
            )
            return ("too-deep",)
        if id(v) in self.seen:
            self.reentered = self.reentered or self.seen[id(v)] == 0
            return ("ref", self.seen[id(v)])
        self.seen[id(v)] = len(self.seen)
        self.pins.append(v)  # keeps ids in `seen` unique for the walk
        d = depth + 1
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, (tuple, list)):
            if not isinstance(v, tuple):
                self.watches.sequence(v)
            return (type(v).__name__, tuple(self.value(x, d) for x in v))
        if isinstance(v, (set, frozenset)):
            if not isinstance(v, frozenset):
                self.watches.set(v)
            return (type(v).__name__, tuple(sorted((self.value(x, d) for x in v), key=repr)))
        if isinstance(v, dict):
            self.watches.dict(v)
            items = [(self.value(k, d), self.value(x, d)) for k, x in v.items()]
            return (type(v).__name__, tuple(items))
        if isinstance(v, torch.fx.GraphModule):
            return self.graph_module(v, d)
        if isinstance(v, types.FunctionType):
            return self.function(v, d)
        if isinstance(v, types.CodeType):
            return self.code(v, d)
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__, d), self.value(v.__self__, d))
        if isinstance(v, (staticmethod, classmethod)):
            return (type(v).__name__, self.value(v.__func__, d))
        if isinstance(v, property):
            return ("property", self.value(v.fget, d), self.value(v.fset, d))
        if isinstance(v, functools.partial):
            self.watches.partial(v)
            return ("partial", self.value(v.func, d), self.value(v.args, d), self.value(v.keywords, d))
        if isinstance(v, types.ModuleType):
            return self.module(v, d)
        if isinstance(v, type):
            return self.cls(v, d)
        if isinstance(v, enum.Enum):
            return ("enum", self.cls(type(v), d), v.name)
        if isinstance(v, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            return ("descriptor", v.__objclass__.__qualname__, v.__name__)  # a slot, by name
        if isinstance(
            v,
            (
                types.BuiltinFunctionType,
                types.WrapperDescriptorType,
                types.MethodDescriptorType,
                types.MethodWrapperType,
                torch._ops.OpOverload,
                torch._ops.OpOverloadPacket,
            ),
        ):
            self.volatile(v)
            owner = getattr(v, "__self__", None)
            named = ("builtin", getattr(v, "__module__", None), getattr(v, "__qualname__", repr(v)))
            if owner is None or isinstance(owner, types.ModuleType):
                return named
            return named + (self.value(owner, d),)
        if isinstance(v, io.IOBase) or any(v is s for s in (sys.stdout, sys.stderr, sys.stdin)):
            self.unkeyable.append(f"it has side effects (uses a stream or file, {type(v).__qualname__})")
            return ("io",)
        return self.instance(v, d)

    # --------------------------------------------------------------- leaves

    def tensor(self, t: torch.Tensor) -> Any:
        from torch._subclasses.fake_tensor import is_fake

        meta = (
            "tensor",
            str(t.dtype),
            tuple(t.shape),
            tuple(t.stride()) if t.layout == torch.strided else str(t.layout),
            str(t.device),
            t.requires_grad,
            type(t).__qualname__,
        )
        if is_fake(t):
            self.unkeyable.append("it captures a fake tensor (made while tracing), which has no value to run with")
            return meta
        keying = tensor_keying(t, self.lifted)
        if keying is Keying.LIFTED:
            self.watches.tensor(t, "meta")
            return meta + ("lifted",)
        if keying is Keying.VALUE:
            self.watches.tensor(t, "bytes")
            return meta + ("value", hashlib.sha256(tensor_bytes(t)).hexdigest()[:24])
        self.identity_keyed.append(t)
        self.watches.tensor(t, "version")
        self.local.append(
            f"captures a {str(t.dtype).replace('torch.', '')}{list(t.shape)} tensor on "
            f"{t.device.type}, keyed by identity and version (only CPU tensors of at most "
            f"{_TENSOR_VALUE_NUMEL} elements are keyed by value)"
        )
        return meta + ("identity", id(t), t._version)

    def watch_environ(self) -> None:
        data = getattr(os.environ, "_data", None)
        if type(data) is dict:
            self.watches.dict(data)
        else:
            self.watches.equal(functools.partial(dict, os.environ), dict(os.environ))

    def volatile(self, v: Any) -> None:
        name = _volatile_name(v)
        if name is not None:
            self.unkeyable.append(
                f"it calls {name}, whose result changes at every call: a compiled graph would replay the value seen while tracing"
            )

    def code(self, co: types.CodeType, depth: int) -> Any:
        info = _code_info(co)
        self.names.update(info.names)
        self.unkeyable.extend(info.unkeyable)
        return info.key

    def made_with(self, fn: types.FunctionType, depth: int) -> Any:
        """What a function object carries beyond its code: defaults, closure, attributes."""
        self.watches.function(fn)
        for cell in fn.__closure__ or ():
            self.watches.cell(cell)
        closure = tuple(self.value(cell.cell_contents, depth) if _cell_filled(cell) else ("empty",) for cell in (fn.__closure__ or ()))
        return (
            self.value(fn.__defaults__, depth),
            self.value(fn.__kwdefaults__, depth),
            closure,
            self.value(_instance_dict(fn), depth),  # attributes set on the function
        )

    def function(self, fn: types.FunctionType, depth: int) -> Any:
        module = fn.__module__
        if _is_library_module(module):
            self.volatile(fn)
            if module == "os" and fn.__name__ in ("getenv", "getenvb"):
                # Reads the environment: keyed by its content (as os.environ is).
                self.watch_environ()
                return ("lib-function", module, fn.__qualname__, ("environ", self.value(dict(os.environ), depth)))
            if "<locals>" in fn.__qualname__:
                # Made by a library's factory (torch's own ready-made hooks, in the upstream
                # form): the code is fixed by the version, what the factory was called with
                # (its closure and defaults: a dtype, a predicate) is data, keyed by value.
                return ("lib-function", module, fn.__qualname__, _library_version(module), self.made_with(fn, depth))
            return ("lib-function", module, fn.__qualname__, _library_version(module))
        state = self.made_with(fn, depth)
        if _is_own_module(module):
            # Our own code is fixed for a given package source; what it was built with
            # (closures, defaults: a factory's arguments, a user's predicate) is keyed.
            return ("own-function", module, fn.__qualname__, own_source_digest(), state)
        globs: list[Any] = []
        self.watches.names(fn.__globals__, sorted(_global_names(fn.__code__)))
        for name in sorted(_global_names(fn.__code__)):
            if name in fn.__globals__:
                globs.append((name, self.value(fn.__globals__[name], depth)))
            else:
                globs.append((name, "builtin"))
        if ALL_ATTRS in self.attrs:
            # Code that reads attributes by a computed name may read any global.
            globs.append((ALL_ATTRS, self.namespace(fn.__globals__, depth)))
        imported = []
        for level, name in _code_info(fn.__code__).imports:
            target = _resolve_import(level, name, fn.__globals__)
            # The module itself and the package the name binds (``import a.b`` binds ``a``).
            mod_names = tuple(dict.fromkeys((target, target.split(".", 1)[0]))) if target else ()
            self.watches.names(sys.modules, mod_names)
            for mod_name in mod_names:
                mod = sys.modules.get(mod_name)
                if mod is not None:
                    imported.append((mod_name, self.value(mod, depth)))
        return (
            "function",
            module,
            fn.__qualname__,
            self.code(fn.__code__, depth),
            state,
            tuple(globs),
            tuple(imported),
        )

    def namespace(self, ns: dict[str, Any], depth: int) -> Any:
        """Every entry of a user module's namespace but its dunders (import machinery)."""
        before = len(self.unkeyable)
        self.watches.dict(ns)
        key = tuple((k, self.value(v, depth)) for k, v in sorted(ns.items()) if not (k.startswith("__") and k.endswith("__")))
        self.unkeyable[before:] = [
            f"{reason} (every global of module {ns.get('__name__', '?')!r} is keyed: the hook reads "
            "attributes by a computed name, e.g. getattr(obj, name) with a non-constant name)"
            for reason in self.unkeyable[before:]
        ]
        return key

    def module(self, m: types.ModuleType, depth: int) -> Any:
        name = m.__name__
        library = _is_library_module(name) or _is_own_module(name)
        if not library and ALL_ATTRS in self.attrs:
            return ("module", name, False, self.namespace(m.__dict__, depth))
        entries = []
        self.watches.names(m.__dict__, sorted(self.attrs))
        for attr in sorted(self.attrs):
            if attr not in m.__dict__:
                continue
            v = m.__dict__[attr]
            if library:
                if isinstance(v, _ATOMS + _REPR_ATOMS):
                    entries.append((attr, self.value(v, depth)))
                elif isinstance(v, io.IOBase) or any(v is s for s in (sys.stdout, sys.stderr, sys.stdin)):
                    self.unkeyable.append(f"it has side effects (uses {name}.{attr})")
                elif isinstance(v, (dict, list, set, frozenset, tuple)):
                    entries.append((attr, self.value(v, depth)))  # module-level data
                elif isinstance(v, collections.abc.Mapping) and not isinstance(v, type):
                    if v is os.environ:
                        self.watch_environ()
                    else:  # keyed through a copy: only equality can vouch for it
                        self.watches.equal(functools.partial(dict, v), dict(v))
                    entries.append((attr, ("mapping", self.value(dict(v), depth))))  # os.environ
                elif isinstance(v, types.FunctionType):
                    entries.append((attr, self.function(v, depth)))  # version, volatility
                elif callable(v) and not isinstance(v, type):
                    self.volatile(v)
                # Library functions, classes, submodules: fixed by the library's version.
                continue
            entries.append((attr, self.value(v, depth)))
        return ("module", name, library, tuple(entries))

    def cls(self, c: type, depth: int) -> Any:
        if _is_library_module(c.__module__):
            return ("lib-class", c.__module__, c.__qualname__, _library_version(c.__module__))
        if _is_own_module(c.__module__):
            return ("own-class", c.__module__, c.__qualname__, own_source_digest())
        # A user class: everything in its (and its user bases') namespace.
        mro: list[tuple[Any, ...]] = []
        self.watches.attr(c, "__mro__", c.__mro__)
        for base in c.__mro__:
            if _is_library_module(base.__module__):
                mro.append(("lib-class", base.__module__, base.__qualname__))
                continue
            self.watches.mapping(base.__dict__)
            entries = tuple((k, self.value(v, depth)) for k, v in base.__dict__.items() if k not in _CLASS_DICT_SKIP)
            mro.append(("class", base.__module__, base.__qualname__, entries))
        return ("class-mro", tuple(mro))

    def instance(self, v: Any, depth: int) -> Any:
        state = _instance_dict(v)
        slots = _slot_values(v)
        if state is None and slots is None:
            if type(v).__module__ == "numpy" and hasattr(v, "tobytes") and getattr(v, "size", 1 << 30) <= _TENSOR_VALUE_NUMEL:
                self.watches.equal(functools.partial(_array_state, v), _array_state(v))
                return ("ndarray", str(v.dtype), tuple(v.shape), hashlib.sha256(v.tobytes()).hexdigest()[:24])
            self.unkeyable.append(
                f"it reaches a {type(v).__module__}.{type(v).__qualname__} object, whose state "
                "torch_patches cannot see (no __dict__), so a compiled graph could not tell "
                "when it changes"
            )
            return ("opaque", type(v).__qualname__)
        self.watches.type_of(v)
        if state is not None and type(object.__getattribute__(v, "__dict__")) is not dict:
            self.watches.mapping(object.__getattribute__(v, "__dict__"))  # keyed through a copy
        if slots is not None:
            self.watches.slots(v, tuple(slots))
        return (
            "object",
            self.cls(type(v), depth),
            self.value(state, depth) if state is not None else None,
            self.value(slots, depth) if slots is not None else None,
        )

    def graph_module(self, gm: torch.fx.GraphModule, depth: int) -> Any:
        # Its code (``gm.code`` is its ``_code``) and its graph live in its ``__dict__``.
        self.watches.dict(gm.__dict__)
        attrs: list[tuple[Any, ...]] = []
        for node in gm.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                obj: Any = gm
                for part in str(node.target).split("."):
                    found = getattr(obj, part, None)
                    self.watches.attr(obj, part, found)
                    obj = found
                attrs.append((node.op, str(node.target), self.value(obj, depth)))
            elif node.op == "call_function" and not isinstance(
                node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, types.BuiltinFunctionType)
            ):
                # fx.wrap leaves and other Python callables the graph calls: make_fx traces
                # through them, so their code counts; a user_cache_hash stands for it.
                user_hash = leaf_cache_hash(node)
                self.watches.attr(node.target, CACHE_HASH_ATTR, getattr(node.target, CACHE_HASH_ATTR, None))
                if user_hash is not None:
                    attrs.append((node.name, ("user_cache_hash", user_hash)))
                else:
                    attrs.append((node.name, self.value(node.target, depth)))
        return ("graph_module", type(gm).__qualname__, gm.code, tuple(attrs))


def _array_state(a: Any) -> tuple[Any, ...]:
    return (str(a.dtype), a.shape, a.tobytes())


def leaf_cache_hash(node: torch.fx.Node) -> str | None:
    """The user_cache_hash of an opaque leaf call: node.meta's, else its function's."""
    value = node.meta.get("user_cache_hash") or getattr(node.target, CACHE_HASH_ATTR, None)
    return None if value is None else str(value)
