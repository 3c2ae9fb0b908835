"""``python -m torch_patches bench``.

* End to end on CPU at tiny sizes (no timing assertions, ``slow``): the offload hook on both
  models, every mode: the JSON must hold every row with every column, finite numbers (the
  stock-inline row runs the same ops as GraphModule hooks); ``--budget``: a budget and a
  stock-budget row beside no-hooks, each saving at most what no-hooks saves.
* ``saved_bytes`` (the ``saved MiB`` column) against bytes computed by hand: a Linear+ReLU
  stack eager (a ReLU's result and the next Linear's input are one storage, counted once),
  compiled with aot_eager (the compiled function's ctx), and the packed outputs of runtime
  hooks (``eager-hooks`` rows); the block working set of ``floor MiB`` on the MLP block.
* ``Case`` with a budget: JSON round trip (old JSON without the field still loads), labels,
  the rows ``--budget`` adds, the table's budget columns; the inliner's decisions
  (``recording_decisions``: budget plans and bytes a select predicate left unhooked) summed.
* ``bench --overhead``: rows interleaved over rounds and their ratios against the named
  reference row (in this process, its worker stubbed); end to end at tiny sizes (``slow``):
  every shape's rows measured in fresh processes, guard times for our rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import pytest
import torch

from torch_patches.bench import _fractions, overhead
from torch_patches.bench._decisions import recording_decisions
from torch_patches.bench.case import Case
from torch_patches.bench.measure import _recording_pack, block_working_set, saved_bytes, tensor_bytes
from torch_patches.bench.models import blocks_of, build_model, example_input
from torch_patches.bench.report import add_ratios, format_table
from torch_patches.bench.run import COMPOSED_HOOKS, _cast_hooks, cases_for
from torch_patches.testing import TestCase


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
                            "time_ratio", "time_ratio_min", "saved_bytes"):
                    self.assertTrue(math.isfinite(r[key]), f"{key}={r[key]}")
                self.assertEqual(r["frames_compiled"], 1)
        self.assertIn("fp8_rowwise+cpu_offload", COMPOSED_HOOKS)

    @pytest.mark.slow
    def test_budget_rows(self) -> None:
        import torch_patches.hooks

        if not hasattr(torch_patches.hooks, "budget"):
            self.skipTest("torch_patches.hooks.budget (the budget planner) is not there")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bench.json")
            proc = subprocess.run(
                [
                    sys.executable, "-m", "torch_patches", "bench", "--device", "cpu", "--small",
                    "--models", "mlp8", "--backends", "aot_eager", "--hooks", "", "--budget", "0.5",
                    "--blocks", "2", "--steps", "1", "--batch", "128", "--json", out,
                ],
                capture_output=True, text=True, timeout=300,
            )
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(out) as f:
                results = json.load(f)["results"]
        self.assertEqual(
            [r["label"] for r in results],
            ["mlp8 aot_eager - no-hooks", "mlp8 aot_eager budget 0.5 budget", "mlp8 aot_eager amb 0.5 stock-budget"],
        )
        base, ours, stock = results
        for r in results:
            with self.subTest(r["label"]):
                self.assertNotIn("error", r)
                for key in ("peak_ratio", "time_ratio", "time_ratio_min"):
                    self.assertTrue(math.isfinite(r[key]), f"{key}={r[key]}")
                self.assertGreater(r["saved_bytes"], 0)
                self.assertLessEqual(r["saved_bytes"], base["saved_bytes"])
        self.assertEqual(ours["case"]["budget"], 0.5)
        self.assertEqual(ours["plan_graphs"], 1)
        self.assertGreater(ours["plan_bytes"], 0)
        self.assertEqual(ours["block_ws_bytes"], 40 * 128 * 32)  # see test_block_working_set
        self.assertEqual(
            ours["floor_bytes"], ours["peak_bytes"] - (ours["grad_bytes"] + ours["plan_bytes"] + ours["block_ws_bytes"])
        )
        self.assertIsNone(stock["plan_bytes"])
        self.assertIn("amb 0.5", proc.stdout)


def _linear_relu(n: int, d: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(n) for m in (torch.nn.Linear(d, d), torch.nn.ReLU())])


class TestSavedBytes(TestCase):
    N, B, D = 3, 64, 16

    def test_eager(self) -> None:
        n, b, d = self.N, self.B, self.D
        model = _linear_relu(n, d)
        x = torch.randn(b, d, requires_grad=True)
        y = model(x)
        # Each ReLU saves its result (b x d fp32); the next addmm saves that same storage as
        # its mat1, counted once. The first addmm's mat1 is x, every mat2 a weight's t().
        self.assertEqual(saved_bytes(y, (*model.parameters(), x)), n * b * d * 4)
        self.assertEqual(saved_bytes(y), n * b * d * 4 + b * d * 4 + n * d * d * 4)
        self.assertEqual(saved_bytes((y, [y.view(-1)])), n * b * d * 4 + b * d * 4 + n * d * d * 4)

    def test_compiled_aot_eager(self) -> None:
        n, b, d = self.N, self.B, self.D
        model = _linear_relu(n, d)
        x = torch.randn(b, d, requires_grad=True)
        y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        self.assertEqual(type(y.grad_fn).__name__, "CompiledFunctionBackward")
        # The min-cut partition saves the same: every ReLU output (the last is the output
        # itself), x and the weights (left out).
        self.assertEqual(saved_bytes(y, (*model.parameters(), x)), n * b * d * 4)
        y.sum().backward()
        self.assertEqual(saved_bytes(y), 0)  # freed by backward

    def test_runtime_hooks_packed(self) -> None:
        # eager-hooks rows: what pack returned (bf16 copies, one per saved tensor and pack call).
        n, b, d = self.N, self.B, self.D
        model = _linear_relu(n, d)
        x = torch.randn(b, d, requires_grad=True)
        pack, unpack = _cast_hooks(torch.bfloat16)
        packed: list = []
        with torch.autograd.graph.saved_tensors_hooks(_recording_pack(pack, packed), unpack):
            model(x).sum().backward()
        # x, n weights, n ReLU results, and again n - 1 of them as the next addmm's mat1.
        expected = 2 * (b * d + n * d * d + n * b * d + (n - 1) * b * d)
        self.assertEqual(tensor_bytes(packed, (*model.parameters(), x)), expected)

    def test_storage_once_and_excluded(self) -> None:
        t = torch.zeros(10, 4)
        self.assertEqual(tensor_bytes([t, t[1:], (t.view(40), {"k": t.t()})]), 160)
        self.assertEqual(tensor_bytes([t, torch.ones(3)], exclude=[t[2:]]), 12)
        self.assertEqual(tensor_bytes([torch.empty(0)]), 0)

    def test_block_working_set(self) -> None:
        case = Case(model="mlp8", dim=4, batch=8, blocks=2)
        model = build_model(case)
        x = example_input(case).requires_grad_(True)
        # Per MLP block (b x d in, up to 2d): gelu saves h, the product its two factors (the
        # sigmoid's result is one of them), down its input: 4 b x 2d fp32 = 32bd B; plus the
        # output and the input gradients, 4bd each.
        self.assertEqual(block_working_set(model, x, blocks_of(model, case)), 40 * 8 * 4)


class TestBudgetRows(TestCase):
    def test_case_json_round_trip(self) -> None:
        for case in (Case(), Case(mode="budget", budget=0.5), Case(mode="stock-budget", budget=0.3)):
            with self.subTest(case.label):
                self.assertEqual(Case(**json.loads(json.dumps(dataclasses.asdict(case)))), case)
        # JSON written before the field existed.
        old = {k: v for k, v in dataclasses.asdict(Case(mode="ours")).items() if k != "budget"}
        self.assertEqual(Case(**old).label, "mlp8 aot_eager bf16 ours")
        self.assertIsNone(Case(**old).budget)

    def test_labels_and_validation(self) -> None:
        self.assertEqual(Case(mode="budget", budget=0.5).label, "mlp8 aot_eager budget 0.5 budget")
        self.assertEqual(Case(mode="stock-budget", budget=0.5).label, "mlp8 aot_eager amb 0.5 stock-budget")
        self.assertEqual(Case(mode="no-hooks").label, "mlp8 aot_eager - no-hooks")
        for kwargs in (dict(mode="budget"), dict(mode="ours", budget=0.5), dict(mode="budget", budget=1.5),
                       dict(mode="stock-budget", budget=0.0)):
            with self.subTest(**kwargs), self.assertRaises(ValueError):
                Case(**kwargs)

    def test_cases_for(self) -> None:
        cases = cases_for(
            models=["mlp8"], backends=["aot_eager"], hooks=["fp8_rowwise"], modes=["ours"], budgets=[0.3, 0.7], steps=2
        )
        self.assertEqual(
            [c.label for c in cases],
            [
                "mlp8 aot_eager - no-hooks",
                "mlp8 aot_eager fp8_rowwise ours",
                "mlp8 aot_eager budget 0.3 budget",
                "mlp8 aot_eager amb 0.3 stock-budget",
                "mlp8 aot_eager budget 0.7 budget",
                "mlp8 aot_eager amb 0.7 stock-budget",
            ],
        )
        self.assertEqual({c.steps for c in cases}, {2})
        self.assertEqual(_fractions("0.3,0.5,0.7"), (0.3, 0.5, 0.7))
        for bad in ("0", "0.5,1.2", "half"):
            with self.subTest(bad), self.assertRaises(argparse.ArgumentTypeError):
                _fractions(bad)

    def test_decisions_summed(self) -> None:
        # Two graphs (a graph break), each planned by the budget; and a select predicate
        # leaving one saved tensor unhooked.
        import torch

        import torch_patches
        from torch_patches.hooks import bf16, budget, select

        torch_patches.apply()
        self.addCleanup(torch_patches.unapply)

        def two_graphs(x, w):
            y = (x @ w).sigmoid()
            torch._dynamo.graph_break()
            return ((y @ w).sigmoid() @ w).sum()

        x = torch.randn(64, 128, requires_grad=True)
        w = torch.randn(128, 128, requires_grad=True)
        torch._dynamo.reset()
        # The plans' own storage (here the partitioner's knapsack would recompute exactly,
        # nothing stored otherwise: test_budget.TestPartitionerFirst).
        knob = torch_patches.config.patch(activation_budget_partitioner_recompute=False)
        with knob, recording_decisions() as decisions, torch.autograd.graph.saved_tensors_hooks(*budget(0.5)):
            torch.compile(two_graphs, backend="aot_eager")(x, w).backward()
        plans = [p for c in decisions._compiled for p in c.plans]
        self.assertEqual(decisions.plan_graphs, 2)
        self.assertEqual(
            (decisions.planned, decisions.saved, decisions.budget),
            tuple(sum(getattr(p, f) for p in plans) for f in ("planned_bytes", "baseline_bytes", "budget_bytes")),
        )
        self.assertLess(decisions.planned, decisions.saved)
        self.assertEqual(decisions.kept_bytes, 0)
        torch._dynamo.reset()
        only_mm = select(*bf16(where=None), where=lambda info: info.producer == "aten.mm.default")
        with recording_decisions() as decisions, torch.autograd.graph.saved_tensors_hooks(*only_mm):
            torch.compile(lambda x, w: (x @ w).sigmoid().sum(), backend="aot_eager")(x, w).backward()
        self.assertEqual(decisions.plan_graphs, 0)
        self.assertEqual(decisions.kept_bytes, 64 * 128 * 4)  # the sigmoid's output, rejected
        torch._dynamo.reset()

    def test_table(self) -> None:
        def row(mode: str, budget: float | None, peak: int, step_s: float, saved: int, **extra: object) -> dict:
            case = Case(mode=mode, budget=budget, hook="-" if budget else "bf16")
            return {
                "case": dataclasses.asdict(case), "label": case.label, "peak_bytes": peak, "step_s": step_s,
                "step_min_s": step_s, "compile_s": 1.0, "frames_compiled": 1, "kept_bytes": None,
                "saved_bytes": saved, "plan_bytes": None, **extra,
            }

        mib = 2**20
        results = [
            row("no-hooks", None, 40 * mib, 0.010, 32 * mib),
            row("budget", 0.5, 30 * mib, 0.015, 16 * mib, plan_bytes=16 * mib, floor_bytes=-mib // 2),
            row("stock-budget", 0.5, 20 * mib, 0.020, 12 * mib),
            {"case": dataclasses.asdict(Case(mode="budget", budget=0.7)), "label": "x", "error": ["E: e"]},
        ]
        add_ratios(results)
        self.assertAlmostEqual(results[1]["peak_ratio"], 0.75)
        self.assertAlmostEqual(results[2]["time_ratio"], 2.0)
        lines = format_table(results).splitlines()
        header = lines[0].split()
        self.assertEqual(header[-6:], ["saved", "MiB", "plan", "MiB", "floor", "MiB"])
        base, ours, stock, err = (line.split() for line in lines[2:])
        self.assertEqual(base[2:4], ["-", "no-hooks"])
        self.assertEqual(base[-3:], ["32.00", "-", "-"])
        self.assertEqual(ours[2:5], ["budget", "0.5", "budget"])
        self.assertEqual(ours[5:7], ["30.0", "0.75"])
        self.assertEqual(ours[-3:], ["16.00", "16.00", "-0.50"])
        self.assertEqual(stock[2:5], ["amb", "0.5", "stock-budget"])
        self.assertEqual(stock[7:9], ["20.0", "2.00"])
        self.assertEqual(stock[-3:], ["12.00", "-", "-"])
        self.assertEqual(err[2:6], ["budget", "0.7", "budget", "ERROR"])



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
                [sys.executable, "-m", "torch_patches", "bench", "--overhead", "--shapes", shapes,
                 "--modes", "stock,ours-bf16,ours-scaled", "--blocks", "2", "--steps", "3", "--rounds", "1",
                 "--json", path],
                capture_output=True, text=True, timeout=1200,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            with open(path) as f:
                rows = json.load(f)["rows"]
        self.assertEqual(len(rows), 3 * len(shapes.split(",")))
        for row in rows:
            self.assertTrue(math.isfinite(row["step_ms"]) and row["step_ms"] > 0, row)
            self.assertEqual("guard_us" in row, row["mode"].startswith("ours"), row)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None

if __name__ == "__main__":
    unittest.main()


class TestBudgetSweep(TestCase):
    """``bench --budget-sweep``: its table and verdicts from rows (the rows themselves are
    ``bench --train``'s, run by the bench)."""

    @staticmethod
    def row(peak, ms=100.0, plans=()):
        return {"seeds": {"0": {"peak_bytes": peak, "step_ms": ms}}, "plans": list(plans)}

    @staticmethod
    def plan(peak, baseline, met, holders=(), ratio=None):
        return {"peak_bytes": peak, "baseline_bytes": baseline, "met": met, "floor_holders": list(holders),
                "partitioner_ratio": ratio, "partitioner_met": None if ratio is None else True}

    def results(self, ours, stock, plans):
        out = {"compiled": self.row(1000)}
        for f in ours:
            out[f"budget:{f:g}"] = self.row(ours[f], 120.0, plans[f])
            out[f"amb:{f:g}"] = self.row(stock[f], 150.0)
        return out

    def test_summary_ratios_plans_and_verdicts(self) -> None:
        from torch_patches.bench import budget_sweep

        plans = {
            0.1: [self.plan(400, 1000, False, ["logits 64 MiB in use there at full size"])],
            0.5: [self.plan(500, 1000, True)],
            # The partitioner's recomputation met it: the plan's baseline is what it left.
            0.9: [self.plan(450, 500, True, ratio=0.5)],
        }
        summary = budget_sweep.summarize(self.results({0.1: 500, 0.5: 600, 0.9: 550}, {0.1: 700, 0.5: 580, 0.9: 900}, plans),
                                         [0.1, 0.5, 0.9], 0.02)
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
        mixed = budget_sweep.summarize(self.results({0.1: 500, 0.5: 600, 0.9: 550}, {0.1: 700, 0.5: 580, 0.9: 900}, plans),
                                       [0.1, 0.5, 0.9], 0.02)
        self.assertIn("| 0.5 | 0.55 | met in 1 of 2 graphs |", budget_sweep.format_table(mixed, 0.02))

    def test_monotonic_and_below_stock_say_so(self) -> None:
        from torch_patches.bench import budget_sweep

        plans = {f: [self.plan(100, 1000, True)] for f in (0.3, 0.6)}
        summary = budget_sweep.summarize(self.results({0.3: 400, 0.6: 400}, {0.3: 395, 0.6: 500}, plans), [0.3, 0.6], 0.02)
        self.assertEqual((summary["rises"], summary["above_stock"]), ([], []))
        self.assertIn("never rises as F falls; at or below stock's + 2% at every F", budget_sweep.format_table(summary, 0.02))

    def test_planned_step_peak_beside_the_measured(self) -> None:
        # Each plan says what its graph holds at its forward's end (planned_bytes) and the
        # most it holds in its backward with its own tensors (predicted_peak_bytes). The step
        # holds every call's saved bytes and one backward's extra on top.
        from torch_patches.bench import budget_sweep

        def plan(planned, predicted, compile_id):
            return {**self.plan(planned, 1000, True), "planned_bytes": planned, "predicted_peak_bytes": predicted,
                    "compile_id": compile_id}

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
        from torch_patches.bench import budget_sweep

        plans = {0.5: [self.plan(100, 1000, True)]}
        results = {**self.results({0.5: 400}, {0.5: 450}, plans), "offload": self.row(250, 105.0),
                   "fp8+offload": {"error": "boom"}}
        summary = budget_sweep.summarize(results, [0.5], 0.02)
        self.assertEqual(summary["offload"][0], {"row": "offload", "peak": 0.25, "time": 1.05, "error": None})
        table = budget_sweep.format_table(summary, 0.02)
        self.assertIn("offload: peak x 0.25, time x 1.05", table)
        self.assertIn("fp8+offload: error: boom", table)

    def test_errors_are_reported_not_ratioed(self) -> None:
        from torch_patches.bench import budget_sweep

        results = self.results({0.5: 400}, {0.5: 500}, {0.5: []})
        results["amb:0.5"] = {"row": "amb:0.5", "error": "boom"}
        summary = budget_sweep.summarize(results, [0.5], 0.02)
        (line,) = summary["lines"]
        self.assertEqual((line["stock_peak"], line["errors"]), (None, ["boom"]))
        self.assertIn("F=0.5: error: boom", budget_sweep.format_table(summary, 0.02))

    def test_cli_validates_before_running(self) -> None:
        from torch_patches.bench import budget_sweep

        for bad in (["--fractions", "0,0.5"], ["--fractions", "1.5"], ["--steps", "2"]):
            with self.subTest(bad=bad), self.assertRaises(SystemExit), mock.patch("sys.stderr"):
                budget_sweep.main(["--budget-sweep", *bad])

    def test_plan_rows_are_json(self) -> None:
        from torch_patches._functorch._aot_autograd.saved_tensor_records import BudgetPlanSummary, PlannedStorage
        from torch_patches.bench.convergence import TrainConfig, plan_row

        plan = BudgetPlanSummary("ambient", "budget(0.5)", 10, 20, 10, 12, "the forward's end", False, "the floor", 1.0,
                                 (PlannedStorage(("a",), "int8", 3, 0.1), PlannedStorage(("b",), "int8", 3, 0.1)),
                                 floor_bytes=12, floor_holders=("a 3 B",))
        row = plan_row(plan)
        self.assertEqual((row["options"], row["floor_holders"], "units" in row), ({"int8": 2}, ("a 3 B",), False))
        json.dumps(row)
        with self.assertRaises(ValueError):
            TrainConfig(vocab=100)
