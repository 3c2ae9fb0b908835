"""Meta-tests of the patch registry: records, identity round trips, refusals."""

import contextlib
import dataclasses
import gc
import inspect
import io
import json
import os
import re
import subprocess
import sys
import types
import unittest.mock as mock
import warnings

import pytest
import torch
from torch._dynamo.test_case import run_tests

import torch_patches
import torch_patches.config as tp_config
from torch_patches import _registry
from torch_patches._registry import install
from torch_patches._registry.patches import PATCHES
from torch_patches.testing import TestCase

SUPPORTED_MINORS = [f"2.{m}" for m in range(11, 16)]


def _raw(patch):
    owner, attr, raw = install._resolve(patch.target)
    return raw


def _snapshot_torch():
    """id() of every attribute of every loaded torch module and of patched classes."""
    snap = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch" or name.startswith("torch.")):
            continue
        for k, v in list(vars(module).items()):
            snap[(name, k)] = id(v)
    for patch in PATCHES:
        owner, _, _ = install._resolve(patch.target)
        if isinstance(owner, type):
            for k, v in vars(owner).items():
                snap[(owner.__qualname__, k)] = id(v)
    return snap


_UNDONE: list[str] = []


def _ok_effect():
    return lambda: _UNDONE.append("test.ok")


def _bad_effect():
    raise RuntimeError("effect failed")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _aliasing_module(name, value):
    """A module in sys.modules holding ``value`` as ``maybe_inline`` (an alias of a patched
    function, as ``from ... import`` makes one), removed afterwards."""
    module = types.ModuleType(name)
    module.maybe_inline = value
    sys.modules[name] = module
    try:
        yield module
    finally:
        sys.modules.pop(name, None)


class TestRecords(TestCase):
    apply_patches = False

    def test_records_complete(self):
        self.assertEqual(_registry.validate_records(PATCHES), [])
        for patch in PATCHES:
            self.assertTrue(patch.summary.startswith("["), patch.name)
            self.assertIn(":", patch.target)
            self.assertEqual(
                sorted(patch.fingerprints),
                [m for m in SUPPORTED_MINORS if patch.in_band(_registry.parse_version(m))],
                f"{patch.name} lacks fingerprints for some torch versions of its band",
            )
            # The Test Plan of its upstream commit: test files that exist.
            self.assertTrue(patch.tests, f"{patch.name} names no tests")
            for test in patch.tests:
                self.assertTrue(os.path.exists(os.path.join(REPO, test)), f"{patch.name}: {test}")

    def test_records_say_what_they_change_and_risk(self):
        # What a reviewer weighs each upstream commit by (its SUMMARY.md entry): every patch,
        # and every effect exported as a commit of its own, says what it changes, measured,
        # and what could go wrong; an effect with no commit of its own has nowhere to say it.
        from torch_patches._registry.patches import EFFECTS

        for record in (*PATCHES, *(e for e in EFFECTS if e.upstream is not None)):
            for field in ("measured", "risk"):
                text = getattr(record, field)
                self.assertTrue(text and text == text.strip(), f"{record.name}: {field}")
                self.assertFalse(text.endswith("."), f"{record.name}: {field} (the summary adds the full stop)")
        for e in EFFECTS:
            if e.upstream is None:
                self.assertEqual((e.measured, e.risk), ("", ""), e.name)
        # A result page it cites exists.
        for record in (*PATCHES, *EFFECTS):
            for path in re.findall(r"benchmarks/[\w./-]+\.md", record.measured):
                self.assertTrue(os.path.exists(os.path.join(REPO, path)), f"{record.name}: {path}")

    def test_validate_records_catches_problems(self):
        good = PATCHES[0]
        bad = [
            dataclasses.replace(good, upstream=""),
            dataclasses.replace(good, name="x", upstream="https://example.com"),
            dataclasses.replace(good, name="y", fingerprints={}),
            dataclasses.replace(good, name="z", torch_min=(2, 9)),
            dataclasses.replace(good, name="w", after=("nope",)),
            dataclasses.replace(good, name="v", target="no_colon"),
        ]
        for record in bad:
            problems = _registry.validate_records([record])
            self.assertTrue(problems, record)
            self.assertTrue(all(p.startswith(record.name or "?") for p in problems), problems)

    def test_fingerprints_match_installed_torch(self):
        for record in torch_patches.status():
            self.assertTrue(record.in_band, record)
            self.assertTrue(record.fingerprint_ok, f"{record.name}: {record.problem}")

    def test_fingerprint_ignores_comments_docstrings_annotations(self):
        a = "def f(x: int) -> int:\n    '''doc'''\n    # comment\n    return x + 1\n"
        b = "def f(x):\n    return x + 1  # other\n"
        c = "def f(x):\n    return x + 2\n"
        fp = _registry.fingerprint_source
        self.assertEqual(fp(a), fp(b))
        self.assertNotEqual(fp(a), fp(c))

    def test_status_records(self):
        records = torch_patches.status()
        self.assertEqual([r.name for r in records], [p.name for p in PATCHES])
        for r in records:
            d = r.as_dict()
            for key in ("name", "target", "band", "applied", "fingerprint_ok", "upstream", "retire_when"):
                self.assertIn(key, d)
            self.assertFalse(r.applied)

    def test_dependency_order(self):
        seen = set()
        for patch in PATCHES:
            for dep in patch.after:
                self.assertIn(dep, seen, f"{patch.name} comes before {dep}")
            seen.add(patch.name)


class TestApplyUnapply(TestCase):
    apply_patches = False

    def test_round_trip_by_identity(self):
        originals = {p.name: _raw(p) for p in PATCHES}
        before = _snapshot_torch()
        torch_patches.apply()
        torch_patches.apply()  # idempotent
        self.assertTrue(torch_patches.is_applied())
        for p in PATCHES:
            replaced = _raw(p)
            self.assertIsNot(replaced, originals[p.name], p.name)
            func = getattr(replaced, "__func__", replaced)
            self.assertEqual(getattr(func, "__torch_patches_patch__", None), p.name)
        self.assertEqual([r.name for r in torch_patches.status() if r.applied], [p.name for p in PATCHES])
        torch_patches.unapply()
        torch_patches.unapply()  # idempotent
        for p in PATCHES:
            self.assertIs(_raw(p), originals[p.name], p.name)
        after = _snapshot_torch()
        changed = {k for k in before if after.get(k) != before[k]}
        self.assertEqual(changed, set())

    def test_offload_area_opt_out(self):
        originals = {p.name: _raw(p) for p in PATCHES}
        offload = {p.name for p in PATCHES if p.area == "offload"}
        self.assertEqual(
            offload,
            {
                "inductor.free_without_reuse",
                "inductor.no_inplace_reuse",
                "inductor.offload_order_kept",
            },
        )
        torch_patches.apply(offload=False)
        try:
            self.assertEqual(set(torch_patches.applied_patches()), {p.name for p in PATCHES} - offload)
            for p in PATCHES:
                if p.name in offload:
                    self.assertIs(_raw(p), originals[p.name], p.name)
            from torch_patches.hooks import cpu_offload

            with self.assertRaisesRegex(RuntimeError, "offload=False"):
                cpu_offload()
            torch_patches.apply(offload=False)  # idempotent with the same areas
            with self.assertRaisesRegex(RuntimeError, "already applied with other areas"):
                torch_patches.apply()
        finally:
            torch_patches.unapply()
        for p in PATCHES:
            self.assertIs(_raw(p), originals[p.name], p.name)

    def test_global_effects_are_registry_records(self):
        from torch._inductor import lowering as inductor_lowering

        from torch_patches._registry.patches import EFFECTS

        names = [e.name for e in EFFECTS]
        self.assertEqual(len(names), len(set(names)))
        patch_names = {p.name for p in PATCHES}
        for e in EFFECTS:
            self.assertTrue(e.summary and e.install, e.name)
            # Upstream, each is code run at a module's import, or done by the code at first use.
            self.assertNotEqual(e.upstream is None, not e.upstream_lazy, e.name)
            if e.upstream is not None:
                self.assertLessEqual(set(e.upstream.after), patch_names, e.name)
                form = install._load(e.upstream.form)
                self.assertEqual(list(inspect.signature(form).parameters), [], e.name)
        torch_patches.apply()
        try:
            self.assertEqual(torch_patches.installed_effects(), names)
            op = torch.ops.saved_tensors_hooks.offload.default
            self.assertIn(op, inductor_lowering.lowerings)
        finally:
            torch_patches.unapply()
        self.assertEqual(torch_patches.installed_effects(), [])
        self.assertNotIn(op, inductor_lowering.lowerings)  # undone
        torch_patches.apply(offload=False)
        try:
            self.assertNotIn("inductor.offload_lowering", torch_patches.installed_effects())
            self.assertNotIn(op, inductor_lowering.lowerings)
        finally:
            torch_patches.unapply()

    def test_effect_failure_rolls_back_everything(self):
        from torch_patches._registry.patches import EFFECTS

        originals = {p.name: _raw(p) for p in PATCHES}
        ok = _registry.Effect(name="test.ok", install="test_registry:_ok_effect", summary="ok")
        bad = _registry.Effect(name="test.bad", install="test_registry:_bad_effect", summary="bad")
        _UNDONE[:] = []
        with mock.patch.object(install, "_registered_effects", return_value=(*EFFECTS, ok, bad)):
            with self.assertRaisesRegex(RuntimeError, "effect failed"):
                torch_patches.apply()
        self.assertEqual(_UNDONE, ["test.ok"])
        self.assertFalse(torch_patches.is_applied())
        self.assertEqual(torch_patches.installed_effects(), [])
        for p in PATCHES:
            self.assertIs(_raw(p), originals[p.name], p.name)

    def test_get_original(self):
        p = PATCHES[0]
        original = _raw(p)
        torch_patches.apply()
        self.assertIs(torch_patches.get_original(p.name), original)
        torch_patches.unapply()
        self.assertIs(torch_patches.get_original(p.name), original)

    def test_aliases_are_rebound_and_restored(self):
        patch = next(p for p in PATCHES if p.name == "aot.inline_saved_tensors_hooks")
        original = _raw(patch)
        # As if: from graph_compile import maybe_inline_...
        with _aliasing_module("tp_test_early_alias", original) as early:
            torch_patches.apply()
            self.assertIs(early.maybe_inline, _raw(patch))
            # A module imported after apply() copies the replacement...
            with _aliasing_module("tp_test_late_alias", _raw(patch)) as late:
                torch_patches.unapply()
                # ...and unapply() finds it too.
                self.assertIs(early.maybe_inline, original)
                self.assertIs(late.maybe_inline, original)

    def test_alias_scan_matches_identity_only(self):
        # The scan looks functions up by themselves (hashed by identity) and anything else
        # by id(): a value equal to a target but not it is no alias, and a module value
        # whose class cannot be hashed (its metaclass defines __eq__ alone) is passed over.
        class AlwaysEqual:
            def __eq__(self, other):
                return True

            def __hash__(self):
                return 0

        class UnhashableMeta(type):
            def __eq__(cls, other):
                return True

            __hash__ = None  # type: ignore[assignment]

        class Odd(metaclass=UnhashableMeta):
            pass

        def target():
            pass

        def lookalike():
            pass

        lookalike.__code__ = target.__code__
        equal_target = AlwaysEqual()
        with _aliasing_module("tp_test_scan_alias", target) as module:
            module.equal_target, module.other_equal = equal_target, AlwaysEqual()
            module.lookalike, module.odd = lookalike, Odd()
            found = install._scan_aliases([target, equal_target])
        self.assertEqual([n for m, n in found[id(target)] if m is module], ["maybe_inline"])
        self.assertEqual([n for m, n in found[id(equal_target)] if m is module], ["equal_target"])

    def test_aliases_found_among_frozen_objects(self):
        # gc.freeze() (servers freeze what they imported) hides objects from the collector's
        # referrer search: an alias in a module frozen before apply() is rebound all the same.
        patch = next(p for p in PATCHES if p.name == "aot.inline_saved_tensors_hooks")
        original = _raw(patch)
        already_frozen = gc.get_freeze_count()
        with _aliasing_module("tp_test_frozen_alias", original) as frozen:
            gc.freeze()
            try:
                torch_patches.apply()
                self.assertIs(frozen.maybe_inline, _raw(patch))
                torch_patches.unapply()
                self.assertIs(frozen.maybe_inline, original)
            finally:
                if not already_frozen:
                    gc.unfreeze()

    def test_import_changes_nothing(self):
        code = r"""
import sys, torch
def snap():
    return {(n, k): id(v) for n, m in list(sys.modules.items())
            if m is not None and (n == "torch" or n.startswith("torch."))
            for k, v in list(vars(m).items())}
mods = set(sys.modules)
before = snap()
import torch_patches, torch_patches.config
after = snap()
changed = sorted(k for k in before if after.get(k) != before[k])
added = sorted(k for k in after if k not in before)
new_torch_mods = sorted(m for m in set(sys.modules) - mods if m.startswith("torch."))
print(changed, added, new_torch_mods)
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "[] [] []", out.stderr)


class TestRefusal(TestCase):
    apply_patches = False

    def _assert_nothing_patched(self, originals):
        self.assertFalse(torch_patches.is_applied())
        for p in PATCHES:
            self.assertIs(_raw(p), originals[p.name], p.name)

    def test_refuses_outside_version_band(self):
        originals = {p.name: _raw(p) for p in PATCHES}
        for version in ("2.10.0", "2.16.0.dev20261101", "3.0.0"):
            with mock.patch.object(install, "torch_version", return_value=version):
                with self.assertRaises(torch_patches.PatchError) as cm:
                    torch_patches.apply()
            msg = str(cm.exception)
            self.assertIn(f"torch {version}", msg)
            self.assertIn("nothing was patched", msg)
            for p in PATCHES:
                self.assertIn(p.name, msg)
            self.assertIn("outside the supported band 2.11-2.15", msg)
            self._assert_nothing_patched(originals)

    def _with_drift(self, name):
        drifted = [dataclasses.replace(p, fingerprints={"2.13": "0" * 16}) if p.name == name else p for p in PATCHES]
        return mock.patch.object(install, "_registered", return_value=tuple(drifted))

    def test_refuses_on_fingerprint_drift(self):
        originals = {p.name: _raw(p) for p in PATCHES}
        # The last patch drifts: none of the earlier ones may be applied either.
        name = PATCHES[-1].name
        with self._with_drift(name):
            with self.assertRaises(torch_patches.PatchError) as cm:
                torch_patches.apply()
        err = cm.exception
        self.assertEqual([n for n, _ in err.refusals], [name])
        self.assertIn("drifted", str(err))
        self.assertIn(name, str(err))
        self.assertIn(torch.__version__, str(err))
        self._assert_nothing_patched(originals)

    def test_drift_can_be_downgraded_to_warning(self):
        name = PATCHES[0].name
        with self._with_drift(name), tp_config.patch(fingerprint_drift="warn"):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch_patches.apply()
        try:
            self.assertTrue(torch_patches.is_applied())
            self.assertTrue(any(name in str(x.message) and "drift" in str(x.message) for x in w))
        finally:
            torch_patches.unapply()

    def test_refuses_when_target_already_replaced(self):
        patch = PATCHES[0]
        owner, attr, original = install._resolve(patch.target)

        def impostor(*args, **kwargs):
            return original(*args, **kwargs)

        setattr(owner, attr, impostor)
        try:
            with self.assertRaises(torch_patches.PatchError) as cm:
                torch_patches.apply()
            self.assertIn("someone else patched it", str(cm.exception))
            self.assertFalse(torch_patches.is_applied())
        finally:
            setattr(owner, attr, original)

    def test_refuses_a_functools_wraps_foreign_patch(self):
        # wraps copies __module__/__qualname__ and inspect follows __wrapped__ to torch's
        # source: names and fingerprint both look like torch's own definition.
        import functools

        for patch in (PATCHES[0], PATCHES[-1]):
            owner, attr, original = install._resolve(patch.target)
            fn = install._function_of(original)

            @functools.wraps(fn)
            def foreign(*args, **kwargs):
                return fn(*args, **kwargs)

            setattr(owner, attr, type(original)(foreign) if isinstance(original, (staticmethod, classmethod)) else foreign)
            try:
                with self.assertRaises(torch_patches.PatchError) as cm:
                    torch_patches.apply()
                self.assertIn(patch.name, str(cm.exception))
                self.assertIn("someone else patched it", str(cm.exception))
                self.assertIn("code foreign at", str(cm.exception))
                self.assertFalse(torch_patches.is_applied())
            finally:
                setattr(owner, attr, original)

    def test_unapply_refuses_under_a_foreign_patch_layered_after_apply(self):
        originals = {p.name: _raw(p) for p in PATCHES}
        torch_patches.apply()
        patch = PATCHES[0]
        owner, attr, ours = install._resolve(patch.target)

        def layered(*args, **kwargs):
            return ours(*args, **kwargs)

        setattr(owner, attr, layered)
        try:
            with self.assertRaises(torch_patches.UnapplyError) as cm:
                torch_patches.unapply()
            self.assertIn(patch.name, str(cm.exception))
            self.assertIn("layered", str(cm.exception))
            self.assertTrue(torch_patches.is_applied())  # nothing restored
            self.assertIs(_raw(patch), layered)
        finally:
            setattr(owner, attr, ours)
            torch_patches.unapply()
        self._assert_nothing_patched(originals)

    def test_status_after_apply_fingerprints_the_originals(self):
        before = {s.name: s.fingerprint for s in torch_patches.status()}
        torch_patches.apply()
        try:
            after = torch_patches.status()
        finally:
            torch_patches.unapply()
        self.assertEqual({s.name: s.fingerprint for s in after}, before)
        self.assertEqual([s.name for s in after if not s.fingerprint_ok or s.problem], [])
        self.assertTrue(all(s.applied for s in after))

    def test_rolls_back_if_install_fails(self):
        originals = {p.name: _raw(p) for p in PATCHES}
        real_install = install._Installed.install
        calls = []

        def flaky(self):
            calls.append(self.patch.name)
            if len(calls) == 3:
                raise RuntimeError("boom")
            real_install(self)

        with mock.patch.object(install._Installed, "install", flaky):
            with self.assertRaisesRegex(RuntimeError, "boom"):
                torch_patches.apply()
        self._assert_nothing_patched(originals)


class TestCli(TestCase):
    apply_patches = False

    def test_status_command(self):
        # In this process; the command as a user runs it, in a fresh process with the base
        # install only, is test_layout's test_base_install_needs_no_extra (and CI's "Try it").
        from torch_patches.__main__ import main

        text, js = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(text):
            self.assertEqual(main(["status"]), 0)
        with contextlib.redirect_stdout(js):
            self.assertEqual(main(["status", "--json"]), 0)
        for p in PATCHES:
            self.assertIn(p.name, text.getvalue())
        records = json.loads(js.getvalue())
        self.assertEqual({r["name"] for r in records}, {p.name for p in PATCHES})
        self.assertTrue(all(r["fingerprint_ok"] for r in records))

    @pytest.mark.slow
    def test_demo_command(self):
        out = subprocess.run(
            [sys.executable, "-m", "torch_patches", "demo", "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("# pack(", out.stdout)
        self.assertIn("# unpack(", out.stdout)
        for mode in ("no-hooks", "stock-inline", "ours"):
            self.assertIn(mode, out.stdout)


if __name__ == "__main__":
    run_tests()
