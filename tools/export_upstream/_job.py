"""One patch's job: its upstream form generated against the stack's current state.

A :class:`Job` is composed of the objects that do the work: a
:class:`~tools.export_upstream._place.Workspace` (the upstream files it changes and what it
adds), a :class:`~tools.export_upstream._place.Placer` (where each definition of ours goes)
and an :class:`~tools.export_upstream._emit.Emitter` (our code's text, rewritten to live
there). What it writes is one of three: the replacement put in place of the target
(:meth:`Job.replace_target`), the body of a registry effect's upstream form
(:meth:`Job.append_form`), or the public package's re-exports (:meth:`Job.reexport`).
"""

from __future__ import annotations

import ast
import re

from tools.export_upstream._emit import Emitter
from tools.export_upstream._model import StackState, is_tp
from tools.export_upstream._place import ROOT, Placer, Workspace
from tools.export_upstream._pysrc import ExportError, Source, apply_edits, def_name_edit, reindent, stmt_binds
from tools.export_upstream._render import render_file, stage_file
from tools.export_upstream._trees import Trees
from tools.fingerprints import fingerprint_of
from torch_patches._registry import Patch


class Job:
    """Generation of one patch (target ``t_module:t_path``, replacement ``r_module:r_attr``)
    against ``state``, which it changes as it places our definitions."""

    def __init__(
        self,
        trees: Trees,
        patch: Patch,
        state: StackState,
        t_module: str,
        t_path: list[str],
        r_module: str,
        r_attr: str,
    ) -> None:
        self.trees, self.patch = trees, patch
        self.t_module, self.t_path = t_module, t_path
        self.r_module, self.r_attr = r_module, r_attr
        self.ws = Workspace(trees, state)
        self.placer = Placer(self.ws, requester=t_module)
        self.emitter = Emitter(self.ws, self.placer)
        self._emitted: set[tuple[str, int]] = set()

    # --------------------------------------------------------------- output

    def render(self) -> dict[str, str]:
        """Every upstream file the job touches, as it leaves it (relpath -> text)."""
        return {self.trees.upstream_rel(module): render_file(fw) for module, fw in self.ws.work.items()}

    def render_stage(self, module: str, new_modules: frozenset[str]) -> str:
        """Existing upstream ``module`` with only the additions the definitions of
        ``new_modules`` reach (no replacement): what their ``Add`` commits change in it."""
        roots = {k for m in new_modules if m in self.ws.work for k in self.ws.work[m].helper_keys}
        return stage_file(self.ws.work[module], self.ws.reach(roots))

    # ---------------------------------------------------------- what it writes

    def replace_target(self) -> None:
        """The replacement put in place of the target (whole, or as a wrapper of the
        original), then what it needs."""
        self.ws.ctx = ROOT
        target_file = self.ws.file(self.t_module)
        src = target_file.src
        owner_path, attr = self.t_path[:-1], self.t_path[-1]
        body = src.tree.body
        owners: list[ast.ClassDef] = []
        for part in owner_path:
            cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
            if cls is None:
                raise ExportError(f"class {'.'.join(owner_path)} not found in {self.trees.upstream_rel(self.t_module)}")
            owners.append(cls)
            body = cls.body
        t_node = next(
            (n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == attr),
            None,
        )
        if t_node is None:
            raise ExportError(
                f"target {self.patch.target} is not defined in {self.trees.upstream_rel(self.t_module)} (no such function or method)"
            )
        self._check_fingerprint()
        r_src = self.trees.tp_source(self.r_module)
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
            self.ws.state.placed[(self.r_module, self.r_attr)] = (
                self.t_module,
                f"{qual_owner}.{attr}" if owner_path else attr,
            )
            text = self.emitter.emit(r_src, r_node, self.t_module, rename_def=attr, comments=False)
            text = reindent(text, 0, indent)
            new = upstream_decorators + text
        else:
            new = self._wrapper(src, t_node, r_src, r_node, indent, owner_path, attr, upstream_decorators)
        target_file.replace = (first, last, new)
        self.drain()

    def append_form(self, src: Source, fn: ast.FunctionDef) -> None:
        """A registry effect's upstream form: the body of its form function ``fn`` (of our
        module ``src``), appended to the job's target module, whose import runs it."""
        fw = self.ws.file(self.t_module)
        body = [stmt for stmt in fn.body if not _is_docstring(stmt)]
        if not body:
            raise ExportError(f"{self.patch.name}: {self.r_module}:{self.r_attr} has no statements")
        for stmt in body:
            text = self.emitter.emit(src, stmt, self.t_module, comments=False, fold_constants=True)
            fw.tail.append(reindent(text, stmt.col_offset, ""))
        self.drain()

    def reexport(self, package: str) -> None:
        """Every name our ``package``'s ``__init__`` re-exports, imported into the job's
        target module (its upstream home) from where the stack put it; its own definitions
        placed there."""
        state = self.ws.state
        fw = self.ws.file(self.t_module)
        src = self.trees.tp_source(package)
        for name, b in sorted(src.bindings.items(), key=lambda kv: kv[1].index):
            if b.kind == "import" and b.dotted is not None and is_tp(b.dotted):
                mod, nm = self.trees.resolve_tp(b.dotted)
                dest = self.trees.module_home(mod, state) if nm is None else ".".join(self.placer.place(mod, nm))
                if dest is None:
                    raise ExportError(f"{package}.{name}: {b.dotted} has no upstream home")
                self.emitter.ensure_binding(fw, name, dest, annotation=False)
            elif b.kind != "import" and (package, name) not in state.placed:
                self.placer.place(package, name)
        self.drain()

    def drain(self) -> None:
        """Emit every definition the placer queued (emitting one may queue more)."""
        while self.placer.queue:
            tp_module, name = self.placer.queue.pop(0)
            src = self.trees.tp_source(tp_module)
            b = src.bindings[name]
            key = (tp_module, b.index)
            if key in self._emitted:
                continue
            self._emitted.add(key)
            dest, final = self.ws.state.placed[(tp_module, name)]
            fw = self.ws.file(dest)
            self.ws.ctx = (dest, final)
            renames = {}
            if final != name:
                renames[name] = final
            text = self.emitter.emit(src, b.stmt, dest, rename_def=renames.get(name), store_renames=renames)
            is_knob = self.trees.is_config_module(tp_module)
            rank = self.trees.import_rank(tp_module)
            order = (0 if self.trees.mirror_of(tp_module) is None else 1, rank, tp_module, b.stmt.lineno)
            (fw.knobs if is_knob else fw.helpers).append((order, text))
            (fw.knob_keys if is_knob else fw.helper_keys).append((dest, final))
            fw.bound.update(renames.get(n, n) for n in stmt_binds(b.stmt))
            self.ws.added.append(f"{dest}:{final}")

    def _check_fingerprint(self) -> None:
        pristine = StackState()  # the upstream files as the tree holds them, parsed once

        def source_of(module: str) -> tuple[str, ast.Module]:
            src = self.trees.upstream_source(pristine, module)
            return src.text, src.tree

        try:
            fp = fingerprint_of((self.patch.target, *self.patch.depends_on), source_of)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            self.ws.notes.append(f"could not fingerprint the upstream code: {e}")
            return
        if fp not in self.patch.fingerprints.values():
            self.ws.notes.append(
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
        scope_names = {n.name for n in (self._scope_body(src, owner_path)) if hasattr(n, "name")} | (
            set(src.bindings) if not owner_path else set()
        )
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
        text = self.emitter.emit(
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
        descriptor = "".join(f"{indent}@{k}\n" for k in kinds if k in ("staticmethod", "classmethod"))
        others = [src.segment(d) or "?" for d, k in zip(t_node.decorator_list, kinds) if k not in ("staticmethod", "classmethod")]
        if others:
            self.ws.notes.append(
                f"decorators {', '.join('@' + o for o in others)} stay on {impl} only; check whether the wrapper needs them"
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


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
