"""Generate the upstream form of every patch record: a stack of edits to torch's sources.

How one patch becomes upstream code (see CONTRIBUTING.md, "Upstreaming"):

* Our modules mirror upstream: ``torch_patches/X/Y.py`` stands for ``torch/X/Y.py``.  The
  target definition in the upstream file is replaced by the replacement's definition,
  renamed to the target's name and indented into its class for methods; the upstream
  definition's decorators are kept (they carry upstream conventions the registry copies
  onto replacements, e.g. guard check specs).
* ``wraps=True`` (a factory taking the original): the factory must be a *simple wrapper*
  (a docstring, one nested function, ``return`` of it).  The upstream definition is kept
  under a private name ``_<name>_impl`` (all its decorators stay on it), and the nested
  function becomes the definition under the target's name, calling the renamed original
  where the factory's argument was used (``functools.wraps(original)`` is dropped;
  ``staticmethod``/``classmethod`` are carried over).  That is exactly what runs under
  ``apply()``; a reviewer may fold the two by hand.
* Module-level helpers the code uses are added to the upstream module they mirror (an
  AST dependency closure over names and ``module.attr`` uses).  A helper upstream already
  defines identically is reused; one defined differently is added under a new name.
  Helpers are appended to the end of the file, in our source order (so anything they
  use at import time, upstream's or ours, is defined before them).
* ``torch_patches`` modules without an upstream counterpart (``_errors``, ``_logging``...)
  are moved into the upstream file whose code needs them first (stack order); code in
  other files reaches them as ``module.name``.  Cross-module references import the other
  upstream module inside the function that uses it (never a new top-level import between
  torch modules: those can create import cycles).  Knobs of
  ``torch_patches.config`` become knobs of ``torch/_functorch/config.py``
  (``saved_tensors_hooks_*``, see :data:`KNOB_NAMES`).
* Imports our code needs are added to the upstream module's imports when it lacks them.
* Patches are generated in stack order (``after``), each against the sources as the
  previous ones left them.  Anything that cannot be resolved makes that patch (and the
  patches built on it) *skipped* with the reason; no partial diff is emitted.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch_patches._registry import Effect, Patch, find_definition, fingerprint_source, combine_fingerprints

from tools.export_upstream import _names
from tools.export_upstream._pysrc import (
    BUILTINS,
    Edit,
    ExportError,
    NOT_EXPORTED,
    NameUse,
    Source,
    apply_edits,
    def_name_edit,
    import_bindings,
    local_imports,
    name_uses,
    reindent,
    stmt_binds,
)


TP = "torch_patches"
#: Where knobs of torch_patches' config module go upstream.
CONFIG_HOME = "torch._functorch.config"
#: Upstream names of our knobs; knobs not listed get ``saved_tensors_hooks_<name>``.
KNOB_NAMES = {
    "hook_placement": "saved_tensors_hooks_placement",
    "hooked_saved_tensor_dtypes": "saved_tensors_hooks_dtypes",
    "untraceable_hook": "saved_tensors_hooks_untraceable",
}
_CONFIG_MARK = "install_config_module(sys.modules[__name__])"
#: Methods ``install_config_module`` gives a config module (not definitions of ours).
CONFIG_MODULE_API = frozenset(
    {"get_config_copy", "save_config", "save_config_portable", "get_hash", "patch", "load_config"}
)


#: The proposed home of ``torch_patches.hooks`` (see ``_names.HOOKS_HOME``).
HOOKS_PACKAGE = "torch.utils.saved_tensors_hooks"


def knob_upstream_name(name: str) -> str:
    if name in KNOB_NAMES:
        return KNOB_NAMES[name]
    return name if name.startswith("saved_tensors_hooks") else f"saved_tensors_hooks_{name}"


# ------------------------------------------------------------------- module files


def module_relpath(root: str, module: str) -> str | None:
    """``torch/x/y.py`` (or ``.../__init__.py``) for a module under ``root``, if it exists."""
    base = module.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        if os.path.isfile(os.path.join(root, rel)):
            return rel
    return None


def _tp_root() -> str:
    spec = importlib.util.find_spec(TP)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError("torch_patches is not importable")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def rel_module(rel: str) -> str:
    """The dotted module of a source file's path (``torch/x/__init__.py`` -> ``torch.x``)."""
    return rel[: -len(".py")].removesuffix("/__init__").replace("/", ".")


def is_test_file(rel: str) -> bool:
    """An upstream test file or test helper (not library code)."""
    return rel.startswith(("test/", "torch/testing/_internal/"))


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
    #: it, see :func:`split_new_modules`): that module; None for the patch's own commit.
    module: str | None = None
    #: The module of ours the new module stands for (with ``module``).
    source: str | None = None
    #: Upstream test files this commit adds (``_tests.py``), run right after it is applied.
    upstream_tests: list[str] = dataclasses.field(default_factory=list)
    #: ``stage(rel, modules)``: an existing file of the patch with only what the new
    #: ``modules`` need of its additions (:func:`split_new_modules`).
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
class _FileWork:
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
    #: (module, name) of each entry of ``helpers`` / ``knobs``, in order (see ``_Job.edges``).
    helper_keys: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    knob_keys: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def binds(self, name: str) -> bool:
        return name in self.bound or name in self.src.bindings


class _State:
    """What the stack has done so far (copied per patch, committed on success)."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}  # relpath -> current text
        self.placed: dict[tuple[str, str], tuple[str, str]] = {}  # (tp module, name) -> (module, name)
        self.homes: dict[str, str] = {}  # satellite tp module -> upstream module

    def copy(self) -> _State:
        new = _State()
        new.texts = dict(self.texts)
        new.placed = dict(self.placed)
        new.homes = dict(self.homes)
        return new


class Exporter:
    """Turns patch records into a stack of upstream diffs against one torch source tree."""

    def __init__(self, torch_root: str, repo_root: str | None = None) -> None:
        self.root = torch_root
        self.tp_root = _tp_root()
        self.repo_root = repo_root or os.path.dirname(self.tp_root)
        self.base: dict[str, str] = {}
        self.state = _State()
        self._tp_sources: dict[str, Source] = {}
        self._up_sources: dict[str, Source] = {}
        self._import_ranks: dict[str, int] = {}
        #: Where each satellite module went in a previous pass (prose may name one before
        #: the code that moves it is exported).
        self.home_hints: dict[str, str] = {}
        self._unknown_homes: set[str] = set()
        #: New upstream modules (:meth:`new_home`): module -> relpath, and the module of
        #: ours each stands for.
        self.new_modules: dict[str, str] = {}
        self.new_module_sources: dict[str, str] = {}
        #: The registry effects being exported (:meth:`export`), by commit name.
        self.effects: dict[str, Effect] = {}

    # ------------------------------------------------------------ sources

    def read_upstream(self, rel: str) -> str:
        if rel not in self.base:
            with open(os.path.join(self.root, rel), encoding="utf-8") as f:
                self.base[rel] = f.read()
        return self.base[rel]

    def upstream_source(self, state: _State, module: str) -> Source:
        rel = self.upstream_rel(module)
        text = state.texts.get(rel) or self.read_upstream(rel)
        if not text and module in self.new_modules:
            text = self.new_module_skeleton(module)
        key = f"{rel}\0{hash(text)}"
        if key not in self._up_sources:
            self._up_sources[key] = Source(text, module, rel.endswith("__init__.py"))
        return self._up_sources[key]

    def upstream_rel(self, module: str) -> str:
        rel = module_relpath(self.root, module)
        if rel is None and module in self.new_modules:
            return self.new_modules[module]
        if rel is None:
            raise ExportError(f"upstream module {module} has no source file under {self.root}")
        return rel

    def new_home(self, tp_module: str) -> str | None:
        """The new upstream module our ``tp_module`` becomes (None: it moves instead)."""
        if tp_module == TP + ".hooks":
            home = HOOKS_PACKAGE
        elif tp_module.startswith(TP + ".hooks."):
            # Private modules: the package is the API (its ``select`` and ``budget`` are
            # functions; a submodule of the same name would be shadowed by them).
            home = f"{HOOKS_PACKAGE}._{tp_module.rpartition('.')[2].lstrip('_')}"
        elif tp_module.count(".") >= 2 and module_relpath(self.root, "torch" + tp_module[len(TP) :]) is None:
            home = "torch" + tp_module[len(TP) :]
        else:
            return None
        if home not in self.new_modules:
            is_package = module_relpath(self.tp_root, tp_module).endswith("__init__.py")  # type: ignore[union-attr]
            rel = home.replace(".", "/") + ("/__init__.py" if is_package else ".py")
            self.new_modules[home] = rel
            self.new_module_sources[home] = tp_module
            self.base.setdefault(rel, "")
            parent = tp_module.rpartition(".")[0]
            if module_relpath(self.root, home.rpartition(".")[0]) is None and self.is_tp_module(parent):
                self.new_home(parent)  # a new package: its __init__.py comes with it
        return home

    def new_module_skeleton(self, module: str) -> str:
        """The text a new upstream module starts from: our module's docstring, and
        ``from __future__ import annotations`` (our code is written for it)."""
        src = self.tp_source(self.new_module_sources[module])
        first = src.tree.body[0] if src.tree.body else None
        is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        head = src.segment(first) + "\n\n" if is_doc else ""  # as written (r-strings...)
        return head + "from __future__ import annotations\n"

    def tp_source(self, module: str) -> Source:
        if module not in self._tp_sources:
            rel = module_relpath(self.tp_root, module)
            if rel is None:
                raise ExportError(f"{module} is not a torch_patches source module")
            with open(os.path.join(self.tp_root, rel), encoding="utf-8") as f:
                self._tp_sources[module] = Source(f.read(), module, rel.endswith("__init__.py"))
        return self._tp_sources[module]

    def import_rank(self, module: str) -> int:
        """How deep our ``module`` sits in our modules' top-level imports: 0 if it imports
        none of ours, else one more than the deepest it imports.  Helpers moved from several
        of our modules into one upstream file are written in this order (then by module and
        line), the order Python runs them in: a definition never comes before one of another
        module that it uses when it is defined (an annotation, a base class, a default)."""
        if module not in self._import_ranks:
            self._import_ranks[module] = 0  # an import cycle stops here
            deps = set()
            for b in self.tp_source(module).bindings.values():
                if b.kind != "import" or b.type_checking or b.dotted is None or not _is_tp(b.dotted):
                    continue
                try:
                    dep = self.resolve_tp(b.dotted)[0]
                except ExportError:
                    continue
                if dep != module:
                    deps.add(dep)
            self._import_ranks[module] = max((self.import_rank(d) + 1 for d in sorted(deps)), default=0)
        return self._import_ranks[module]

    def is_tp_module(self, dotted: str) -> bool:
        return (dotted == TP or dotted.startswith(TP + ".")) and module_relpath(self.tp_root, dotted) is not None

    def mirror_of(self, tp_module: str) -> str | None:
        """The upstream module a torch_patches module mirrors (None: a satellite)."""
        if self._is_config_module(tp_module):
            return CONFIG_HOME
        # Mirrors live in packages (torch_patches/_functorch/..., _dynamo/...); top-level
        # modules (_errors, _logging, hooks, testing...) are ours only.
        if tp_module.count(".") < 2:
            return None
        up = "torch" + tp_module[len(TP) :]
        return up if module_relpath(self.root, up) else None

    def _is_config_module(self, tp_module: str) -> bool:
        return _CONFIG_MARK in self.tp_source(tp_module).text

    def resolve_tp(self, dotted: str) -> tuple[str, str | None]:
        """``torch_patches...`` dotted path -> (tp module, None) or (defining tp module, name)."""
        if self.is_tp_module(dotted):
            return dotted, None
        module, _, name = dotted.rpartition(".")
        for _ in range(8):
            if not self.is_tp_module(module):
                raise ExportError(f"cannot resolve {dotted}: {module} is not a torch_patches module")
            b = self.tp_source(module).bindings.get(name)
            if b is None:
                raise ExportError(f"{module} does not define {name}")
            if b.kind != "import":
                return module, name
            assert b.dotted is not None
            if not (b.dotted == TP or b.dotted.startswith(TP + ".")):
                raise ExportError(f"{module}.{name} re-exports {b.dotted}, which is not ours")
            if self.is_tp_module(b.dotted):
                return b.dotted, None
            module, _, name = b.dotted.rpartition(".")
        raise ExportError(f"cannot resolve {dotted}: re-export chain too long")

    # ----------------------------------------------------------- the stack

    def module_home(self, tp_module: str, state: _State | None = None) -> str | None:
        """The upstream module our module stands for (a mirror) or was moved into."""
        if not self.is_tp_module(tp_module):
            return None
        mirror = self.mirror_of(tp_module)
        if mirror is not None:
            return mirror
        home = (
            (state or self.state).homes.get(tp_module)
            or self.new_home(tp_module)
            or self.home_hints.get(tp_module)
        )
        if home is None:
            self._unknown_homes.add(tp_module)
        return home

    def _knob_name(self, name: str) -> str | None:
        from torch_patches import config

        return knob_upstream_name(name) if name in config.get_config_copy() else None

    def upstream_names(self, text: str, state: _State) -> str:
        api = self.tp_source(TP + ".hooks").bindings
        return _names.upstream_names(text, lambda m: self.module_home(m, state), self._knob_name, api)

    def export(self, patches: Sequence[Patch], effects: Sequence[Effect] = ()) -> list[PatchExport]:
        """Every patch's upstream form, and every effect's that has one, in stack order
        (twice when prose named a moved module before the patch that moves it: the second
        pass knows where it went)."""
        patches = with_effects(stack_order(patches), effects)
        self.effects = {e.name: e for e in effects if e.upstream is not None}
        base, state = dict(self.base), self.state.copy()
        out = self._export_all(patches)
        missed = {m for m in self._unknown_homes if m in self.state.homes}
        if missed:
            self.home_hints = dict(self.state.homes)
            self.base, self.state, self._unknown_homes = base, state, set()
            out = self._export_all(patches)
        return out

    def _export_all(self, patches: Sequence[Patch]) -> list[PatchExport]:
        out: list[PatchExport] = []
        skipped: set[str] = set()
        for number, patch in enumerate(stack_order(patches), 1):
            result = PatchExport(patch, number)
            blocked = [a for a in patch.after if a in skipped]
            if blocked:
                result.status, result.reason = "skipped", f"builds on skipped patch {', '.join(blocked)}"
            else:
                state = self.state.copy()
                try:
                    self._export_one(patch, state, result)
                    self._verify(result, state)
                except ExportError as e:
                    result.status, result.reason = "skipped", str(e)
                else:
                    self.state = state
            if result.status == "skipped":
                skipped.add(patch.name)
                result.files, result.diff, result.added = [], "", []
                result.before, result.after, result.knobs = {}, {}, {}
            out.append(result)
        return out

    def final_texts(self) -> dict[str, tuple[str, str]]:
        """relpath -> (pristine, after the whole stack) for every touched file."""
        return {rel: (self.base[rel], text) for rel, text in sorted(self.state.texts.items())}

    # ------------------------------------------------------------ one patch

    def _export_one(self, patch: Patch, state: _State, result: PatchExport) -> None:
        if patch.name in self.effects:
            self._export_effect(self.effects[patch.name], patch, state, result)
            return
        t_module, _, t_qual = patch.target.partition(":")
        r_module, _, r_attr = patch.replacement.partition(":")
        if not t_module.startswith("torch.") and t_module != "torch":
            raise ExportError(f"target {patch.target} is not a torch module")
        if not (r_module == TP or r_module.startswith(TP + ".")):
            raise ExportError(f"replacement {patch.replacement} is not a torch_patches definition")
        rel = self.upstream_rel(t_module)
        self.read_upstream(rel)
        job = _Job(self, patch, state, t_module, t_qual.split("."), r_module, r_attr)
        job.run()
        self._finish_job(job, state, result)

    def _export_effect(self, effect: Effect, patch: Patch, state: _State, result: PatchExport) -> None:
        """A registry effect's upstream form: the body of its form function, appended to
        the upstream module whose import does it (:class:`~torch_patches._registry.UpstreamForm`)."""
        form = effect.upstream
        assert form is not None
        module, _, name = form.form.partition(":")
        src = self.tp_source(module)
        b = src.bindings.get(name)
        fn = b.stmt if b is not None else None
        if not isinstance(fn, ast.FunctionDef) or fn.args.args or fn.args.posonlyargs or fn.args.kwonlyargs:
            raise ExportError(f"{effect.name}: {form.form} is not a function without parameters")
        self.read_upstream(self.upstream_rel(form.home))
        job = _Job(self, patch, state, form.home, [], module, name)
        job._requester = form.home  # type: ignore[attr-defined]
        fw = job.file(form.home)
        body = [stmt for stmt in fn.body if not _is_docstring(stmt)]
        if not body:
            raise ExportError(f"{effect.name}: {form.form} has no statements")
        for stmt in body:
            text = job.emit(src, stmt, form.home, comments=False, fold_constants=True)
            fw.tail.append(reindent(text, stmt.col_offset, ""))
        job.drain()
        self._finish_job(job, state, result)

    def _finish_job(self, job: _Job, state: _State, result: PatchExport) -> None:
        result.added = job.added
        result.knobs = job.knobs
        result.notes = job.notes
        before = {r: state.texts.get(r) or self.base[r] for r in job.files}
        after = {r: self.upstream_names(text, state) for r, text in job.render().items()}
        diffs = []
        for r in sorted(after):
            if after[r] == before[r]:
                continue
            diffs.append(unified_diff(r, before[r], after[r]))
            state.texts[r] = after[r]
        if not diffs:
            raise ExportError("the upstream form changes nothing")
        result.files = sorted(r for r in after if after[r] != before[r])
        result.diff = "".join(diffs)
        rel_module = {self.upstream_rel(m): m for m in job.work}
        result.stage = lambda rel, modules: self.upstream_names(job.render_stage(rel_module[rel], modules), state)
        result.before = {r: before[r] for r in result.files}
        result.after = {r: after[r] for r in result.files}

    def export_api(self, package: str, after: Sequence[str]) -> PatchExport:
        """The commit that gives our public package's upstream home its API: every name our
        ``package``'s ``__init__`` re-exports, imported there from where the stack put it
        (the modules no patch needed, such as the ``budget`` and ``cache_hash`` markers,
        come whole in commits of their own before it), and its ``__all__``.  It comes last:
        the public API is what the stack adds up to."""
        home = self.new_home(package)
        if home is None:
            raise ExportError(f"{package} has no new upstream home")
        patch = api_patch(package, home, after)
        result = PatchExport(patch, 0)
        state = self.state.copy()
        job = _Job(self, patch, state, home, [], package, "")
        job._requester = home  # type: ignore[attr-defined]
        fw = job.file(home)
        src = self.tp_source(package)
        for name, b in sorted(src.bindings.items(), key=lambda kv: kv[1].index):
            if b.kind == "import" and b.dotted is not None and _is_tp(b.dotted):
                mod, nm = self.resolve_tp(b.dotted)
                dest = self.module_home(mod, state) if nm is None else ".".join(job.place(mod, nm))
                if dest is None:
                    raise ExportError(f"{package}.{name}: {b.dotted} has no upstream home")
                job.ensure_binding(fw, name, dest, annotation=False)
            elif b.kind != "import" and (package, name) not in state.placed:
                job.place(package, name)
        job.drain()
        self._finish_job(job, state, result)
        self._verify(result, state)
        self.state = state
        return result

    def _verify(self, result: PatchExport, state: _State) -> None:
        from tools.export_upstream._write import check_applies

        for rel, text in result.after.items():
            try:
                compile(text, rel, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise ExportError(f"generated {rel} does not compile: {e}") from e
        problem = check_applies(result.diff, result.before)
        if problem:
            raise ExportError(f"generated diff does not apply: {problem}")


#: Name of the public-API commit (:meth:`Exporter.export_api`).
API_COMMIT = "utils.saved_tensors_hooks_api"


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
    )


def split_new_modules(exporter: Exporter, results: Sequence[PatchExport]) -> list[PatchExport]:
    """Each new upstream module a patch creates (whole, see ``_Job.place``) becomes a commit
    of its own, ``Add ...``, right before the patch's, dependencies first (packages before
    their modules, then by how deep the module sits in our imports).  Nothing uses these
    modules until the patch's own commit, which keeps the changes to upstream's files, so
    each of these commits builds alone (``import_each_commit`` checks it)."""
    module_of = {rel: m for m, rel in exporter.new_modules.items()}
    out: list[PatchExport] = []
    for r in results:
        created = [rel for rel in r.files if r.status == "exported" and rel in module_of and not r.before.get(rel)]
        if not created:
            out.append(r)
            continue
        created = _dependencies_first(created, module_of, r.after, lambda rel: (
            rel.count("/") - rel.endswith("__init__.py"),
            exporter.import_rank(exporter.new_module_sources[module_of[rel]]),
            rel,
        ))
        blocks = _diff_blocks(r.diff)
        rest = [rel for rel in r.files if rel not in created]
        current = {rel: r.before[rel] for rel in rest}  # existing files as the Add commits leave them
        taken: set[str] = set()
        for k, rel in enumerate(created):
            module = module_of[rel]
            add = PatchExport(
                r.patch, r.number, files=[rel], diff=blocks[rel],
                added=[a for a in r.added if a.partition(":")[0] == module],
                before={rel: ""}, after={rel: r.after[rel]},
                module=module, source=exporter.new_module_sources[module],
            )
            # What the module uses of the patch's additions to existing files comes with it.
            assert r.stage is not None
            needs = frozenset(module_of[c] for c in created[: k + 1])
            defined: set[str] = set()  # "module:name" the commit's changes to existing files bind
            for other in rest:
                text = r.stage(other, needs)
                if text != current[other]:
                    add.files.append(other)
                    add.diff += unified_diff(other, current[other], text)
                    add.before[other], add.after[other] = current[other], text
                    current[other] = text
                    home = rel_module(other)
                    defined.update(f"{home}:{n}" for n in Source(text, home).bindings)
            moved = [a for a in r.added if a not in taken and re.sub(r"(:[^.]*)\..*", r"\1", a) in defined]  # m:Class.f -> m:Class
            add.added += [a for a in moved if a not in add.added]
            taken.update(moved)
            out.append(add)
        r.files = [rel for rel in rest if current[rel] != r.after[rel]]
        r.diff = "".join(
            blocks[rel] if current[rel] == r.before[rel] else unified_diff(rel, current[rel], r.after[rel])
            for rel in r.files
        )
        r.added = [a for a in r.added if a.partition(":")[0] not in {module_of[c] for c in created} and a not in taken]
        r.before = {rel: current[rel] for rel in r.files}
        r.after = {rel: r.after[rel] for rel in r.files}
        out.append(r)
    for number, r in enumerate(out, 1):
        r.number = number
    return out




def _dependencies_first(
    rels: list[str], module_of: dict[str, str], texts: dict[str, str], key: Callable[[str], Any]
) -> list[str]:
    """The new files ``rels`` in an order where each comes after its package and after the
    new modules its text names (at import or in a function), else by ``key``."""

    def uses(a: str, b: str) -> bool:
        pkg, _, name = module_of[b].rpartition(".")
        return (
            rel_dir(a).startswith(rel_dir(b)) and b.endswith("__init__.py") and a != b
        ) or bool(re.search(rf"\b{re.escape(module_of[b])}\b|\bfrom {re.escape(pkg)} import (?:\(\s*)?[^\n]*\b{name}\b", texts[a]))

    def rel_dir(rel: str) -> str:
        return rel.rpartition("/")[0] + "/"

    out: list[str] = []
    todo = sorted(rels, key=key)
    while todo:
        ready = next((a for a in todo if not any(uses(a, b) for b in todo if b != a)), todo[0])  # a cycle: by key
        out.append(ready)
        todo.remove(ready)
    return out


def _not_exported(src: Source, node: ast.stmt) -> list[tuple[int, int]]:
    """Byte spans of the statements inside ``node`` marked :data:`NOT_EXPORTED` (with the
    marker line)."""
    spans = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.stmt) and sub is not node and sub.lineno >= 2:
            if src.lines[sub.lineno - 2].strip() == NOT_EXPORTED:
                spans.append(src.line_range_bytes(sub.lineno - 1, sub.end_lineno))  # type: ignore[arg-type]
    return spans


def _diff_blocks(diff: str) -> dict[str, str]:
    """A multi-file git diff, by file."""
    blocks: dict[str, str] = {}
    for block in re.split(r"(?m)^(?=diff --git )", diff):
        if block:
            rel = block.split("\n", 1)[0].split(" b/", 1)[1]
            blocks[rel] = block
    return blocks


#: ``_Job.edges``' key for the patch's replacement itself.
_ROOT = ("", "")


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


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


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


def unified_diff(rel: str, before: str, after: str) -> str:
    """git's diff of ``rel``; ``before == ""``: a new file."""
    a = before.splitlines(keepends=True)
    b = after.splitlines(keepends=True)
    for lines in (a, b):
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n\\ No newline at end of file\n"
    new = not before
    body = "".join(difflib.unified_diff(a, b, "/dev/null" if new else f"a/{rel}", f"b/{rel}", n=3))
    return f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n" if new else "") + body


# -------------------------------------------------------------------- the job


class _Placement:
    """Where each definition of ours goes upstream (``place``), and the queue of those one
    job emits (``drain``), with what each emitted definition needs (``edges``)."""

    def __init__(
        self,
        ex: Exporter,
        patch: Patch,
        state: _State,
        t_module: str,
        t_path: list[str],
        r_module: str,
        r_attr: str,
    ) -> None:
        self.ex, self.patch, self.state = ex, patch, state
        self.t_module, self.t_path = t_module, t_path
        self.r_module, self.r_attr = r_module, r_attr
        self.work: dict[str, _FileWork] = {}
        self.queue: list[tuple[str, str]] = []
        self.added: list[str] = []
        self.knobs: dict[str, str] = {}
        self.notes: list[str] = []
        self._emitted: set[tuple[str, int]] = set()
        #: What each emitted definition (upstream module, name) needs that this job adds:
        #: definitions, and top-level imports as (module, "import NAME"). ``_ROOT`` is the
        #: patch's replacement itself. A new module's commit takes what its definitions reach.
        self.edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self._ctx: tuple[str, str] = _ROOT

    def _need(self, key: tuple[str, str]) -> None:
        self.edges.setdefault(self._ctx, set()).add(key)

    def reach(self, roots: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        seen: set[tuple[str, str]] = set()
        todo = list(roots)
        while todo:
            key = todo.pop()
            if key not in seen:
                seen.add(key)
                todo.extend(self.edges.get(key, ()))
        return seen

    @property
    def files(self) -> list[str]:
        return [self.ex.upstream_rel(m) for m in self.work]

    def file(self, module: str) -> _FileWork:
        if module not in self.work:
            self.work[module] = _FileWork(self.ex.upstream_source(self.state, module), module)
            parent = module.rpartition(".")[0]
            if parent in self.ex.new_modules and not self.state.texts.get(self.ex.new_modules[parent]):
                self.file(parent)  # a new package is created with its first module
        return self.work[module]

    # --------------------------------------------------------- dependencies

    def place(self, tp_module: str, name: str) -> tuple[str, str]:
        """Where (upstream module, name) our definition ``tp_module.name`` lives; queue it."""
        key = (tp_module, name)
        if key in self.state.placed:
            self._need(self.state.placed[key])
            return self.state.placed[key]
        src = self.ex.tp_source(tp_module)
        b = src.bindings.get(name)
        if b is None and name in CONFIG_MODULE_API and self.ex._is_config_module(tp_module):
            # The config-module API (a snapshot of every knob...): upstream's config module
            # has the same methods, over a superset of our knobs.
            self.state.placed[key] = (CONFIG_HOME, name)
            return self.state.placed[key]
        if b is None:
            raise ExportError(f"{tp_module} has no top-level definition {name!r}")
        if b.kind == "import":
            assert b.dotted is not None
            if b.dotted.startswith(TP + ".") or b.dotted == TP:
                mod, nm = self.ex.resolve_tp(b.dotted)
                if nm is None:
                    raise ExportError(f"{tp_module}.{name} is a module; use it by its own name")
                loc = self.place(mod, nm)
                self.state.placed[key] = loc
                return loc
            raise ExportError(
                f"{tp_module}.{name} is imported there from {b.dotted}; import it from where "
                "it is defined"
            )
        dest = self.dest_module(tp_module)
        is_knob = self.ex._is_config_module(tp_module)
        final = knob_upstream_name(name) if is_knob else name
        up = self.ex.upstream_source(self.state, dest)
        existing = up.bindings.get(final)
        if existing is not None and not existing.type_checking and not is_knob:
            if existing.kind != "import" and _same_definition(src, b.stmt, up, existing.stmt):
                for n in stmt_binds(b.stmt):
                    self.state.placed[(tp_module, n)] = (dest, n)
                return self.state.placed[key]
            final = self._fresh(dest, f"_{name.lstrip('_')}_saved_tensors_hooks")
            self.notes.append(
                f"{dest} already defines {name} differently; ours is added as {final}"
            )
        elif existing is not None and is_knob:
            raise ExportError(f"{dest} already has a knob {final}")
        names = stmt_binds(b.stmt)
        if len(names) > 1 and final != name:
            raise ExportError(f"{tp_module}.{name} is bound with other names and collides upstream")
        for n in names:
            self.state.placed[(tp_module, n)] = (dest, final if n == name else n)
        self._need((dest, final))
        self.queue.append((tp_module, name))
        if is_knob:
            self.knobs[name] = f"{dest}.{final}"
        if (
            dest in self.ex.new_modules
            and self.ex.new_module_sources.get(dest) == tp_module
            and not self.state.texts.get(self.ex.new_modules[dest])
        ):
            # A new module comes whole, as ours is (its own tests use all of it), in the
            # commit that creates it; a satellite of ours moved into it brings only what
            # is used.
            for other, b in sorted(src.bindings.items(), key=lambda kv: kv[1].index):
                if b.kind != "import" and not b.type_checking and (tp_module, other) not in self.state.placed:
                    self.place(tp_module, other)
        return dest, final

    def dest_module(self, tp_module: str) -> str:
        mirror = self.ex.mirror_of(tp_module)
        if mirror is not None:
            return mirror
        home = self.ex.new_home(tp_module)
        if home is not None:
            self.state.homes[tp_module] = home
            return home
        # Ours only (no upstream counterpart): moved next to the code that needs it first.
        return self.state.homes.setdefault(tp_module, getattr(self, "_requester", None) or self.t_module)

    def drain(self) -> None:
        while self.queue:
            tp_module, name = self.queue.pop(0)
            src = self.ex.tp_source(tp_module)
            b = src.bindings[name]
            key = (tp_module, b.index)
            if key in self._emitted:
                continue
            self._emitted.add(key)
            dest, final = self.state.placed[(tp_module, name)]
            fw = self.file(dest)
            self._ctx = (dest, final)
            renames = {}
            if final != name:
                renames[name] = final
            text = self.emit(src, b.stmt, dest, rename_def=renames.get(name), store_renames=renames)
            is_knob = self.ex._is_config_module(tp_module)
            rank = self.ex.import_rank(tp_module)
            order = (0 if self.ex.mirror_of(tp_module) is None else 1, rank, tp_module, b.stmt.lineno)
            (fw.knobs if is_knob else fw.helpers).append((order, text))
            (fw.knob_keys if is_knob else fw.helper_keys).append((dest, final))
            fw.bound.update(renames.get(n, n) for n in stmt_binds(b.stmt))
            self.added.append(f"{dest}:{final}")

    def _fresh(self, module: str, base: str) -> str:
        fw = self.file(module)
        name = base
        i = 2
        while fw.binds(name):
            name = f"{base}{i}"
            i += 1
        fw.bound.add(name)
        return name


class _Emission(_Placement):
    """Our statements' text, rewritten to live in an upstream module: names resolved to
    where the stack put them, imports added where they are needed."""

    # ------------------------------------------------------------- emission

    def emit(
        self,
        src: Source,
        node: ast.stmt,
        dest: str,
        *,
        rename_def: str | None = None,
        comments: bool = True,
        enclosing: ast.AST | None = None,
        enclosing_names: dict[str, str] | None = None,
        drop_decorators: Iterable[ast.expr] = (),
        store_renames: dict[str, str] | None = None,
        fold_constants: bool = False,
    ) -> str:
        """The text of our statement ``node``, rewritten to live in upstream ``dest``
        (``fold_constants``: names of ours bound to a string are written as the string)."""
        fw = self.file(dest)
        self._requester = dest
        edits: list[Edit] = []
        enclosing_names = enclosing_names or {}
        store_renames = store_renames or {}
        dropped = []
        for d in drop_decorators:
            start = src.offset(d.lineno, 0)
            end = src.line_range_bytes(d.end_lineno, d.end_lineno)[1]  # type: ignore[arg-type]
            dropped.append((start, end))
        dropped += _not_exported(src, node)
        self._dropped = dropped
        # Functions that get their own imports of other upstream modules (cycle-safe).
        owners: dict[int, ast.AST] = {}
        fns = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
            [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if isinstance(node, ast.ClassDef) else []
        )
        for fn in fns:
            for sub in ast.walk(fn):
                if isinstance(sub, ast.Name) and sub not in fn.decorator_list:
                    owners[id(sub)] = fn
        for fn in fns:  # decorators, defaults and annotations run at import time
            for part in [*fn.decorator_list, *fn.args.defaults, fn.returns, *(
                a.annotation for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg] if a is not None
            )]:
                for sub in ast.walk(part) if part is not None else ():
                    owners.pop(id(sub), None)
        self._local_needs: dict[ast.AST, dict[str, str]] = {}
        for imp in local_imports(node):
            if any(s <= src.span(imp)[0] < e for s, e in dropped):
                continue
            new = self._rewrite_local_import(src, imp)
            if new is not None:
                edits.append(Edit(*src.span(imp), new))
            elif self._is_self_import(src, imp, fw):
                # ``from <this module> import name`` inside a function: name is right here.
                start = src.offset(imp.lineno, 0)
                edits.append(Edit(start, src.line_range_bytes(imp.end_lineno, imp.end_lineno)[1], ""))
        for use in name_uses(node, src.package, enclosing=enclosing):
            n = use.node
            if any(s <= src.span(n)[0] < e for s, e in dropped):
                continue
            if use.scope == "enclosing":
                if n.id in enclosing_names:
                    edits.append(Edit(*src.span(n), enclosing_names[n.id]))
                    continue
                raise ExportError(f"the wrapper uses {n.id!r} of its factory; only the original may be")
            if use.scope == "local":
                if use.local_import and _is_tp(use.local_import) and use.attribute is not None:
                    mod, nm = self.ex.resolve_tp(use.local_import)
                    if nm is None:
                        d, final = self.place(mod, use.attribute.attr)
                        if final != use.attribute.attr:
                            edits.append(self._attr_edit(src, use.attribute, final))
                continue
            # global
            if isinstance(n.ctx, ast.Store) or isinstance(n.ctx, ast.Del):
                if n.id in store_renames:
                    edits.append(Edit(*src.span(n), store_renames[n.id]))
                continue
            self._owner = owners.get(id(n))
            literal = _string_constant(src, n.id) if fold_constants else None
            if literal is not None:
                edits.append(Edit(*src.span(n), literal))
                continue
            new = self._global_ref(src, use, fw)
            if new is not None:
                span_node = use.attribute if (use.attribute is not None and new[1]) else n
                edits.append(Edit(*src.span(span_node), new[0]))
        for fn, needs in self._local_needs.items():
            edits.append(self._local_import_edit(src, fn, needs))
        if rename_def is not None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            edits.append(def_name_edit(src, node, rename_def))
        first, last = src.stmt_lines(node, comments=comments)
        for start, end in dropped:
            edits.append(Edit(start, end, ""))
        return apply_edits(src, *src.line_range_bytes(first, last), edits)

    @staticmethod
    def _is_self_import(src: Source, imp: ast.Import | ast.ImportFrom, fw: _FileWork) -> bool:
        if not isinstance(imp, ast.ImportFrom):
            return False
        line = src.lines[imp.lineno - 1]
        if line[: imp.col_offset].strip() or src.lines[imp.end_lineno - 1][imp.end_col_offset :].strip():  # type: ignore[index]
            return False
        for name, dotted in import_bindings(imp, src.package):
            b = fw.src.bindings.get(name)
            if dotted != f"{fw.module}.{name}" or b is None or b.type_checking:
                return False
        return True

    def _local_import_edit(self, src: Source, fn: ast.AST, needs: dict[str, str]) -> Edit:
        body = fn.body  # type: ignore[attr-defined]
        first = body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
            and len(body) > 1
        ):
            first = body[1]
        # Not inside a statement that is not exported (it and its marker line go).
        kept = [b for b in body[body.index(first):] if not any(s <= src.span(b)[0] < e for s, e in self._dropped)]
        first = kept[0] if kept else first
        indent = " " * first.col_offset
        lines = [_import_line(n, d).rstrip("\n") for n, d in sorted(needs.items(), key=_import_key)]
        at = src.offset(first.lineno, first.col_offset)
        return Edit(at, at, ("\n" + indent).join(lines) + "\n\n" + indent)

    def _attr_edit(self, src: Source, node: ast.Attribute, new_attr: str) -> Edit:
        end = src.offset(node.end_lineno, node.end_col_offset)  # type: ignore[arg-type]
        return Edit(end - len(node.attr.encode()), end, new_attr)

    def _global_ref(self, src: Source, use: NameUse, fw: _FileWork) -> tuple[str, bool] | None:
        """Replacement text for a global name use (bool: it replaces the whole ``x.attr``)."""
        name = use.node.id
        b = src.bindings.get(name)
        if b is None:
            if name in BUILTINS:
                return None
            raise ExportError(f"{src.module} uses {name!r}, which it does not define or import")
        if b.kind != "import":
            dest, final = self.place(src.module, name)
            ref = self._ref_to(fw, dest, final, name)
            return None if ref is None else (ref, False)
        assert b.dotted is not None
        if _is_tp(b.dotted):
            mod, nm = self.ex.resolve_tp(b.dotted)
            if nm is not None:
                dest, final = self.place(mod, nm)
                ref = self._ref_to(fw, dest, final, name)
                return None if ref is None else (ref, False)
            # A torch_patches module: only ``module.attr`` uses, but for the config module,
            # which upstream's config module stands for as a value too (its API, and a
            # superset of our knobs under their upstream names).
            if use.attribute is None:
                if not self.ex._is_config_module(mod):
                    raise ExportError(f"{src.module} uses the module {b.dotted} as a value ({name})")
                alias = self.module_alias(fw, CONFIG_HOME, name)
                return (alias, False) if alias != name else None
            dest, final = self.place(mod, use.attribute.attr)
            if dest == fw.module:
                return final, True
            alias = self.module_alias(fw, dest, name)
            return f"{alias}.{final}", True
        # Anything else: make the upstream module bind it too.
        bound = self.ensure_binding(fw, name, b.dotted, use.annotation)
        return (bound, False) if bound != name else None

    def _ref_to(self, fw: _FileWork, dest: str, final: str, used_as: str) -> str | None:
        if dest == fw.module:
            return final if final != used_as else None
        alias = self.module_alias(fw, dest, dest.rpartition(".")[2])
        return f"{alias}.{final}"

    def module_alias(self, fw: _FileWork, module: str, preferred: str) -> str:
        """A name bound to ``module`` where the current use runs.

        An upstream module the file already imports at top level is used as it is bound
        there. Otherwise the function using it imports it itself (as torch does across
        its own import cycles: a new top-level import between torch modules can make one
        import the other half-initialized); only code that runs at import time gets a
        top-level import.
        """
        for name, dotted in fw.imports.items():
            if dotted == module:
                self._need((fw.module, "import " + name))
                return name
        b = fw.src.bindings.get(preferred)
        if b is not None and b.kind == "import" and b.dotted == module and not b.type_checking:
            return preferred
        for b in fw.src.bindings.values():
            if b.kind == "import" and b.dotted == module and not b.type_checking:
                return b.name
        owner = getattr(self, "_owner", None)
        if owner is not None:
            needs = self._local_needs.setdefault(owner, {})
            for name, dotted in needs.items():
                if dotted == module:
                    return name
            name = preferred
            if name in _local_names(owner) or (name in fw.src.bindings and fw.src.bindings[name].dotted != module):
                name = f"{preferred}_mod"
            needs[name] = module
            return name
        name = preferred if not fw.binds(preferred) else self._fresh(fw.module, f"{preferred}_mod")
        fw.imports[name] = module
        fw.bound.add(name)
        self._need((fw.module, "import " + name))
        return name

    def ensure_binding(self, fw: _FileWork, name: str, dotted: str, annotation: bool) -> str:
        bound = self._ensure_binding(fw, name, dotted, annotation)
        if bound in fw.imports:
            self._need((fw.module, "import " + bound))
        return bound

    def _ensure_binding(self, fw: _FileWork, name: str, dotted: str, annotation: bool) -> str:
        if fw.imports.get(name) == dotted:
            return name
        b = fw.src.bindings.get(name)
        if b is not None:
            if annotation:
                return name
            if not b.type_checking:
                if b.kind == "import" and b.dotted == dotted:
                    return name
                if b.kind != "import" and dotted == f"{fw.module}.{name}":
                    return name
        elif name not in fw.bound:
            if dotted == f"{fw.module}.{name}":
                raise ExportError(f"{fw.module} does not define {name}")
            fw.imports[name] = dotted
            fw.bound.add(name)
            return name
        for other in fw.src.bindings.values():
            if other.kind == "import" and other.dotted == dotted and not other.type_checking:
                return other.name
        for other, d in fw.imports.items():
            if d == dotted:
                return other
        alias = self._fresh(fw.module, f"_{name}")
        fw.imports[alias] = dotted
        return alias

    def _rewrite_local_import(self, src: Source, imp: ast.Import | ast.ImportFrom) -> str | None:
        pairs = list(import_bindings(imp, src.package))
        if not any(_is_tp(d) for _, d in pairs):
            return None
        if isinstance(imp, ast.Import):
            raise ExportError(f"`import torch_patches...` inside a function in {src.module}; use `from ... import ...`")
        lines = []
        for name, dotted in pairs:
            if not _is_tp(dotted):
                raise ExportError(f"mixed import of ours and not ours in {src.module}")
            mod, nm = self.ex.resolve_tp(dotted)
            if nm is None:
                up = self.dest_module(mod)
                pkg, _, last = up.rpartition(".")
            else:
                dest, final = self.place(mod, nm)
                if "." in final:
                    raise ExportError(f"{dotted} became a method upstream; cannot import it")
                pkg, last = dest, final
            lines.append(f"from {pkg} import {last}" + (f" as {name}" if name != last else ""))
        indent = " " * imp.col_offset
        return ("\n" + indent).join(lines)


class _Rendering:
    """The upstream files as one job leaves them (whole, or only the additions a new
    module's ``Add`` commit brings); a part of :class:`_Job`, over its files' work and what
    its definitions reach (:meth:`_Placement.reach`)."""

    work: dict[str, _FileWork]
    ex: Exporter
    reach: Callable[[Iterable[tuple[str, str]]], set[tuple[str, str]]]

    # --------------------------------------------------------------- render

    def render(self) -> dict[str, str]:
        out = {}
        for module, fw in self.work.items():
            out[self.ex.upstream_rel(module)] = self._render_file(fw)
        return out

    def render_stage(self, module: str, new_modules: Iterable[str]) -> str:
        """Existing upstream ``module`` with only the additions the definitions of
        ``new_modules`` reach (no replacement): what their ``Add`` commits change in it."""
        roots = {k for m in new_modules if m in self.work for k in self.work[m].helper_keys}
        allowed = self.reach(roots)
        fw = self.work[module]

        def pick(entries: list[Any], keys: list[tuple[str, str]]) -> list[Any]:
            return [e for e, k in zip(entries, keys) if k in allowed]

        return self._render_file(dataclasses.replace(
            fw,
            replace=None,
            tail=[],
            helpers=pick(fw.helpers, fw.helper_keys),
            knobs=pick(fw.knobs, fw.knob_keys),
            imports={n: d for n, d in fw.imports.items() if (module, "import " + n) in allowed},
        ))

    def _render_file(self, fw: _FileWork) -> str:
        lines = list(fw.src.lines)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        inserts: list[tuple[int, int, list[str]]] = []  # (line index, priority, lines)
        if fw.replace is not None:
            first, last, text = fw.replace
            lines[first - 1 : last] = [text if text.endswith("\n") else text + "\n"] + [""] * (last - first)
        if fw.helpers:
            block = "\n\n".join(t.rstrip("\n") + "\n" for _, t in sorted(fw.helpers))
            if fw.before_line is not None:
                inserts.append((fw.before_line - 1, 1, [block, "\n\n"]))
            else:
                inserts.append((len(lines), 1, ["\n\n", block]))
        if fw.tail:  # after the helpers (inserts at one line go in reverse priority)
            inserts.append((len(lines), 0, ["\n" if fw.helpers else "", *("\n" + t for t in fw.tail)]))
        if fw.knobs:
            at = self._knob_anchor(fw.src)
            block = "".join("\n" + t.rstrip("\n") + "\n" for _, t in sorted(fw.knobs))
            inserts.append((at, 0, [block.lstrip("\n") + "\n"]))
        if fw.imports:
            groups: dict[int, list[tuple[str, str]]] = {}
            for n, d in sorted(fw.imports.items(), key=_import_key):
                groups.setdefault(self._import_anchor(fw.src, d), []).append((n, d))
            for at, pairs in groups.items():
                chunk = _import_lines(pairs)
                if at == self._future_line(fw.src) and not fw.src.text.strip().endswith("annotations"):
                    chunk.append("\n")  # a new module's first imports, then its code
                elif at == self._future_line(fw.src):
                    chunk.insert(0, "\n")
                inserts.append((at, 2, chunk))
        for at, _, chunk in sorted(inserts, key=lambda x: (-x[0], x[1])):
            lines[at:at] = chunk
        return "".join(lines)

    @staticmethod
    def _import_anchor(src: Source, dotted: str) -> int:
        """Line index after the prologue import a new import of ``dotted`` belongs after.

        Imports of torch go after the last torch import, others after the last non-torch
        import (the standard library block), else after the last import.
        """
        group = dotted.split(".")[0] == "torch"
        last = last_same = future = 0
        for node in src.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                break
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                future = node.end_lineno  # type: ignore[assignment]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                last = node.end_lineno  # type: ignore[assignment]
                first = next(import_bindings(node, src.package), ("", ""))[1]
                relative = isinstance(node, ast.ImportFrom) and node.level > 0
                if (first.split(".")[0] == "torch" or relative) == group:
                    last_same = node.end_lineno  # type: ignore[assignment]
        if last == 0 and future:  # a new module: its imports follow the __future__ import
            return future
        if last == 0:
            raise ExportError(f"{src.module} has no import block to extend")
        return last_same or last

    @staticmethod
    def _future_line(src: Source) -> int | None:
        first = next((n for n in src.tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"), None)
        return None if first is None else first.end_lineno

    @staticmethod
    def _knob_anchor(src: Source) -> int:
        """Line index before the config module's closing (TYPE_CHECKING / install call)."""
        body = src.tree.body
        idx = next(
            (i for i, n in enumerate(body) if _CONFIG_MARK in (src.segment(n) or "")),
            None,
        )
        if idx is None:
            raise ExportError(f"{src.module} is not a config module ({_CONFIG_MARK} not found)")
        while idx > 0 and (
            isinstance(body[idx - 1], (ast.Import, ast.ImportFrom))
            or (isinstance(body[idx - 1], ast.If) and "TYPE_CHECKING" in ast.dump(body[idx - 1].test))
        ):
            idx -= 1
        return src.stmt_lines(body[idx])[0] - 1


class _Job(_Emission, _Rendering):
    """Generation of one patch against the current state: the replacement put in place of
    the target (whole, or as a wrapper of the original), then what it needs."""

    # --------------------------------------------------------------- driver

    def run(self) -> None:
        self._ctx = _ROOT
        target_file = self.file(self.t_module)
        src = target_file.src
        owner_path, attr = self.t_path[:-1], self.t_path[-1]
        body = src.tree.body
        owners: list[ast.ClassDef] = []
        for part in owner_path:
            cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
            if cls is None:
                raise ExportError(f"class {'.'.join(owner_path)} not found in {self.ex.upstream_rel(self.t_module)}")
            owners.append(cls)
            body = cls.body
        t_node = next(
            (n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == attr),
            None,
        )
        if t_node is None:
            raise ExportError(
                f"target {self.patch.target} is not defined in {self.ex.upstream_rel(self.t_module)} "
                "(no such function or method)"
            )
        self._check_fingerprint()
        r_src = self.ex.tp_source(self.r_module)
        r_bind = r_src.bindings.get(self.r_attr)
        if r_bind is None or r_bind.kind != "def":
            raise ExportError(f"replacement {self.patch.replacement} is not a function defined in {self.r_module}")
        r_node = r_bind.stmt
        assert isinstance(r_node, (ast.FunctionDef, ast.AsyncFunctionDef))
        first, last = src.stmt_lines(t_node, comments=False)
        indent = re.match(r"[ \t]*", src.lines[t_node.lineno - 1]).group(0)  # type: ignore[union-attr]
        upstream_decorators = "".join(src.lines[first - 1 : t_node.lineno - 1])
        qual_owner = ".".join(owner_path)
        if not self.patch.wraps:
            self.state.placed[(self.r_module, self.r_attr)] = (
                self.t_module,
                f"{qual_owner}.{attr}" if owner_path else attr,
            )
            text = self.emit(r_src, r_node, self.t_module, rename_def=attr, comments=False)
            text = reindent(text, 0, indent)
            new = upstream_decorators + text
        else:
            new = self._wrapper(src, t_node, r_src, r_node, indent, owner_path, attr, upstream_decorators)
        target_file.replace = (first, last, new)
        self.drain()

    def _check_fingerprint(self) -> None:
        from tools.fingerprints import from_source_tree

        try:
            fp = from_source_tree(self.ex.root, (self.patch.target, *self.patch.depends_on))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            self.notes.append(f"could not fingerprint the upstream code: {e}")
            return
        if fp not in self.patch.fingerprints.values():
            self.notes.append(
                f"upstream code drifted from what the patch was written against (fingerprint {fp} "
                "is not recorded): re-read the upstream change before submitting"
            )

    def _wrapper(
        self,
        src: Source,
        t_node: ast.FunctionDef | ast.AsyncFunctionDef,
        r_src: Source,
        factory: ast.FunctionDef | ast.AsyncFunctionDef,
        indent: str,
        owner_path: list[str],
        attr: str,
        upstream_decorators: str,
    ) -> str:
        body = list(factory.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        params = [a.arg for a in factory.args.posonlyargs + factory.args.args]
        if (
            len(body) != 2
            or not isinstance(body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
            or not isinstance(body[1], ast.Return)
            or not isinstance(body[1].value, ast.Name)
            or body[1].value.id != body[0].name
            or len(params) != 1
            or factory.args.vararg
            or factory.args.kwarg
            or factory.args.kwonlyargs
        ):
            raise ExportError(
                f"wrapper factory {self.patch.replacement} is not a simple wrapper (a docstring, "
                "one nested function taking the original by closure, and `return` of it); write "
                "the upstream form by hand or simplify the factory"
            )
        inner = body[0]
        param = params[0]
        # The original stays, renamed; the wrapper takes the target's name.
        scope_names = {
            n.name for n in (self._scope_body(src, owner_path)) if hasattr(n, "name")
        } | (set(src.bindings) if not owner_path else set())
        impl = f"_{attr.lstrip('_')}_impl"
        while impl in scope_names:
            impl += "_"
        kinds = [self._decorator_kind(d) for d in t_node.decorator_list]
        if "classmethod" in kinds:
            original_ref = f"{'.'.join(owner_path)}.{impl}.__func__"
        elif owner_path:
            original_ref = f"{'.'.join(owner_path)}.{impl}"
        else:
            original_ref = impl
        renamed_original = apply_edits(
            src,
            *src.line_range_bytes(*src.stmt_lines(t_node, comments=False)),
            [def_name_edit(src, t_node, impl)],
        )
        # The nested function, with the factory's parameter replaced by the original.
        drop = [d for d in inner.decorator_list if self._is_wraps_of(d, param)]
        text = self.emit(
            r_src,
            inner,
            self.t_module,
            rename_def=attr,
            comments=False,
            enclosing=factory,
            enclosing_names={param: original_ref},
            drop_decorators=drop,
        )
        text = reindent(text, inner.col_offset, indent)
        descriptor = "".join(
            f"{indent}@{k}\n" for k in kinds if k in ("staticmethod", "classmethod")
        )
        others = [
            src.segment(d) or "?"
            for d, k in zip(t_node.decorator_list, kinds)
            if k not in ("staticmethod", "classmethod")
        ]
        if others:
            self.notes.append(
                f"decorators {', '.join('@' + o for o in others)} stay on {impl} only; check "
                "whether the wrapper needs them"
            )
        sep = "\n" if owner_path else "\n\n"
        return renamed_original + sep + descriptor + text

    @staticmethod
    def _scope_body(src: Source, owner_path: list[str]) -> list[ast.stmt]:
        body = src.tree.body
        for part in owner_path:
            body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == part).body
        return body

    @staticmethod
    def _decorator_kind(d: ast.expr) -> str:
        if isinstance(d, ast.Name):
            return d.id
        if isinstance(d, ast.Attribute):
            return d.attr
        return "call"

    @staticmethod
    def _is_wraps_of(d: ast.expr, param: str) -> bool:
        if not isinstance(d, ast.Call) or not d.args:
            return False
        f = d.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name == "wraps" and isinstance(d.args[0], ast.Name) and d.args[0].id == param


def _string_constant(src: Source, name: str) -> str | None:
    """``name``'s string, as a double-quoted literal, when ``src`` binds it to a string
    constant (implicit concatenation included); else None."""
    b = src.bindings.get(name)
    if b is None or b.kind != "assign" or not isinstance(b.stmt, (ast.Assign, ast.AnnAssign)):
        return None
    value = b.stmt.value
    if not isinstance(value, ast.Constant) or not isinstance(value.value, str):
        return None
    text = value.value
    if any(c in text for c in "\"\\\n") or not text.isprintable():
        return repr(text)
    return f'"{text}"'


def _local_names(fn: ast.AST) -> set[str]:
    from tools.export_upstream._pysrc import _local_bindings

    return set(_local_bindings(fn, "").bound)


def _is_tp(dotted: str) -> bool:
    return dotted == TP or dotted.startswith(TP + ".")


def _import_line(name: str, dotted: str) -> str:
    if "." not in dotted:
        return f"import {dotted}\n" if name == dotted else f"import {dotted} as {name}\n"
    pkg, _, last = dotted.rpartition(".")
    return f"from {pkg} import {last}\n" if name == last else f"from {pkg} import {last} as {name}\n"


def _import_lines(pairs: list[tuple[str, str]]) -> list[str]:
    """Import statements binding each (name, dotted): one ``from`` statement per module."""
    out: list[str] = []
    by_module: dict[str, list[str]] = {}
    for name, dotted in pairs:
        if "." not in dotted:
            out.append(_import_line(name, dotted))
            continue
        pkg, _, last = dotted.rpartition(".")
        by_module.setdefault(pkg, []).append(last if name == last else f"{last} as {name}")
    for pkg, names in by_module.items():
        one = f"from {pkg} import {', '.join(names)}\n"
        out.append(one if len(one) <= 89 else f"from {pkg} import (\n" + "".join(f"    {n},\n" for n in names) + ")\n")
    return out


def _import_key(item: tuple[str, str]) -> tuple[int, str]:
    line = _import_line(*item)
    return (0 if line.startswith("import ") else 1, line)


def _same_definition(a_src: Source, a: ast.stmt, b_src: Source, b: ast.stmt) -> bool:
    """Same code, ignoring comments, docstrings, annotations and formatting."""
    try:
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            sa = find_definition(a_src.text, a.name)  # type: ignore[union-attr]
            sb = find_definition(b_src.text, b.name)  # type: ignore[union-attr]
            return fingerprint_source(sa) == fingerprint_source(sb)
    except Exception:  # noqa: BLE001
        return False
    return ast.dump(a) == ast.dump(b) if type(a) is type(b) else False


__all__ = [
    "CONFIG_HOME",
    "Exporter",
    "ExportError",
    "KNOB_NAMES",
    "PatchExport",
    "combine_fingerprints",
    "knob_upstream_name",
    "module_relpath",
    "stack_order",
    "unified_diff",
]
