"""The convergence benchmark (``python -m benchmarks.convergence``) and the bound it
puts on the lossy hooks.

* Fast: the pieces (real text, disjoint splits, seeded batches, the learning-rate schedule,
  row names, the summary's per-seed changes and ratios).
* Slow: every HF family and a PEFT LoRA fine-tune built and stepped; the command end to end
  at tiny sizes (table, JSON, PNG), and the convergence test
  itself: a small Llama trained on real text for 200 steps, two seeds, compiled with and
  without ``fp8_rowwise()``; the mean eval-loss gap must stay within its bound, also for
  e5m2 with the allowlist, and e5m2 without it (``where=None``: RoPE angles, the attention's
  log-sum-exp and the logits compressed) must exceed it, so the bound can fail.
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
import torch

from benchmarks import ROOT, convergence as cv, convergence_report as report
from torch_patches.testing import TestCase
from torch_patches.testing.models import decoder_layers


class TestTrainBenchPieces(unittest.TestCase):
    def test_corpus_is_real_text_and_the_splits_are_disjoint(self) -> None:
        text = cv.corpus()
        self.assertGreater(len(text), 100_000)
        words = text.decode().lower().split()
        self.assertGreater(words.count("the") / len(words), 0.02)  # English prose, not tokens
        train, held_out = cv.splits()
        self.assertEqual(len(train) + len(held_out), len(text))
        self.assertEqual(bytes(held_out[:64].tolist()), text[len(train) : len(train) + 64])

    def test_batches_are_fixed_by_the_seed(self) -> None:
        cfg = cv.TrainConfig(steps=5, batch=3, seq=16)
        train, held_out = cv.splits()
        a, b = cv.train_batches(train, cfg, 0), cv.train_batches(train, cfg, 0)
        self.assertTrue(torch.equal(a, b))
        self.assertEqual(tuple(a.shape), (5, 3, 16))
        self.assertFalse(torch.equal(a, cv.train_batches(train, cfg, 1)))
        evals = cv.eval_batches(held_out, cfg)
        self.assertEqual(tuple(evals.shape), (cfg.eval_batches, 3, 16))
        self.assertLess(int(evals.max()), cv.VOCAB)

    def test_schedule_warms_up_then_decays(self) -> None:
        cfg = cv.TrainConfig(steps=100, lr=1e-3, warmup=0.1, final_lr=0.1)
        lrs = [cv.lr_at(s, cfg) for s in range(100)]
        self.assertAlmostEqual(lrs[0], 1e-4)
        self.assertAlmostEqual(lrs[9], 1e-3)
        self.assertTrue(all(a >= b for a, b in zip(lrs[9:], lrs[10:])))
        self.assertAlmostEqual(cv.lr_at(100, cfg), 1e-4)

    def test_rows(self) -> None:
        self.assertEqual(cv.Row.parse("compiled"), cv.Row("compiled", compiled=True))
        self.assertFalse(cv.Row.parse("eager+bf16").compiled)
        self.assertTrue(cv.Row.parse("fp8_rowwise:all").where_all)
        row = cv.Row.parse("fp8_rowwise(block_size=32,otherwise=bf16)")
        self.assertEqual(row.kwargs, (("block_size", 32), ("otherwise", "bf16")))
        self.assertEqual(cv.Row.parse("fp8_rowwise(dtype=torch.float8_e5m2)").kwargs, (("dtype", "torch.float8_e5m2"),))
        self.assertEqual(cv.Row.parse("budget:0.5").budget, 0.5)
        for name in ("offload", "fp8+offload"):
            row = cv.Row.parse(name)
            self.assertTrue(row.compiled and row.applies_patches)
            self.assertEqual(len(row.hooks()), 2)
        amb = cv.Row.parse("amb:0.3")
        self.assertEqual((amb.amb, amb.applies_patches), (0.3, False))
        by_hand = cv.Row.parse("chunked_by_hand")
        self.assertEqual((by_hand.compiled, by_hand.by_hand, by_hand.applies_patches, by_hand.hooks()), (True, True, False, None))
        self.assertEqual(
            cv.split_rows("compiled, fp8_rowwise(block_size=32,otherwise=bf16),budget:0.5"),
            ["compiled", "fp8_rowwise(block_size=32,otherwise=bf16)", "budget:0.5"],
        )
        for bad in ("fp9", "budget:1.5", "amb:0"):
            with self.assertRaises(ValueError):
                cv.Row.parse(bad)

    def test_pad_to_longest_lengths(self) -> None:
        # As a pad-to-longest collator makes batches: seq x 1, 7/8, 3/4, 5/8 in turn.
        self.assertEqual(cv.step_lengths(cv.TrainConfig(seq=512, lengths="pad")), (512, 448, 384, 320))
        self.assertEqual(cv.step_lengths(cv.TrainConfig(seq=512)), (512,))
        with self.assertRaisesRegex(ValueError, "lengths must be one of"):
            cv.TrainConfig(lengths="bucketed")

    @pytest.mark.slow  # a compile and a recompile at a symbolic length
    def test_pad_to_longest_run_measures_every_length(self) -> None:
        pytest.importorskip("transformers")
        cfg = cv.TrainConfig(
            model="llama", layers=1, dim=32, heads=2, seq=32, batch=2, steps=6, eval_every=6, eval_batches=1, lengths="pad"
        )
        torch._dynamo.reset()
        (seed,) = cv.run_row(cfg, cv.Row.parse("compiled"), [0])["seeds"].values()
        self.assertEqual(sorted(seed["peaks_by_length"], key=int), ["20", "24", "28", "32"])
        self.assertTrue(all(p > 0 for p in seed["peaks_by_length"].values()))
        self.assertEqual(seed["peak_bytes"], max(seed["peaks_by_length"].values()))
        self.assertEqual(len(seed["train"]), 6)
        torch._dynamo.reset()

    def test_compiled_per_layer(self) -> None:
        # --compile-per layer compiles each decoder layer on its own (the budget's graphs of
        # several); the layers of both models are found.
        with self.assertRaises(ValueError):
            cv.TrainConfig(compile_per="block")
        pytest.importorskip("transformers")
        for model in ("llama", "gpt2"):
            cfg = cv.TrainConfig(model=model, layers=3, dim=32, heads=2, seq=16, compile_per="layer")
            layers = decoder_layers(cv.build(cfg).lm)
            self.assertEqual(len(layers), 3)
            self.assertTrue(all(type(layer).__name__.endswith(("DecoderLayer", "Block")) for layer in layers), layers)
        # One graph for every layer, more layers than Dynamo's recompile limit: with HF's KV
        # cache on, each layer recompiled (its guard reads whether its cache layer is filled)
        # and the layers past the limit ran eagerly.
        from torch._dynamo.testing import CompileCounter

        torch._dynamo.reset()
        cfg = cv.TrainConfig(model="llama", layers=torch._dynamo.config.recompile_limit + 1, dim=32, heads=2, seq=16)
        model, counter = cv.build(cfg), CompileCounter()
        for layer in decoder_layers(model.lm):
            layer.compile(backend=counter)
        model(torch.randint(0, cv.VOCAB, (2, 16))).backward()
        self.assertEqual(counter.frame_count, 1)
        torch._dynamo.reset()

    @pytest.mark.slow  # ten HF models and PEFT imported and built: the harness's, not the product's
    def test_families_and_a_lora_fine_tune(self) -> None:
        # Every HF family the loss-head and budget sweeps name builds at the bench's sizes
        # and trains (a loss, gradients on every parameter); --lora wraps the model in PEFT
        # adapters on every linear but the head, the base frozen.
        pytest.importorskip("transformers")
        with self.assertRaises(ValueError):
            cv.TrainConfig(lora=-1)
        torch.manual_seed(0)  # Mixtral's router: each expert gets tokens
        ids = torch.randint(0, cv.VOCAB, (2, 16))
        for model in cv.MODELS:
            with self.subTest(model=model):
                lm = cv.build(cv.TrainConfig(model=model, layers=1, dim=32, heads=2, seq=16))
                lm(ids).backward()
                self.assertEqual([n for n, p in lm.named_parameters() if p.grad is None], [])
        pytest.importorskip("peft")
        lm = cv.build(cv.TrainConfig(model="llama", layers=2, dim=32, heads=2, seq=16, lora=4))
        trained = {n for n, p in lm.named_parameters() if p.requires_grad}
        self.assertTrue(trained and all("lora_" in n for n in trained), trained)
        self.assertEqual(len(decoder_layers(lm.lm)), 2)
        self.assertFalse(any("lm_head" in n for n in trained))
        lm(ids).backward()
        self.assertTrue(all(p.grad is not None for n, p in lm.named_parameters() if n in trained))

    def test_summary_compares_each_seed_with_its_own_reference(self) -> None:
        def run(evals: dict[str, float], peak: int, ms: float) -> dict:
            return {s: {"train": [3.0, 2.0], "eval": [(0, 5.0), (2, e)], "peak_bytes": peak, "step_ms": ms} for s, e in evals.items()}

        results = [
            {"row": "compiled", "seeds": run({"0": 2.0, "1": 4.0}, 100, 10.0), "warnings": []},
            {"row": "fp8_rowwise", "seeds": run({"0": 2.2, "1": 4.0}, 60, 12.0), "warnings": ["w"]},
            {"row": "bf16", "error": "boom"},
        ]
        rows = report.summarize(results)
        self.assertEqual(rows[0]["change"], (0.0, 0.0, 0.0))
        mean, lo, hi = rows[1]["change"]
        self.assertAlmostEqual(mean, 0.05)
        self.assertAlmostEqual(hi, 0.1)
        self.assertEqual(lo, 0.0)
        self.assertAlmostEqual(rows[1]["peak_x"], 0.6)
        self.assertAlmostEqual(rows[1]["time_x"], 1.2)
        self.assertEqual(rows[2]["error"], "boom")
        table = report.format_table(cv.TrainConfig(), rows)
        self.assertIn("| fp8_rowwise | 2.000 | 3.100 | +5.00% [+0.0, +10.0] | 0.0 | 0.60 | 12 | 1.20 |", table)
        self.assertIn("warning, fp8_rowwise: w", table)
        # A seed whose training diverged (a non-finite loss stopped it, maybe before the step
        # whose peak is measured): an infinite change, no peak if no seed measured one.
        diverged = run({"0": 5.0, "1": 5.0}, None, 11.0)
        diverged["0"].update(train=[3.0, math.nan], eval=[(0, 5.0)], diverged_at=1)
        diverged["1"]["diverged_at"] = None
        row = report.summarize([results[0], {"row": "e5m2:all", "seeds": diverged, "warnings": []}])[1]
        self.assertEqual(row["change"][0], math.inf)
        self.assertEqual((row["diverged"], row["peak_bytes"]), (["0"], None))
        self.assertNotIn("peak_x", row)
        self.assertIn("(diverged: seed 0) | - |", report.format_table(cv.TrainConfig(), [row]))


class TestTrainBenchEndToEnd(unittest.TestCase):
    @pytest.mark.slow
    def test_command(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out, png = os.path.join(tmp, "train.json"), os.path.join(tmp, "train.png")
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.convergence",
                    "--models",
                    "llama,gpt2",
                    "--rows",
                    "fp8_rowwise,budget:0.5",
                    "--seeds",
                    "0",
                    "--steps",
                    "6",
                    "--layers",
                    "1",
                    "--dim",
                    "32",
                    "--seq",
                    "32",
                    "--batch",
                    "2",
                    "--eval-every",
                    "3",
                    "--eval-batches",
                    "2",
                    "--backend",
                    "aot_eager",
                    "--json",
                    out,
                    "--png",
                    png,
                ],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=ROOT,
            )
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(out) as f:
                data = json.load(f)
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                self.assertIn("no loss curves", proc.stdout)
            else:
                self.assertTrue(os.path.getsize(png) > 0)
        self.assertEqual([c["model"] for c in data["configs"]], ["llama", "gpt2"])
        for results in data["results"]:
            self.assertEqual([r["row"] for r in results], ["compiled", "fp8_rowwise", "budget:0.5"])
            for r in results:
                seed = r["seeds"]["0"]
                self.assertEqual(len(seed["train"]), 6)
                self.assertEqual([step for step, _ in seed["eval"]], [0, 3, 6])
                self.assertTrue(all(math.isfinite(v) for v in seed["train"]))
                self.assertGreater(seed["peak_bytes"], 0)
        self.assertIn("| fp8_rowwise |", proc.stdout)


#: The slow convergence test's run: small enough for CI, long enough for the log-sum-exp's
#: damage to show (benchmarks/README.md, "Convergence", has the full-size table).
CONVERGENCE = cv.TrainConfig(
    model="llama",
    layers=2,
    dim=128,
    heads=4,
    seq=256,
    batch=4,
    steps=200,
    backend="aot_eager",
    eval_every=200,
    eval_batches=8,
)
#: The bound on the mean eval-loss change against compiled without hooks.
GAP_BOUND = 0.01


class TestConvergence(TestCase):
    @pytest.mark.slow
    def test_fp8_gap_within_bound_and_the_bound_can_fail(self) -> None:
        # The recommended fp8 hook, and e5m2 (2 mantissa bits) with the allowlist, stay within
        # the bound; e5m2 on every saved tensor (RoPE angles, log-sum-exp, logits, the
        # attention's keys and values...) exceeds it: at these sizes it diverges, a non-finite
        # loss at the second step of both seeds (torch 2.13 CPU; +4.1% with HF's KV cache on,
        # before the bench's models turned it off).
        seeds = [0, 1]
        e5m2 = "fp8_rowwise(dtype=torch.float8_e5m2)"
        names = ("compiled", "fp8_rowwise", e5m2, f"{e5m2}:all")
        results = [cv.run_row(CONVERGENCE, cv.Row.parse(row), seeds) for row in names]
        rows = {r["row"]: r for r in report.summarize(results)}
        gaps = {name: rows[name]["change"][0] for name in rows}
        self.assertLessEqual(gaps["fp8_rowwise"], GAP_BOUND, gaps)
        self.assertLessEqual(gaps[e5m2], GAP_BOUND, gaps)
        self.assertGreater(gaps[f"{e5m2}:all"], GAP_BOUND, gaps)
        self.assertLess(rows["fp8_rowwise"]["peak_x"], 0.8, rows["fp8_rowwise"])


if __name__ == "__main__":
    unittest.main()
