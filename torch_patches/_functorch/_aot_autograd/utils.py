"""Which saved-tensor hooks can be inlined, how they are named, and their content keys.

Upstream counterpart: ``torch/_functorch/_aot_autograd/utils.py``
(``top_saved_tensors_hooks``, ``saved_tensors_hooks_are_inlineable``).  Upstream
accepts only ``fx.GraphModule`` pairs and tells hooks apart by ``id()``.  We also accept
plain functions the user marked as inlineable (``torch_patches.hooks.inlineable``), and
key hooks by *content*, so an identical hook recreated every step is the same hook
(guards, caches) while a hook whose code or captured constants changed is not.
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from typing import Any

import torch

from torch_patches._hook_identity import config_key, digest, hook_identity, own_source_digest


#: Attribute set on a plain function by ``torch_patches.hooks.inlineable``.
INLINEABLE_ATTR = "__torch_patches_inlineable__"


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost saved-tensors hooks pair active right now, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def ambient_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The hooks compiled graphs plan with around the compiled call: the innermost pair
    active right now, else the ``torch_patches.config.activation_memory_budget`` pair
    (``torch_patches.hooks.budget``), else None.

    The budget pair stands for the config knob everywhere ambient hooks are read (the
    frame's guard, the cache-key subgraphs, the inliner, the runtime wrapper), so a budget
    set in config is keyed exactly as the same pair entered by hand.
    """
    hooks = top_saved_tensors_hooks()
    if hooks is not None:
        return hooks
    from torch_patches import config

    if config.activation_memory_budget is None:
        return None
    from torch_patches.hooks.budget import budget

    try:
        return budget(config.activation_memory_budget)
    except (TypeError, ValueError) as e:
        raise type(e)(f"torch_patches.config.activation_memory_budget: {e}") from None


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
    if isinstance(fn, functools.partial):
        bound = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{hook_name(fn.func)}({', '.join(bound)})"
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qual}"


#: Attribute ``torch_patches.hooks.cache_hash`` sets on an fx.wrap leaf function.
CACHE_HASH_ATTR = "__torch_patches_user_cache_hash__"


def leaf_cache_hash(node: torch.fx.Node) -> str | None:
    """The user_cache_hash of an opaque leaf call: node.meta's, else its function's."""
    value = node.meta.get("user_cache_hash") or getattr(node.target, CACHE_HASH_ATTR, None)
    return None if value is None else str(value)


# ------------------------------------------------------------------- identity keys
# What a hook's compiled graph depends on is walked by torch_patches._hook_identity (see its
# docstring for the three outcomes: keyed by value, process-local, not inlined).


def hook_cache_hash(fn: Any) -> tuple[str | None, list[str]]:
    """(digest, reasons): a digest of one hook valid across processes.

    None, with the reasons, when part of the hook is keyed by identity (process-local) or
    cannot be keyed at all: compile caches must then bypass, never guess.
    """
    ident = hook_identity(fn)
    reasons = list(ident.local + ident.unkeyable)
    return (None, reasons) if reasons else (ident.digest, [])


def hooks_cache_key(pack: Any, unpack: Any) -> tuple[str | None, list[str]]:
    """The compile-cache key of a hook pair with the torch_patches config: one function
    for ambient hooks and in-region scopes alike. None (with reasons) where it is not
    valid across processes."""
    idents = (hook_identity(pack), hook_identity(unpack))
    reasons = [r for i in idents for r in i.local + i.unkeyable]
    if reasons:
        return None, list(dict.fromkeys(reasons))
    # Our own source is part of the key: an entry written by another torch_patches is never
    # served (it may have inlined differently).
    return _digest((idents[0].key, idents[1].key, config_key(), own_source_digest())), []


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
    if not hooks or not saved_tensors_hooks_are_inlineable(hooks):
        return None, ()
    pack, unpack = (hook_identity(fn) for fn in hooks)
    if pack.unkeyable or unpack.unkeyable:
        return None, ()
    return ("inline", pack.key, unpack.key, config_key()), pack.pins + unpack.pins


def describe_guard_key(key: Any) -> str:
    """A short name for a guard key in guard listings: None, or the key's digest."""
    return "None" if key is None else f"inline hooks {digest(key)}"


def hooks_guard_key(hooks: Any) -> Any:
    """The key of :func:`hooks_guard_state`."""
    return hooks_guard_state(hooks)[0]


def content_key(fn: Any) -> Any:
    """The identity key of one hook (process-local; for purity checks)."""
    return hook_identity(fn).key


def _digest(key: Any) -> str:
    return digest(key)


def size_hint(s: Any) -> int:
    """A symbolic size's example value (its hint); 8192 for one with none (unbacked).

    Reading the hint never evaluates the expression, so it installs no guard."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    hint = getattr(node, "hint", None)
    if isinstance(hint, int):
        return hint
    try:
        return int(node.shape_env.size_hint(node.expr))  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no hint (unbacked size)
        return 8192


def nbytes_of(node: torch.fx.Node) -> int:
    """Bytes of the tensor ``node.meta["val"]``, symbolic sizes at their hints; 0 when it is
    not a tensor."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()
