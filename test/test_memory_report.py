"""``torch_patches.report``: one step's saved tensors, per module, with the planner's pictures.

* Rows: one per saved tensor of every graph the step compiled, named by the module that
  computed it (``named_modules()`` paths: real submodules, a parameter by the module owning
  it, ``""`` for the root's own code), with what was stored and why; the same rows with no
  hooks, with hooks, under a budget.
* ``table()`` groups them by module with totals; ``save()`` writes the text, the CSV and both
  pictures; the timeline model never holds more with the hooks than without them; the pareto
  has the planner's and the partitioner's points.
* Graphs loaded from AOTAutogradCache keep their records (a fresh process, the same cache:
  the same rows).
* The CLI on the built-in models, and an HF model the other tests do not use (OPT).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch
from torch._dynamo.test_case import run_tests

import torch_patches
from torch_patches.hooks import bf16
from torch_patches.testing import TestCase


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).tanh()  # tanh: the root's own code


def _step(backend: str = "aot_eager") -> tuple[Net, Any]:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 16, requires_grad=True)
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        compiled(x).sum().backward()

    return model, step


@functools.cache
def _found(kind: str) -> tuple[Net, Any]:
    """One report of a fresh ``Net``'s step, with ``bf16()`` hooks or a budget of 0.5; the
    tests below only read it, so each is made once (a report compiles, and plans every
    fraction for its pareto)."""
    model, step = _step()
    return model, torch_patches.report(step, **({"hooks": bf16()} if kind == "bf16" else {"budget": 0.5}))


class TestRows(TestCase):
    def test_rows_name_modules_and_what_was_stored(self) -> None:
        model, found = _found("bf16")
        modules = dict(model.named_modules())
        self.assertEqual(len(found.graphs), 1)
        self.assertEqual(len(found.rows), len(found.graphs[0].records))
        for r in found.rows:
            self.assertIn(r["module"], modules, r)  # "" is the root
            self.assertEqual(set(r), set(torch_patches.memory_report.FIELDS))
        by_name = {r["name"]: r for r in found.rows}
        # fc1's output (read by gelu's backward) is stored as bf16 by the hooks, in half the bytes.
        fc1 = [r for r in found.rows if r["module"] == "blocks.0.fc1" and r["op"].startswith("aten.addmm")]
        self.assertEqual(len(fc1), 1, found.rows)
        self.assertEqual((fc1[0]["decision"], fc1[0]["dtype"], fc1[0]["bytes"]), ("hooked", "float32", 8 * 32 * 4))
        self.assertEqual(fc1[0]["device_bytes"], 8 * 32 * 2)
        self.assertIn("bf16", fc1[0]["storage"])
        # A saved weight is named by the module owning it; the root's tanh by "".
        weights = [r for r in found.rows if r["op"] == "input" and r["module"]]
        self.assertTrue(any(r["module"] == "head" for r in weights), weights)
        # tanh's output, saved for its backward (as a detach of it, by AOTAutograd's own node).
        tanh = [r for r in found.rows if r["op"] in ("aten.tanh.default", "aten.detach.default")]
        self.assertEqual([r["module"] for r in tanh], [""])
        self.assertIn(by_name[tanh[0]["name"]]["decision"], ("hooked", "unhooked"))

    def test_no_hooks_and_budget(self) -> None:
        _, step = _step()
        plain = torch_patches.report(step)
        self.assertEqual(plain.hooks, "none")
        self.assertTrue(plain.rows)
        self.assertEqual({r["decision"] for r in plain.rows}, {"unhooked"})
        self.assertTrue(all(r["device_bytes"] == r["bytes"] for r in plain.rows))
        _, planned = _found("budget")
        self.assertEqual(planned.hooks, "budget(0.5)")
        # Every tensor the default partition saves has its row: stored otherwise, kept, or
        # recomputed (by the plan, or by the partitioner's knapsack where that was taken, which
        # may save others instead).
        self.assertLessEqual({r["name"] for r in plain.rows}, {r["name"] for r in planned.rows})
        self.assertLess(sum(r["device_bytes"] for r in planned.rows), sum(r["device_bytes"] for r in plain.rows))
        with self.assertRaisesRegex(ValueError, "not both"):
            torch_patches.report(step, hooks=bf16(), budget=0.5)

    def test_table_groups_by_module_with_totals(self) -> None:
        _, found = _found("bf16")
        text = found.table()
        groups = found.by_module()
        self.assertEqual(sum(g["count"] for g in groups.values()), len(found.rows))
        for module, g in groups.items():
            header = f"{module or '(outside any submodule)'}: {g['count']} saved"
            self.assertEqual(text.count(header + ","), 1, text)
        self.assertIn(f"total: {len(found.rows)} saved tensors", text)
        # Rows appear under their module's header.
        lines = text.splitlines()
        start = lines.index(next(line for line in lines if line.startswith("blocks.1.fc2:")))
        self.assertTrue(any("addmm" in line or "input" in line for line in lines[start + 2 : start + 6]))

    def test_timeline_and_pareto(self) -> None:
        _, found = _found("budget")
        t = found.timeline()
        self.assertEqual(len(t["with"]), len(t["without"]))
        self.assertTrue(all(w <= wo for w, wo in zip(t["with"], t["without"])), t)
        self.assertEqual(max(t["with"]), t["with"][t["peak"]])
        self.assertTrue(t["at_peak"])
        self.assertLess(max(t["with"]), max(t["without"]))
        p = found.pareto()
        self.assertEqual([f for f, _, _ in p["ours"]], [round(0.1 * k, 1) for k in range(1, 11)])
        self.assertEqual([f for f, _, _ in p["stock"]], [round(0.1 * k, 1) for k in range(1, 11)])
        peaks = [b for _, b, _ in p["ours"]]
        self.assertEqual(peaks, sorted(peaks))  # a looser budget never plans a lower peak... nor a higher one at a tighter
        stock_bytes = [b for _, b, _ in p["stock"]]
        self.assertEqual(stock_bytes[-1], max(stock_bytes))

    def test_save_writes_text_csv_and_pictures(self) -> None:
        _, found = _found("budget")
        with tempfile.TemporaryDirectory() as out:
            paths = found.save(out)
            self.assertEqual(set(paths), {"report.txt", "report.csv", "timeline.png", "pareto.png"})
            with open(paths["report.txt"]) as f:
                self.assertEqual(f.read().strip(), found.table().strip())
            with open(paths["report.csv"]) as f:
                rows = list(csv.DictReader(f))
            self.assertEqual([r["name"] for r in rows], [r["name"] for r in found.rows])
            self.assertEqual([int(r["bytes"]) for r in rows], [r["bytes"] for r in found.rows])
            for name in ("timeline.png", "pareto.png"):
                with open(paths[name], "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
                self.assertGreater(os.path.getsize(paths[name]), 10_000)
            with self.assertRaisesRegex(RuntimeError, "snapshot=True"):
                found.save(out, snapshot=True)


_WORKER = r"""
import json, sys, torch, torch_patches
sys.path.insert(0, sys.argv[1])
from test_memory_report import _step
from torch._dynamo.utils import counters
_, step = _step("inductor")
found = torch_patches.report(step, budget=0.5)
print(json.dumps({"rows": [[r["name"], r["module"], r["storage"]] for r in found.rows],
                  "hits": counters["aot_autograd"]["autograd_cache_hit"]}))
"""


@pytest.mark.slow
class TestCacheHit(TestCase):
    def test_graphs_from_autograd_cache_keep_their_records(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
            runs = []
            for _ in range(2):
                proc = subprocess.run([sys.executable, "-c", _WORKER, here], capture_output=True, text=True, env=env, timeout=600)
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        self.assertEqual(runs[0]["hits"], 0)
        self.assertEqual(runs[1]["hits"], 1)
        self.assertTrue(runs[0]["rows"])
        self.assertEqual(runs[1]["rows"], runs[0]["rows"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch_patches", "report", *args], capture_output=True, text=True, timeout=900)


class TestCLI(TestCase):
    def test_mlp8(self) -> None:
        # The command's code in this process (the slow test below runs it as a user would).
        from torch_patches.__main__ import main

        with tempfile.TemporaryDirectory() as out:
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                rc = main(["report", "--model", "mlp8", "--budget", "0.5", "--backend", "aot_eager", "--out", out])
            self.assertEqual(rc, 0)
            self.assertIn("hooks: budget(0.5)", stdout.getvalue())
            self.assertEqual(sorted(os.listdir(out)), ["pareto.png", "report.csv", "report.txt", "timeline.png"])

    @pytest.mark.slow
    def test_hf_models(self) -> None:
        pytest.importorskip("transformers")
        for model, extra in (
            ("mlp8", ("--budget", "0.5", "--backend", "aot_eager")),
            ("gpt2", ("--budget", "0.3")),
            ("vit", ()),
        ):
            with self.subTest(model=model), tempfile.TemporaryDirectory() as out:
                proc = _cli("--model", model, *extra, "--out", out)
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                self.assertEqual(sorted(os.listdir(out)), ["pareto.png", "report.csv", "report.txt", "timeline.png"])
                if model == "mlp8":
                    self.assertIn("hooks: budget(0.5)", proc.stdout)


@pytest.mark.slow
class TestHFModel(TestCase):
    def test_opt_under_a_budget(self) -> None:
        # An HF model no other test uses: OPT from a config (random init, no download).
        transformers = pytest.importorskip("transformers")
        config = transformers.OPTConfig(
            vocab_size=1024,
            hidden_size=128,
            num_hidden_layers=2,
            ffn_dim=512,
            num_attention_heads=4,
            max_position_embeddings=128,
            dropout=0.0,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)
        model = transformers.OPTForCausalLM(config)
        ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
        compiled = torch.compile(model, backend="inductor")

        def step() -> None:
            compiled(input_ids=ids, labels=ids).loss.backward()

        found = torch_patches.report(step, budget=0.5)
        modules = dict(model.named_modules())
        named = [r for r in found.rows if r["module"]]
        self.assertTrue(found.rows)
        self.assertGreaterEqual(len(named) / len(found.rows), 0.8, [r["name"] for r in found.rows if not r["module"]])
        self.assertTrue(all(r["module"] in modules for r in found.rows))
        self.assertTrue(any(r["module"].endswith("fc1") for r in found.rows))
        with tempfile.TemporaryDirectory() as out:
            self.assertEqual(len(found.save(out)), 4)


if __name__ == "__main__":
    run_tests()
