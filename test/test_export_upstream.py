"""The upstream export: every patch as a diff against torch's sources, and proof they are
the same change.

The equivalence test applies the exported stack to an overlay of the installed torch (the
touched files copied, everything else symlinked) and runs the golden-graph tests
(test/test_inline_placement.py, and the in-region scope tests of test/test_inscope_hooks.py)
against it in a subprocess, *without*
``torch_patches.apply()`` (``torch_patches.testing`` upstream-form mode): the same goldens
pass, so the upstream code builds the same graphs as the patches.
"""

import ast
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from unittest import mock

import pytest

import torch_patches._registry.patches as patches_module
import torch_patches.hooks
from tools.export_upstream import (
    apply_to_overlay,
    check_applies,
    make_stack,
    run_export,
)
from tools.export_upstream.__main__ import (
    DEFAULT_TESTS,
    REPO_ROOT,
    UPSTREAM_FORM_ENV,
    installed_torch_root,
    main,
    run_upstream_tests,
)
from tools.export_upstream._commit_imports import ImportChecker
from tools.export_upstream._model import API_COMMIT, CONFIG_HOME, CONFIG_MODULE_API, is_test_file
from tools.export_upstream._names import HOOKS_HOME, PROVENANCE, leftovers, upstream_names
from tools.export_upstream._tests import HELPERS, UPSTREAM_TESTS, Resolver, UpstreamTestError, upstream_test
from tools.export_upstream._write import LARGE_REASONS, REVIEWABLE_LINES, format_patch, import_each_commit, summary_text
from torch_patches.testing import UPSTREAM_FORM_ENV as TESTING_ENV

ROOT = installed_torch_root()
_CACHE = {}


def exported():
    if "results" not in _CACHE:
        _CACHE["results"] = run_export(ROOT, patches_module.PATCHES, REPO_ROOT, patches_module.EFFECTS)
    return _CACHE["results"]


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@unittest.skipIf(os.environ.get(UPSTREAM_FORM_ENV), "runs the upstream-form tests itself")
@pytest.mark.xdist_group("export")  # one worker exports the stack for all of them (pytest.ini)
class TestExport(unittest.TestCase):
    @pytest.fixture(autouse=True)
    def _pytest_config(self, request):
        self.pytest_config = request.config

    def test_one_worker_runs_the_group(self):
        # Under --dist loadgroup (pytest.ini) xdist adds "@export" to these tests' ids as a
        # worker collects them, and so sends them to one worker. pytest-xdist 3.8 does that
        # through an attribute pytest 9.2 no longer reads: then the class is spread over the
        # workers and each one exports the stack again (about 10 s of CPU in the fast tier).
        config = self.pytest_config
        if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
            self.skipTest("not on an xdist worker under --dist loadgroup")
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rpartition(" ")[0]
        import xdist

        self.assertTrue(
            nodeid.endswith("@export"),
            f"{nodeid}: --dist loadgroup has no effect with pytest {pytest.__version__} and pytest-xdist "
            f"{xdist.__version__}; install the test extra's versions (setup.py)",
        )

    def test_env_names_agree(self):
        self.assertEqual(UPSTREAM_FORM_ENV, TESTING_ENV)

    def test_every_record_exports(self):
        _, results = exported()
        patch_names = {p.name for p in patches_module.PATCHES}
        own = [r for r in results if r.patch.name in patch_names and r.module is None]
        self.assertEqual([r.patch.name for r in own], [p.name for p in patches_module.PATCHES])
        # The last commit gives the hooks library's upstream home its public API: every name
        # of ours, importable from the package (the modules no patch needs come before it).
        self.assertEqual(results[-1].patch.name, API_COMMIT)
        package = results[-1].after["torch/utils/saved_tensors_hooks/__init__.py"]
        imported = {a.asname or a.name for n in ast.parse(package).body if isinstance(n, ast.ImportFrom) for a in n.names}
        self.assertLessEqual(set(torch_patches.hooks.__all__), imported)
        skipped = [f"{r.patch.name}: {r.reason}" for r in results if r.status != "exported"]
        self.assertEqual(skipped, [], "patches whose upstream form cannot be produced")
        for r in results:
            self.assertTrue(r.diff.startswith("diff --git a/torch/"), r.name)
            self.assertIn("Test Plan:", r.message)
        for r in own:
            self.assertTrue(r.message.startswith(r.patch.summary + "\n"), r.patch.name)
            self.assertIn(f"Retire when: {r.patch.retire_when}"[:60], r.message.replace("\n", " "))

    def test_no_commit_reads_what_a_later_one_adds(self):
        # A commit's new code reads from upstream modules only names they have at that
        # commit (a knob, a helper a patch adds to utils.py): the Add commits take what
        # their module uses of their patch's additions, and come after the new modules they
        # name. Imports run at first call, so importing each commit cannot show this.
        _, results = exported()
        texts: dict[str, str] = {}

        def module_text(module):
            for rel in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
                if rel in texts:
                    return texts[rel]
                path = os.path.join(ROOT, rel)
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as f:
                        return f.read()
            return None

        parsed = {}  # text -> its tree: every name a file imports is looked up in one text

        def parse(text):
            if text not in parsed:
                parsed[text] = ast.parse(text)
            return parsed[text]

        unparsed = {}

        def unparse(node):
            if node not in unparsed:
                unparsed[node] = ast.unparse(node)
            return unparsed[node]

        def binds(text, name):
            for node in parse(text).body:
                targets = (
                    [node.name]
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                    else [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
                    if isinstance(node, (ast.Assign, ast.AnnAssign))
                    else [a.asname or a.name.split(".")[0] for a in node.names]
                    if isinstance(node, (ast.Import, ast.ImportFrom))
                    else []
                )
                if name in targets or isinstance(node, (ast.If, ast.Try)) and name in unparse(node):
                    return True
            return False

        missing = []
        for r in results:
            texts.update(r.after)
            for rel in r.files:
                if is_test_file(rel) or r.before.get(rel):
                    continue
                tree = parse(r.after[rel])
                aliases = {}
                for node in ast.walk(tree):
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                        for a in node.names:
                            sub = f"{node.module}.{a.name}"
                            if module_text(sub) is not None:
                                aliases[a.asname or a.name] = sub
                            elif module_text(node.module) is not None and not binds(module_text(node.module), a.name):
                                missing.append(f"{r.filename}: {node.module}.{a.name}")
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                        text = module_text(aliases[node.value.id])
                        if not binds(text, node.attr) and not (aliases[node.value.id] == CONFIG_HOME and node.attr in CONFIG_MODULE_API):
                            missing.append(f"{r.filename}: {aliases[node.value.id]}.{node.attr}")
        self.assertEqual(sorted(set(missing)), [])

    def test_effects_have_an_upstream_form(self):
        # Each global effect of apply() is, upstream, code run at a module's import (a commit
        # of its own, right after the patches it builds on, first when none) or done by the
        # exported code at first use (said in its record).
        _, results = exported()
        names = [r.name for r in results]
        for effect in patches_module.EFFECTS:
            self.assertNotEqual(effect.upstream is None, not effect.upstream_lazy, effect.name)
            if effect.upstream is None:
                self.assertNotIn(effect.name, names)
                continue
            i = names.index(effect.name)
            r = results[i]
            self.assertEqual(r.subject, effect.upstream.title)
            home = effect.upstream.home.replace(".", "/") + ".py"
            self.assertIn(home, r.files)
            last_line = r.after[home].rstrip().splitlines()[-1]
            self.assertFalse(last_line.startswith((" ", "\t")), f"{effect.name}: the file does not end at top level")
            after = [names.index(a) for a in effect.upstream.after]
            self.assertEqual(i, max(after) + 1 if after else 0, effect.name)
        # Upstream registers the artifact with the others; the exported code only looks it up.
        artifact = results[names.index("logging.torch_patches_artifact")]
        self.assertIn('register_artifact(\n    "saved_tensors_hooks",', artifact.after["torch/_logging/_registrations.py"])
        added = [line for r in results for line in r.diff.splitlines() if line.startswith("+")]
        self.assertEqual(sum("register_artifact(" in line for line in added), 1)
        # The offload lowering registers at the import of Inductor's lowerings.
        lowering = results[names.index("inductor.offload_lowering")].after["torch/_inductor/lowering.py"]
        self.assertTrue(lowering.rstrip().endswith("\nregister_offload_lowering()"))

    def test_new_modules_are_commits_of_their_own(self):
        # A module of ours with no upstream counterpart is one commit adding one new file
        # (the whole module, with the upstream test file made from ours where there is one),
        # before the commit of the patch that first uses it, with what it uses of the
        # patch's additions to upstream's files (helpers, knobs: only added lines); the
        # patch's own commit changes upstream's files only.
        _, results = exported()
        position = {}
        for i, r in enumerate(results):
            if r.module is not None:
                library = [f for f in r.files if not is_test_file(f) and not r.before[f]]
                self.assertEqual(len(library), 1, r.name)
                self.assertEqual(sorted(f for f in r.files if f.startswith("test/")), r.upstream_tests, r.name)
                self.assertEqual(library[0], r.module.replace(".", "/") + ("/__init__.py" if library[0].endswith("__init__.py") else ".py"))
                for block in r.diff.split("diff --git ")[1:]:
                    removed = [line for line in block.splitlines() if line.startswith("-") and not line.startswith("---")]
                    self.assertEqual(removed, [], f"{r.name} changes upstream code")
                self.assertTrue(r.subject.split("] ", 1)[1].startswith("Add "), r.subject)
                position.setdefault(r.patch.name, []).append(i)
            else:
                for rel in r.files:  # only its tests and test helpers are new files
                    self.assertTrue(r.before[rel] or is_test_file(rel), f"{r.name} creates {rel}")
                for j in position.get(r.patch.name, []):
                    self.assertLess(j, i)
        self.assertIn("torch/_functorch/_aot_autograd/activation_budget/solver.py", {f for r in results for f in r.files})
        self.assertIn("torch/utils/saved_tensors_hooks/__init__.py", {f for r in results for f in r.files})
        # The summary states the size of each commit and why one is over the reviewable size.
        text = summary_text(results, "x")
        for r in results:
            self.assertIn(f"| {r.number:02d} | {r.subject} |", text)
            if r.module is None:  # a commit that changes behaviour says how much, and its risk
                self.assertTrue(r.patch.measured, r.name)
                self.assertTrue(r.patch.risk, r.name)
                self.assertIn(f"Effect: {r.patch.measured}.", text)
                self.assertIn(f"Risk: {r.patch.risk}.", text)
            if r.changed_lines() > REVIEWABLE_LINES:
                self.assertIn(r.name, LARGE_REASONS, f"{r.name}: {r.changed_lines()} lines without a stated reason")
        large = {r.name for r in results if r.changed_lines() > REVIEWABLE_LINES}
        self.assertLessEqual(set(LARGE_REASONS), large, "a reason for a commit no longer over the size")

    def test_upstream_names_only(self):
        # Every exported line, code and commit message, speaks upstream's names: knobs under
        # torch._functorch.config, the hooks library at its proposed home, our modules where
        # they went; the one line naming torch_patches is each commit's provenance trailer.
        _, results = exported()
        for r in results:
            text = format_patch(r, len(results))
            self.assertEqual(leftovers(text), [], r.filename)
            self.assertEqual(sum(line.startswith(PROVENANCE) for line in r.message.splitlines()), 1, r.filename)
        self.assertNotIn("torch_patches.config", "".join(r.diff for r in results))

    def test_tests_become_upstream_test_files(self):
        # Our tests are upstream test files, carried by the commit that completes what they
        # test (test_each_commit_imports_alone runs them right after it, every later commit
        # absent): upstream imports, upstream's TestCase, an Owner(s) line, the commit's Test
        # Plan runs them; our test helpers come as torch/testing/_internal modules with the
        # first commit whose tests need them.
        _, results = exported()
        carriers = {r.name: r for r in results if r.upstream_tests}
        self.assertEqual(sorted(carriers), sorted(UPSTREAM_TESTS))  # every carrier is a commit
        self.assertIn("test/inductor/test_saved_tensors_hooks_offload.py", carriers["inductor.offload_lowering"].upstream_tests)
        helpers = [rel for r in results for rel in r.files if rel.startswith("torch/testing/_internal/")]
        self.assertEqual(sorted(helpers), sorted(rel for _, rel in HELPERS.values()))  # each added once
        for r in carriers.values():
            for rel in r.upstream_tests:
                text = r.after[rel]
                self.assertRegex(text.splitlines()[0], r'^# Owner\(s\): \["module: \w+"\]$', rel)
                self.assertEqual(leftovers(text), [], rel)
                self.assertNotRegex(text, r"^\s*(from|import) torch_patches\b", rel)
                self.assertIn(f"python {rel}", r.message)
        solver = carriers["add-solver"].after["test/functorch/test_activation_budget_solver.py"]
        self.assertIn("from torch._functorch._aot_autograd.activation_budget import solver", solver)
        self.assertIn("from torch._dynamo.test_case import TestCase", solver)
        placement = carriers["aot.runtime_saved_tensors_hooks_context"].after["test/functorch/test_saved_tensors_hooks_placement.py"]
        self.assertIn("from torch.testing._internal.common_saved_tensors_hooks import (", placement)
        self.assertIn("import torch._functorch.config as tp_config", placement)
        self.assertIn("tp_config.patch(saved_tensors_hooks_placement=", placement)

    def test_upstream_test_rules(self):
        homes = {
            "torch_patches.hooks._inlineable": "torch.utils.saved_tensors_hooks._inlineable",
        }
        defined = {("torch_patches.hooks._inlineable", "inlineable"): ("torch.utils.saved_tensors_hooks._inlineable", "inlineable")}
        imports = {("torch_patches.hooks", "inlineable"): "torch_patches.hooks._inlineable.inlineable"}
        resolver = Resolver(
            place=lambda m, n: defined.get((m, n)),
            module_home=homes.get,
            knob={"hook_placement": "saved_tensors_hooks_placement"}.get,
            binding=lambda m, n: imports.get((m, n)),
            names=lambda t: t,
        )
        ours = textwrap.dedent("""\
            import pytest
            import torch
            import torch_patches.config as tp_config
            from torch_patches.hooks import inlineable
            from torch_patches.testing import TestCase

            class TestStock(TestCase):
                apply_patches = False

                def test_a(self):
                    pass

            class TestOurs(TestCase):
                @pytest.mark.slow
                def test_b(self):
                    # upstream: not exported
                    torch_patches.apply()
                    with tp_config.patch(hook_placement="boundary"), tp_config.patch("hook_placement", "at_use"):
                        return inlineable, tp_config.hook_placement

            instantiate_device_type_tests(TestStock, globals())
            instantiate_device_type_tests(TestOurs, globals())
        """)
        text, helpers = upstream_test(ours, "module: functorch", resolver)
        self.assertEqual(helpers, set())
        self.assertEqual(
            text,
            """\
# Owner(s): ["module: functorch"]

import torch
from torch.testing._internal.common_utils import slowTest
import torch._functorch.config as tp_config
from torch.utils.saved_tensors_hooks._inlineable import inlineable
from torch._dynamo.test_case import TestCase


class TestOurs(TestCase):
    @slowTest
    def test_b(self):
        with tp_config.patch(saved_tensors_hooks_placement="boundary"), tp_config.patch('saved_tensors_hooks_placement', "at_use"):
            return inlineable, tp_config.saved_tensors_hooks_placement

instantiate_device_type_tests(TestOurs, globals())
""",
        )
        with self.assertRaisesRegex(UpstreamTestError, "bench.*does not export"):
            upstream_test("import torch_patches.bench as b\n", "x", resolver)
        with self.assertRaisesRegex(UpstreamTestError, "applies the patch set"):
            upstream_test("import torch_patches\ntorch_patches.apply()\n", "x", resolver)

    def test_upstream_names_rules(self):
        homes = {"torch_patches._errors": "torch._functorch._aot_autograd.graph_compile"}.get
        knobs = {"lossy_min_bytes": "saved_tensors_hooks_lossy_min_bytes"}.get
        cases = {
            "``torch_patches.config.lossy_min_bytes``": "``torch._functorch.config.saved_tensors_hooks_lossy_min_bytes``",
            "``torch_patches.hooks.inlineable``": f"``{HOOKS_HOME}.inlineable``",
            "(``torch_patches.hooks.select.numerics_safe``)": f"(``{HOOKS_HOME}.numerics_safe``)",
            "see ``torch_patches/_errors.py``": "see ``torch/_functorch/_aot_autograd/graph_compile.py``",
            "``torch_patches._errors.SavedTensorsHookError``": "``torch._functorch._aot_autograd.graph_compile.SavedTensorsHookError``",
            'warnings.warn(f"torch_patches: {error}")': 'warnings.warn(f"{error}")',
            'TORCH_LOGS="+torch_patches"': 'TORCH_LOGS="+saved_tensors_hooks"',
            'ARTIFACT = "torch_patches"': 'ARTIFACT = "saved_tensors_hooks"',
            "the whole torch_patches config": "the whole saved tensors hooks config",
            "unrelated text": "unrelated text",
        }
        for before, after in cases.items():
            self.assertEqual(upstream_names(before, homes, knobs), after)

    def test_stack_order_respects_after(self):
        _, results = exported()
        position = {r.patch.name: i for i, r in enumerate(results)}
        for r in results:
            for dep in r.patch.after:
                self.assertLess(position[dep], position[r.patch.name], r.patch.name)

    def test_diffs_apply_in_order_and_compile(self):
        _, results = exported()
        for r in results:
            self.assertIsNone(check_applies(r.diff, r.before), r.patch.name)
            for rel, text in r.after.items():
                compile(text, rel, "exec", dont_inherit=True)
        # And the whole stack, one diff after the other, with git apply on real files.
        with tempfile.TemporaryDirectory() as tmp:
            apply_to_overlay(os.path.join(tmp, "site"), ROOT, results)

    @pytest.mark.slow  # a second export of the whole stack
    def test_deterministic(self):
        _, first = exported()
        _, second = run_export(ROOT, patches_module.PATCHES, REPO_ROOT, patches_module.EFFECTS)
        self.assertEqual([(r.diff, r.message) for r in first], [(r.diff, r.message) for r in second])

    def test_stack_commits(self):
        exporter, results = exported()
        with tempfile.TemporaryDirectory() as tmp:
            _git("init", "-q", cwd=tmp)
            _git("config", "user.name", "Test", cwd=tmp)
            _git("config", "user.email", "test@example.com", cwd=tmp)
            commits = make_stack(tmp, exporter, results)
            self.assertEqual(len(commits), len(results))
            subjects = _git("log", "--reverse", "--format=%s", cwd=tmp).splitlines()
            self.assertTrue(subjects[0].startswith("Base: torch"))
            self.assertEqual(subjects[1:], [r.subject for r in results])
            for commit, r in zip(commits, results):
                body = _git("log", "-1", "--format=%B", commit, cwd=tmp)
                self.assertEqual(body.strip(), r.message.strip())
                changed = _git("show", "--name-only", "--format=", commit, cwd=tmp).split()
                self.assertEqual(sorted(changed), sorted(r.files))
            self.assertEqual(_git("status", "--porcelain", cwd=tmp), "")

    @pytest.mark.slow  # the CLI's export of the whole stack, beside this process's
    def test_cli_writes_patches_and_skips_unresolvable(self):
        good = patches_module.PATCHES
        bad = dataclasses.replace(
            good[0],
            name="aot.no_such_target",
            target="torch._functorch._aot_autograd.utils:no_such_function",
            after=(good[0].name,),
        )
        child = dataclasses.replace(good[0], name="aot.builds_on_bad", after=("aot.no_such_target",))
        old = patches_module.PATCHES
        patches_module.PATCHES = (*good, bad, child)
        try:
            with tempfile.TemporaryDirectory() as out:
                from contextlib import redirect_stdout
                from io import StringIO

                buf = StringIO()
                with redirect_stdout(buf):
                    rc = main(["export", "--out", out])
                files = sorted(f for f in os.listdir(out) if f.endswith(".patch"))
                summary = open(os.path.join(out, "SUMMARY.md")).read()
                texts = [open(os.path.join(out, f)).read() for f in files]
                first = texts[0]
        finally:
            patches_module.PATCHES = old
        text = buf.getvalue()
        self.assertEqual(rc, 1)
        self.assertIn("aot.no_such_target: skipped: target torch._functorch._aot_autograd.utils:no_such_function is not defined", text)
        self.assertIn("aot.builds_on_bad: skipped: builds on skipped patch aot.no_such_target", text)
        self.assertIn("skipped", summary)
        _, results = exported()
        self.assertEqual(len(files), len(results))
        self.assertFalse(any("no_such" in f or "builds_on_bad" in f for f in files))
        self.assertTrue(files[0].startswith("01-"))
        self.assertIn(f"Subject: [PATCH 01/{len(results):02d}] {results[0].subject}", first)
        # Two exports (the CLI's and this process's) agree commit by commit: deterministic.
        for text, r in zip(texts, results):
            self.assertIn(r.diff, text, r.patch.name)


class TestImportChecker(unittest.TestCase):
    @pytest.mark.slow  # an interpreter importing torch, twice
    def test_imports_as_a_fresh_interpreter_would(self):
        # A module added after the forking interpreters started imports; one that needs what
        # is not there names it; a commit changing a module the server holds (imported with
        # torch._dynamo) ends the server only, one changing a module the base holds
        # (imported with torch) restarts both, one adding a file or changing a module
        # neither holds ends neither.
        with tempfile.TemporaryDirectory() as root, ImportChecker(sys.executable, root, {**os.environ, "PYTHONPATH": root}) as imports:

            def write(rel, text):
                os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
                with open(os.path.join(root, rel), "w") as f:
                    f.write(text)

            write("pkg_under_check/__init__.py", "")
            self.assertIsNone(imports.check(["torch._functorch.config"]))
            server = imports.proc
            self.assertIn("torch._dynamo", imports.server_loaded)
            self.assertNotIn("torch._dynamo", imports.loaded)
            write("pkg_under_check/added.py", "import torch\nVALUE = 1\n")
            write("pkg_under_check/needs_later.py", "from pkg_under_check.later import X\n")
            imports.before_commit(["pkg_under_check/added.py", "pkg_under_check/new.py"], root)
            self.assertIs(imports.proc, server)  # pkg_under_check was never imported by it
            self.assertIsNone(imports.check(["pkg_under_check.added"]))
            self.assertEqual(imports.check(["pkg_under_check.needs_later"]), "ModuleNotFoundError: No module named 'pkg_under_check.later'")
            server_only = next(m for m in sorted(imports.server_loaded - imports.loaded) if m.startswith("torch._dynamo."))
            self.assertIn("torch", imports.loaded)
            rel = server_only.replace(".", "/") + ".py"
            write(rel, "")  # only where before_commit looks: torch's own module still imports
            imports.before_commit([rel], root)
            self.assertIs(imports.proc, server)
            self.assertIsNone(imports.server_loaded)
            self.assertIsNone(imports.check(["pkg_under_check.added"]))
            self.assertIn(server_only, imports.server_loaded)
            shutil.rmtree(os.path.join(root, "torch"))
            write("json/decoder.py", "")  # json.decoder: the base holds it
            imports.before_commit(["json/decoder.py"], root)
            self.assertIsNone(imports.proc)
            os.remove(os.path.join(root, "json", "decoder.py"))
            os.rmdir(os.path.join(root, "json"))
            self.assertIsNone(imports.check(["pkg_under_check.added"]))
            self.assertIsNot(imports.proc, server)


@unittest.skipIf(os.environ.get(UPSTREAM_FORM_ENV), "runs the upstream-form tests itself")
class TestUpstreamEquivalence(unittest.TestCase):
    def check_commits(self, part, tests=True):
        # Commit by commit on one overlay: after each, torch and every module it touched
        # import, and the upstream test files it carries pass, so no commit needs a later
        # one to build or pass. In three parts (the commits before a part are only applied)
        # so that test workers share the work, about 8 minutes in all: the commits before
        # the runtime-context commit (mostly module imports), that commit (most of the
        # compiler's tests), the ones after it.
        # The commits' tests build Inductor's C++ kernels scalar (as the fast tier does,
        # test/conftest.py): they check that each commit stands alone, and the same tests
        # in torch_patches' form build them vectorized in this suite. About a fifth of the
        # runtime-context commit's 2 minutes.
        _, results = exported()
        k = next(i for i, r in enumerate(results) if r.name == "aot.runtime_saved_tensors_hooks_context")
        bounds = [0, k, k + 1, len(results)]
        scalar_kernels = mock.patch.dict(os.environ, {"TORCHINDUCTOR_VEC_ISA_OK": "0"})
        with tempfile.TemporaryDirectory(prefix="tp-upstream-each-") as tmp, scalar_kernels:
            if not tests:  # imports only, every commit
                bounds = [0, len(results)]
            failures = import_each_commit(results, ROOT, tmp, sys.executable, bounds[part], bounds[part + 1], tests)
        self.assertEqual(failures, [])

    @pytest.fixture(autouse=True)
    def _selected(self, request):
        self.selected = request.session.items

    @pytest.mark.slow
    def test_each_commit_imports_alone(self):
        # Every commit imports alone (about 2 minutes of one core). The upstream_stack tests
        # below import each commit too, then run the upstream tests it carries: where they
        # run in the same pytest run (the full suite, CI), this check is theirs.
        if any(item.get_closest_marker("upstream_stack") for item in self.selected):
            self.skipTest("each commit imports in the upstream_stack tests of this pytest run")
        self.check_commits(0, tests=False)

    @pytest.mark.slow
    @pytest.mark.upstream_stack
    def test_each_commit_passes_its_upstream_tests_part1(self):
        self.check_commits(0)

    @pytest.mark.slow
    @pytest.mark.upstream_stack
    def test_each_commit_passes_its_upstream_tests_part2(self):
        self.check_commits(1)

    @pytest.mark.slow
    @pytest.mark.upstream_stack
    def test_each_commit_passes_its_upstream_tests_part3(self):
        self.check_commits(2)

    @pytest.mark.slow  # a pytest run in a subprocess
    def test_upstream_form_passes_the_goldens(self):
        # Our own tests against the whole stack through the upstream-form switch (the
        # ``verify`` command). The goldens themselves also run in upstream form on the
        # commit that completes them (check_commits); one here proves the switch.
        _, results = exported()
        with tempfile.TemporaryDirectory(prefix="tp-upstream-") as tmp:
            proc = run_upstream_tests(results, ROOT, tmp, [f"{DEFAULT_TESTS[0]}::TestInlinePlacementCPU::test_linear_cpu"])
            # The overlay's torch holds the code and the patches are not applied.
            probe = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import torch, torch_patches, torch._functorch._aot_autograd.graph_compile as g;"
                    "print(g.maybe_inline_graph_saved_tensors_hooks.__code__.co_filename);"
                    "print(torch_patches.is_applied())",
                ],
                env={**os.environ, "PYTHONPATH": os.path.join(tmp, "site")},
                capture_output=True,
                text=True,
                cwd=tmp,
            )
        out = proc.stdout + proc.stderr
        self.assertEqual(proc.returncode, 0, out[-8000:])
        self.assertRegex(proc.stdout, r"\b12 passed\b|\b\d+ passed\b")
        self.assertNotIn("skipped", proc.stdout.splitlines()[-1])
        filename, applied = probe.stdout.split()
        self.assertTrue(filename.startswith(tmp), filename)
        self.assertEqual(applied, "False")


if __name__ == "__main__":
    unittest.main()
