"""The export's data: where our names go upstream (knobs, the hooks library's home), one
commit's upstream form (:class:`PatchExport`), the pending changes to one upstream file
(:class:`FileWork`), what the stack has done so far (:class:`StackState`), and the stack's
order with the commits that stand for no patch of the registry (effects, the public API).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from tools.export_upstream._pysrc import ExportError, Source
from torch_patches._registry import Effect, Patch

TP = "torch_patches"
#: Where knobs of torch_patches' config module go upstream.
CONFIG_HOME = "torch._functorch.config"
#: Upstream names of our knobs; knobs not listed get ``saved_tensors_hooks_<name>``.
KNOB_NAMES = {
    "hook_placement": "saved_tensors_hooks_placement",
    "hooked_saved_tensor_dtypes": "saved_tensors_hooks_dtypes",
    "untraceable_hook": "saved_tensors_hooks_untraceable",
}
#: The line that makes a module a config module (ours and upstream's).
CONFIG_MARK = "install_config_module(sys.modules[__name__])"
#: Methods ``install_config_module`` gives a config module (not definitions of ours).
CONFIG_MODULE_API = frozenset({"get_config_copy", "save_config", "save_config_portable", "get_hash", "patch", "load_config"})
#: The proposed home of ``torch_patches.hooks`` (see ``_names.HOOKS_HOME``).
HOOKS_PACKAGE = "torch.utils.saved_tensors_hooks"
#: Name of the public-API commit (:meth:`Exporter.export_api`).
API_COMMIT = "utils.saved_tensors_hooks_api"


def knob_upstream_name(name: str) -> str:
    if name in KNOB_NAMES:
        return KNOB_NAMES[name]
    return name if name.startswith("saved_tensors_hooks") else f"saved_tensors_hooks_{name}"


def module_relpath(root: str, module: str) -> str | None:
    """``torch/x/y.py`` (or ``.../__init__.py``) for a module under ``root``, if it exists."""
    base = module.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        if os.path.isfile(os.path.join(root, rel)):
            return rel
    return None


def rel_module(rel: str) -> str:
    """The dotted module of a source file's path (``torch/x/__init__.py`` -> ``torch.x``)."""
    return rel[: -len(".py")].removesuffix("/__init__").replace("/", ".")


def is_test_file(rel: str) -> bool:
    """An upstream test file or test helper (not library code)."""
    return rel.startswith(("test/", "torch/testing/_internal/"))


def is_tp(dotted: str) -> bool:
    """A dotted name of ours."""
    return dotted == TP or dotted.startswith(TP + ".")


# -------------------------------------------------------------------------- records


@dataclasses.dataclass
class PatchExport:
    """The upstream form of one patch (or why there is none)."""

    patch: Patch
    number: int
    status: str = "exported"  # or "skipped"
    reason: str = ""
    files: list[str] = dataclasses.field(default_factory=list)
    diff: str = ""
    message: str = ""
    added: list[str] = dataclasses.field(default_factory=list)  # "module:name" added
    knobs: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    tests: list[str] = dataclasses.field(default_factory=list)
    before: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    after: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)

    #: For a commit that adds one new upstream module (split off the patch that first needs
    #: it, see ``split_new_modules``): that module; None for the patch's own commit.
    module: str | None = None
    #: The module of ours the new module stands for (with ``module``).
    source: str | None = None
    #: Upstream test files this commit adds (``_tests.py``), run right after it is applied.
    upstream_tests: list[str] = dataclasses.field(default_factory=list)
    #: ``stage(rel, modules)``: an existing file of the patch with only what the new
    #: ``modules`` need of its additions (``split_new_modules``).
    stage: Callable[[str, frozenset[str]], str] | None = dataclasses.field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The commit's name: the patch's, or ``add-<module>``."""
        return self.patch.name if self.module is None else "add-" + self.module.rpartition(".")[2]

    @property
    def filename(self) -> str:
        return f"{self.number:02d}-{self.name}.patch"

    @property
    def subject(self) -> str:
        return self.message.partition("\n")[0] if self.message else self.patch.summary

    def changed_lines(self) -> int:
        """Lines of library code the diff adds or removes (file headers, tests and test
        helpers aside)."""
        count, library = 0, True
        for line in self.diff.splitlines():
            if line.startswith("diff --git "):
                library = not is_test_file(line.split(" b/", 1)[1])
            elif library and line[:1] in "+-" and not line.startswith(("+++ ", "--- ")):
                count += 1
        return count


@dataclasses.dataclass
class FileWork:
    """Pending changes to one upstream file within one patch."""

    src: Source
    module: str
    imports: dict[str, str] = dataclasses.field(default_factory=dict)  # bound name -> dotted
    helpers: list[tuple[tuple[Any, ...], str]] = dataclasses.field(default_factory=list)
    replace: tuple[int, int, str] | None = None  # (first line, last line, text)
    before_line: int | None = None  # helpers go before this line (else end of file)
    knobs: list[tuple[tuple[Any, ...], str]] = dataclasses.field(default_factory=list)
    bound: set[str] = dataclasses.field(default_factory=set)  # names we bind in it
    tail: list[str] = dataclasses.field(default_factory=list)  # statements run at its import, last
    #: (module, name) of each entry of ``helpers`` / ``knobs``, in order (see ``Workspace.edges``).
    helper_keys: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    knob_keys: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def binds(self, name: str) -> bool:
        return name in self.bound or name in self.src.bindings


class StackState:
    """What the stack has done so far (copied per patch, committed on success)."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}  # relpath -> current text
        self.placed: dict[tuple[str, str], tuple[str, str]] = {}  # (tp module, name) -> (module, name)
        self.homes: dict[str, str] = {}  # satellite tp module -> upstream module

    def copy(self) -> StackState:
        new = StackState()
        new.texts = dict(self.texts)
        new.placed = dict(self.placed)
        new.homes = dict(self.homes)
        return new


# ---------------------------------------------------------------------- the stack


def stack_order(patches: Sequence[Patch]) -> list[Patch]:
    """Registry order, moved where needed so every patch follows those in its ``after``."""
    by_name = {p.name: p for p in patches}
    done: list[Patch] = []
    seen: set[str] = set()

    def visit(p: Patch, path: tuple[str, ...]) -> None:
        if p.name in seen:
            return
        if p.name in path:
            raise ExportError(f"'after' cycle: {' -> '.join(path + (p.name,))}")
        for dep in p.after:
            if dep in by_name:
                visit(by_name[dep], path + (p.name,))
        seen.add(p.name)
        done.append(p)

    for p in patches:
        visit(p, ())
    return done


def effect_patch(effect: Effect) -> Patch:
    """The record an effect's upstream commit is described by (it replaces nothing)."""
    form = effect.upstream
    assert form is not None
    return Patch(
        name=effect.name,
        target=f"{form.home}:<import>",
        replacement=form.form,
        summary=form.title,
        upstream="",
        retire_when="never: it is part of the feature upstream",
        fingerprints={},
        after=form.after,
        tests=effect.tests,
        area=effect.area,
        measured=effect.measured,
        risk=effect.risk,
    )


def with_effects(ordered: Sequence[Patch], effects: Sequence[Effect]) -> list[Patch]:
    """``ordered`` with the commit of each effect that has an upstream form: right after the
    last patch it builds on, first when it builds on none."""
    out = list(ordered)
    for effect in effects:
        if effect.upstream is None:
            continue
        names = [p.name for p in out]
        missing = [a for a in effect.upstream.after if a not in names]
        if missing:
            raise ExportError(f"{effect.name} builds on {', '.join(missing)}, which are not in the stack")
        at = max((names.index(a) + 1 for a in effect.upstream.after), default=0)
        out.insert(at, effect_patch(effect))
    return out


def api_patch(package: str, home: str, after: Sequence[str]) -> Patch:
    """The record the public-API commit is described by (it replaces no torch function)."""
    return Patch(
        name=API_COMMIT,
        target=f"{home}:__all__",
        replacement=f"{package}:__all__",
        summary=f"[utils] Export the public API of {home}",
        upstream="",
        retire_when="never: it is the feature's public API",
        fingerprints={},
        after=tuple(after),
        tests=("test/test_hooks_library.py",),
        measured=("`torch.utils.saved_tensors_hooks.bf16()` and the rest are importable from the package; its modules are private"),
        risk="the package's names are public API from here on",
    )
