"""How a saved-tensors hook's code reads the world, for the walk that keys it
(``hook_walk``): which modules belong to installed libraries (fixed by their distribution's
version) or to this package, which library functions return a new value at every call
(random numbers, clocks), what a code object names (globals, attributes, imports, computed
names, I/O), and the state of objects Python can see (instance dictionaries, slots)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any

import torch

_ATOMS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented))


# Roots of installed libraries, keyed by name: their code is fixed for a given version
# (every compile cache key already holds torch's version).
_LIBRARY_ROOTS = frozenset({"torch", "numpy", "typing_extensions", "sympy", "triton"})


# Builtins whose call in a hook is I/O: a hook that reaches them is not inlined.
_IO_BUILTINS = frozenset({"print", "open", "input", "breakpoint", "exec", "eval", "compile"})


# Names whose use means code reads attributes by a computed name: every attribute of the
# user modules it reaches is keyed (the ``ALL_ATTRS`` marker among the walk's names).
_DYNAMIC_ATTR_NAMES = frozenset({"vars", "globals", "locals", "__dict__", "__getattribute__", "attrgetter", "getattr_static"})


# Builtins that read an attribute named by their second argument.
_GETATTR_BUILTINS = frozenset({"getattr", "hasattr"})


# Names whose use imports a module named at run time: the walk cannot tell which.
_DYNAMIC_IMPORT_NAMES = frozenset({"__import__", "import_module"})


ALL_ATTRS = "<any attribute>"


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


@functools.lru_cache(maxsize=1024)
def _is_library_root(root: str) -> bool:
    if root in _LIBRARY_ROOTS or root in sys.stdlib_module_names or root == "builtins":
        return True
    # Other installed distributions (site-packages); user code and editable installs are not.
    module = sys.modules.get(root)
    path = getattr(module, "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


# Class-namespace entries that hold no behaviour of their own: descriptors of the instance
# dict, the docstring, and dataclasses' bookkeeping (derived from the class body, whose
# defaults and generated methods are keyed themselves).
_CLASS_DICT_SKIP = frozenset({"__dict__", "__weakref__", "__doc__", "__dataclass_fields__", "__dataclass_params__"})


def _cell_filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
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


_SIMPLE_LOADS = frozenset(
    {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST", "LOAD_CLOSURE", "LOAD_FAST_BORROW"}
)


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


# Library modules whose functions return a new value at every call (random numbers, clocks,
# identifiers): a compiled graph would replay the value seen while tracing.
_VOLATILE_MODULES = ("random", "secrets", "uuid", "time", "numpy.random")


_VOLATILE_NAMES = {
    "posix": frozenset({"urandom", "getrandom"}),
    "nt": frozenset({"urandom"}),
    "os": frozenset({"urandom", "getrandom"}),
    "datetime": frozenset({"now", "today", "utcnow"}),
}


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
