"""The patch set's test case: every test runs with torch_patches applied
(``apply_patches = False`` for tests of stock behaviour), or against upstream-form torch
(below).  Its base is the helpers' ``TestCase``
(``_internal/common_saved_tensors_hooks.py``), which needs nothing of the patch set."""

from __future__ import annotations

import torch_patches
from torch_patches.testing._internal.common_saved_tensors_hooks import TestCase as _HooksTestCase


class TestCase(_HooksTestCase):
    """Dynamo-resetting test case that runs each test with torch_patches applied."""

    apply_patches = True

    def setUp(self) -> None:
        super().setUp()
        # Dynamo's test case listens to the structured trace (a NullHandler on
        # ``torch.__trace``) so that torch's own tests build every payload: each graph of
        # each stage printed again for a trace nobody reads, a few percent of a compile.
        # Our tests read no trace; the one that checks our trace artifact attaches its own
        # handler (test_inline_placement ``TestStructuredTrace``), which builds every payload.
        # pytest 9.1 and later attach their log capture to every logger that does not
        # propagate, torch's trace logger included, in each phase of each test: the same
        # payloads built again, each formatted into the capture (13% of the CPU of three
        # compile-heavy test files on torch 2.15). A handler of any other owner
        # (``TORCH_TRACE``'s) stays.
        from torch._logging._internal import trace_log

        trace_log.removeHandler(getattr(self, "handler", None))
        for handler in [h for h in trace_log.handlers if type(h).__module__ == "_pytest.logging"]:
            trace_log.removeHandler(handler)
        if upstream_form_config_map() is not None:
            _use_upstream_form(self)  # torch's own sources hold the patches
        elif self.apply_patches:
            # Applied at the first such test and left applied for the next (apply() is a
            # no-op while applied; a test that unapplies gets it back at the next test):
            # each apply() and unapply() looks for aliases of the patched functions among
            # every live object, which in a process that has compiled for minutes costs a
            # good part of a second. Tests of stock behaviour unapply below; tests that do
            # not use this class run unpatched (``test/conftest.py``).
            torch_patches.apply()
        else:
            torch_patches.unapply()


# ----------------------------------------------------------------- upstream form
# ``python -m tools.export_upstream`` turns every patch into upstream code; its
# equivalence test (test/test_export_upstream.py) applies that code to a copy of torch
# and runs our golden tests against it with this variable set to the export's
# config-map.json. Then TestCase never calls apply(), and each torch_patches.config knob
# in the map reads and writes its upstream counterpart (torch's config ``alias``), so
# ``tp_config.patch(...)`` in a test reaches the upstream code.

UPSTREAM_FORM_ENV = "TORCH_PATCHES_UPSTREAM_FORM"


def upstream_form_config_map() -> dict[str, str] | None:
    """The knob map when tests run against upstream-form torch (None: normal mode)."""
    import json
    import os

    path = os.environ.get(UPSTREAM_FORM_ENV)
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def _use_upstream_form(test: TestCase) -> None:
    if not test.apply_patches:
        test.skipTest("tests stock torch behaviour; torch here holds the upstream form")
    torch_patches.unapply()
    import importlib

    import torch_patches.config as tp_config

    for ours, upstream in (upstream_form_config_map() or {}).items():
        module, _, name = upstream.rpartition(".")
        if name not in importlib.import_module(module)._config:
            raise RuntimeError(f"{UPSTREAM_FORM_ENV}: torch has no config {upstream} (is the stack applied?)")
        tp_config._config[ours].alias = upstream
