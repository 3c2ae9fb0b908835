"""Our tests as upstream test files, carried by the commit that completes what they test.

A test module of ours becomes an upstream test file by rewriting what it imports, not what
it does:

* an import of our code becomes an import of the upstream module each name was exported to
  (followed name by name through re-exports to where the stack placed its definition), so
  ``from torch_patches.hooks import inlineable`` becomes
  ``from torch.utils.saved_tensors_hooks._inlineable import inlineable``;
* our config module becomes ``torch._functorch.config`` and every knob it names (an
  attribute, a ``patch(...)`` keyword or string) takes its upstream name;
* our test helpers become upstream test helpers: ``torch_patches/testing/_internal/X.py``
  is ``torch/testing/_internal/X.py`` (the recording backends, the test base and helpers,
  the fixtures), converted the same way and added by the first commit whose tests need
  them; ``torch_patches.testing.TestCase`` is the helpers' ``TestCase`` (or, for a test
  that needs nothing else of them, Dynamo's);
* test classes of stock behaviour (``apply_patches = False``) and statements marked
  ``# upstream: not exported`` (a worker process applying the patch set) are left out, and a test that
  still needs the patch set (``torch_patches.apply()``, a name the stack does not export) is
  refused with the reason;
* the names pass of ``_names.py`` runs over the rest (docstrings, comments), and an
  ``Owner(s)`` line goes on top.

``import_each_commit`` runs each commit's files on the overlay right after applying it,
with every later commit still absent and without ``torch_patches``.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections.abc import Callable, Sequence

from tools.export_upstream._pysrc import NOT_EXPORTED, Source


@dataclasses.dataclass(frozen=True)
class UpstreamTest:
    """One of our test modules as an upstream test file."""

    ours: str  #: our test file (relative to the repository)
    theirs: str  #: the upstream test file it becomes
    owner: str  #: upstream's owner label
    classes: tuple[str, ...] = ()  #: only these test classes (empty: all of them)
    #: Helper modules of ours beside it (``test/X.py``: data for hidden dependencies, a
    #: fresh-process worker), converted too and put beside the upstream test file.
    siblings: tuple[str, ...] = ()
    #: ``"Class.test_method"`` -> why it is left out (said in SUMMARY.md).
    leave_out: tuple[tuple[str, str], ...] = ()


#: Commit name -> the upstream test files it carries: each commit whose behaviour is
#: complete once it is applied (the later commits only add to it) carries its tests.
_F, _D, _I = "module: functorch", "module: dynamo", "module: inductor"
_IDENTITY_DATA = ("identity_cfg.py", "identity_deps.py", "identity_imported.py", "identity_worker.py")

UPSTREAM_TESTS: dict[str, list[UpstreamTest]] = {
    "logging.torch_patches_artifact": [
        UpstreamTest("test/test_logging.py", "test/dynamo/test_saved_tensors_hooks_logging.py", _D),
    ],
    # A new module's unit tests come with it (the behaviour commits that use it follow).
    "add-saved_numerics": [
        UpstreamTest("test/test_numerics.py", "test/functorch/test_saved_numerics.py", _F, classes=("TestAllowlistRules",)),
    ],
    "add-solver": [
        UpstreamTest(
            "test/test_budget_solver.py",
            "test/functorch/test_activation_budget_solver.py",
            _F,
            classes=("TestSolverMatchesReference", "TestSolverWork", "TestSolverIsPure"),
        ),
    ],
    "add-exact": [
        UpstreamTest(
            "test/test_budget_solver.py",
            "test/functorch/test_activation_budget_exact.py",
            _F,
            classes=("TestExactSolver",),
        ),
    ],
    "add-planner": [
        UpstreamTest(
            "test/test_budget.py",
            "test/functorch/test_activation_budget.py",
            _F,
            classes=("TestCostModel", "TestRecompute", "TestTimeline"),
        ),
    ],
    # Hooks traced into the graphs, placed at use, with the runtime deciding per graph: the
    # goldens, the numerics against eager hooks, identity, guards, inputs, in-region scopes.
    "aot.runtime_saved_tensors_hooks_context": [
        UpstreamTest("test/test_inline_placement.py", "test/functorch/test_saved_tensors_hooks_placement.py", _F),
        UpstreamTest("test/test_inline_numerics.py", "test/functorch/test_saved_tensors_hooks_numerics.py", _F),
        UpstreamTest("test/test_packed_subclasses.py", "test/functorch/test_saved_tensors_hooks_packed_subclasses.py", _F),
        UpstreamTest("test/test_compile_facts.py", "test/functorch/test_saved_tensors_hooks_compile_facts.py", _F),
        UpstreamTest("test/test_hook_identity.py", "test/dynamo/test_saved_tensors_hooks_identity.py", _D, siblings=_IDENTITY_DATA),
        UpstreamTest("test/test_hook_guards.py", "test/dynamo/test_saved_tensors_hooks_guards.py", _D),
        UpstreamTest("test/test_hook_inputs.py", "test/dynamo/test_saved_tensors_hooks_inputs.py", _D),
        UpstreamTest("test/test_inscope_hooks.py", "test/dynamo/test_saved_tensors_hooks_in_region.py", _D),
    ],
    # Ports of upstream's saved-tensors-hooks tests (test_aotdispatch's, their cache tests
    # included): complete once graphs whose hooks fell back are not cached.
    "aot.autograd_cache_skip_eager_fallback": [
        UpstreamTest("test/test_upstream_ports.py", "test/functorch/test_saved_tensors_hooks_aotdispatch.py", _F),
    ],
    # In-graph CPU offload: complete once Inductor lowers the offload op (the registry
    # effect's commit, after the two Inductor fixes it relies on).
    "inductor.offload_lowering": [
        UpstreamTest("test/test_offload.py", "test/inductor/test_saved_tensors_hooks_offload.py", _I),
    ],
    # The library through its public API.
    "utils.saved_tensors_hooks_api": [
        UpstreamTest("test/test_hooks_library.py", "test/test_saved_tensors_hooks.py", _F),
        UpstreamTest("test/test_select.py", "test/functorch/test_saved_tensors_hooks_select.py", _F),
        UpstreamTest(
            "test/test_numerics.py",
            "test/functorch/test_saved_tensors_hooks_allowlist.py",
            _F,
            classes=("TestAllowlistCompiled", "TestAllowlistEager", "TestStorageLevels"),
        ),
        UpstreamTest(
            "test/test_activation_inputs.py",
            "test/functorch/test_saved_tensors_hooks_activation_inputs.py",
            _F,
            classes=("TestActivationInputs",),
        ),
    ],
}

#: Our test helpers, in upstream's layout: ``torch_patches/testing/_internal/X.py`` is
#: ``torch/testing/_internal/X.py`` (added with the first test that needs it).
INTERNAL = "torch_patches/testing/_internal"


def _helpers() -> dict[str, tuple[str, str]]:
    """module -> (our file, its upstream file), for every module of :data:`INTERNAL`."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for f in sorted(os.listdir(os.path.join(root, INTERNAL))):
        if f.endswith(".py") and f != "__init__.py":
            ours = f"{INTERNAL}/{f}"
            out[ours[: -len(".py")].replace("/", ".")] = (ours, "torch/" + ours[len("torch_patches/") :])
    return out


HELPERS = _helpers()
#: Our testing package: its ``TestCase`` applies the patch set; the rest is the helpers'.
TESTING = "torch_patches.testing"
CONFIG = "torch_patches.config"
UPSTREAM_CONFIG = "torch._functorch.config"


def helper_home(module: str) -> str:
    return HELPERS[module][1][: -len(".py")].replace("/", ".")


class UpstreamTestError(ValueError):
    """A test of ours that cannot become an upstream test (it needs the patch set)."""


@dataclasses.dataclass
class Resolver:
    """Where our names went: ``place(module, name)`` -> (upstream module, name) or None
    (not exported); ``module_home(module)`` -> the upstream module ours became;
    ``knob(name)`` -> a knob's upstream name (None: not a knob); ``binding(module,
    name)`` -> the dotted path ``module.name`` is imported from there (None: defined
    there)."""

    place: Callable[[str, str], tuple[str, str] | None]
    module_home: Callable[[str], str | None]
    knob: Callable[[str], str | None]
    binding: Callable[[str, str], str | None]
    names: Callable[[str], str]  #: the names pass over prose


class _Converter:
    def __init__(self, text: str, resolver: Resolver, plain_testcase: bool) -> None:
        self.src = Source(text, "test")
        self.r = resolver
        self.plain_testcase = plain_testcase
        self.edits: list[tuple[int, int, str]] = []
        self.config_aliases: set[str] = set()
        self.helpers: set[str] = set()
        self.generated: set[str] = set()  # modules the converted imports name
        #: With some classes only: the top-level names what is kept uses (None: all).
        self.needed: set[str] | None = None

    # ------------------------------------------------------------- imports

    def _resolve(self, module: str, name: str) -> tuple[str, str]:
        """The upstream (module, name) of ``module.name``; ``module`` is ours."""
        for _ in range(8):
            if module == TESTING and name == "TestCase":
                if self.plain_testcase:
                    return "torch._dynamo.test_case", "TestCase"
                module = "torch_patches.testing._internal.common_saved_tensors_hooks"
            if module in HELPERS:
                via = self.r.binding(module, name) if _ours(module) else None
                if via is not None and via.rpartition(".")[0] in HELPERS:
                    # A helper's re-export of another helper's name: from where it is defined
                    # (the converted helper keeps only the imports it uses itself).
                    module, _, name = via.rpartition(".")
                    continue
                self.helpers.add(module)
                return helper_home(module), name
            via = self.r.binding(module, name)
            home = self.r.module_home(f"{module}.{name}") if via is None else None
            if home is not None:  # a module of ours the module does not shadow
                return home.rpartition(".")[0], home.rpartition(".")[2]
            if via is None:
                placed = self.r.place(module, name)
                if placed is None:
                    raise UpstreamTestError(f"it uses {module}.{name}, which the stack does not export")
                return placed
            if not _ours(via):
                return via.rpartition(".")[0], via.rpartition(".")[2]
            module, _, name = via.rpartition(".")
        raise UpstreamTestError(f"cannot follow {module}.{name}")

    def _import_text(self, node: ast.Import | ast.ImportFrom, indent: str) -> str | None:
        """The statement(s) replacing ``node`` (None: keep it)."""
        if isinstance(node, ast.Import):
            if not any(_ours(a.name) or a.name in HELPERS for a in node.names):
                return None
            lines = []
            for a in node.names:
                if a.name in HELPERS:
                    self.helpers.add(a.name)
                    lines.append(f"import {helper_home(a.name)} as {a.asname or a.name}")
                elif a.name == "torch_patches":
                    continue  # only torch_patches.config is used through it (checked below)
                elif a.name == CONFIG:
                    self.config_aliases.add(a.asname or CONFIG)
                    lines.append(f"import {UPSTREAM_CONFIG}" + (f" as {a.asname}" if a.asname else ""))
                elif _ours(a.name):
                    home = self.r.module_home(a.name)
                    if home is None or a.asname is None:
                        raise UpstreamTestError(f"it imports {a.name}, which the stack does not export")
                    lines.append(f"import {home} as {a.asname}")
                else:
                    lines.append(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
            return "\n".join(indent + line for line in lines) if lines else ""
        module = node.module or ""
        if not (_ours(module) or module in HELPERS):
            return None
        groups: dict[str, list[str]] = {}
        for a in node.names:
            bound = a.asname or a.name
            if node.col_offset == 0 and self.needed is not None and bound not in self.needed:
                continue  # only classes left out use it
            if module == "torch_patches" and a.name == "config":
                self.config_aliases.add(bound)
                groups.setdefault("torch._functorch", []).append("config" + (f" as {bound}" if bound != "config" else ""))
                continue
            up_module, up_name = self._resolve(module, a.name)
            groups.setdefault(up_module, []).append(up_name + (f" as {bound}" if bound != up_name else ""))
        self.generated.update(groups)
        return "\n".join(_from_import(m, names, indent) for m, names in groups.items())

    # ------------------------------------------------------------- the rest

    def _knob_edits(self) -> None:
        for node in ast.walk(self.src.tree):
            target = node.func if isinstance(node, ast.Call) else node
            if not (isinstance(target, ast.Attribute) and self._is_config(target.value)):
                continue
            if isinstance(node, ast.Call) and target.attr == "patch":
                for kw in node.keywords:
                    up = kw.arg and self.r.knob(kw.arg)
                    if up:
                        start = self.src.offset(kw.lineno, kw.col_offset)
                        self.edits.append((start, start + len(kw.arg.encode()), up))
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and self.r.knob(first.value):
                    start, end = self.src.span(first)
                    self.edits.append((start, end, repr(self.r.knob(first.value))))
                if isinstance(first, ast.Dict):
                    raise UpstreamTestError("a config.patch({...}) dict: write it with keywords")
            elif not isinstance(node, ast.Call):
                up = self.r.knob(target.attr)
                if up:
                    _, end = self.src.span(target)
                    self.edits.append((end - len(target.attr.encode()), end, up))

    def _is_config(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.config_aliases
        return _dotted(node) == CONFIG

    def _stock_classes(self) -> list[ast.ClassDef]:
        out = []
        for node in self.src.tree.body:
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.Assign)
                        and [_dotted(t) for t in stmt.targets] == ["apply_patches"]
                        and isinstance(stmt.value, ast.Constant)
                        and stmt.value.value is False
                    ):
                        out.append(node)
        return out

    def convert(self, keep: Sequence[str], leave_out: Sequence[str] = ()) -> str:
        tree = self.src.tree
        leave_out = set(leave_out)
        drop = {c.name for c in self._stock_classes()}
        test_classes = {
            n.name
            for n in tree.body
            if isinstance(n, ast.ClassDef) and any(isinstance(s, ast.FunctionDef) and s.name.startswith("test") for s in n.body)
        }
        if keep:
            unknown = set(keep) - test_classes
            if unknown:
                raise UpstreamTestError(f"no test class {', '.join(sorted(unknown))}")
            drop |= test_classes - set(keep)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name not in drop:
                for stmt in node.body:
                    if isinstance(stmt, ast.FunctionDef) and f"{node.name}.{stmt.name}" in leave_out:
                        self._remove(stmt)
                        leave_out.discard(f"{node.name}.{stmt.name}")
        if leave_out:
            raise UpstreamTestError(f"no test {', '.join(sorted(leave_out))} to leave out")
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in drop:
                self._remove(node)
            elif isinstance(node, ast.Expr) and _instantiates(node, drop):
                self._remove(node)
        if keep:  # helpers only the dropped classes use go with them
            self.needed = _needed(tree, drop)
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in drop | self.needed | set(keep):
                    self._remove(node)
                    drop.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _binds(node) and not _binds(node) & self.needed:
                    self._remove(node)
        left_out: list[tuple[int, int]] = []  # line ranges of the statements not exported
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt) and node.lineno >= 2 and self.src.lines[node.lineno - 2].strip() == NOT_EXPORTED:
                self.edits.append((*self.src.line_range_bytes(node.lineno - 1, node.end_lineno), ""))  # type: ignore[arg-type]
                left_out.append((node.lineno, node.end_lineno))  # type: ignore[arg-type]
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.Import, ast.ImportFrom))
                and not self._inside_dropped(node, drop)
                and not any(a <= node.lineno <= b for a, b in left_out)  # goes with its statement
            ):
                start, end = self.src.span(node)
                indent = " " * node.col_offset
                new = self._import_text(node, indent)
                if new is not None:
                    self.edits.append((start - node.col_offset, end, new))
        self._knob_edits()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _dotted(node) == "torch_patches.config":
                start, end = self.src.span(node)
                self.edits.append((start, end, UPSTREAM_CONFIG))
        text = _prune_imports(self._apply(), self.generated, every=bool(keep))
        left = sorted(
            {_dotted(n) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute) and _dotted(n).startswith("torch_patches.")}
            | {"torch_patches" for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name) and n.id == "torch_patches"}
        )
        if any(name.startswith(("torch_patches.apply", "torch_patches.unapply")) for name in left):
            raise UpstreamTestError("it applies the patch set itself")
        if left:
            raise UpstreamTestError(f"it still uses {left[0]}")
        return self.r.names(_slow_tests(text))

    def _inside_dropped(self, node: ast.AST, drop: set[str]) -> bool:
        for cls in self.src.tree.body:
            if isinstance(cls, ast.ClassDef) and cls.name in drop:
                if cls.lineno <= node.lineno <= (cls.end_lineno or cls.lineno):  # type: ignore[attr-defined]
                    return True
        return False

    def _remove(self, node: ast.stmt) -> None:
        first, last = self.src.stmt_lines(node)
        start, end = self.src.line_range_bytes(first, last)
        self.edits.append((start, end, ""))

    def _apply(self) -> str:
        return re.sub(r"\n{4,}", "\n\n\n", _splice(self.src.text, self.edits))


def _needed(tree: ast.Module, drop: set[str]) -> set[str]:
    """The names the module's code outside the ``drop`` classes uses, following top-level
    definitions: what a file carrying only some classes still needs."""
    defs: dict[str, ast.stmt] = {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name not in drop:
            defs[n.name] = n
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            defs.update((name, n) for name in _binds(n))
    roots = [
        n
        for n in tree.body
        if not isinstance(n, (ast.Import, ast.ImportFrom))
        and not (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in drop)
        and n not in defs.values()
        and not (isinstance(n, ast.Expr) and _instantiates(n, drop))
    ]
    roots += [
        n
        for n in defs.values()
        if isinstance(n, ast.ClassDef) and any(isinstance(s, ast.FunctionDef) and s.name.startswith("test") for s in n.body)
    ]
    needed: set[str] = set()
    todo = list(roots)
    while todo:
        for sub in ast.walk(todo.pop()):
            if isinstance(sub, ast.Name) and sub.id not in needed:
                needed.add(sub.id)
                if sub.id in defs:
                    todo.append(defs[sub.id])
    return needed


def _binds(node: ast.Assign | ast.AnnAssign) -> set[str]:
    """The names a top-level assignment binds (empty unless they are all plain names)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets} if all(isinstance(t, ast.Name) for t in targets) else set()  # type: ignore[attr-defined]


def _splice(text: str, edits: Sequence[tuple[int, int, str]]) -> str:
    """``text`` with each byte span (start, end) replaced; an edit inside an earlier one (an
    import inside a removed class) is dropped with it."""
    data = text.encode()
    out, pos = [], 0
    for start, end, new in sorted(edits):
        if start < pos:
            continue
        out += [data[pos:start], new.encode()]
        pos = end
    out.append(data[pos:])
    return b"".join(out).decode()


def _prune_imports(text: str, modules: set[str], every: bool = False) -> str:
    """``text`` without the names its converted top-level imports (from ``modules``; with
    ``every``, all its imports) bind but nothing uses: a file that carries some of a test
    module's classes imports only what they need, so it runs on the commit that completes
    them."""
    tree = ast.parse(text)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    src = Source(text, "test")
    edits = []
    for node in tree.body:
        if every and isinstance(node, ast.Import):
            keep_a = [a for a in node.names if (a.asname or a.name.partition(".")[0]) in used]
            if len(keep_a) < len(node.names):
                first, last = src.line_range_bytes(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                line = "import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in keep_a)
                edits.append((first, last, line + "\n" if keep_a else ""))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__" and (every or node.module in modules):
            keep = [a for a in node.names if (a.asname or a.name) in used]
            if len(keep) == len(node.names):
                continue
            names = [a.name + (f" as {a.asname}" if a.asname else "") for a in keep]
            first, last = src.line_range_bytes(node.lineno, node.end_lineno)  # type: ignore[arg-type]
            edits.append((first, last, _from_import(node.module, names, "") + "\n" if names else ""))
    text = _splice(text, edits)
    return re.sub(r"\n\n\n+(?=(?:from|import) )", "\n\n", text) if every else text


def _slow_tests(text: str) -> str:
    """``@pytest.mark.slow`` -> upstream's ``@slowTest`` (run with PYTORCH_TEST_WITH_SLOW=1)."""
    if "@pytest.mark.slow" not in text:
        return text
    text = text.replace("@pytest.mark.slow", "@slowTest")
    if not re.search(r"\bpytest\.", text):
        text = re.sub(r"^import pytest\n", "", text, count=1, flags=re.M)
    return re.sub(r"^(import torch\n)", r"\1from torch.testing._internal.common_utils import slowTest\n", text, count=1, flags=re.M)


def _ours(dotted: str) -> bool:
    return dotted == "torch_patches" or dotted.startswith("torch_patches.")


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _instantiates(node: ast.Expr, classes: set[str]) -> bool:
    call = node.value
    return isinstance(call, ast.Call) and bool(call.args) and isinstance(call.args[0], ast.Name) and call.args[0].id in classes


def _from_import(module: str, names: list[str], indent: str) -> str:
    one = f"{indent}from {module} import {', '.join(names)}"
    if len(one) <= 100:
        return one
    inner = "".join(f"{indent}    {n},\n" for n in names)
    return f"{indent}from {module} import (\n{inner}{indent})"


def upstream_test(
    text: str, owner: str, resolver: Resolver, classes: Sequence[str] = (), leave_out: Sequence[str] = ()
) -> tuple[str, set[str]]:
    """Our test module ``text`` in upstream's form, and the helper modules it needs."""
    tree = ast.parse(text)
    testing_names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == TESTING for a in n.names}
    conv = _Converter(text, resolver, plain_testcase=testing_names <= {"TestCase"})
    out = conv.convert(classes, leave_out)
    return f'# Owner(s): ["{owner}"]\n\n' + out, conv.helpers


def helper_text(module: str, repo_root: str, resolver: Resolver) -> tuple[str, set[str]]:
    """The upstream form of one of our test helper modules, and the helpers it needs."""
    with open(os.path.join(repo_root, HELPERS[module][0]), encoding="utf-8") as f:
        conv = _Converter(f.read(), resolver, plain_testcase=False)
    return conv.convert(()), conv.helpers - {module}


def tests_for(name: str, repo_root: str, resolver: Resolver, added: set[str]) -> dict[str, str]:
    """The upstream test files (relpath -> text) the commit ``name`` carries, with the test
    helpers they need that no earlier commit added (``added``: those, updated)."""
    out = {}
    needed: list[str] = []
    for t in UPSTREAM_TESTS.get(name, ()):
        with open(os.path.join(repo_root, t.ours), encoding="utf-8") as f:
            try:
                text, helpers = upstream_test(f.read(), t.owner, resolver, t.classes, [n for n, _ in t.leave_out])
            except UpstreamTestError as e:
                raise UpstreamTestError(f"{t.ours} as {t.theirs}: {e}") from None
        out[t.theirs] = text
        needed += sorted(helpers)
        for sibling in t.siblings:
            with open(os.path.join(repo_root, "test", sibling), encoding="utf-8") as f:
                conv = _Converter(f.read(), resolver, plain_testcase=False)
            out[os.path.join(os.path.dirname(t.theirs), sibling)] = conv.convert(())
            needed += sorted(conv.helpers)
    while needed:
        module = needed.pop()
        if module in added:
            continue
        added.add(module)
        text, more = helper_text(module, repo_root, resolver)
        out[HELPERS[module][1]] = text
        needed += sorted(more)
    return out
