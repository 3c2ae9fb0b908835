"""Python source utilities for the upstream export: bindings, name resolution, text edits.

Everything works on source text and ``ast`` positions; nothing is imported.  Edits are
applied at exact byte offsets, so the emitted code keeps its comments and formatting.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import re
from collections.abc import Iterator

BUILTINS = frozenset(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__package__"}


#: A comment line that keeps the statement after it out of the upstream form: code that
#: only the patch set needs (a check that the patches it relies on are applied, a test
#: worker applying the patch set).
NOT_EXPORTED = "# upstream: not exported"


class ExportError(Exception):
    """The upstream form of a patch cannot be produced; the message says why."""


# ------------------------------------------------------------------------ source


class Source:
    """A module's text, its AST and byte offsets of its lines."""

    def __init__(self, text: str, module: str, is_package: bool = False) -> None:
        self.text = text
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.lines = text.splitlines(keepends=True)
        self._starts = [0]
        for line in self.lines:
            self._starts.append(self._starts[-1] + len(line.encode()))
        self.data = text.encode()
        try:
            self.tree = ast.parse(text)
        except SyntaxError as e:
            raise ExportError(f"{module} does not parse: {e}") from e
        self._bindings: dict[str, Binding] | None = None

    def offset(self, lineno: int, col: int) -> int:
        return self._starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def segment(self, node: ast.AST) -> str | None:
        """``node``'s source text, as ``ast.get_source_segment`` gives it (which splits the
        whole text again on every call: the export asks thousands of times)."""
        if getattr(node, "end_lineno", None) is None:
            return None
        start, end = self.span(node)
        return self.data[start:end].decode()

    def stmt_lines(self, node: ast.stmt, comments: bool = True) -> tuple[int, int]:
        """1-based inclusive line range of a statement with its decorators (and comments)."""
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if comments:
            while start > 1 and self.lines[start - 2].strip().startswith("#"):
                start -= 1
        return start, node.end_lineno  # type: ignore[return-value]

    def line_range_bytes(self, first: int, last: int) -> tuple[int, int]:
        return self._starts[first - 1], self._starts[last]

    @property
    def bindings(self) -> dict[str, Binding]:
        if self._bindings is None:
            self._bindings = top_level_bindings(self)
        return self._bindings

    def has_future_annotations(self) -> bool:
        return any(
            isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
            for n in self.tree.body
        )


@dataclasses.dataclass
class Binding:
    """What a top-level name of a module is bound to."""

    name: str
    kind: str  # "import" | "def" | "class" | "assign"
    stmt: ast.stmt
    dotted: str | None = None  # for imports: the dotted path bound
    type_checking: bool = False
    index: int = 0  # position of the top-level statement


def resolve_relative(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(base + ([module] if module else []))


def import_bindings(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[tuple[str, str]]:
    """(bound name, dotted path) for every alias of an import statement."""
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                yield a.asname, a.name
            else:
                first = a.name.split(".")[0]
                yield first, first
    else:
        base = resolve_relative(package, node.module, node.level)
        for a in node.names:
            if a.name == "*":
                continue
            yield a.asname or a.name, f"{base}.{a.name}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def stmt_binds(node: ast.stmt) -> list[str]:
    """Names a (top-level) definition statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    out = []
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                out.append(n.id)
    return out


def top_level_bindings(src: Source) -> dict[str, Binding]:
    out: dict[str, Binding] = {}

    def visit(body: list[ast.stmt], index: int | None, tc: bool) -> None:
        for i, node in enumerate(body):
            idx = i if index is None else index
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                    continue
                for name, dotted in import_bindings(node, src.package):
                    if name not in out or out[name].type_checking:
                        out[name] = Binding(name, "import", node, dotted, tc, idx)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = Binding(node.name, "def", node, None, tc, idx)
            elif isinstance(node, ast.ClassDef):
                out[node.name] = Binding(node.name, "class", node, None, tc, idx)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                if isinstance(node, ast.AnnAssign) and node.value is None:
                    continue
                for name in stmt_binds(node):
                    if name not in out or out[name].type_checking:
                        out[name] = Binding(name, "assign", node, None, tc, idx)
            elif isinstance(node, ast.If):
                is_tc = _is_type_checking(node.test)
                visit(node.body, idx, tc or is_tc)
                visit(node.orelse, idx, tc)
            elif isinstance(node, ast.Try):
                visit(node.body, idx, tc)
                for h in node.handlers:
                    visit(h.body, idx, tc)
                visit(node.orelse, idx, tc)

    visit(src.tree.body, None, False)
    return out


# ------------------------------------------------------------------- name uses


@dataclasses.dataclass
class NameUse:
    """One use of a name inside emitted code, resolved against Python's scoping."""

    node: ast.Name
    scope: str  # "global" | "local" | "enclosing"
    annotation: bool = False
    local_import: str | None = None  # dotted path, for names bound by a local import
    attribute: ast.Attribute | None = None  # the ``name.attr`` node when name is its base


@dataclasses.dataclass
class _Scope:
    kind: str  # "function" | "class" | "comprehension" | "module"
    bound: dict[str, str | None]  # name -> dotted path of a local import (or None)
    globals_: set[str]
    node: ast.AST | None = None


_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _local_bindings(node: ast.AST, package: str) -> _Scope:
    bound: dict[str, str | None] = {}
    globals_: set[str] = set()
    if isinstance(node, (*_FUNCS, ast.Lambda)):
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None:
                bound[a.arg] = None
        body = [node.body] if isinstance(node, ast.Lambda) else node.body
    else:
        body = node.body  # type: ignore[attr-defined]

    def scan(n: ast.AST) -> None:
        if isinstance(n, (*_FUNCS, ast.ClassDef)):
            bound[n.name] = None
            return
        if isinstance(n, (ast.Lambda, *_COMPS)):
            return
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            bound.setdefault(n.id, None)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for name, dotted in import_bindings(n, package):
                bound[name] = dotted
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.setdefault(n.name, None)
        elif isinstance(n, ast.Global):
            globals_.update(n.names)
        elif isinstance(n, ast.Nonlocal):
            pass
        for child in ast.iter_child_nodes(n):
            scan(child)

    for stmt in body:
        scan(stmt)
    for g in globals_:
        bound.pop(g, None)
    kind = "class" if isinstance(node, ast.ClassDef) else "function"
    return _Scope(kind, bound, globals_, node)


def name_uses(node: ast.AST, package: str, *, module_level: bool = True, enclosing: ast.AST | None = None) -> list[NameUse]:
    """Every name use in ``node`` that does not resolve to a local of a scope inside it.

    ``module_level``: ``node`` is a top-level statement (its own bindings are module
    names). ``enclosing``: a function ``node`` is nested in (a wrapper factory); names
    resolving to it are reported with scope "enclosing".
    """
    uses: list[NameUse] = []
    attr_of: dict[int, ast.Attribute] = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            attr_of[id(n.value)] = n
    start: list[_Scope] = []
    if enclosing is not None:
        start.append(_local_bindings(enclosing, package))

    def resolve(name: str, scopes: list[_Scope]) -> tuple[str, str | None]:
        for i in range(len(scopes) - 1, -1, -1):
            s = scopes[i]
            if s.kind == "class" and i != len(scopes) - 1:
                continue
            if name in s.globals_:
                return "global", None
            if name in s.bound:
                if s.node is enclosing and enclosing is not None:
                    return "enclosing", s.bound[name]
                return "local", s.bound[name]
        return "global", None

    def visit(n: ast.AST, scopes: list[_Scope], ann: bool) -> None:
        if isinstance(n, ast.Name):
            scope, dotted = resolve(n.id, scopes)
            uses.append(NameUse(n, scope, ann, dotted, attr_of.get(id(n))))
            return
        if isinstance(n, _FUNCS):
            for d in n.decorator_list:
                visit(d, scopes, False)
            args = n.args
            for d in [*args.defaults, *(x for x in args.kw_defaults if x is not None)]:
                visit(d, scopes, False)
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None and a.annotation is not None:
                    visit(a.annotation, scopes, True)
            if n.returns is not None:
                visit(n.returns, scopes, True)
            inner = scopes + [_local_bindings(n, package)]
            for stmt in n.body:
                visit(stmt, inner, False)
            return
        if isinstance(n, ast.Lambda):
            for d in [*n.args.defaults, *(x for x in n.args.kw_defaults if x is not None)]:
                visit(d, scopes, False)
            visit(n.body, scopes + [_local_bindings(n, package)], False)
            return
        if isinstance(n, ast.ClassDef):
            for d in [*n.decorator_list, *n.bases, *(k.value for k in n.keywords)]:
                visit(d, scopes, False)
            inner = scopes + [_local_bindings(n, package)]
            for stmt in n.body:
                visit(stmt, inner, False)
            return
        if isinstance(n, _COMPS):
            bound: dict[str, str | None] = {}
            for gen in n.generators:
                for t in ast.walk(gen.target):
                    if isinstance(t, ast.Name):
                        bound[t.id] = None
            inner = scopes + [_Scope("comprehension", bound, set(), n)]
            for child in ast.iter_child_nodes(n):
                visit(child, inner, False)
            return
        if isinstance(n, ast.AnnAssign):
            visit(n.target, scopes, False)
            visit(n.annotation, scopes, True)
            if n.value is not None:
                visit(n.value, scopes, False)
            return
        if isinstance(n, ast.arg):
            return
        for child in ast.iter_child_nodes(n):
            visit(child, scopes, ann)

    if module_level or isinstance(node, (*_FUNCS, ast.ClassDef)):
        visit(node, start, False)
    else:
        visit(node, start, False)
    return uses


def local_imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements inside function bodies of ``node``."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, _FUNCS):
            for m in ast.walk(n):
                if isinstance(m, (ast.Import, ast.ImportFrom)) and m not in out:
                    out.append(m)
    return out


# ----------------------------------------------------------------------- edits


@dataclasses.dataclass(order=True)
class Edit:
    start: int  # byte offsets into Source.data
    end: int
    text: str


def apply_edits(src: Source, start: int, end: int, edits: list[Edit]) -> str:
    """Source bytes [start, end) with ``edits`` (inside that range) applied."""
    out = []
    pos = start
    for e in sorted(edits, key=lambda e: (e.start, e.end)):
        if e.start < pos:
            raise ExportError(f"overlapping rewrites in {src.module} at byte {e.start}")
        out.append(src.data[pos : e.start].decode())
        out.append(e.text)
        pos = e.end
    out.append(src.data[pos:end].decode())
    return "".join(out)


_DEF_RE = re.compile(rb"(async\s+def|def|class)\s+([A-Za-z_]\w*)")


def def_name_edit(src: Source, node: ast.stmt, new: str) -> Edit:
    start = src.offset(node.lineno, node.col_offset)
    m = _DEF_RE.match(src.data, start)
    if not m:
        raise ExportError(f"cannot find the name of {getattr(node, 'name', '?')} in {src.module}")
    return Edit(m.start(2), m.end(2), new)


def protected_lines(text: str) -> set[int]:
    """0-based lines that continue a multi-line string token (docstrings excepted).

    Re-indenting them would change the string's value.
    """
    import io
    import tokenize

    docstrings: set[int] = set()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    for n in ast.walk(tree):
        if isinstance(n, (*_FUNCS, ast.ClassDef, ast.Module)) and n.body:
            b = n.body[0]
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docstrings.add(b.lineno)
    kinds = {tokenize.STRING} | {getattr(tokenize, "FSTRING_MIDDLE", -1), getattr(tokenize, "FSTRING_END", -1)}
    out: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in kinds and tok.end[0] > tok.start[0] and tok.start[0] not in docstrings:
                out.update(range(tok.start[0], tok.end[0]))  # rows start+1..end, 0-based
    except (tokenize.TokenError, IndentationError):
        return out
    return out


def reindent(text: str, remove: int, add: str) -> str:
    """Remove ``remove`` columns of indentation and add ``add``, sparing string bodies."""
    protect = protected_lines(_dedent_for_parse(text, remove))
    out = []
    for i, line in enumerate(text.splitlines(keepends=True)):
        if i in protect:
            out.append(line)
            continue
        if not line.strip():
            out.append("\n" if line.endswith("\n") else "")
            continue
        body = line[remove:] if line[:remove].strip() == "" else line.lstrip()
        out.append(add + body)
    return "".join(out)


def _dedent_for_parse(text: str, remove: int) -> str:
    return "".join(line[remove:] if line[:remove].strip() == "" else line.lstrip() for line in text.splitlines(keepends=True))
