"""The budget's promise, priced by Inductor's own accounting and held by the ceiling.

``activation_budget/inductor_accounting.py`` prices a partitioned graph pair by what
Inductor schedules; ``activation_budget/ceiling.py`` withdraws a plan whose graphs price above
the default partition without a budget or stock's knapsack at the same fraction.  The
generated steps (``torch_patches.testing.budget_steps``) test the promise on graphs nobody
tuned for: a few here in the fast tier, more in the slow tier, hundreds in the bench
(``python -m benchmarks.budget_promise``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests

import torch_patches
from benchmarks.budget_promise import summary
from torch_patches import config as tp_config
from torch_patches._functorch._aot_autograd.activation_budget import ceiling, inductor_accounting
from torch_patches._functorch._aot_autograd.activation_budget.inductor_accounting import Accounted
from torch_patches._functorch._aot_autograd.compile_facts import PartitionOffer
from torch_patches.testing import TestCase, budget_steps as steps
from torch_patches.testing._internal.common_saved_tensors_hooks import (
    InductorAndRecordGraphs,
    hook_nodes,
    instantiate_device_type_tests,
    peak_bytes,
    saved_tensor_records,
)


class _Thin(torch.nn.Module):
    """The issue's thin MLP at a smaller size: ``x + down(gelu(up(x)))`` then ``y *
    sigmoid(y)``, 8 blocks, wide -> thin -> wide."""

    def __init__(self, wide: int = 512, thin: int = 16) -> None:
        super().__init__()
        self.ups = torch.nn.ModuleList(torch.nn.Linear(wide, thin, bias=False) for _ in range(8))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(thin, wide, bias=False) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs):
            y = x + down(F.gelu(up(x)))
            x = y * torch.sigmoid(y)
        return x


def _plans(fn) -> list:
    with saved_tensor_records() as found:
        fn()
    return [p for g in found for p in g.plans]


class TestInductorAccounting(TestCase):
    @pytest.mark.slow  # two compiles; the fast tier keeps the cheaper checks of the same path
    def test_only_where_inductor_compiles(self, device: str) -> None:
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        for backend, priced in (("aot_eager", False), (InductorAndRecordGraphs(kernels=False), True)):
            torch._dynamo.reset()
            with tp_config.patch(activation_memory_budget=0.5):
                (plan,) = _plans(lambda: torch.compile(model, backend=backend)(x).sum().backward())
            self.assertEqual(plan.accounted_peak_bytes is not None, priced, plan.accounting)
            self.assertEqual("priced by Inductor's scheduler" in plan.accounting, priced, plan.accounting)

    def test_fx_turns_it_off_and_a_bad_value_names_the_knob(self, device: str) -> None:
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        with tp_config.patch(activation_memory_budget=0.5, activation_budget_accounting="fx"):
            (plan,) = _plans(lambda: torch.compile(model, backend=InductorAndRecordGraphs(kernels=False))(x).sum().backward())
        self.assertIsNone(plan.accounted_peak_bytes)
        torch._dynamo.reset()
        with tp_config.patch(activation_memory_budget=0.5, activation_budget_accounting="measured"):
            # Dynamo wraps it (BackendCompilerFailed); the knob and the value are named.
            with self.assertRaisesRegex(Exception, r"activation_budget_accounting must be 'auto' or 'fx', got 'measured'"):
                torch.compile(model, backend=InductorAndRecordGraphs(kernels=False))(x).sum().backward()

    def test_only_forwards_lowered_where_the_budget_bounds_the_forwards_end(self, device: str) -> None:
        """A graph that is one of several (compiled per layer) is compared by what its
        forward holds at its end: every partition is priced by its forward alone, and the
        plan's summary says where that forward peaks."""
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        real = inductor_accounting._live_bytes
        lowered: list[bool] = []

        def live_bytes(copy, is_backward):
            lowered.append(is_backward)
            return real(copy, is_backward)

        with (
            mock.patch.object(inductor_accounting, "_live_bytes", live_bytes),
            tp_config.patch(activation_memory_budget=0.3, activation_budget_bounds="forward_end"),
        ):
            (plan,) = _plans(lambda: torch.compile(model, backend=InductorAndRecordGraphs(kernels=False))(x).sum().backward())
        self.assertGreaterEqual(len(lowered), 2, plan.accounting)  # the default's forward and the plan's at least
        self.assertNotIn(True, lowered)
        self.assertTrue(plan.accounted_peak_at.startswith("forward "), plan.accounted_peak_at)
        self.assertIn("its forward's end", plan.accounting)

    def test_the_knapsack_that_peaks_above_no_budget_is_kept_out(self, device: str) -> None:
        """The issue's thin MLP: the partitioner's knapsack at 0.5 rebuilds every block's
        wide sum in its backward, beside what it still holds.  The fx model predicted it
        32% low and took it (1.42x of no budget measured); Inductor's accounting prices it
        above the default partition without a budget, and the plan over the default stands."""
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        with tp_config.patch(activation_memory_budget=0.5):
            (plan,) = _plans(lambda: torch.compile(model, backend=InductorAndRecordGraphs(kernels=False))(x).sum().backward())
        self.assertNotIn("recomputed by the partitioner", plan.preference)
        self.assertIn("at or below the default partition without a budget", plan.accounting)


def _plan_priced_above(above: bool = True):
    """The plan's graphs priced as if they peaked ten times higher (the ceiling must withdraw
    them); the other partitions as Inductor prices them."""
    return _priced_above(("plan",) if above else ())


@contextlib.contextmanager
def _priced_above(roles: tuple[str, ...]):
    """The partitions of ``roles`` (``plan``, ``default``, ``knapsack``, ``cheap``, ``knapsack
    0.5``) priced as if they peaked ten times higher; the others as Inductor prices them."""
    real = inductor_accounting.Pricing.of

    def of(pricing, role, *args, **kwargs):
        found = real(pricing, role, *args, **kwargs)
        return Accounted(10 * found.peak, 10 * found.forward_end, found.at) if role in roles and found else found

    with mock.patch.object(inductor_accounting.Pricing, "of", of):
        yield


class TestCeiling(TestCase):
    def compile_step(self, device: str, above: bool) -> tuple[list, InductorAndRecordGraphs]:
        """One compile of the thin MLP under ``budget(0.3)`` (:func:`_plan_priced_above`)."""
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        backend = InductorAndRecordGraphs(kernels=False)
        with _plan_priced_above(above), tp_config.patch(activation_memory_budget=0.3):
            plans = _plans(lambda: torch.compile(model, backend=backend)(x).sum().backward())
        return plans, backend

    @pytest.mark.slow  # two compiles; the fast tier keeps the cheaper checks of the same path
    def test_a_plan_priced_above_is_withdrawn(self, device: str) -> None:
        (plan,), backend = self.compile_step(device, above=True)
        self.assertIn("withdrawn: priced by Inductor's scheduler", plan.accounting)
        self.assertIn("runs instead", plan.preference)
        # The graphs compiled are a partition with no hook in them; the same compile with
        # the plan standing packs.
        self.assertEqual([hook_nodes(g) for g in backend.fw_graphs + backend.bw_graphs], [{}, {}])
        torch._dynamo.reset()
        _, standing = self.compile_step(device, above=False)
        self.assertTrue(any(hook_nodes(g) for g in standing.fw_graphs))

    def test_withdrawn_records_say_why(self, device: str) -> None:
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        with _plan_priced_above(), tp_config.patch(activation_memory_budget=0.3), saved_tensor_records() as found:
            torch.compile(model, backend=InductorAndRecordGraphs(kernels=False))(x).sum().backward()
        records = [r for g in found for r in g.records]
        self.assertTrue(records)
        self.assertFalse([r for r in records if r.decision == "hooked"])
        self.assertTrue(all("withdrawn" in r.reason for r in records if r.decided_by in ("budget", "partitioner")))

    @pytest.mark.slow
    def test_withdrawn_gradients_equal_no_budget(self, device: str) -> None:
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        model(x).sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with _plan_priced_above(), tp_config.patch(activation_memory_budget=0.3):
            torch.compile(model, backend="inductor")(x).sum().backward()
        for got, want in zip((p.grad for p in model.parameters()), expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class TestTheLadder(TestCase):
    """The partitions a budget's graphs are held against besides the default, in order."""

    def test_the_ladder(self) -> None:
        offer = PartitionOffer(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), 0.3, 1, 0.6, 0.99)
        roles = [role for role, _, _ in ceiling._ladder(offer)]
        self.assertEqual(
            roles, ["knapsack", "cheap", "knapsack 0.4", "knapsack 0.5", "knapsack 0.6", "knapsack 0.7", "knapsack 0.8", "knapsack 0.9"]
        )
        with tp_config.patch(activation_budget_ceiling_fractions=(0.5, 0.2, 1.0)):
            self.assertEqual([r for r, _, _ in ceiling._ladder(offer)], ["knapsack", "cheap", "knapsack 0.5"])
            never = dataclasses.replace(offer, cheap_ratio=1.0)  # the cheap recomputation not offered
            self.assertEqual([r for r, _, _ in ceiling._ladder(never)], ["knapsack", "knapsack 0.5"])
        self.assertEqual(ceiling._ladder(offer)[2][2], "stock's activation_memory_budget = 0.4 (looser than 0.3)")

    def test_words_with_and_without_a_partition_of_the_partitioner(self) -> None:
        # Only the default partition left (no fraction offered, or every rung ruled out,
        # already held against, or holding more than the plan's graphs): said alone.
        priced = Accounted(3 << 20, 1 << 20, "backward buf0")
        default = ceiling.Alternative("the default partition without a budget", priced, lambda fw, bw: None)
        self.assertEqual(ceiling._words([default], False, 0), "the default partition without a budget's 3145728 B (3.0 MiB)")
        rungs = [ceiling.Alternative(f"stock's {mib}", Accounted(mib << 20, 0, "x"), lambda fw, bw: None, True) for mib in (5, 2)]
        self.assertEqual(
            ceiling._words([default, *rungs], False, 0),
            "the default partition without a budget's 3145728 B (3.0 MiB) and stock's 2's 2097152 B (2.0 MiB)",
        )


class TestHeldToALooserKnob(TestCase):
    """Stock's knapsack is not monotone in the fraction: at a tighter one it can peak higher
    (it recomputes more, and its backward rebuilds more at once).  A budget is held to what
    stock's knob gives at every looser fraction of ``config.activation_budget_ceiling_fractions``
    too, so a tighter budget never takes the higher of the two."""

    def test_withdrawn_to_a_looser_knob(self, device: str) -> None:
        # The plan, the default partition, stock's knapsack at 0.3 and the cheap recomputation
        # priced ten times higher: the lowest left is stock's knapsack at a looser fraction,
        # and the graphs compiled are its own.
        x = torch.randn(128, 512, device=device, requires_grad=True)
        model = _Thin().to(device)
        backend = InductorAndRecordGraphs(kernels=False)
        with _priced_above(("plan", "default", "knapsack", "cheap")), tp_config.patch(activation_memory_budget=0.3):
            (plan,) = _plans(lambda: torch.compile(model, backend=backend)(x).sum().backward())
        self.assertRegex(plan.accounting, r"withdrawn: .* above stock's activation_memory_budget = 0\.\d \(looser than 0\.3\)'s")
        (fraction,) = {float(f) for f in re.findall(r"budget = (0\.\d) \(looser", plan.accounting)}
        self.assertEqual([hook_nodes(g) for g in backend.fw_graphs + backend.bw_graphs], [{}, {}])
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            torch_patches.unapply()
            try:
                torch._dynamo.reset()
                stock = InductorAndRecordGraphs(kernels=False)
                torch.compile(model, backend=stock)(x).sum().backward()
            finally:
                torch_patches.apply()
        saved = [ceiling._saves(g.graph, 1) for g in (backend.fw_graphs[0], stock.fw_graphs[0])]
        self.assertEqual(saved[0], saved[1])

    @pytest.mark.slow
    def test_the_generators_counterexample(self, device: str) -> None:
        """Seed 7 of the generator (7 blocks, width 1024, tokens in): stock's knapsack holds
        55.1 MiB at 0.5 and 61.0 MiB at 0.3; budget(0.3) took the one at 0.3 (it meets the
        fraction, within the prediction's margin of the plan's floor) and peaked 11% above
        budget(0.5)."""
        measured = steps.measure(steps.draw(7), (0.5, 0.3), device=device, kinds=("budget",))
        self.assertEqual(steps.violations(measured), [], measured.peaks)


class TestPromiseVerdicts(TestCase):
    def test_violations_and_the_bench_summary(self) -> None:
        step = steps.draw(0)
        mib = 2**20
        m = steps.Measured(
            step, {"none": 100 * mib, "stock 0.5": 90 * mib, "budget 0.5": 80 * mib, "stock 0.1": 60 * mib, "budget 0.1": 95 * mib}
        )
        found = steps.violations(m)
        self.assertEqual(
            found,
            [
                f"budget(0.1) peaks at {95 * mib} B, above stock's 0.1 ({60 * mib} B)",
                f"budget(0.1) peaks at {95 * mib} B, above budget(0.5)'s {80 * mib} B",
            ],
        )
        # Within 1% or 1 MiB, whichever is more: no breach.
        m.peaks["budget 0.1"] = 60 * mib + mib // 2
        m.peaks["budget 0.5"] = 60 * mib
        self.assertEqual(steps.violations(m), [])
        m.planned = {"budget 0.5": 61 * mib, "budget 0.1": 70 * mib}
        rows = [steps.as_json(m), {"seed": 1, "error": ["boom"]}]
        self.assertEqual(
            summary(rows),
            {
                "steps": 2,
                "failed": 1,
                "above_no_budget": 0,
                "above_stock": 0,
                "not_monotone": 0,
                "planned_within_10pct": "1 of 2",
                "withdrawn_rows": 0,
            },
        )

    def test_draw_is_a_function_of_the_seed(self) -> None:
        self.assertEqual(steps.draw(7), steps.draw(7))
        self.assertNotEqual(steps.draw(7), steps.draw(8))
        kinds = {k for seed in range(40) for k in steps.draw(seed).blocks}
        self.assertEqual(kinds, set(steps.BLOCKS))


class TestGeneratedSteps(TestCase):
    """Generated steps measured beside no budget and stock's knob (allocator events)."""

    def check(self, seed: int, fractions: tuple[float, ...], device: str) -> None:
        step = steps.draw(seed, small=True)
        measured = steps.measure(step, fractions, device=device)
        self.assertEqual(steps.violations(measured), [], f"{step.describe()}: {measured.peaks}")

    @pytest.mark.slow
    def test_generated_steps(self, device: str) -> None:
        for seed in range(4):
            with self.subTest(seed=seed):
                self.check(seed, (0.5, 0.1), device)


class TestTheIssuesThinMLP(TestCase):
    @pytest.mark.slow
    def test_at_or_below_no_budget_and_stock(self, device: str) -> None:
        """The issue's thin MLP as written (2048 x 8192, 8 blocks of 8192 -> 64 -> 8192): a
        warm step's peak under ``budget(0.5)`` and ``budget(0.3)`` at or below no budget's
        (1.42x before), and below stock's knob at the same fraction."""
        torch.manual_seed(0)
        model = _Thin(8192, 64).to(device)
        x = torch.randn(2048, 8192, device=device, requires_grad=True)

        def peak(knob) -> int:
            torch._dynamo.reset()
            compiled = torch.compile(model)

            def step() -> None:
                compiled(x).sum().backward()
                model.zero_grad(set_to_none=True)
                x.grad = None

            with knob:
                step()
                step()
                return peak_bytes(step, device)

        none = peak(contextlib.nullcontext())
        for fraction in (0.5, 0.3):
            with self.subTest(fraction=fraction):
                ours = peak(tp_config.patch(activation_memory_budget=fraction))
                torch_patches.unapply()
                try:
                    stock = peak(torch._functorch.config.patch(activation_memory_budget=fraction))
                finally:
                    torch_patches.apply()
                self.assertLessEqual(ours, 0.6 * none, (ours, none))
                self.assertLess(ours, stock)


instantiate_device_type_tests(TestInductorAccounting, globals())
instantiate_device_type_tests(TestCeiling, globals())
instantiate_device_type_tests(TestHeldToALooserKnob, globals())
instantiate_device_type_tests(TestGeneratedSteps, globals())
instantiate_device_type_tests(TestTheIssuesThinMLP, globals())


if __name__ == "__main__":
    run_tests()
