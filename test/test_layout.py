"""The package's structure, as ARCHITECTURE.md states it.

* No import loop between modules of ``torch_patches``, ``tools`` and ``benchmarks``
  (imports at module top and inside functions alike).
* The hooks library (``torch_patches/hooks``) imports nothing of the compiler
  (``torch_patches/_dynamo``, ``_functorch``, ``_inductor``): the line between them is
  one-way (the compiler imports the library's markers and numerics allowlist).
* Imports sit at the top of each module (no import after code at module level).
* Modules sit where they go upstream: at most 8 at the package root.
* Units a reader can hold: no function over 100 lines, no class over 400, in
  ``torch_patches``, ``tools`` and ``benchmarks``; the budget wing, the bench and the
  benchmarks keep each module under 600 lines, and the package's bench stays small (at most
  800 lines in all: the research harness is ``benchmarks/``, outside the package).
* What runs at every compiled call sits in marked sections (``PER_CALL``).
* What the base install runs (``import torch_patches``, ``apply()``, the command line and
  every module it imports) imports no package that only an extra of setup.py provides.
* No binary archive (wheel, tarball, zip...) is tracked.
"""

import ast
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap

from torch._dynamo.test_case import run_tests

from torch_patches.testing import TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("torch_patches", "tools", "benchmarks")
#: Import loops allowed: none.
ALLOWED_LOOPS: list[set[str]] = []
#: Modules at the package root (the rest sit where they go upstream, or in packages).
MAX_ROOT_MODULES = 8
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 400
COMPILER = ("torch_patches._dynamo", "torch_patches._functorch", "torch_patches._inductor")
SIZE_LIMITED = ("torch_patches/bench", "torch_patches/_functorch/_aot_autograd/activation_budget", "benchmarks")
#: What runs at every compiled call (ARCHITECTURE.md, "What runs per compiled call"), in
#: the modules that also hold compile-time code: in each, these functions sit in the section
#: under the per-call banner (a line starting ``# ===`` and ending ``per compiled call``).
PER_CALL = {
    "torch_patches/_dynamo/guards.py": ("current_key", "_guard_check"),
    "torch_patches/_functorch/_aot_autograd/hook_identity.py": (
        "hook_identity",
        "config_key",
        "hooks_guard_key",
        "_content_check",
    ),
    "torch_patches/_functorch/_aot_autograd/hook_inputs.py": ("current_input", "resolve", "_alias_of"),
    "torch_patches/_functorch/_aot_autograd/donated_inputs.py": ("_owned_or_copy",),
    "torch_patches/_functorch/_aot_autograd/runtime_wrappers.py": (
        "_per_call",
        "run_with_hooks_disabled",
        "run_under_hooks_contract",
        "_contract_hooks",
    ),
    "torch_patches/_functorch/_aot_autograd/utils.py": (
        "top_saved_tensors_hooks",
        "ambient_saved_tensors_hooks",
        "_config_budget",
        "is_hookable_dtype",
    ),
}
MAX_LINES = 600
#: The package's bench (the memory/speed table of ``python -m torch_patches bench``), in all:
#: the research harness built on it lives in ``benchmarks/``, outside the package.
MAX_BENCH_LINES = 800


@functools.cache
def _tree(path):
    """A module's parsed source (the checks below each walk every module)."""
    with open(path) as f:
        return ast.parse(f.read())


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
        tree = _tree(path)
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


def _requirement_names(requirements):
    return {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def extras_only_modules():
    """Top-level modules of the packages setup.py's extras add to the base install."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        call = next(n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    base = _requirement_names(ast.literal_eval(kw["install_requires"]))
    extras = set().union(*(_requirement_names(v) for v in ast.literal_eval(kw["extras_require"]).values()))
    provides = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    return sorted(m for dist in extras - base for m in provides.get(dist, {dist.replace("-", "_")}) if not m.startswith("_"))


def cli_imports():
    """Modules of ours that the command line imports anywhere in torch_patches/__main__.py."""
    with open(os.path.join(ROOT, "torch_patches", "__main__.py")) as f:
        tree = ast.parse(f.read())
    found = {"torch_patches.__main__", "torch_patches.bench"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_patches"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch_patches"))
    return sorted(found)


#: Tracked files that are binary archives or build products.
BINARY = re.compile(r"\.(whl|egg|tar|tgz|gz|bz2|xz|zip|so|pyd|dll|dylib|pyc|pt|pth|bin|safetensors)$")


class TestLayout(TestCase):
    def test_no_test_harness_listens_to_the_trace(self):
        # torch builds a structured-trace payload (each graph of each stage, printed) only
        # where its trace logger has a handler: torch_patches.testing.TestCase drops the one
        # Dynamo's test case adds and the log capture pytest 9.1+ attaches to every logger
        # that does not propagate. (Not in the tests exported upstream: their test case is
        # upstream's, which listens.)
        from torch._logging._internal import trace_log

        harness = [h for h in trace_log.handlers if h is getattr(self, "handler", None) or type(h).__module__ == "_pytest.logging"]
        self.assertEqual(harness, [])

    def test_base_install_needs_no_extra(self):
        # A fresh process where every package only an extra provides cannot be imported:
        # what a newcomer has after `pip install torch_patches` (README's "Try it").
        blocked = extras_only_modules()
        self.assertIn("expecttest", blocked)
        script = textwrap.dedent(f"""
            import importlib, sys

            # Absent, as import and importlib.util.find_spec see it (torch probes with both).
            sys.modules.update(dict.fromkeys({blocked!r}))
            import torch_patches
            torch_patches.apply()
            for module in {cli_imports()!r}:
                importlib.import_module(module)
            from torch_patches.__main__ import main
            assert main(["status"]) == 0
            for argv in (["demo", "--help"], ["bench", "--help"], ["report", "--help"]):
                try:
                    main(argv)
                except SystemExit as e:
                    assert e.code == 0, (argv, e.code)
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        # The status command's table names every patch (the command's own test: test_registry).
        from torch_patches._registry.patches import PATCHES

        for patch in PATCHES:
            self.assertIn(patch.name, proc.stdout)

    def test_no_binary_archive_is_tracked(self):
        tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
        if tracked.returncode != 0:
            self.skipTest("not a git checkout")
        self.assertEqual([f for f in tracked.stdout.splitlines() if BINARY.search(f)], [])

    def test_recorded_durations_name_tests_that_exist(self):
        # test/durations.json (`--store-durations`, test/conftest.py): the order workers run
        # tests in. A renamed test only loses its place; a file that is gone, or a value that
        # is not a duration, is an entry to rewrite.
        import json

        with open(os.path.join(ROOT, "test", "durations.json")) as f:
            recorded = json.load(f)
        self.assertTrue(recorded)
        for nodeid, seconds in recorded.items():
            path, sep, name = nodeid.partition("::")
            self.assertTrue(sep and name and os.path.exists(os.path.join(ROOT, path)), nodeid)
            self.assertIsInstance(seconds, float, nodeid)
            self.assertGreaterEqual(seconds, 1.0, nodeid)
        self.assertEqual(list(recorded), sorted(recorded))

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
            body = _tree(path).body
            seen_code = False
            for node in body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    if seen_code:
                        late.append(f"{name}:{node.lineno}")
                elif (
                    not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                    and not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test))
                    and not isinstance(node, ast.Try)
                ):
                    seen_code = True
        self.assertEqual(late, [])

    def test_few_modules_at_the_package_root(self):
        root = sorted(f for f in os.listdir(os.path.join(ROOT, "torch_patches")) if f.endswith(".py"))
        self.assertLessEqual(len(root), MAX_ROOT_MODULES, root)

    def test_units_a_reader_can_hold(self):
        long = []
        for name, path in _modules().items():
            for node in ast.walk(_tree(path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        long.append(f"{name}.{node.name}: {lines} lines (at most {limit})")
        self.assertEqual(long, [])

    def test_per_call_code_is_marked(self):
        misplaced = []
        for rel, names in PER_CALL.items():
            with open(os.path.join(ROOT, rel)) as f:
                text = f.read()
            banner = next(
                (
                    i
                    for i, line in enumerate(text.splitlines(), 1)
                    if line.startswith("# ===") and line.rstrip().endswith("per compiled call")
                ),
                None,
            )
            defs = {n.name: n.lineno for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            misplaced += [f"{rel}:{n}" for n in names if banner is None or defs.get(n, 0) < banner]
        self.assertEqual(misplaced, [])

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

    def test_the_packages_bench_is_small(self):
        lines = {}
        for dirpath, _, files in os.walk(os.path.join(ROOT, "torch_patches", "bench")):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f)) as fh:
                        lines[f] = sum(1 for _ in fh)
        self.assertLessEqual(sum(lines.values()), MAX_BENCH_LINES, lines)


if __name__ == "__main__":
    run_tests()
