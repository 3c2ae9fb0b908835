"""The ``torch_patches`` log artifact: known to ``torch._logging`` by name, so that
``TORCH_LOGS="torch_patches"`` and ``set_logs(modules={"torch_patches": True})`` turn it on
(``set_logs`` has a keyword for each of torch's own artifacts only)."""

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from torch._dynamo.test_case import run_tests
from torch._logging._internal import log_registry, log_state

from torch_patches.testing import TestCase


class TestLoggingArtifact(TestCase):
    def test_artifact_is_registered(self):
        self.assertTrue(log_registry.is_artifact("torch_patches"))
        self.assertIn("torch_patches", log_registry.off_by_default_artifact_names)

    def test_set_logs_enables_it(self):
        try:
            torch._logging.set_logs(modules={"torch_patches": True})
            self.assertTrue(log_state.is_artifact_enabled("torch_patches"))
        finally:
            torch._logging.set_logs()
        self.assertFalse(log_state.is_artifact_enabled("torch_patches"))

    def test_torch_logs_enables_it(self):
        # The variable read as torch reads it when it is imported (``_init_logs``), in this
        # process; the fresh-process twin below starts one.
        internal = torch._logging._internal
        state = internal.log_state  # reading the variable replaces it with a new object
        try:
            with mock.patch.dict(os.environ, {"TORCH_LOGS": "torch_patches"}):
                internal._init_logs()
                self.assertTrue(internal.log_state.is_artifact_enabled("torch_patches"))
        finally:
            internal.log_state = state
            torch._logging.set_logs()
        self.assertFalse(internal.log_state.is_artifact_enabled("torch_patches"))

    @pytest.mark.slow  # a fresh process; fast twin: test_torch_logs_enables_it
    def test_torch_logs_enables_it_in_a_fresh_process(self):
        lines = ["import torch"]
        # upstream: not exported
        lines.append("import torch_patches; torch_patches.apply()")
        lines.append("from torch._logging._internal import log_state")
        lines.append("print(log_state.is_artifact_enabled('torch_patches'))")
        env = dict(os.environ, TORCH_LOGS="torch_patches")
        proc = subprocess.run([sys.executable, "-c", "\n".join(lines)], env=env, capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "True")


if __name__ == "__main__":
    run_tests()
