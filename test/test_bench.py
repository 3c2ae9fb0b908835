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

The research harness built on it (``benchmarks/``): ``test_benchmarks.py``.
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

import pytest
import torch

from torch_patches.bench import parse_fractions
from torch_patches.bench.case import Case
from torch_patches.bench.decisions import recording_decisions
from torch_patches.bench.measure import block_working_set, recording_pack, saved_bytes, tensor_bytes
from torch_patches.bench.report import add_ratios, format_table
from torch_patches.bench.run import COMPOSED_HOOKS, cases_for, cast_hooks
from torch_patches.testing import TestCase
from torch_patches.testing.models import blocks_of, build_model, example_input


class TestBench(unittest.TestCase):
    @pytest.mark.slow
    def test_cpu_offload_rows(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bench.json")
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch_patches",
                    "bench",
                    "--device",
                    "cpu",
                    "--small",
                    "--models",
                    "mlp8,transformer",
                    "--backends",
                    "aot_eager",
                    "--hooks",
                    "cpu_offload",
                    "--blocks",
                    "1",
                    "--steps",
                    "1",
                    "--batch",
                    "128",
                    "--json",
                    out,
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(out) as f:
                data = json.load(f)
        results = data["results"]
        labels = [r["label"] for r in results]
        expected = [
            f"{m} aot_eager {h} {mode}"
            for m in ("mlp8", "transformer")
            for h, mode in (("-", "no-hooks"), ("cpu_offload", "eager-hooks"), ("cpu_offload", "stock-inline"), ("cpu_offload", "ours"))
        ]
        self.assertEqual(labels, expected)
        for r in results:
            with self.subTest(r["label"]):
                self.assertNotIn("error", r)

                for key in ("peak_bytes", "step_s", "step_min_s", "compile_s", "peak_ratio", "time_ratio", "time_ratio_min", "saved_bytes"):
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
                    sys.executable,
                    "-m",
                    "torch_patches",
                    "bench",
                    "--device",
                    "cpu",
                    "--small",
                    "--models",
                    "mlp8",
                    "--backends",
                    "aot_eager",
                    "--hooks",
                    "",
                    "--budget",
                    "0.5",
                    "--blocks",
                    "2",
                    "--steps",
                    "1",
                    "--batch",
                    "128",
                    "--json",
                    out,
                ],
                capture_output=True,
                text=True,
                timeout=300,
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
        self.assertEqual(ours["floor_bytes"], ours["peak_bytes"] - (ours["grad_bytes"] + ours["plan_bytes"] + ours["block_ws_bytes"]))
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
        pack, unpack = cast_hooks(torch.bfloat16)
        packed: list = []
        with torch.autograd.graph.saved_tensors_hooks(recording_pack(pack, packed), unpack):
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
        for kwargs in (
            dict(mode="budget"),
            dict(mode="ours", budget=0.5),
            dict(mode="budget", budget=1.5),
            dict(mode="stock-budget", budget=0.0),
        ):
            with self.subTest(**kwargs), self.assertRaises(ValueError):
                Case(**kwargs)

    def test_cases_for(self) -> None:
        cases = cases_for(models=["mlp8"], backends=["aot_eager"], hooks=["fp8_rowwise"], modes=["ours"], budgets=[0.3, 0.7], steps=2)
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
        self.assertEqual(parse_fractions("0.3,0.5,0.7"), (0.3, 0.5, 0.7))
        for bad in ("0", "0.5,1.2", "half"):
            with self.subTest(bad), self.assertRaises(argparse.ArgumentTypeError):
                parse_fractions(bad)

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
                "case": dataclasses.asdict(case),
                "label": case.label,
                "peak_bytes": peak,
                "step_s": step_s,
                "step_min_s": step_s,
                "compile_s": 1.0,
                "frames_compiled": 1,
                "kept_bytes": None,
                "saved_bytes": saved,
                "plan_bytes": None,
                **extra,
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


if __name__ == "__main__":
    unittest.main()
