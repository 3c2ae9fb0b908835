"""The package's structure, as ARCHITECTURE.md states it.

* No import loop between modules of ``torch_patches`` and ``tools`` (imports at module top
  and inside functions alike) except the manifest/mechanism pairs: the registry and its
  patch list, the export tool's package and its halves.
* The hooks library (``torch_patches/hooks``) imports nothing of the compiler
  (``torch_patches/_dynamo``, ``_functorch``, ``_inductor``): the line between them is
  one-way, through the bottom modules (``_hook_kinds``, ``_numerics``, ``config``).
* Imports sit at the top of each module (no import after code at module level).
* The budget wing and the bench keep each module under 600 lines.
"""

import ast
import os

from torch._dynamo.test_case import run_tests

from torch_patches.testing import TestCase


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("torch_patches", "tools")
#: Loops allowed: a manifest and the mechanism that reads it.
ALLOWED_LOOPS = [
    {"torch_patches._registry", "torch_patches._patches"},
    {"tools.export_upstream._generate", "tools.export_upstream._write"},
]
COMPILER = ("torch_patches._dynamo", "torch_patches._functorch", "torch_patches._inductor")
SIZE_LIMITED = ("torch_patches/bench", "torch_patches/_functorch/_aot_autograd/activation_budget")
MAX_LINES = 600


def _modules():
    mods = {}
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(mods):
    """module -> {imported module of ours}, counting every import statement in the file."""
    edges = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        is_pkg = path.endswith("__init__.py")
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - (0 if is_pkg else 1) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
        edges[name] = out
    return edges


def _loops(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


class TestLayout(TestCase):
    def test_no_import_loops(self):
        loops = [sorted(c) for c in _loops(_imports(_modules())) if c not in ALLOWED_LOOPS]
        self.assertEqual(loops, [])

    def test_hooks_library_does_not_import_the_compiler(self):
        edges = _imports(_modules())
        crossing = {
            (m, t)
            for m, targets in edges.items()
            if m == "torch_patches.hooks" or m.startswith("torch_patches.hooks.")
            for t in targets
            if t.startswith(COMPILER)
        }
        self.assertEqual(crossing, set())

    def test_imports_at_module_top(self):
        late = []
        for name, path in _modules().items():
            with open(path) as f:
                body = ast.parse(f.read()).body
            seen_code = False
            for node in body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    if seen_code:
                        late.append(f"{name}:{node.lineno}")
                elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) and not (
                    isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
                ) and not isinstance(node, ast.Try):
                    seen_code = True
        self.assertEqual(late, [])

    def test_budget_wing_and_bench_modules_stay_small(self):
        big = {}
        for prefix in SIZE_LIMITED:
            for dirpath, _, files in os.walk(os.path.join(ROOT, prefix)):
                for f in files:
                    if f.endswith(".py"):
                        with open(os.path.join(dirpath, f)) as fh:
                            n = sum(1 for _ in fh)
                        if n > MAX_LINES:
                            big[os.path.relpath(os.path.join(dirpath, f), ROOT)] = n
        self.assertEqual(big, {})


if __name__ == "__main__":
    run_tests()
