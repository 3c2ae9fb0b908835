"""Our statements' text, rewritten to live in an upstream module: names resolved to where
the stack put them (:class:`~tools.export_upstream._place.Placer`), imports added where they
are needed (a function imports another upstream module itself: a new top-level import
between torch modules can create an import cycle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from tools.export_upstream._model import CONFIG_HOME, FileWork, is_tp
from tools.export_upstream._place import Placer, Workspace
from tools.export_upstream._pysrc import (
    BUILTINS,
    NOT_EXPORTED,
    Edit,
    ExportError,
    NameUse,
    Source,
    _local_bindings,
    apply_edits,
    def_name_edit,
    import_bindings,
    local_imports,
    name_uses,
)
from tools.export_upstream._render import import_key, import_line


class Emitter:
    """Writes our statements as upstream code for one job (``emit``), placing what they
    use through ``placer`` and recording the imports it adds in the job's workspace."""

    def __init__(self, ws: Workspace, placer: Placer) -> None:
        self.ws, self.placer, self.trees = ws, placer, ws.trees
        # The statement being emitted: the function a name use runs in (a local import goes
        # there), the imports each such function needs, the spans left out.
        self._owner: ast.AST | None = None
        self._local_needs: dict[ast.AST, dict[str, str]] = {}
        self._dropped: list[tuple[int, int]] = []

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
        fw = self.ws.file(dest)
        self.placer.requester = dest
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
        fns = (
            [node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            else (
                [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] if isinstance(node, ast.ClassDef) else []
            )
        )
        for fn in fns:
            for sub in ast.walk(fn):
                if isinstance(sub, ast.Name) and sub not in fn.decorator_list:
                    owners[id(sub)] = fn
        for fn in fns:  # decorators, defaults and annotations run at import time
            for part in _import_time_parts(fn):
                for sub in ast.walk(part) if part is not None else ():
                    owners.pop(id(sub), None)
        self._local_needs = {}
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
                if use.local_import and is_tp(use.local_import) and use.attribute is not None:
                    mod, nm = self.trees.resolve_tp(use.local_import)
                    if nm is None:
                        d, final = self.placer.place(mod, use.attribute.attr)
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
    def _is_self_import(src: Source, imp: ast.Import | ast.ImportFrom, fw: FileWork) -> bool:
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
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str) and len(body) > 1:
            first = body[1]
        # Not inside a statement that is not exported (it and its marker line go).
        kept = [b for b in body[body.index(first) :] if not any(s <= src.span(b)[0] < e for s, e in self._dropped)]
        first = kept[0] if kept else first
        indent = " " * first.col_offset
        lines = [import_line(n, d).rstrip("\n") for n, d in sorted(needs.items(), key=import_key)]
        at = src.offset(first.lineno, first.col_offset)
        return Edit(at, at, ("\n" + indent).join(lines) + "\n\n" + indent)

    def _attr_edit(self, src: Source, node: ast.Attribute, new_attr: str) -> Edit:
        end = src.offset(node.end_lineno, node.end_col_offset)  # type: ignore[arg-type]
        return Edit(end - len(node.attr.encode()), end, new_attr)

    def _global_ref(self, src: Source, use: NameUse, fw: FileWork) -> tuple[str, bool] | None:
        """Replacement text for a global name use (bool: it replaces the whole ``x.attr``)."""
        name = use.node.id
        b = src.bindings.get(name)
        if b is None:
            if name in BUILTINS:
                return None
            raise ExportError(f"{src.module} uses {name!r}, which it does not define or import")
        if b.kind != "import":
            dest, final = self.placer.place(src.module, name)
            ref = self._ref_to(fw, dest, final, name)
            return None if ref is None else (ref, False)
        assert b.dotted is not None
        if is_tp(b.dotted):
            mod, nm = self.trees.resolve_tp(b.dotted)
            if nm is not None:
                dest, final = self.placer.place(mod, nm)
                ref = self._ref_to(fw, dest, final, name)
                return None if ref is None else (ref, False)
            # A torch_patches module: only ``module.attr`` uses, but for the config module,
            # which upstream's config module stands for as a value too (its API, and a
            # superset of our knobs under their upstream names).
            if use.attribute is None:
                if not self.trees.is_config_module(mod):
                    raise ExportError(f"{src.module} uses the module {b.dotted} as a value ({name})")
                alias = self.module_alias(fw, CONFIG_HOME, name)
                return (alias, False) if alias != name else None
            dest, final = self.placer.place(mod, use.attribute.attr)
            if dest == fw.module:
                return final, True
            alias = self.module_alias(fw, dest, name)
            return f"{alias}.{final}", True
        # Anything else: make the upstream module bind it too.
        bound = self.ensure_binding(fw, name, b.dotted, use.annotation)
        return (bound, False) if bound != name else None

    def _ref_to(self, fw: FileWork, dest: str, final: str, used_as: str) -> str | None:
        if dest == fw.module:
            return final if final != used_as else None
        alias = self.module_alias(fw, dest, dest.rpartition(".")[2])
        return f"{alias}.{final}"

    def module_alias(self, fw: FileWork, module: str, preferred: str) -> str:
        """A name bound to ``module`` where the current use runs.

        An upstream module the file already imports at top level is used as it is bound
        there. Otherwise the function using it imports it itself (as torch does across
        its own import cycles: a new top-level import between torch modules can make one
        import the other half-initialized); only code that runs at import time gets a
        top-level import.
        """
        for name, dotted in fw.imports.items():
            if dotted == module:
                self.ws.need((fw.module, "import " + name))
                return name
        b = fw.src.bindings.get(preferred)
        if b is not None and b.kind == "import" and b.dotted == module and not b.type_checking:
            return preferred
        for b in fw.src.bindings.values():
            if b.kind == "import" and b.dotted == module and not b.type_checking:
                return b.name
        owner = self._owner
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
        name = preferred if not fw.binds(preferred) else self.ws.fresh(fw.module, f"{preferred}_mod")
        fw.imports[name] = module
        fw.bound.add(name)
        self.ws.need((fw.module, "import " + name))
        return name

    def ensure_binding(self, fw: FileWork, name: str, dotted: str, annotation: bool) -> str:
        bound = self._ensure_binding(fw, name, dotted, annotation)
        if bound in fw.imports:
            self.ws.need((fw.module, "import " + bound))
        return bound

    def _ensure_binding(self, fw: FileWork, name: str, dotted: str, annotation: bool) -> str:
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
        alias = self.ws.fresh(fw.module, f"_{name}")
        fw.imports[alias] = dotted
        return alias

    def _rewrite_local_import(self, src: Source, imp: ast.Import | ast.ImportFrom) -> str | None:
        pairs = list(import_bindings(imp, src.package))
        if not any(is_tp(d) for _, d in pairs):
            return None
        if isinstance(imp, ast.Import):
            raise ExportError(f"`import torch_patches...` inside a function in {src.module}; use `from ... import ...`")
        lines = []
        for name, dotted in pairs:
            if not is_tp(dotted):
                raise ExportError(f"mixed import of ours and not ours in {src.module}")
            mod, nm = self.trees.resolve_tp(dotted)
            if nm is None:
                up = self.placer.dest_module(mod)
                pkg, _, last = up.rpartition(".")
            else:
                dest, final = self.placer.place(mod, nm)
                if "." in final:
                    raise ExportError(f"{dotted} became a method upstream; cannot import it")
                pkg, last = dest, final
            lines.append(f"from {pkg} import {last}" + (f" as {name}" if name != last else ""))
        indent = " " * imp.col_offset
        return ("\n" + indent).join(lines)


def _not_exported(src: Source, node: ast.stmt) -> list[tuple[int, int]]:
    """Byte spans of the statements inside ``node`` marked :data:`NOT_EXPORTED` (with the
    marker line)."""
    spans = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.stmt) and sub is not node and sub.lineno >= 2:
            if src.lines[sub.lineno - 2].strip() == NOT_EXPORTED:
                spans.append(src.line_range_bytes(sub.lineno - 1, sub.end_lineno))  # type: ignore[arg-type]
    return spans


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
    if any(c in text for c in '"\\\n') or not text.isprintable():
        return repr(text)
    return f'"{text}"'


def _local_names(fn: ast.AST) -> set[str]:
    return set(_local_bindings(fn, "").bound)


def _import_time_parts(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST | None]:
    """What of a function runs when its module is imported: decorators, defaults, annotations."""
    args = fn.args
    annotated = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return [*fn.decorator_list, *args.defaults, fn.returns, *(a.annotation for a in annotated if a is not None)]
