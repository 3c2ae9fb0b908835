"""What a saved-tensors hook's compiled graph depends on: its identity for guards and caches.

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
    CPU tensors by their bytes.  A change: one recompile, one cache miss.  The same hook
    recreated: the same key.
(b) **process-local** (``HookIdentity.local`` says why): tensors keyed by value would cost
    too much per guard check (more than ``_TENSOR_VALUE_NUMEL`` elements, or not on the
    CPU), so they are keyed by identity, version counter and metadata.  The identity holds
    them (``pins``): whoever keeps the identity (the guard of a compiled frame) keeps them
    alive, so their ``id()`` cannot be reused by another object while it is compared.  Such
    hooks never key a cross-process cache (AOTAutogradCache bypasses, reason logged).
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
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_patches import config
from torch_patches._hook_kinds import CACHE_HASH_ATTR, is_inlineable_hook, pair_is_inlineable


# Tensors up to this many elements (on the CPU) are keyed by value; larger ones by identity.
_TENSOR_VALUE_NUMEL = 4096
# Values nested deeper than this, or walks visiting more values, are not keyable.
_MAX_DEPTH = 48
_MAX_VALUES = 200_000

_ATOMS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented))
_REPR_ATOMS = (
    torch.dtype,
    torch.device,
    torch.Size,
    torch.memory_format,
    torch.layout,
    range,
    slice,
)
# Roots of installed libraries, keyed by name: their code is fixed for a given version
# (every compile cache key already holds torch's version).
_LIBRARY_ROOTS = frozenset({"torch", "numpy", "typing_extensions", "sympy", "triton"})
# Builtins whose call in a hook is I/O: a hook that reaches them is not inlined.
_IO_BUILTINS = frozenset({"print", "open", "input", "breakpoint", "exec", "eval", "compile"})
# Names whose use means code reads attributes by a computed name: every attribute of the
# user modules it reaches is keyed (the ``ALL_ATTRS`` marker among the walk's names).
_DYNAMIC_ATTR_NAMES = frozenset(
    {"vars", "globals", "locals", "__dict__", "__getattribute__", "attrgetter", "getattr_static"}
)
# Builtins that read an attribute named by their second argument.
_GETATTR_BUILTINS = frozenset({"getattr", "hasattr"})
# Names whose use imports a module named at run time: the walk cannot tell which.
_DYNAMIC_IMPORT_NAMES = frozenset({"__import__", "import_module"})
ALL_ATTRS = "<any attribute>"
# Library modules whose functions return a new value at every call (random numbers, clocks,
# identifiers): a compiled graph would replay the value seen while tracing.
_VOLATILE_MODULES = ("random", "secrets", "uuid", "time", "numpy.random")
_VOLATILE_NAMES = {
    "posix": frozenset({"urandom", "getrandom"}),
    "nt": frozenset({"urandom"}),
    "os": frozenset({"urandom", "getrandom"}),
    "datetime": frozenset({"now", "today", "utcnow"}),
}


def _is_library_module(name: str | None) -> bool:
    """Whether ``name`` is a module of an installed library (keyed by name, not content)."""
    if not name:
        return False
    if _is_own_module(name):
        return False  # keyed by name, source digest and closures (_Walker.function)
    return _is_library_root(name.split(".", 1)[0])


_OWN_ROOT = __name__.split(".", 1)[0]


def _is_own_module(name: str | None) -> bool:
    """A module of this package (torch_patches; never torch itself, in the upstream form)."""
    if not name or _OWN_ROOT == "torch":
        return False
    return name == _OWN_ROOT or name.startswith(_OWN_ROOT + ".")


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


def _library_version(module: str) -> str:
    """The installed version of the distribution providing ``module`` ("" for the standard
    library and builtins, whose code Python's version fixes)."""
    return _root_version(module.split(".", 1)[0])


@functools.lru_cache(maxsize=256)
def _root_version(root: str) -> str:
    if root in sys.stdlib_module_names or root in ("builtins", "posix", "nt"):
        return ""
    if root == "torch":
        return torch.__version__
    import importlib.metadata

    try:
        names = _distributions().get(root) or [root]
        return ",".join(f"{n}=={importlib.metadata.version(n)}" for n in sorted(set(names)))
    except Exception:  # noqa: BLE001 - no metadata: the module's file stands for its version
        path = getattr(sys.modules.get(root), "__file__", None)
        return f"file:{path}" if path else "unknown"


@functools.lru_cache(maxsize=1)
def _distributions() -> Any:
    """Top-level module -> distributions providing it (scans the installed metadata once)."""
    import importlib.metadata

    return importlib.metadata.packages_distributions()


def _volatile_name(v: Any) -> str | None:
    """``module.name`` if calling ``v`` returns a new value each time (see _VOLATILE_MODULES)."""
    owner = getattr(v, "__self__", None)
    module = getattr(v, "__module__", None)
    if isinstance(owner, types.ModuleType):
        module = owner.__name__
    elif isinstance(owner, type):
        module = owner.__module__
    elif owner is not None and module in (None, "builtins"):
        module = type(owner).__module__
    if not isinstance(module, str):
        return None
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or type(v).__name__
    short = str(name).rsplit(".", 1)[-1]
    if any(module == m or module.startswith(m + ".") for m in _VOLATILE_MODULES) or short in _VOLATILE_NAMES.get(module, ()):
        return f"{module}.{name}"
    return None


@functools.lru_cache(maxsize=1024)
def _is_library_root(root: str) -> bool:
    if root in _LIBRARY_ROOTS or root in sys.stdlib_module_names or root == "builtins":
        return True
    # Other installed distributions (site-packages); user code and editable installs are not.
    module = sys.modules.get(root)
    path = getattr(module, "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


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

    def same_as(self, other: "HookIdentity") -> bool:
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
        self.count = 0

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
            return ("ref", self.seen[id(v)])
        self.seen[id(v)] = len(self.seen)
        self.pins.append(v)  # keeps ids in `seen` unique for the walk
        d = depth + 1
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(self.value(x, d) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, tuple(sorted((self.value(x, d) for x in v), key=repr)))
        if isinstance(v, dict):
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
            return ("partial", self.value(v.func, d), self.value(v.args, d), self.value(v.keywords, d))
        if isinstance(v, types.ModuleType):
            return self.module(v, d)
        if isinstance(v, type):
            return self.cls(v, d)
        if isinstance(v, enum.Enum):
            return ("enum", self.cls(type(v), d), v.name)
        if isinstance(v, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            return ("descriptor", v.__objclass__.__qualname__, v.__name__)  # a slot, by name
        if isinstance(v, (types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodDescriptorType,
                          types.MethodWrapperType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
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

        meta = ("tensor", str(t.dtype), tuple(t.shape), tuple(t.stride()), str(t.device),
                t.requires_grad, type(t).__qualname__)
        if is_fake(t):
            self.unkeyable.append("it captures a fake tensor (made while tracing), which has no value to run with")
            return meta
        if id(t) in self.lifted:
            # A runtime input of the graphs (``find_inputs``): its metadata is what the
            # compiled graph depends on; Dynamo guards it at its source.
            return meta + ("lifted",)
        if (
            t.numel() <= _TENSOR_VALUE_NUMEL
            and t.device.type == "cpu"
            and t.layout == torch.strided
            and type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
        ):
            from torch.utils._python_dispatch import _disable_current_modes

            # Read the bytes outside whatever mode is tracing (fake, proxy, functional).
            with _disable_current_modes(), torch._C._DisableTorchDispatch():
                data = t.detach().contiguous().view(-1)
                raw = bytes(data.view(torch.uint8).numpy()) if data.numel() and data.dtype.itemsize else repr(data.tolist()).encode()
            return meta + ("value", hashlib.sha256(raw).hexdigest()[:24])
        self.local.append(
            f"captures a {str(t.dtype).replace('torch.', '')}{list(t.shape)} tensor on "
            f"{t.device.type}, keyed by identity and version (only CPU tensors of at most "
            f"{_TENSOR_VALUE_NUMEL} elements are keyed by value)"
        )
        return meta + ("identity", id(t), t._version)

    def volatile(self, v: Any) -> None:
        name = _volatile_name(v)
        if name is not None:
            self.unkeyable.append(
                f"it calls {name}, whose result changes at every call: a compiled graph would "
                "replay the value seen while tracing"
            )

    def code(self, co: types.CodeType, depth: int) -> Any:
        info = _code_info(co)
        self.names.update(info.names)
        self.unkeyable.extend(info.unkeyable)
        return info.key

    def made_with(self, fn: types.FunctionType, depth: int) -> Any:
        """What a function object carries beyond its code: defaults, closure, attributes."""
        closure = tuple(
            self.value(cell.cell_contents, depth) if _cell_filled(cell) else ("empty",)
            for cell in (fn.__closure__ or ())
        )
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
            for mod_name in dict.fromkeys((target, target.split(".", 1)[0])) if target else ():
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
        key = tuple(
            (k, self.value(v, depth)) for k, v in sorted(ns.items()) if not (k.startswith("__") and k.endswith("__"))
        )
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
        mro = []
        for base in c.__mro__:
            if _is_library_module(base.__module__):
                mro.append(("lib-class", base.__module__, base.__qualname__))
                continue
            entries = tuple(
                (k, self.value(v, depth))
                for k, v in base.__dict__.items()
                if k not in _CLASS_DICT_SKIP
            )
            mro.append(("class", base.__module__, base.__qualname__, entries))
        return ("class-mro", tuple(mro))

    def instance(self, v: Any, depth: int) -> Any:
        state = _instance_dict(v)
        slots = _slot_values(v)
        if state is None and slots is None:
            if type(v).__module__ == "numpy" and hasattr(v, "tobytes") and getattr(v, "size", 1 << 30) <= _TENSOR_VALUE_NUMEL:
                return ("ndarray", str(v.dtype), tuple(v.shape), hashlib.sha256(v.tobytes()).hexdigest()[:24])
            self.unkeyable.append(
                f"it reaches a {type(v).__module__}.{type(v).__qualname__} object, whose state "
                "torch_patches cannot see (no __dict__), so a compiled graph could not tell "
                "when it changes"
            )
            return ("opaque", type(v).__qualname__)
        return (
            "object",
            self.cls(type(v), depth),
            self.value(state, depth) if state is not None else None,
            self.value(slots, depth) if slots is not None else None,
        )

    def graph_module(self, gm: torch.fx.GraphModule, depth: int) -> Any:

        attrs = []
        for node in gm.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                obj: Any = gm
                for part in str(node.target).split("."):
                    obj = getattr(obj, part, None)
                attrs.append((node.op, str(node.target), self.value(obj, depth)))
            elif node.op == "call_function" and not isinstance(
                node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, types.BuiltinFunctionType)
            ):
                # fx.wrap leaves and other Python callables the graph calls: make_fx traces
                # through them, so their code counts; a user_cache_hash stands for it.
                user_hash = leaf_cache_hash(node)
                if user_hash is not None:
                    attrs.append((node.name, ("user_cache_hash", user_hash)))
                else:
                    attrs.append((node.name, self.value(node.target, depth)))
        return ("graph_module", type(gm).__qualname__, gm.code, tuple(attrs))


# Class-namespace entries that hold no behaviour of their own: descriptors of the instance
# dict, the docstring, and dataclasses' bookkeeping (derived from the class body, whose
# defaults and generated methods are keyed themselves).
_CLASS_DICT_SKIP = frozenset(
    {"__dict__", "__weakref__", "__doc__", "__dataclass_fields__", "__dataclass_params__"}
)


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})


@functools.lru_cache(maxsize=8192)
def _global_names(co: types.CodeType) -> frozenset[str]:
    """Global names the code (and code nested in it) reads or writes (not attribute names)."""
    import dis

    out = {ins.argval for ins in dis.get_instructions(co) if ins.opname in _GLOBAL_OPS}
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            out |= _global_names(c)
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class _CodeInfo:
    key: Any
    #: Names the code may read as attributes (``ALL_ATTRS``: any, by a computed name).
    names: frozenset[str]
    #: Why the code cannot be keyed (I/O, dynamic imports).
    unkeyable: tuple[str, ...]
    #: Modules the code imports: (level, name) of each ``import``.
    imports: tuple[tuple[int, str], ...]


_SIMPLE_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST",
                           "LOAD_CLOSURE", "LOAD_FAST_BORROW"})
_CALLS = frozenset({"CALL", "CALL_FUNCTION", "PRECALL"})


def _constant_name_call(ins: list[Any], i: int) -> bool:
    """Whether the ``getattr``/``hasattr`` loaded at ``ins[i]`` is called as
    ``getattr(<name or attribute chain>, "CONSTANT"[, <constant>])``.  Anything else (a
    computed name, an object made by a call, the builtin passed as a value) is not: the
    caller then keys every attribute (conservative)."""
    j = i + 1
    if j >= len(ins) or ins[j].opname not in _SIMPLE_LOADS or "NULL" in ins[j].argrepr:
        return False
    j += 1
    while j < len(ins) and ins[j].opname == "LOAD_ATTR" and "NULL" not in ins[j].argrepr:
        j += 1
    if j >= len(ins) or ins[j].opname != "LOAD_CONST" or not isinstance(ins[j].argval, str):
        return False
    argc = 2
    j += 1
    if j < len(ins) and ins[j].opname == "LOAD_CONST":
        argc, j = 3, j + 1
    if j < len(ins) and ins[j].opname == "PRECALL":
        j += 1
    return j < len(ins) and ins[j].opname in _CALLS and ins[j].arg == argc


@functools.lru_cache(maxsize=8192)
def _code_info(co: types.CodeType) -> _CodeInfo:
    """What a code object (and the code nested in it) reads, and its key.

    Code objects and their constants are immutable, so this is cached per code object.
    """
    import dis

    names = set(co.co_names)
    ins = list(dis.get_instructions(co))
    reasons = []
    imports = []
    for i, instr in enumerate(ins):
        if instr.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            name = instr.argval
            if name in _IO_BUILTINS:
                reasons.append(f"it has side effects or runs dynamic code (calls {name}())")
            elif name in _GETATTR_BUILTINS and not _constant_name_call(ins, i):
                names.add(ALL_ATTRS)
        elif instr.opname == "IMPORT_NAME":
            level = ins[i - 2].argval if i >= 2 and ins[i - 2].opname == "LOAD_CONST" else 0
            imports.append((level if isinstance(level, int) else 0, instr.argval))
    if names & _DYNAMIC_ATTR_NAMES:
        names.add(ALL_ATTRS)
    for name in sorted(names & _DYNAMIC_IMPORT_NAMES):
        reasons.append(f"it imports a module named at run time ({name}), which the key cannot follow")
    consts: list[Any] = []
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            inner = _code_info(c)
            names |= inner.names
            reasons.extend(inner.unkeyable)
            imports.extend(inner.imports)
            consts.append(inner.key)
        else:
            if isinstance(c, str):
                names.add(c)  # getattr(obj, "NAME")
            consts.append(_const_key(c))
    key = (
        "code",
        co.co_code,
        getattr(co, "co_exceptiontable", b""),
        tuple(consts),
        co.co_names,
        co.co_varnames,
        co.co_freevars,
        co.co_cellvars,
    )
    return _CodeInfo(key, frozenset(names), tuple(reasons), tuple(imports))


def _resolve_import(level: int, name: str, globs: dict[str, Any]) -> str | None:
    """The absolute name of ``import`` ``name`` at ``level`` in a module with ``globs``."""
    if level == 0:
        return name
    import importlib.util

    try:
        return importlib.util.resolve_name("." * level + name, globs.get("__package__") or "")
    except (ImportError, ValueError):
        return None


def _const_key(c: Any) -> Any:
    """Key of a code constant (None, numbers, strings, bytes, tuples/frozensets of them)."""
    if isinstance(c, (tuple, frozenset)):
        items = tuple(_const_key(x) for x in c)
        return (type(c).__name__, tuple(sorted(items, key=repr)) if isinstance(c, frozenset) else items)
    return (type(c).__name__, c if isinstance(c, _ATOMS) else repr(c))


def _instance_dict(v: Any) -> dict[str, Any] | None:
    try:
        d = object.__getattribute__(v, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if isinstance(d, dict) else dict(d)


def _slot_values(v: Any) -> dict[str, Any] | None:
    slots: dict[str, Any] = {}
    for klass in type(v).__mro__:
        for name in klass.__dict__.get("__slots__", ()) if not _is_library_module(klass.__module__) else ():
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                slots[name] = object.__getattribute__(v, name)
            except AttributeError:
                slots[name] = ("unset",)
    return slots or None


# Attribute names found in each hook's reachable code, so the next walk of the same hook
# starts from them and finishes in one pass (a hint: the walk checks it is complete).
_attr_hints: dict[int, tuple[weakref.ref[Any] | None, frozenset[str]]] = {}


#: Which tensors a hook reads are runtime inputs of the graphs: all it reads (``True``, the
#: ambient hooks), none (``False``), or those at the given paths from it (an in-region scope's
#: hooks: the tensors Dynamo could make inputs at the hook's source).
Lift = bool | frozenset[tuple["Step", ...]]


def hook_identity(fn: Any, lift: Lift = False) -> HookIdentity:
    """Walk ``fn`` (see the module docstring). Never raises for ordinary Python values.

    ``lift``: the tensors ``fn`` reads that are runtime inputs of the graphs
    (``find_inputs``; see :data:`Lift`): keyed by their metadata, not their values or
    identity."""
    hint = _attr_hints.get(id(fn))
    attrs = hint[1] if hint is not None and hint[0] is not None and hint[0]() is fn else frozenset()
    lifted = frozenset(
        id(t.tensor) for t in find_inputs(fn, "pack")[0] if lift is True or t.path in lift
    ) if lift else frozenset()
    while True:
        walker = _Walker(attrs, lifted)
        try:
            key = walker.value(fn)
        except Exception as e:  # noqa: BLE001 - an object that resists inspection
            # Conservative: what cannot be walked cannot be keyed (outcome (c)).
            return HookIdentity(
                key=("unwalkable", type(e).__name__),
                unkeyable=(f"reading what it depends on raised {type(e).__name__}: {e}",),
            )
        if walker.names <= attrs:
            break
        attrs = attrs | walker.names  # a module may hold attributes later code names
    try:
        _attr_hints[id(fn)] = (weakref.ref(fn, lambda _, i=id(fn): _attr_hints.pop(i, None)), attrs)
    except TypeError:
        pass
    pins = tuple(p for p in walker.pins if isinstance(p, torch.Tensor) and not _value_keyed(p))
    return HookIdentity(
        key=key,
        local=tuple(dict.fromkeys(walker.local)),
        unkeyable=tuple(dict.fromkeys(walker.unkeyable)),
        pins=pins,
    )


def _value_keyed(t: torch.Tensor) -> bool:
    return t.numel() <= _TENSOR_VALUE_NUMEL and t.device.type == "cpu"


def config_key() -> Any:
    """Every ``torch_patches.config`` knob, as upstream's ``save_config`` would snapshot it."""
    return tuple(sorted((k, repr(v)) for k, v in config.get_config_copy().items()))


def leaf_cache_hash(node: torch.fx.Node) -> str | None:
    """The user_cache_hash of an opaque leaf call: node.meta's, else its function's."""
    value = node.meta.get("user_cache_hash") or getattr(node.target, CACHE_HASH_ATTR, None)
    return None if value is None else str(value)


# ------------------------------------------------------------------- runtime inputs
# Tensors an ambient saved-tensors hook reads, lifted into the compiled graphs as runtime
# inputs.  A hook that reads a tensor the training loop updates in place every step (a delayed or
# learned scale, an amax history, a step counter) would otherwise be a constant of the graph:
# keyed by value (or by identity and version) in the guard, so each update recompiles.  Here
# such a tensor becomes an input of the Dynamo graph, as a global tensor the traced code reads
# does: Dynamo guards its metadata (dtype, shape, strides, device, requires_grad), never its
# values or its identity, and each call passes the tensor the hook would read *now*.
#
# :func:`find_inputs` walks a hook the way its code reads the world (closure cells, the
# globals its code names, defaults, ``functools.partial`` arguments, a bound method's
# object, attributes of user objects and modules its code names, items of containers) and
# returns, for every plain tensor it reaches, a :class:`LiftedTensor`: the path from the hook
# to it.  At run time :func:`current_input` follows the path again from the hooks active
# *then*, so an in-place update is seen and a rebinding (another tensor of the same
# metadata under the same name) too.  ``hook_identity(fn, lift=True)`` keys a lifted tensor
# by its metadata only; the Dynamo patch (``_dynamo/symbolic_convert.py``) makes it a graph
# input; the inliner traces the hooks with it as an input (``hook_tracing.trace_hook``) and
# maps it to the forward's input, saved for the backward.


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
        for name in sorted(_global_names(v.__code__)):
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
                found = v._parameters.get(n, v._buffers.get(n)) if n in v._parameters or n in v._buffers else None
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


#: The alias :func:`current_input` gave for each tensor, while it lives and its storage,
#: offset, sizes and strides stay the same: one object per tensor (Dynamo's no-aliasing guard
#: compares its inputs' ids, and a new object at each call could take a freed one's id).
#: By id (a tensor's ``==`` compares values, so no weak-keyed mapping), dropped with it.
_aliases: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def _alias_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage with a version counter of its own (kept per tensor)."""
    held = _aliases.get(id(t))
    alias = held[1] if held is not None and held[0]() is t else None
    if (
        alias is None
        or alias.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        or alias.untyped_storage().nbytes() != t.untyped_storage().nbytes()
        or alias.storage_offset() != t.storage_offset()
        or alias.size() != t.size()
        or alias.stride() != t.stride()
    ):
        with torch.no_grad():
            alias = torch.empty((0,), dtype=t.dtype, device=t.device)
            alias.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        _aliases[id(t)] = (weakref.ref(t, lambda _, i=id(t): _aliases.pop(i, None)), alias)
    return alias


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


# ------------------------------------------------------------------- pair keys
# The keys of a hook pair, built from the walk above: the Dynamo guard's
# (hooks_guard_state), the compile caches' (hooks_cache_key), and the checks behind both.


def hook_cache_hash(fn: Any) -> tuple[str | None, list[str]]:
    """(digest, reasons): a digest of one hook valid across processes.

    None, with the reasons, when part of the hook is keyed by identity (process-local) or
    cannot be keyed at all: compile caches must then bypass, never guess.
    """
    ident = hook_identity(fn)
    reasons = list(ident.local + ident.unkeyable)
    return (None, reasons) if reasons else (ident.digest, [])


def hooks_cache_key(
    pack: Any, unpack: Any, lift: Lift | tuple[Lift, Lift] = False
) -> tuple[str | None, list[str]]:
    """The compile-cache key of a hook pair with the torch_patches config: one function
    for ambient hooks and in-region scopes alike (``lift``: which tensors they read are
    graph inputs, keyed by metadata; one :data:`Lift` for both hooks, or one each). None
    (with reasons) where it is not valid across processes."""
    lifts = lift if isinstance(lift, tuple) else (lift, lift)
    idents = (hook_identity(pack, lifts[0]), hook_identity(unpack, lifts[1]))
    reasons = [r for i in idents for r in i.local + i.unkeyable]
    if reasons:
        return None, list(dict.fromkeys(reasons))
    # Our own source is part of the key: an entry written by another torch_patches is never
    # served (it may have inlined differently).
    return digest((idents[0].key, idents[1].key, config_key(), own_source_digest())), []


def unkeyable_reasons(hooks: Any) -> list[str]:
    """Why a pair of inlineable hooks cannot be inlined soundly (empty: it can)."""
    return list(dict.fromkeys(r for fn in hooks for r in hook_identity(fn).unkeyable))


def hooks_guard_state(hooks: Any) -> tuple[Any, tuple[Any, ...]]:
    """(key, pins): what the saved-tensors-hooks guard compares, and what it must keep alive.

    The key is None without hooks and for hooks that run as Python hooks at runtime (not
    inlineable, or not keyable): the compiled graph does not depend on them, so entering
    or leaving such hooks does not recompile. For inlined hooks it is ("inline", pack key,
    unpack key, config): every dependency of what the graphs compute. The pins are the
    objects keyed by identity (large tensors): holding them keeps their ids unique.
    """
    if not hooks or not pair_is_inlineable(hooks):
        return None, ()
    pack, unpack = (hook_identity(fn, lift=True) for fn in hooks)
    if pack.unkeyable or unpack.unkeyable:
        return None, ()
    return ("inline", pack.key, unpack.key, config_key()), pack.pins + unpack.pins


def hook_content_check(fn: Any, lift: Lift = False) -> tuple[str, Any]:
    """(digest, check) of one hook entered in a compiled region: ``check(value)`` holds
    while ``value`` is an inlineable hook with every dependency of ``fn`` and the
    torch_patches config is unchanged (a knob changes what the inliner does with the hook).
    The tensors at the ``lift`` paths are graph inputs: their metadata is compared, and
    Dynamo's guard on the input checks it again. ``check.pins`` keeps the objects keyed by
    identity alive as long as the check."""
    expected = hook_identity(fn, lift)
    expected_config = config_key()

    def check(value: Any) -> bool:
        return (
            is_inlineable_hook(value)
            and hook_identity(value, lift).same_as(expected)
            and config_key() == expected_config
        )

    check.pins = expected.pins  # type: ignore[attr-defined]
    return expected.digest, check


def describe_guard_key(key: Any) -> str:
    """A short name for a guard key in guard listings: None, or the key's digest."""
    return "None" if key is None else f"inline hooks {digest(key)}"


def hooks_guard_key(hooks: Any) -> Any:
    """The key of :func:`hooks_guard_state`."""
    return hooks_guard_state(hooks)[0]


def content_key(fn: Any) -> Any:
    """The identity key of one hook (process-local; for purity checks)."""
    return hook_identity(fn).key
