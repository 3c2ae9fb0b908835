"""``python -m torch_patches bench`` end to end on CPU at tiny sizes (no timing assertions).

Runs the offload hook on both models, every mode: the JSON must hold every row with every
column, finite numbers (the stock-inline row runs the same ops as GraphModule hooks).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import pytest

from torch_patches import bench


class TestBench(unittest.TestCase):
    @pytest.mark.slow
    def test_cpu_offload_rows(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bench.json")
            proc = subprocess.run(
                [
                    sys.executable, "-m", "torch_patches", "bench", "--device", "cpu", "--small",
                    "--models", "mlp8,transformer", "--backends", "aot_eager",
                    "--hooks", "cpu_offload", "--blocks", "1", "--steps", "1",
                    "--batch", "128", "--json", out,
                ],
                capture_output=True, text=True, timeout=300,
            )
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(out) as f:
                data = json.load(f)
        results = data["results"]
        labels = [r["label"] for r in results]
        expected = [
            f"{m} aot_eager {h} {mode}"
            for m in ("mlp8", "transformer")
            for h, mode in (("-", "no-hooks"), ("cpu_offload", "eager-hooks"),
                            ("cpu_offload", "stock-inline"), ("cpu_offload", "ours"))
        ]
        self.assertEqual(labels, expected)
        for r in results:
            with self.subTest(r["label"]):
                self.assertNotIn("error", r)

                for key in ("peak_bytes", "step_s", "step_min_s", "compile_s", "peak_ratio",
                            "time_ratio", "time_ratio_min"):
                    self.assertTrue(math.isfinite(r[key]), f"{key}={r[key]}")
                self.assertEqual(r["frames_compiled"], 1)
        self.assertIn("fp8_rowwise+cpu_offload", bench.COMPOSED_HOOKS)


if __name__ == "__main__":
    unittest.main()
