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
import re
from collections.abc import Callable, Sequence
from typing import Any

from tools.export_upstream._git import check_applies, diff_blocks, unified_diff
from tools.export_upstream._job import Job
from tools.export_upstream._model import (
    PatchExport,
    StackState,
    api_patch,
    is_tp,
    rel_module,
    stack_order,
    with_effects,
)
from tools.export_upstream._pysrc import ExportError, Source
from tools.export_upstream._trees import Trees
from torch_patches._registry import Effect, Patch


class Exporter:
    """Turns patch records into a stack of upstream diffs against one torch source tree:
    each patch a :class:`~tools.export_upstream._job.Job` against the stack's state in
    :attr:`trees`, committed there when its diff applies and compiles."""

    def __init__(self, torch_root: str, repo_root: str | None = None) -> None:
        self.trees = Trees(torch_root, repo_root)
        #: The registry effects being exported (:meth:`export`), by commit name.
        self.effects: dict[str, Effect] = {}

    def export(self, patches: Sequence[Patch], effects: Sequence[Effect] = ()) -> list[PatchExport]:
        """Every patch's upstream form, and every effect's that has one, in stack order
        (twice when prose named a moved module before the patch that moves it: the second
        pass knows where it went)."""
        patches = with_effects(stack_order(patches), effects)
        self.effects = {e.name: e for e in effects if e.upstream is not None}
        base, state = dict(self.trees.base), self.trees.state.copy()
        out = self._export_all(patches)
        missed = {m for m in self.trees.unknown_homes if m in self.trees.state.homes}
        if missed:
            self.trees.home_hints = dict(self.trees.state.homes)
            self.trees.base, self.trees.state, self.trees.unknown_homes = base, state, set()
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
                state = self.trees.state.copy()
                try:
                    self._export_one(patch, state, result)
                    self._verify(result)
                except ExportError as e:
                    result.status, result.reason = "skipped", str(e)
                else:
                    self.trees.state = state
            if result.status == "skipped":
                skipped.add(patch.name)
                result.files, result.diff, result.added = [], "", []
                result.before, result.after, result.knobs = {}, {}, {}
            out.append(result)
        return out

    def final_texts(self) -> dict[str, tuple[str, str]]:
        """relpath -> (pristine, after the whole stack) for every touched file."""
        return {rel: (self.trees.base[rel], text) for rel, text in sorted(self.trees.state.texts.items())}

    # ------------------------------------------------------------ one patch

    def _export_one(self, patch: Patch, state: StackState, result: PatchExport) -> None:
        if patch.name in self.effects:
            self._export_effect(self.effects[patch.name], patch, state, result)
            return
        t_module, _, t_qual = patch.target.partition(":")
        r_module, _, r_attr = patch.replacement.partition(":")
        if not t_module.startswith("torch.") and t_module != "torch":
            raise ExportError(f"target {patch.target} is not a torch module")
        if not is_tp(r_module):
            raise ExportError(f"replacement {patch.replacement} is not a torch_patches definition")
        self.trees.read_upstream(self.trees.upstream_rel(t_module))
        job = Job(self.trees, patch, state, t_module, t_qual.split("."), r_module, r_attr)
        job.replace_target()
        self._finish_job(job, state, result)

    def _export_effect(self, effect: Effect, patch: Patch, state: StackState, result: PatchExport) -> None:
        """A registry effect's upstream form: the body of its form function, appended to
        the upstream module whose import does it (:class:`~torch_patches._registry.UpstreamForm`)."""
        form = effect.upstream
        assert form is not None
        module, _, name = form.form.partition(":")
        src = self.trees.tp_source(module)
        b = src.bindings.get(name)
        fn = b.stmt if b is not None else None
        if not isinstance(fn, ast.FunctionDef) or fn.args.args or fn.args.posonlyargs or fn.args.kwonlyargs:
            raise ExportError(f"{effect.name}: {form.form} is not a function without parameters")
        self.trees.read_upstream(self.trees.upstream_rel(form.home))
        job = Job(self.trees, patch, state, form.home, [], module, name)
        job.append_form(src, fn)
        self._finish_job(job, state, result)

    def _finish_job(self, job: Job, state: StackState, result: PatchExport) -> None:
        trees = self.trees
        result.added = job.ws.added
        result.knobs = job.ws.knobs
        result.notes = job.ws.notes
        before = {r: state.texts.get(r) or trees.base[r] for r in job.ws.files}
        after = {r: trees.upstream_names(text, state) for r, text in job.render().items()}
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
        module_of = {trees.upstream_rel(m): m for m in job.ws.work}
        result.stage = lambda rel, modules: trees.upstream_names(job.render_stage(module_of[rel], modules), state)
        result.before = {r: before[r] for r in result.files}
        result.after = {r: after[r] for r in result.files}

    def export_api(self, package: str, after: Sequence[str]) -> PatchExport:
        """The commit that gives our public package's upstream home its API: every name our
        ``package``'s ``__init__`` re-exports, imported there from where the stack put it
        (the modules no patch needed, such as the ``budget`` and ``cache_hash`` markers,
        come whole in commits of their own before it), and its ``__all__``.  It comes last:
        the public API is what the stack adds up to."""
        home = self.trees.new_home(package)
        if home is None:
            raise ExportError(f"{package} has no new upstream home")
        patch = api_patch(package, home, after)
        result = PatchExport(patch, 0)
        state = self.trees.state.copy()
        job = Job(self.trees, patch, state, home, [], package, "")
        job.reexport(package)
        self._finish_job(job, state, result)
        self._verify(result)
        self.trees.state = state
        return result

    @staticmethod
    def _verify(result: PatchExport) -> None:
        for rel, text in result.after.items():
            try:
                compile(text, rel, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise ExportError(f"generated {rel} does not compile: {e}") from e
        problem = check_applies(result.diff, result.before)
        if problem:
            raise ExportError(f"generated diff does not apply: {problem}")


def split_new_modules(exporter: Exporter, results: Sequence[PatchExport]) -> list[PatchExport]:
    """Each new upstream module a patch creates (whole, see ``Placer.place``) becomes a commit
    of its own, ``Add ...``, right before the patch's, dependencies first (packages before
    their modules, then by how deep the module sits in our imports).  Nothing uses these
    modules until the patch's own commit, which keeps the changes to upstream's files, so
    each of these commits builds alone (``import_each_commit`` checks it)."""
    module_of = {rel: m for m, rel in exporter.trees.new_modules.items()}
    out: list[PatchExport] = []
    for r in results:
        created = [rel for rel in r.files if r.status == "exported" and rel in module_of and not r.before.get(rel)]
        if not created:
            out.append(r)
            continue
        created = _dependencies_first(
            created,
            module_of,
            r.after,
            lambda rel: (
                rel.count("/") - rel.endswith("__init__.py"),
                exporter.trees.import_rank(exporter.trees.new_module_sources[module_of[rel]]),
                rel,
            ),
        )
        blocks = diff_blocks(r.diff)
        rest = [rel for rel in r.files if rel not in created]
        current = {rel: r.before[rel] for rel in rest}  # existing files as the Add commits leave them
        taken: set[str] = set()
        for k, rel in enumerate(created):
            module = module_of[rel]
            add = PatchExport(
                r.patch,
                r.number,
                files=[rel],
                diff=blocks[rel],
                added=[a for a in r.added if a.partition(":")[0] == module],
                before={rel: ""},
                after={rel: r.after[rel]},
                module=module,
                source=exporter.trees.new_module_sources[module],
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
        r.diff = "".join(blocks[rel] if current[rel] == r.before[rel] else unified_diff(rel, current[rel], r.after[rel]) for rel in r.files)
        r.added = [a for a in r.added if a.partition(":")[0] not in {module_of[c] for c in created} and a not in taken]
        r.before = {rel: current[rel] for rel in r.files}
        r.after = {rel: r.after[rel] for rel in r.files}
        out.append(r)
    for number, r in enumerate(out, 1):
        r.number = number
    return out


def _dependencies_first(rels: list[str], module_of: dict[str, str], texts: dict[str, str], key: Callable[[str], Any]) -> list[str]:
    """The new files ``rels`` in an order where each comes after its package and after the
    new modules its text names (at import or in a function), else by ``key``."""

    def uses(a: str, b: str) -> bool:
        pkg, _, name = module_of[b].rpartition(".")
        return (rel_dir(a).startswith(rel_dir(b)) and b.endswith("__init__.py") and a != b) or bool(
            re.search(rf"\b{re.escape(module_of[b])}\b|\bfrom {re.escape(pkg)} import (?:\(\s*)?[^\n]*\b{name}\b", texts[a])
        )

    def rel_dir(rel: str) -> str:
        return rel.rpartition("/")[0] + "/"

    out: list[str] = []
    todo = sorted(rels, key=key)
    while todo:
        ready = next((a for a in todo if not any(uses(a, b) for b in todo if b != a)), todo[0])  # a cycle: by key
        out.append(ready)
        todo.remove(ready)
    return out
