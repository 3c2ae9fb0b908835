"""Which saved-tensor hooks can be inlined, how they are named, and their content keys.

Upstream counterpart: ``torch/_functorch/_aot_autograd/utils.py``
(``top_saved_tensors_hooks``, ``saved_tensors_hooks_are_inlineable``).  Upstream
accepts only ``fx.GraphModule`` pairs and tells hooks apart by ``id()``.  We also accept
plain functions the user marked as inlineable (``torch_patches.hooks.inlineable``), and
key hooks by *content*, so an identical hook recreated every step is the same hook
(guards, caches) while a hook whose code or captured constants changed is not.
"""

from __future__ import annotations

import dis
import hashlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch


#: Attribute set on a plain function by ``torch_patches.hooks.inlineable``.
INLINEABLE_ATTR = "__torch_patches_inlineable__"

# Tensors captured by a hook are keyed by value up to this many elements, by
# identity + version counter above it.
_TENSOR_VALUE_KEY_NUMEL = 4096


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost saved-tensors hooks pair active right now, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def is_inlineable_hook(fn: Any) -> bool:
    return isinstance(fn, torch.fx.GraphModule) or (
        callable(fn) and getattr(fn, INLINEABLE_ATTR, False) is True
    )


def saved_tensors_hooks_are_inlineable(hooks: Any) -> bool:
    """Replacement for upstream's predicate: GraphModules or marked functions, both."""
    if not hooks:
        return False
    pack, unpack = hooks
    return is_inlineable_hook(pack) and is_inlineable_hook(unpack)


def is_hookable_dtype(dtype: torch.dtype) -> bool:
    """Whether user hooks see saved tensors of ``dtype`` (``config.hooked_saved_tensor_dtypes``).

    "float" (default): floating point and complex only; masks and indices the partitioner
    saves are kept as they are. "all": every dtype, as eager autograd would pass them.
    """
    from torch_patches import config

    policy = config.hooked_saved_tensor_dtypes
    if policy == "all":
        return True
    if policy != "float":
        raise ValueError(
            f"torch_patches.config.hooked_saved_tensor_dtypes must be 'float' or 'all', got {policy!r}"
        )
    return dtype.is_floating_point or dtype.is_complex


def describe_tensor(dtype: torch.dtype, shape: Any, device: torch.device) -> str:
    """``float32[4, 8] on cpu``: a tensor in errors and logs."""
    return f"{str(dtype).replace('torch.', '')}{list(shape)} on {device.type}"


def describe_value(val: Any) -> str:
    """A tensor as :func:`describe_tensor` writes it; anything else by its type's name."""
    if isinstance(val, torch.Tensor):
        return describe_tensor(val.dtype, val.shape, val.device)
    return type(val).__name__


def hook_name(fn: Any) -> str:
    """A human name for a hook, for errors and logs."""
    if isinstance(fn, torch.fx.GraphModule):
        return f"GraphModule {type(fn).__name__!r}"
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qual}"


# ---------------------------------------------------------------------- content keys


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    meta = (str(t.dtype), tuple(t.shape), str(t.device), t.requires_grad)
    if (
        t.numel() <= _TENSOR_VALUE_KEY_NUMEL
        and t.device.type == "cpu"
        and not t.is_sparse
        and type(t) is torch.Tensor
    ):
        data = t.detach().contiguous().view(-1)
        if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raw = bytes(data.view(torch.uint8).numpy()) if data.numel() else b""
        else:
            raw = repr(data.tolist()).encode()
        return ("tensor",) + meta + (hashlib.sha256(raw).hexdigest()[:16],)
    # Large or device tensors: identity and version counter (in-place changes count).
    return ("tensor-ref",) + meta + (id(t), t._version)


_ATOMS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_REPR_ATOMS = (torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)


class _Keyer:
    """Content key of a Python value as a hook sees it (code, constants, tensors)."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}
        # Why the key is only valid in this process (it holds an id()); a key with
        # reasons can guard a compiled frame but must not key a cross-process cache.
        self.process_local: list[str] = []

    def value(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, _ATOMS):
            return (type(v).__name__, v)
        if isinstance(v, _REPR_ATOMS):
            return (type(v).__name__, repr(v))
        if depth > 6:
            self.process_local.append(f"nests values too deeply ({type(v).__qualname__})")
            return ("deep", type(v).__qualname__, id(v))
        if id(v) in self._seen:  # cycles
            return ("cycle", self._seen[id(v)])
        self._seen[id(v)] = len(self._seen)
        if isinstance(v, torch.Tensor):
            key = _tensor_key(v)
            if key[0] == "tensor-ref":
                self.process_local.append(
                    f"captures a {describe_tensor(v.dtype, v.shape, v.device)} tensor "
                    "(keyed by identity: only small CPU tensors are keyed by value)"
                )
            return key
        if isinstance(v, (tuple, list, frozenset, set)):
            items = [self.value(x, depth + 1) for x in v]
            if isinstance(v, (set, frozenset)):
                items = sorted(items, key=repr)
            return (type(v).__name__, tuple(items))
        if isinstance(v, dict):
            return (
                "dict",
                tuple(sorted((repr(k), self.value(x, depth + 1)) for k, x in v.items())),
            )
        if isinstance(v, torch.fx.GraphModule):
            return self.graph_module(v, depth)
        if isinstance(v, types.FunctionType):
            return self.function(v, depth)
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__, depth + 1), self.value(v.__self__, depth + 1))
        if isinstance(v, types.ModuleType):
            return ("module", v.__name__)
        if isinstance(v, type) or isinstance(v, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return ("named", getattr(v, "__module__", None), getattr(v, "__qualname__", repr(v)))
        if isinstance(v, torch.nn.Module):
            return (
                "nn.Module",
                type(v).__qualname__,
                tuple((k, self.value(p, depth + 1)) for k, p in v.state_dict().items()),
            )
        # Unknown objects: identity (a recreated one counts as a different hook).
        self.process_local.append(f"captures a {type(v).__qualname__} object (keyed by identity)")
        return ("object", type(v).__module__, type(v).__qualname__, id(v))

    def code(self, co: types.CodeType, depth: int) -> Any:
        consts = tuple(
            self.code(c, depth + 1) if isinstance(c, types.CodeType) else self.value(c, depth + 1)
            for c in co.co_consts
        )
        return ("code", co.co_code, consts, co.co_names, co.co_varnames, co.co_freevars)

    def function(self, fn: types.FunctionType, depth: int) -> Any:
        closure = tuple(
            self.value(cell.cell_contents, depth + 1) if _cell_filled(cell) else ("empty",)
            for cell in (fn.__closure__ or ())
        )
        # Globals the code reads (recursively through nested code objects).
        names: set[str] = set()
        _collect_names(fn.__code__, names)
        glob = tuple(
            (name, self.value(fn.__globals__[name], depth + 1))
            for name in sorted(names)
            if name in fn.__globals__
        )
        return (
            "function",
            fn.__module__,
            fn.__qualname__,
            self.code(fn.__code__, depth),
            self.value(fn.__defaults__, depth + 1),
            self.value(fn.__kwdefaults__, depth + 1),
            closure,
            glob,
        )

    def graph_module(self, gm: torch.fx.GraphModule, depth: int) -> Any:
        attrs = []
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                obj: Any = gm
                for part in str(node.target).split("."):
                    obj = getattr(obj, part, None)
                attrs.append((node.target, self.value(obj, depth + 1)))
            elif node.op == "call_function" and (
                node.meta.get("is_wrapped", False) or isinstance(node.target, types.FunctionType)
            ):
                # fx.wrap leaf calls: opaque to the graph. The user's cache hash stands for
                # them where given; their Python code keys guards, never a cache.
                user_hash = leaf_cache_hash(node)
                if user_hash is not None:
                    attrs.append((node.name, ("user_cache_hash", user_hash)))
                else:
                    self.process_local.append(
                        f"calls the fx.wrap leaf {getattr(node.target, '__qualname__', node.target)} "
                        "without a user_cache_hash"
                    )
                    attrs.append((node.name, self.value(node.target, depth + 1)))
        return ("graph_module", gm.code, tuple(attrs))


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})


def _collect_names(co: types.CodeType, out: set[str]) -> None:
    """Global names the code (and code nested in it) reads or writes.

    Not ``co_names``: it also holds attribute names, so ``torch.ops.torch_patches.offload``
    would drag in a module global that happens to be called ``offload``.
    """
    out.update(
        ins.argval for ins in dis.get_instructions(co) if ins.opname in _GLOBAL_LOADS
    )
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _collect_names(c, out)


#: Attribute ``torch_patches.hooks.cache_hash`` sets on an fx.wrap leaf function.
CACHE_HASH_ATTR = "__torch_patches_user_cache_hash__"


def leaf_cache_hash(node: torch.fx.Node) -> str | None:
    """The user_cache_hash of an opaque leaf call: node.meta's, else its function's."""
    value = node.meta.get("user_cache_hash") or getattr(node.target, CACHE_HASH_ATTR, None)
    return None if value is None else str(value)


def hook_cache_hash(fn: Any) -> tuple[str | None, list[str]]:
    """(digest, reasons): a digest of the hook's content valid across processes.

    The digest is None, with the reasons, when part of the key is process-local: an opaque
    fx.wrap leaf call without a user_cache_hash, a captured tensor keyed by identity, an
    unknown captured object. Compile caches must then bypass, never guess.
    """
    keyer = _Keyer()
    key = keyer.value(fn)
    if keyer.process_local:
        return None, list(dict.fromkeys(keyer.process_local))
    return _digest(key), []


def _digest(key: Any) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:20]


def content_key(fn: Any) -> Any:
    """Content key of one hook (hashable, process-local)."""
    return _Keyer().value(fn)


def content_hash(fn: Any) -> str:
    """Digest of a hook's content for guards (may hold id()s: see :func:`hook_cache_hash`)."""
    return _digest(content_key(fn))


# Guards evaluate the key on every call; hooks that are the same objects as last time
# (and unchanged, for GraphModules) reuse their digest.
_memo: dict[int, tuple[weakref.ref[Any], Any, str]] = {}


def _stamp(fn: Any) -> Any:
    # A GraphModule's generated code string is replaced whenever it recompiles.
    return id(fn._code) if isinstance(fn, torch.fx.GraphModule) else None


def cached_content_hash(fn: Any) -> str:
    entry = _memo.get(id(fn))
    if entry is not None and entry[0]() is fn and entry[1] == _stamp(fn):
        # Functions: identical object, but closure cells/globals may have changed.
        if not isinstance(fn, types.FunctionType):
            return entry[2]
    digest = content_hash(fn)
    try:
        ref = weakref.ref(fn, lambda _, i=id(fn): _memo.pop(i, None))
    except TypeError:
        return digest
    _memo[id(fn)] = (ref, _stamp(fn), digest)
    return digest


def hooks_guard_key(hooks: Any) -> tuple[str, ...] | None:
    """What the saved-tensors-hooks guard compares.

    None without hooks; ("eager",) for hooks that run as Python hooks at runtime (their
    identity does not matter to the compiled graph); ("inline", pack, unpack digests)
    for inlineable hooks, which are baked into the graphs.
    """
    if not hooks:
        return None
    if not saved_tensors_hooks_are_inlineable(hooks):
        return ("eager",)
    pack, unpack = hooks
    return ("inline", cached_content_hash(pack), cached_content_hash(unpack))
