"""Installing the records: :func:`apply`, :func:`unapply`, :func:`status`.

:func:`apply` is transactional: every record is checked first (torch version band,
target present and still torch's own definition, fingerprint known), and only if all
pass is anything patched.  :func:`unapply` puts back every original object by identity,
including copies other modules made with ``from x import f`` (found by scanning
``sys.modules``, in the spirit of gevent's ``monkey``).

Nothing here runs at import time: resolving a target imports torch internals, which
only :func:`apply` and :func:`status` do.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

from torch_patches._registry import patches
from torch_patches._registry.fingerprints import _definition_fingerprint, _function_of, combine_fingerprints
from torch_patches._registry.records import Effect, Patch, PatchStatus, _split, parse_version, torch_version

log = logging.getLogger(__name__)

_MISSING = object()
_MARK = "__torch_patches_patch__"


class PatchError(RuntimeError):
    """Raised by :func:`apply` when a patch cannot be applied. Nothing was patched."""

    def __init__(self, torch_version: str, refusals: list[tuple[str, str]]) -> None:
        self.torch_version = torch_version
        self.refusals = refusals
        lines = [f"torch_patches.apply() refused on torch {torch_version}; nothing was patched."]
        lines += [f"  patch {name!r}: {reason}" for name, reason in refusals]
        super().__init__("\n".join(lines))


class _Refused(Exception):
    pass


# ------------------------------------------------------------------------ fingerprints


def live_fingerprint(targets: Iterable[str]) -> str:
    """Fingerprint of torch's definitions of ``targets`` in the installed torch (the
    originals of targets we patched, not our replacements)."""
    parts = []
    for target in targets:
        _, _, raw = _resolve(target)
        raw = next((p.original for p in _INSTALLED if p.patch.target == target), raw)
        if raw is _MISSING:
            raise LookupError(f"{target} does not exist")
        parts.append(_definition_fingerprint(_function_of(raw)))
    return combine_fingerprints(parts)


# ---------------------------------------------------------------------------- targets


def _resolve(target: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, raw value or _MISSING) for a target."""
    module_name, path = _split(target)
    owner: Any = importlib.import_module(module_name)
    for part in path[:-1]:
        owner = getattr(owner, part)
    return owner, path[-1], vars(owner).get(path[-1], _MISSING)


def _load(spec: str) -> Any:
    module_name, path = _split(spec)
    obj: Any = importlib.import_module(module_name)
    for part in path:
        obj = getattr(obj, part)
    return obj


def _iter_module_dicts() -> Iterator[tuple[ModuleType, dict[str, Any]]]:
    for name, module in list(sys.modules.items()):
        # Our own modules may hold originals on purpose (wrappers); never rebind them.
        if module is None or name == "torch_patches" or name.startswith("torch_patches."):
            continue
        try:
            d = vars(module)
        except TypeError:
            continue
        yield module, d


def _scan_aliases(values: Iterable[Any]) -> dict[int, list[tuple[ModuleType, str]]]:
    """Every (module, name) in sys.modules that holds one of ``values`` by identity.

    Every module's dict is read: ``gc.get_referrers`` would not see what ``gc.freeze()``
    moved out of the collector's generations (servers and test sessions freeze their
    imports), and learning whether anything is frozen (``gc.get_freeze_count()``) walks
    all of it.  Values of a type hashed and compared by identity (functions, the patched
    targets) are looked up by themselves, without ``id()``: ``id()`` raises an audit event
    (PEP 578), and with an audit hook in the process (``hook_audit``) calling it on each of
    the few hundred thousand values of a large process costs ten times the reading."""
    values = list(values)
    found: dict[int, list[tuple[ModuleType, str]]] = {id(v): [] for v in values}
    if not values:
        return found
    by_identity = frozenset(type(v) for v in values if _hashed_by_identity(type(v)))
    targets = {v for v in values if type(v) in by_identity}
    others = {id(v) for v in values if type(v) not in by_identity}
    for module, d in _iter_module_dicts():
        for name, value in list(d.items()):
            try:
                plain = type(value) in by_identity
            except TypeError:  # a class made unhashable by its metaclass
                plain = False
            if plain:
                if value in targets:
                    found[id(value)].append((module, name))
            elif others and id(value) in others:
                found[id(value)].append((module, name))
    return found


def _hashed_by_identity(kind: type) -> bool:
    """Whether ``kind``'s instances hash and compare by identity (object's own slots)."""
    return getattr(kind, "__hash__", None) is object.__hash__ and getattr(kind, "__eq__", None) is object.__eq__


# ----------------------------------------------------------------------------- state


@dataclasses.dataclass
class _Installed:
    patch: Patch
    owner: Any
    attr: str
    original: Any  # raw object from owner.__dict__, or _MISSING
    replacement: Any  # raw object we put there
    aliases: list[tuple[ModuleType, str]] = dataclasses.field(default_factory=list)

    def install(self) -> None:
        setattr(self.owner, self.attr, self.replacement)
        for module, name in self.aliases:
            vars(module)[name] = self.replacement

    def uninstall(self) -> None:
        if self.original is _MISSING:
            if self.attr in vars(self.owner):
                delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.original)
        for module, name in self.aliases:
            if vars(module).get(name) is self.replacement:
                vars(module)[name] = self.original


_LOCK = threading.RLock()
_INSTALLED: list[_Installed] = []
_ORIGINALS: dict[str, Any] = {}


def _registered() -> tuple[Patch, ...]:
    return patches.PATCHES


def _registered_effects() -> tuple[Effect, ...]:
    return patches.EFFECTS


#: Undo callables of the effects :func:`apply` installed, in install order (None: inert).
_EFFECTS: list[tuple[Effect, Callable[[], None] | None]] = []


def _install_effects(effects: Iterable[Effect]) -> None:
    """Install ``effects`` in order, all or none (undoing the installed ones on failure)."""
    done: list[tuple[Effect, Callable[[], None] | None]] = []
    try:
        for effect in effects:
            done.append((effect, _load(effect.install)()))
    except BaseException:
        _undo_effects(done)
        raise
    _EFFECTS.extend(done)


def _undo_effects(done: list[tuple[Effect, Callable[[], None] | None]]) -> None:
    for _, undo in reversed(done):
        if undo is not None:
            undo()
    done.clear()


def installed_effects() -> list[str]:
    """Names of the global effects :func:`apply` installed (empty when not applied)."""
    return [e.name for e, _ in _EFFECTS]


def _is_torch_definition(raw: Any, target: str) -> bool:
    """Whether ``raw`` is the function torch's module defines at ``target``.

    Names are not enough: ``functools.wraps`` copies ``__module__``/``__qualname__`` onto a
    foreign wrapper (and ``inspect`` follows its ``__wrapped__`` to fingerprint torch's
    source), so the code object must be compiled from the target module's own file.
    """
    fn = _function_of(raw)
    module_name, path = _split(target)
    if getattr(fn, "__module__", None) != module_name or getattr(fn, "__qualname__", None) != ".".join(path) or hasattr(fn, _MARK):
        return False
    code = getattr(fn, "__code__", None)
    module_file = getattr(sys.modules.get(module_name), "__file__", None)
    if code is None or module_file is None:
        return False
    return code.co_name == path[-1] and os.path.samefile(code.co_filename, module_file)


def check_fingerprint(patch: Patch) -> tuple[str, bool]:
    fp = live_fingerprint((patch.target, *patch.depends_on))
    return fp, fp in patch.fingerprints.values()


def _plan(patch: Patch, version_str: str) -> _Installed:
    from torch_patches import config

    version = parse_version(version_str)
    if not patch.in_band(version):
        raise _Refused(f"torch {version_str} is outside the supported band {patch.band} (target {patch.target})")
    try:
        owner, attr, raw = _resolve(patch.target)
    except (ImportError, AttributeError) as e:
        raise _Refused(f"target {patch.target} cannot be resolved: {e}") from e
    if raw is _MISSING:
        raise _Refused(f"target {patch.target} does not exist in torch {version_str}")
    if not _is_torch_definition(raw, patch.target):
        fn = _function_of(raw)
        found = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        code = getattr(fn, "__code__", None)
        if code is not None:
            found += f", code {code.co_name} at {code.co_filename}:{code.co_firstlineno}"
        raise _Refused(f"target {patch.target} is no longer torch's own definition (found {found}); someone else patched it")
    try:
        fp, ok = check_fingerprint(patch)
    except (OSError, LookupError, SyntaxError) as e:
        raise _Refused(f"cannot fingerprint {patch.target}: {e}") from e
    if not ok:
        known = ", ".join(f"{v}={f}" for v, f in sorted(patch.fingerprints.items()))
        reason = (
            f"upstream source of {patch.target} drifted: fingerprint {fp} on torch "
            f"{version_str} matches none recorded ({known}). Re-read the upstream change, "
            "update the patch, then record the new fingerprint (python -m tools.fingerprints)"
        )
        if config.fingerprint_drift != "warn":
            raise _Refused(reason)
        warnings.warn(
            f"torch_patches: applying {patch.name!r} despite drift (config.fingerprint_drift='warn'): {reason}",
            stacklevel=3,
        )
    original_fn = _function_of(raw)
    try:
        obj = _load(patch.replacement)
        new = obj(original_fn) if patch.wraps else obj
    except Exception as e:
        raise _Refused(f"replacement {patch.replacement} failed to load: {e!r}") from e
    if not callable(new):
        raise _Refused(f"replacement {patch.replacement} is not callable")
    # Keep marks upstream decorators put on the original (e.g. guard check specs).
    for key, value in vars(original_fn).items():
        if key != "__wrapped__" and not hasattr(new, key):
            setattr(new, key, value)
    setattr(new, _MARK, patch.name)
    if isinstance(raw, staticmethod):
        new = staticmethod(new)
    elif isinstance(raw, classmethod):
        new = classmethod(new)
    return _Installed(patch, owner, attr, raw, new)


#: Opt-out areas: keyword of :func:`apply` -> what its patches are for.
AREAS = {
    "offload": "Inductor buffer-reuse patches cpu_offload needs (inductor.*); without them cpu_offload() refuses",
}


def _selected(areas: dict[str, bool]) -> tuple[Patch, ...]:
    unknown = sorted(set(areas) - set(AREAS))
    if unknown:
        raise TypeError(f"apply() got unknown area(s) {unknown}; areas: {sorted(AREAS)}")
    return tuple(p for p in _registered() if p.area == "core" or areas.get(p.area, True))


def apply(*, offload: bool = True) -> None:
    """Apply every registered patch, or none.

    Idempotent.  Raises :class:`PatchError` naming each patch that cannot apply on the
    installed torch (version band, missing target, fingerprint drift); in that case
    nothing was patched.  ``offload=False`` leaves out the patches only ``cpu_offload``
    needs (:data:`AREAS`), as gevent's ``patch_all(socket=False)`` does; applying again
    with other areas while applied raises (``unapply()`` first).
    """
    with _LOCK:
        wanted = _selected({"offload": offload})
        if _INSTALLED:
            if {p.patch.name for p in _INSTALLED} != {p.name for p in wanted}:
                raise RuntimeError(
                    f"torch_patches is already applied with other areas ({', '.join(applied_patches())}); call unapply() first"
                )
            return
        version_str = torch_version()
        plans: list[_Installed] = []
        refusals: list[tuple[str, str]] = []
        for patch in wanted:
            try:
                plans.append(_plan(patch, version_str))
            except _Refused as e:
                refusals.append((patch.name, str(e)))
        if refusals:
            raise PatchError(version_str, refusals)

        aliases = _scan_aliases(p.original for p in plans)
        for plan in plans:
            plan.aliases = [(m, n) for m, n in aliases[id(plan.original)] if not (m is plan.owner and n == plan.attr)]
        done: list[_Installed] = []
        try:
            for plan in plans:
                plan.install()
                done.append(plan)
            areas = {"offload": offload}
            _install_effects(e for e in _registered_effects() if e.area == "core" or areas.get(e.area, True))
        except BaseException:
            for plan in reversed(done):
                plan.uninstall()
            raise
        _INSTALLED.extend(done)
        for plan in done:
            _ORIGINALS[plan.patch.name] = plan.original
        log.info(
            "applied %d patches on torch %s: %s",
            len(done),
            version_str,
            ", ".join(p.patch.name for p in done),
        )


class UnapplyError(RuntimeError):
    """Raised by :func:`unapply` when a patched attribute was replaced again after
    :func:`apply` (a foreign patch layered on ours).  Nothing was restored."""


def unapply() -> None:
    """Restore every patched attribute (and every alias of it) to the original object.

    Refuses (:class:`UnapplyError`, nothing restored) when someone replaced a patched
    attribute after :func:`apply`: restoring torch's original under their patch would
    silently drop it, and leaving ours would keep torch patched.  Undo that patch first.
    """
    with _LOCK:
        if not _INSTALLED:
            return
        layered = [
            (plan, vars(plan.owner).get(plan.attr)) for plan in _INSTALLED if vars(plan.owner).get(plan.attr) is not plan.replacement
        ]
        if layered:
            lines = ["torch_patches.unapply() refused; nothing was restored."]
            for plan, found in layered:
                fn = _function_of(found)
                lines.append(
                    f"  patch {plan.patch.name!r}: {plan.patch.target} was replaced after "
                    f"apply() by {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}; "
                    "undo that patch first"
                )
            raise UnapplyError("\n".join(lines))
        _undo_effects(_EFFECTS)
        # Modules imported after apply() may have copied a replacement.
        late = _scan_aliases(p.replacement for p in _INSTALLED)
        for plan in reversed(_INSTALLED):
            plan.uninstall()
            for module, name in late[id(plan.replacement)]:
                if vars(module).get(name) is plan.replacement:
                    vars(module)[name] = plan.original
        _INSTALLED.clear()
        log.info("unapplied all patches")


def is_applied() -> bool:
    return bool(_INSTALLED)


def applied_patches() -> list[str]:
    return [p.patch.name for p in _INSTALLED]


def get_original(name: str) -> Any:
    """The original torch object a patch replaced (while applied, or after)."""
    if name in _ORIGINALS:
        return _function_of(_ORIGINALS[name])
    patch = next((p for p in _registered() if p.name == name), None)
    if patch is None:
        raise KeyError(name)
    return _function_of(_resolve(patch.target)[2])


def status() -> list[PatchStatus]:
    """One :class:`PatchStatus` per registered patch, for the installed torch."""
    version_str = torch_version()
    version = parse_version(version_str)
    applied = set(applied_patches())
    out = []
    for patch in _registered():
        fp, ok, problem = None, False, None
        in_band = patch.in_band(version)
        try:
            fp, ok = check_fingerprint(patch)
            if not ok:
                problem = "fingerprint drift"
        except Exception as e:  # noqa: BLE001 - report, never raise from status
            problem = f"cannot fingerprint: {e}"
        if not in_band:
            problem = f"torch {version_str} outside {patch.band}"
        out.append(
            PatchStatus(
                name=patch.name,
                target=patch.target,
                band=patch.band,
                in_band=in_band,
                applied=patch.name in applied,
                fingerprint=fp,
                fingerprint_ok=ok,
                upstream=patch.upstream,
                retire_when=patch.retire_when,
                summary=patch.summary,
                problem=problem,
            )
        )
    return out
