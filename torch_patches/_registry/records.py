"""The registry's records: what a patch (:class:`Patch`) or a global effect
(:class:`Effect`, with its upstream form :class:`UpstreamForm`) is, the versions it holds
for, and what :func:`~torch_patches._registry.install.status` reports (:class:`PatchStatus`).
The list of records is ``patches.py``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: Oldest and newest torch (major, minor) this project supports.
SUPPORTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced torch attribute.

    Attributes:
        name: short unique name, ``area.what`` (used in errors, logs, status, export).
        target: ``"module:Qual.name"`` of the torch attribute that is replaced.
        replacement: ``"module:attr"`` of our object.  With ``wraps=True`` it is a
            factory called with the original function that returns the replacement.
        summary: one line, imperative, as an upstream commit title would read.
        upstream: link to the upstream code/PR this patch changes.
        retire_when: the condition under which this patch can be deleted.
        fingerprints: torch version -> fingerprint of the upstream source this patch
            was written against (see :func:`fingerprint_source`).  The installed
            torch's fingerprint must be one of the values.
        depends_on: further ``"module:Qual.name"`` whose source the patch relies on
            (conventions it reads or functions it calls); they are part of the
            fingerprint.
        torch_min / torch_max: inclusive (major, minor) band.
        after: names of patches this one builds on (order of the upstream stack).
        issue: the tracker issue that introduced it.
        tests: our test files that exercise it (the Test Plan of its upstream commit).
        area: ``"core"`` (always applied) or an opt-out area named by a keyword of
            :func:`apply` (``"offload"``: ``apply(offload=False)`` leaves it out).
        measured: what the patch changes, measured (the bench tables in
            ``benchmarks/README.md``, a page per topic in ``benchmarks/results/``, or the
            test that shows it): the "Effect" a reviewer weighs its upstream commit by.
        risk: what could go wrong with it, and where it stays as before: the commit's "Risk".
    """

    name: str
    target: str
    replacement: str
    summary: str
    upstream: str
    retire_when: str
    fingerprints: Mapping[str, str]
    wraps: bool = False
    depends_on: tuple[str, ...] = ()
    torch_min: tuple[int, int] = SUPPORTED_TORCH[0]
    torch_max: tuple[int, int] = SUPPORTED_TORCH[1]
    after: tuple[str, ...] = ()
    issue: int | None = None
    tests: tuple[str, ...] = ()
    area: str = "core"
    measured: str = ""
    risk: str = ""

    @property
    def band(self) -> str:
        return "{}.{}-{}.{}".format(*self.torch_min, *self.torch_max)

    def in_band(self, version: tuple[int, int]) -> bool:
        return self.torch_min <= version <= self.torch_max


@dataclasses.dataclass(frozen=True)
class UpstreamForm:
    """What an :class:`Effect` is in the upstream form, where torch holds the feature and no
    ``apply()`` runs: code that runs when an upstream module is imported.

    Attributes:
        home: the upstream module whose import does it (``torch._logging._registrations``).
        form: ``"module:function"`` of ours, a function without parameters whose body is
            that code.  The exporter appends the body to ``home``, names resolved as in any
            exported code; a name of ours bound to a string constant is written as the
            literal (an upstream registration names its artifact in place).
        title: the subject of its upstream commit (``[inductor] ...``).
        after: patches it builds on: its commit comes right after the last of them, first
            in the stack when there are none.
    """

    home: str
    form: str
    title: str
    after: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Effect:
    """A global effect of :func:`apply` that is not an attribute replacement (a logging
    artifact, an Inductor lowering, an audit hook).

    Attributes:
        name: ``area.what``, as patch names.
        install: ``"module:function"`` called by :func:`apply` after every patch is in
            place; it returns a callable that undoes the effect, or None when the effect
            cannot be undone and is inert once unapplied (``inert`` says why).
        summary: what it does, one line.
        inert: for an effect that stays after :func:`unapply`: why it then does nothing.
        area: as :attr:`Patch.area`.
        upstream: its upstream form, exported as a commit of its own (see
            :class:`UpstreamForm`).
        upstream_lazy: instead of ``upstream``: why the upstream form needs none (the
            exported code does it at first use).
        tests: as :attr:`Patch.tests`.
        measured / risk: as :attr:`Patch.measured` and :attr:`Patch.risk`, for the commit
            of its upstream form.
    """

    name: str
    install: str
    summary: str
    inert: str = ""
    area: str = "core"
    upstream: UpstreamForm | None = None
    upstream_lazy: str = ""
    tests: tuple[str, ...] = ()
    measured: str = ""
    risk: str = ""


@dataclasses.dataclass
class PatchStatus:
    """What :func:`status` reports for one patch on the installed torch."""

    name: str
    target: str
    band: str
    in_band: bool
    applied: bool
    fingerprint: str | None
    fingerprint_ok: bool
    upstream: str
    retire_when: str
    summary: str
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- versions


def parse_version(version: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot parse torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def torch_version() -> str:
    """The installed torch's version string (a seam for tests)."""
    import torch

    return str(torch.__version__)


# ---------------------------------------------------------------------------- targets


def _split(target: str) -> tuple[str, list[str]]:
    module_name, _, qual = target.partition(":")
    if not module_name or not qual:
        raise ValueError(f"target {target!r} is not of the form 'module:Qual.name'")
    return module_name, qual.split(".")


def validate_records(patches: Iterable[Patch]) -> list[str]:
    """Problems with the records themselves (used by the meta-tests)."""
    problems = []
    names = set()
    for p in patches:
        for field in ("name", "target", "replacement", "summary", "upstream", "retire_when"):
            if not getattr(p, field):
                problems.append(f"{p.name or '?'}: empty {field}")
        if p.name in names:
            problems.append(f"{p.name}: duplicate name")
        names.add(p.name)
        if not p.fingerprints:
            problems.append(f"{p.name}: no fingerprints")
        if not p.upstream.startswith("https://github.com/pytorch/pytorch"):
            problems.append(f"{p.name}: upstream link is not a pytorch/pytorch URL")
        if not (SUPPORTED_TORCH[0] <= p.torch_min <= p.torch_max <= SUPPORTED_TORCH[1]):
            problems.append(f"{p.name}: band {p.band} outside the supported window")
        for dep in p.after:
            if dep not in names:
                problems.append(f"{p.name}: 'after' names {dep!r}, not an earlier patch")
        try:
            _split(p.target)
            _split(p.replacement)
        except ValueError as e:
            problems.append(f"{p.name}: {e}")
    return problems
