"""A saved-tensors hook pair's keys for guards and compile caches.

:func:`hook_identity` keys one hook by what its compiled graph depends on (the walk and its
three outcomes: ``hook_walk``), with the tensors it reads that are runtime inputs of the
graphs (``hook_inputs``) keyed by their metadata.  From it: the guard state and the
content check Dynamo installs for the hooks active around a compiled call
(:func:`hooks_guard_state`, :func:`hook_content_check`), the compile-cache key of a pair
(:func:`hooks_cache_key`) and a hook's own ``cache_hash`` (:func:`hook_cache_hash`).

The walk and the keys built from it run while compiling; the last section is what the
guards ask at every compiled call: :func:`hook_identity` is a lookup and its watches
(``hook_watch``) once a hook object was walked, :func:`config_key` a lookup against the
config's hash object, :func:`hooks_guard_key` the two with them.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

from torch_patches import config
from torch_patches._functorch._aot_autograd import hook_inputs
from torch_patches._functorch._aot_autograd.hook_walk import HookIdentity, _Walker, digest, own_source_digest
from torch_patches._functorch._aot_autograd.hook_watch import Watches
from torch_patches.hooks.markers import is_inlineable_hook, pair_is_inlineable

# Attribute names found in each hook's reachable code, so the next walk of the same hook
# starts from them and finishes in one pass (a hint: the walk checks it is complete).
_attr_hints: dict[int, tuple[weakref.ref[Any] | None, frozenset[str]]] = {}


#: Which tensors a hook reads are runtime inputs of the graphs: all it reads (``True``, the
#: ambient hooks), none (``False``), or those at the given paths from it (an in-region scope's
#: hooks: the tensors Dynamo could make inputs at the hook's source).
Lift = bool | frozenset[tuple[hook_inputs.Step, ...]]


# ------------------------------------------------------------------------- the walk
# Once per hook object, and again after one of its watches failed (while compiling).


def _walk(fn: Any, lift: Lift) -> tuple[HookIdentity, _Walker | None]:
    """The walk itself, with the walker whose watches re-check it (None: not cacheable)."""
    hint = _attr_hints.get(id(fn))
    attrs = hint[1] if hint is not None and hint[0] is not None and hint[0]() is fn else frozenset()
    lifted = (
        frozenset(id(t.tensor) for t in hook_inputs.find_inputs(fn, "pack")[0] if lift is True or t.path in lift) if lift else frozenset()
    )
    while True:
        walker = _Walker(attrs, lifted)
        try:
            key = walker.value(fn)
        except Exception as e:  # noqa: BLE001 - an object that resists inspection
            # Conservative: what cannot be walked cannot be keyed (outcome (c)).
            return HookIdentity(
                key=("unwalkable", type(e).__name__),
                unkeyable=(f"reading what it depends on raised {type(e).__name__}: {e}",),
            ), None
        if walker.names <= attrs:
            break
        attrs = attrs | walker.names  # a module may hold attributes later code names
    try:
        fn_id = id(fn)
        _attr_hints[fn_id] = (weakref.ref(fn, lambda _: _attr_hints.pop(fn_id, None)), attrs)
    except TypeError:
        pass
    return HookIdentity(
        key=key,
        local=tuple(dict.fromkeys(walker.local)),
        unkeyable=tuple(dict.fromkeys(walker.unkeyable)),
        pins=tuple(walker.identity_keyed),
    ), walker


def _watch_containers(watches: Watches, value: Any) -> None:
    if isinstance(value, dict):
        watches.dict(value)
        for v in value.values():
            _watch_containers(watches, v)
    elif isinstance(value, (list, set)):
        (watches.sequence if isinstance(value, list) else watches.set)(value)
        for v in value:
            _watch_containers(watches, v)


# ------------------------------------------------------------------- pair keys
# The keys of a hook pair, built from the walk: the Dynamo guard's (hooks_guard_state), the
# compile caches' (hooks_cache_key), and the checks behind both.


def hook_cache_hash(fn: Any) -> tuple[str | None, list[str]]:
    """(digest, reasons): a digest of one hook valid across processes.

    None, with the reasons, when part of the hook is keyed by identity (process-local) or
    cannot be keyed at all: compile caches must then bypass, never guess.
    """
    ident = hook_identity(fn)
    reasons = list(ident.local + ident.unkeyable)
    return (None, reasons) if reasons else (ident.digest, [])


def hooks_cache_key(pack: Any, unpack: Any, lift: Lift | tuple[Lift, Lift] = False) -> tuple[str | None, list[str]]:
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
    key = hooks_guard_key(hooks)
    if key is None:
        return None, ()
    return key, hook_identity(hooks[0], lift=True).pins + hook_identity(hooks[1], lift=True).pins


def hook_content_check(fn: Any, lift: Lift = False) -> tuple[str, Any]:
    """(digest, check) of one hook entered in a compiled region: ``check(value)`` holds
    while ``value`` is an inlineable hook with every dependency of ``fn`` and the
    torch_patches config is unchanged (a knob changes what the inliner does with the hook).
    The tensors at the ``lift`` paths are graph inputs: their metadata is compared, and
    Dynamo's guard on the input checks it again. ``check.pins`` keeps the objects keyed by
    identity alive as long as the check."""
    expected = hook_identity(fn, lift)
    check = _content_check(expected, config_key(), lift)
    check.pins = expected.pins
    return expected.digest, check


def describe_guard_key(key: Any) -> str:
    """A short name for a guard key in guard listings: None, or the key's digest."""
    return "None" if key is None else f"inline hooks {digest(key)}"


def content_key(fn: Any) -> Any:
    """The identity key of one hook (process-local; for purity checks)."""
    return hook_identity(fn).key


# ===================================================================== per compiled call
# What runs at every call of a compiled graph (ARCHITECTURE.md, "What runs per compiled
# call"): lookups against what compiling recorded, never a walk, an input search or a trace
# (test_hook_guards.TestPerCallPath counts them).


class _Known:
    """A hook's identity with what re-checks it (``hook_watch.Watches``)."""

    __slots__ = ("ref", "identity", "watches")

    def __init__(self, ref: weakref.ref[Any], identity: HookIdentity, watches: Any) -> None:
        self.ref, self.identity, self.watches = ref, identity, watches

    def walked(self, fn: Any) -> bool:
        """Whether this is ``fn``'s identity: walked from ``fn`` itself, or from a bound
        method of the same object and function (methods equal by identity of both)."""
        return self.ref() is fn or type(fn) is types.MethodType


#: The identity of each hook object walked, per ``lift``, while the object lives: the walk
#: runs once per hook object and again only after a watch failed.  Keyed by a weak
#: reference to the hook (equal while the hook lives, dropped with it); not by ``id()``,
#: whose every call is an audited event (a call of each audit hook of the process).
_known: dict[weakref.ref[Any], dict[Lift, _Known]] = {}


def hook_identity(fn: Any, lift: Lift = False) -> HookIdentity:
    """The identity of ``fn`` (see the module docstring). Never raises for ordinary Python
    values.

    ``lift``: the tensors ``fn`` reads that are runtime inputs of the graphs
    (``find_inputs``; see :data:`Lift`): keyed by their metadata, not their values or
    identity.

    This runs at every compiled call (the frames' guards): the walk runs once per hook
    object, and afterwards only its watches are checked (dict versions, identities,
    tensor versions: ``hook_watch``); a hook whose watches fail is walked again."""
    try:
        ref = weakref.ref(fn)
        per_lift = _known.get(ref)
    except TypeError:  # not weakly referenceable or not hashable: walked at every request
        return _walk(fn, lift)[0]
    known = per_lift.get(lift) if per_lift is not None else None
    if known is not None and known.walked(fn) and known.watches.holds():
        return known.identity
    identity, walker = _walk(fn, lift)
    if walker is None or (walker.reentered and not _immortal(fn)):
        return identity
    if per_lift is None:
        per_lift = _known.setdefault(weakref.ref(fn, _forget), {})  # dropped with the hook
    # (A hook equal to a known one but another object, a user class's __eq__, takes over
    # the entry: one identity per key at a time.)
    per_lift[lift] = _Known(ref, identity, walker.watches)
    return identity


def _forget(ref: weakref.ref[Any]) -> None:
    _known.pop(ref, None)


def _immortal(fn: Any) -> bool:
    """A module-level function (its module holds it: keeping its identity leaks nothing).
    A hook the walk reached again from itself is otherwise not kept: the watches hold what
    it reaches, and so would hold the hook alive."""
    return isinstance(fn, types.FunctionType) and fn.__globals__.get(fn.__name__) is fn


def config_key() -> Any:
    """Every ``torch_patches.config`` knob, as upstream's ``save_config`` would snapshot it.

    Asked at every compiled call (the guards), so it is remembered with what vouches for
    it: the config module's own hash object (``get_hash`` makes a new one whenever a knob
    was set since it last hashed, ``patch`` included, so the same object means no knob was
    set) and the dict versions of knobs that are mutable containers
    (``numerics_allowlist``), which can change in place."""
    h = config.get_hash()
    memo = _config_memo
    if memo and memo[0] is h and memo[1].holds():
        return memo[2]
    values = config.get_config_copy()
    key = tuple(sorted((k, repr(v)) for k, v in values.items()))
    watches = Watches()
    for name, value in values.items():
        if isinstance(value, (dict, list, set)):
            _watch_containers(watches, getattr(config, name))
    _config_memo[:] = [h, watches, key]
    return key


_config_memo: list[Any] = []


def hooks_guard_key(hooks: Any) -> Any:
    """The key of :func:`hooks_guard_state` (what the guard compares at every call)."""
    if not hooks or not pair_is_inlineable(hooks):
        return None
    pack = hook_identity(hooks[0], lift=True)
    unpack = hook_identity(hooks[1], lift=True)
    if pack.unkeyable or unpack.unkeyable:
        return None
    return ("inline", pack.key, unpack.key, config_key())


def _content_check(expected: HookIdentity, expected_config: Any, lift: Lift) -> Any:
    """An in-region hook's content check (:func:`hook_content_check`): Dynamo runs it on the
    hook at its source at every call."""

    def check(value: Any) -> bool:
        return is_inlineable_hook(value) and hook_identity(value, lift).same_as(expected) and config_key() == expected_config

    return check
