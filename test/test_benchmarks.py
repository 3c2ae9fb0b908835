"""The research harness (``benchmarks/``), built on ``python -m torch_patches bench``.

* ``benchmarks.overhead``: rows interleaved over rounds and their ratios against the named
  reference row (in this process, its worker stubbed); end to end at tiny sizes (``slow``):
  every shape's rows measured in fresh processes, guard times for our rows.
* ``benchmarks.budget_sweep``: its table and verdicts from rows, the planned step peak beside
  the measured one, the command's argument checks, the budget plans as JSON.
* ``benchmarks.loss_head_time``: rows interleaved after their warm-up, its argument checks;
  its three rows end to end (``slow``).

The training bench (``benchmarks.convergence``) and the convergence bound: ``test_convergence.py``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import pytest

from benchmarks import ROOT, budget_sweep, interleaved_times, loss_head_time, overhead, trainer_convergence
from benchmarks.convergence import TrainConfig, plan_row
from torch_patches._functorch._aot_autograd.saved_tensor_records import BudgetPlanSummary, PlannedStorage
from torch_patches.testing import TestCase


class TestOverheadBench(TestCase):
    def test_rounds_interleaved_and_ratios(self) -> None:
        order = []

        def worker(shape, mode, args):
            order.append((shape, mode))
            ms = {"stock": 1.0, "stock-pair": 2.0, "ours": 1.1, "ours-bf16": 2.2}[mode] * (1 + 0.1 * (len(order) % 3))
            return {"shape": shape, "mode": mode, "step_ms": ms, **({"guard_us": 3.0} if mode.startswith("ours") else {})}

        modes = ["stock", "stock-pair", "ours", "ours-bf16"]
        with mock.patch.object(overhead, "_run_worker", worker):
            rows = overhead.run(["per-block"], modes, {}, rounds=3)
        self.assertEqual(order, [("per-block", m) for m in modes] * 3)  # round by round
        by_mode = {r["mode"]: r for r in rows}
        self.assertEqual(len(by_mode["ours"]["rounds_ms"]), 3)
        self.assertAlmostEqual(by_mode["ours"]["ratio"], by_mode["ours"]["step_ms"] / by_mode["stock"]["step_ms"])
        self.assertEqual(by_mode["ours-bf16"]["against"], "stock-pair")
        self.assertNotIn("ratio", by_mode["stock-pair"])
        self.assertIn("1.", overhead.format_rows(rows))

    @pytest.mark.slow
    def test_every_shape_end_to_end(self) -> None:
        with tempfile.TemporaryDirectory() as out:
            path = os.path.join(out, "overhead.json")
            shapes = "per-block,graph-breaks,llama" if _has("transformers") else "per-block,graph-breaks"
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.overhead",
                    "--shapes",
                    shapes,
                    "--modes",
                    # stock and the mode with the most parts: ours-bf16's pair, reading a
                    # tensor updated in place every step (a lifted input and its guard)
                    "stock,ours-scaled",
                    "--blocks",
                    "2",
                    "--steps",
                    "3",
                    "--rounds",
                    "1",
                    "--json",
                    path,
                ],
                capture_output=True,
                text=True,
                timeout=1200,
                cwd=ROOT,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            with open(path) as f:
                rows = json.load(f)["rows"]
        self.assertEqual(len(rows), 2 * len(shapes.split(",")))
        for row in rows:
            self.assertTrue(math.isfinite(row["step_ms"]) and row["step_ms"] > 0, row)
            self.assertEqual("guard_us" in row, row["mode"].startswith("ours"), row)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class TestBudgetSweep(TestCase):
    """``benchmarks.budget_sweep``: its table and verdicts from rows (the rows themselves are
    ``benchmarks.convergence``'s, run by the sweep)."""

    @staticmethod
    def row(peak, ms=100.0, plans=()):
        return {"seeds": {"0": {"peak_bytes": peak, "step_ms": ms}}, "plans": list(plans)}

    @staticmethod
    def plan(peak, baseline, met, holders=(), ratio=None):
        return {
            "peak_bytes": peak,
            "baseline_bytes": baseline,
            "met": met,
            "floor_holders": list(holders),
            "partitioner_ratio": ratio,
            "partitioner_met": None if ratio is None else True,
        }

    def results(self, ours, stock, plans):
        out = {"compiled": self.row(1000)}
        for f in ours:
            out[f"budget:{f:g}"] = self.row(ours[f], 120.0, plans[f])
            out[f"amb:{f:g}"] = self.row(stock[f], 150.0)
        return out

    def test_summary_ratios_plans_and_verdicts(self) -> None:
        plans = {
            0.1: [self.plan(400, 1000, False, ["logits 64 MiB in use there at full size"])],
            0.5: [self.plan(500, 1000, True)],
            # The partitioner's recomputation met it: the plan's baseline is what it left.
            0.9: [self.plan(450, 500, True, ratio=0.5)],
        }
        summary = budget_sweep.summarize(
            self.results({0.1: 500, 0.5: 600, 0.9: 550}, {0.1: 700, 0.5: 580, 0.9: 900}, plans), [0.1, 0.5, 0.9], 0.02
        )
        lines = {line["fraction"]: line for line in summary["lines"]}
        self.assertEqual([lines[f]["ours_peak"] for f in (0.1, 0.5, 0.9)], [0.5, 0.6, 0.55])
        self.assertEqual(lines[0.9]["plan_peak"], 0.45)
        self.assertEqual((lines[0.1]["plan_met"], lines[0.1]["floor"]), (False, ["logits 64 MiB in use there at full size"]))
        self.assertAlmostEqual(lines[0.5]["ours_time"], 1.2)
        self.assertEqual(summary["rises"], [(0.5, 0.9)])  # 0.5 measured above 0.9
        self.assertEqual(summary["above_stock"], [0.5])  # 600 > 1.02 * 580
        table = budget_sweep.format_table(summary, 0.02)
        self.assertIn("| 0.1 | 0.40 | floor | - | 0.50 | 0.70 | 1.20 | 1.50 |", table)
        self.assertIn("rises from F=0.5 to F=0.9; above stock's + 2% at F = 0.5", table)
        self.assertIn("floor held by: logits 64 MiB in use there at full size", table)
        # A model compiled to two graphs whose loss graph cannot meet it says so.
        plans[0.5].append(self.plan(100, 100, False, ["logits 1 MiB kept exact"]))
        mixed = budget_sweep.summarize(
            self.results({0.1: 500, 0.5: 600, 0.9: 550}, {0.1: 700, 0.5: 580, 0.9: 900}, plans), [0.1, 0.5, 0.9], 0.02
        )
        self.assertIn("| 0.5 | 0.55 | met in 1 of 2 graphs |", budget_sweep.format_table(mixed, 0.02))

    def test_each_length_against_no_hooks_at_that_length(self) -> None:
        # Pad-to-longest batches: each length's peak against no hooks' at that length.
        def row(by_length):
            return {"seeds": {"0": {"peak_bytes": max(by_length.values()), "step_ms": 100.0, "peaks_by_length": by_length}}, "plans": []}

        results = {
            "compiled": row({"512": 1000, "384": 800}),
            "budget:0.1": row({"512": 400, "384": 400}),
            "amb:0.1": row({"512": 900, "384": 720}),
        }
        summary = budget_sweep.summarize(results, [0.1], 0.02)
        self.assertEqual(summary["lines"][0]["by_length"], {"512": {"ours": 0.4, "stock": 0.9}, "384": {"ours": 0.5, "stock": 0.9}})
        table = budget_sweep.format_table(summary, 0.02)
        self.assertIn("| F | `budget(F)` / stock x at 512 | `budget(F)` / stock x at 384 |", table)
        self.assertIn("| 0.1 | 0.40 / 0.90 | 0.50 / 0.90 |", table)
        # One length: no table of lengths.
        self.assertNotIn(
            "stock x at", budget_sweep.format_table(budget_sweep.summarize(self.results({0.1: 1}, {0.1: 1}, {0.1: []}), [0.1], 0.02), 0.02)
        )

    def test_monotonic_and_below_stock_say_so(self) -> None:
        plans = {f: [self.plan(100, 1000, True)] for f in (0.3, 0.6)}
        summary = budget_sweep.summarize(self.results({0.3: 400, 0.6: 400}, {0.3: 395, 0.6: 500}, plans), [0.3, 0.6], 0.02)
        self.assertEqual((summary["rises"], summary["above_stock"]), ([], []))
        self.assertIn("never rises as F falls; at or below stock's + 2% at every F", budget_sweep.format_table(summary, 0.02))

    def test_planned_step_peak_beside_the_measured(self) -> None:
        # Each plan says what its graph holds at its forward's end (planned_bytes) and the
        # most it holds in its backward with its own tensors (predicted_peak_bytes). The step
        # holds every call's saved bytes and one backward's extra on top.
        def plan(planned, predicted, compile_id):
            return {**self.plan(planned, 1000, True), "planned_bytes": planned, "predicted_peak_bytes": predicted, "compile_id": compile_id}

        whole = [plan(100, 400, "0/0")]
        self.assertEqual(budget_sweep.call_order(whole, None), [0])
        self.assertEqual(budget_sweep.planned_step_peak(whole, [0]), 400)
        # A graph break: while the second graph's backward runs, the first holds its bytes.
        broken = [plan(100, 400, "0/0"), plan(60, 350, "1/0")]
        self.assertEqual(budget_sweep.planned_step_peak(broken, budget_sweep.call_order(broken, None)), 450)
        # Four layers sharing one graph (frame 0), the loss apart (frame 1): at the loss's
        # backward every layer holds its saved bytes.
        per_layer = [plan(50, 120, "0/0"), plan(30, 200, "1/0")]
        self.assertEqual(budget_sweep.call_order(per_layer, 4), [0, 0, 0, 0, 1])
        self.assertEqual(budget_sweep.planned_step_peak(per_layer, [0, 0, 0, 0, 1]), 4 * 50 + 200)
        # Layers that recompile (frame 0 twice): one graph each, the last repeated.
        recompiled = [plan(50, 120, "0/0"), plan(50, 120, "0/1"), plan(30, 200, "1/0")]
        self.assertEqual(budget_sweep.call_order(recompiled, 4), [0, 1, 1, 1, 2])
        self.assertIsNone(budget_sweep.planned_step_peak([self.plan(1, 1, True)], [0]))
        results = self.results({0.5: 420, 0.3: 300}, {0.5: 450, 0.3: 350}, {0.5: whole, 0.3: [plan(50, 230, "0/0")]})
        summary = budget_sweep.summarize(results, [0.3, 0.5], 0.02)
        lines = {line["fraction"]: line for line in summary["lines"]}
        self.assertEqual((lines[0.5]["planned_peak"], round(lines[0.5]["planned_off"], 3)), (0.4, 0.048))
        self.assertEqual(summary["planned_off"], [0.3])  # 230 against 300 measured
        table = budget_sweep.format_table(summary, 0.02)
        self.assertIn("| 0.5 | 0.10 | met | 0.40 | 0.42 |", table)
        self.assertIn("planned peak more than 10% off the measured one at F = 0.3", table)

    def test_offload_rows_listed_under_the_table(self) -> None:
        # Where the device has a copy engine the sweep also runs cpu_offload() and fp8 +
        # offload; their peaks and times are ratios to the row without hooks.
        plans = {0.5: [self.plan(100, 1000, True)]}
        results = {**self.results({0.5: 400}, {0.5: 450}, plans), "offload": self.row(250, 105.0), "fp8+offload": {"error": "boom"}}
        summary = budget_sweep.summarize(results, [0.5], 0.02)
        self.assertEqual(summary["offload"][0], {"row": "offload", "peak": 0.25, "time": 1.05, "error": None})
        table = budget_sweep.format_table(summary, 0.02)
        self.assertIn("offload: peak x 0.25, time x 1.05", table)
        self.assertIn("fp8+offload: error: boom", table)

    def test_the_loss_chunked_by_hand_listed_under_the_table(self) -> None:
        # --by-hand: the row with the loss written in chunks under checkpoint, stock compile.
        results = {**self.results({0.5: 400}, {0.5: 450}, {0.5: [self.plan(100, 1000, True)]}), "chunked_by_hand": self.row(300, 120.0)}
        summary = budget_sweep.summarize(results, [0.5], 0.02)
        self.assertEqual(summary["by_hand"], {"peak": 0.3, "time": 1.2, "error": None})
        self.assertIn(
            "the loss chunked by hand under checkpoint, stock compile: peak x 0.30, time x 1.20", budget_sweep.format_table(summary, 0.02)
        )
        self.assertIsNone(budget_sweep.summarize(self.results({0.5: 400}, {0.5: 450}, {0.5: []}), [0.5], 0.02)["by_hand"])

    def test_errors_are_reported_not_ratioed(self) -> None:
        results = self.results({0.5: 400}, {0.5: 500}, {0.5: []})
        results["amb:0.5"] = {"row": "amb:0.5", "error": "boom"}
        summary = budget_sweep.summarize(results, [0.5], 0.02)
        (line,) = summary["lines"]
        self.assertEqual((line["stock_peak"], line["errors"]), (None, ["boom"]))
        self.assertIn("F=0.5: error: boom", budget_sweep.format_table(summary, 0.02))

    def test_cli_validates_before_running(self) -> None:
        for bad in (["--fractions", "0,0.5"], ["--fractions", "1.5"], ["--steps", "2"]):
            with self.subTest(bad=bad), self.assertRaises(SystemExit), mock.patch("sys.stderr"):
                budget_sweep.main(bad)

    def test_plan_rows_are_json(self) -> None:

        plan = BudgetPlanSummary(
            "ambient",
            "budget(0.5)",
            10,
            20,
            10,
            12,
            "the forward's end",
            False,
            "the floor",
            1.0,
            (PlannedStorage(("a",), "int8", 3, 0.1), PlannedStorage(("b",), "int8", 3, 0.1)),
            floor_bytes=12,
            floor_holders=("a 3 B",),
        )
        row = plan_row(plan)
        self.assertEqual((row["options"], row["floor_holders"], "units" in row), ({"int8": 2}, ("a 3 B",), False))
        json.dumps(row)
        with self.assertRaises(ValueError):
            TrainConfig(vocab=100)


class TestTrainerConvergence(TestCase):
    """``benchmarks.trainer_convergence``'s table from results (its runs: Trainer in fresh
    processes, as test_checkpointing's Trainer test runs it in process)."""

    def test_changes_against_the_same_seed_without_a_budget(self) -> None:
        def result(row, seed, loss, peak):
            return {"row": row, "seed": seed, "eval_loss": loss, "train_loss": loss, "peak_bytes": peak, "steps": 3}

        results = [
            result("none", 0, 2.0, 100),
            result("budget:0.3", 0, 2.02, 80),
            result("none", 1, 4.0, 100),
            result("budget:0.3", 1, 3.96, 90),
            {"row": "budget:0.1", "seed": 0, "error": "RuntimeError: boom"},
        ]
        rows = {r["row"]: r for r in trainer_convergence.summarize(results)}
        mean, lo, hi = rows["budget:0.3"]["change_pct"]
        self.assertAlmostEqual(mean, 0.0)
        self.assertAlmostEqual(lo, -1.0)
        self.assertAlmostEqual(hi, 1.0)
        self.assertAlmostEqual(rows["budget:0.3"]["peak_x"], 0.85)
        self.assertEqual(rows["budget:0.1"], {"row": "budget:0.1", "error": "RuntimeError: boom"})
        table = trainer_convergence.format_table(list(rows.values()))
        self.assertIn("| budget:0.3 | 2 | 2.9900 | +0.00% [-1.00, +1.00] |", table)
        self.assertIn("error: RuntimeError: boom", table)


class TestLossHeadTime(TestCase):
    """``benchmarks.loss_head_time``: its argument checks; end to end at tiny sizes (slow):
    three rows, interleaved, their medians and the ratio written as JSON."""

    def test_rows_alternate_after_their_warm_up(self) -> None:
        calls = []

        def step(name: str) -> float:
            calls.append(name)
            return float(len(calls))

        times = interleaved_times(step, ["a", "b", "c"], steps=2, warmup=1)
        self.assertEqual(calls, ["a", "b", "c", "a", "b", "c", "c", "b", "a"])
        self.assertEqual(times, {"a": [4.0, 9.0], "b": [5.0, 8.0], "c": [6.0, 7.0]})

    def test_cli_validates_before_running(self) -> None:
        for bad in (["--fraction", "0"], ["--fraction", "1.5"], ["--steps", "0"]):
            with self.subTest(bad=bad), self.assertRaises(SystemExit), mock.patch("sys.stderr"):
                loss_head_time.main(bad)

    @pytest.mark.slow
    def test_rows_interleaved_end_to_end(self) -> None:
        pytest.importorskip("transformers")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.json")
            argv = "--vocab 512 --dim 32 --heads 2 --seq 32 --steps 2 --backend aot_eager --json".split() + [path]
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.loss_head_time", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            with open(path) as f:
                out = json.load(f)
        self.assertEqual(sorted(out["times_s"]), ["budget(0.3), head chunked", "budget(0.3), head whole", "no hooks"])
        self.assertTrue(all(len(t) == 2 for t in out["times_s"].values()))
        self.assertGreater(out["chunked_over_whole"], 0)
        self.assertIn("chunked / whole:", proc.stdout)


if __name__ == "__main__":
    unittest.main()
