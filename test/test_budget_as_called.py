"""The activation memory budget as users call models (issue 51).

* What a graph holds besides its saved tensors (``activation_budget/working_set.py``): the
  bytes alive per node, a fused pointwise chain counted as nothing, the graph's outputs to
  its end, the saved tensors left to the plan.
* HF's default call (``labels=``, the KV cache on, the HF model itself compiled): the logits
  and the cache's keys and values are outputs of the graph sharing storage with saved
  tensors; upstream's ``donated`` filter leaves them alone, the budget's plan stores them
  otherwise (a training step drops them after the forward); a plain hook pair still leaves
  them alone.
* The plan's predicted step peak (its saved tensors with the graphs' own tensors) against
  the allocator's measured peak of the same step: within 10% on an HF Llama compiled whole
  with Inductor, at HF's default call and with the cache off, and on a loss compiled apart
  (slow tier).
"""

from __future__ import annotations

import contextlib
import unittest

import pytest
import torch
from torch._dynamo.test_case import run_tests
from torch.fx.experimental.proxy_tensor import make_fx

import torch_patches
from torch_patches._functorch._aot_autograd.activation_budget import inductor_order, working_set
from torch_patches.hooks import bf16, budget
from torch_patches.testing import (
    CUDA_RATES,
    TestCase,
    copy_engine_everywhere,
    graph_caches_off,
    instantiate_device_type_tests,
    peak_bytes,
    saved_tensor_records,
)


def _llama(device: str, vocab: int = 1024) -> tuple[object, torch.Tensor]:
    try:
        from torch_patches.testing.models import hf_llama

        lm = hf_llama(vocab=vocab, dim=64, layers=2, heads=2, seq=64).to(device)
    except ImportError:
        raise unittest.SkipTest("needs transformers") from None
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    return lm, ids


class TestHeldBytes(TestCase):
    def test_alive_per_node(self, device: str) -> None:
        def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = x @ w  # 16 x 32 floats: 2048 B, read by the pointwise chain and the output
            g = torch.sigmoid(h) * 2  # fused into the sum: never materialised
            return g.sum(0), h.t()  # the sum (128 B) and a view of h, both outputs

        gm = make_fx(f)(torch.randn(16, 8, device=device), torch.randn(8, 32, device=device))
        names = [n.name for n in gm.graph.nodes]
        held = dict(zip(names, working_set.held_bytes(gm.graph)))
        x, w, mm = 16 * 8 * 4, 8 * 32 * 4, 16 * 32 * 4
        # The inputs to the end (a backward's incoming gradients: autograd holds them in the
        # call's arguments until it returns).
        self.assertEqual(held["mm"], x + w + mm)
        self.assertEqual(held["sigmoid"], x + w + mm)  # fused: nothing of its own
        self.assertEqual(held["sum_1"], x + w + mm + 32 * 4)
        self.assertEqual(held["output"], x + w + mm + 32 * 4)  # outputs (h through its view) live to the end
        without_inputs = dict(zip(names, working_set.held_bytes(gm.graph, inputs=False)))
        self.assertEqual((without_inputs["mm"], without_inputs["sigmoid"]), (mm, mm))
        mm_node = next(n for n in gm.graph.nodes if n.name == "mm")
        without = dict(zip(names, working_set.held_bytes(gm.graph, [mm_node], inputs=False)))
        self.assertEqual(without["output"], 32 * 4)  # the plan's own storage left out
        self.assertFalse(working_set.materialized(next(n for n in gm.graph.nodes if n.name == "sigmoid")))

    def test_zeros_for_dropped_outputs_die_at_their_last_use(self, device: str) -> None:
        # A backward whose forward returned a scalar loss beside an output the caller drops
        # (HF's logits): where autograd hands a compiled backward its gradients in a list
        # the backward empties (torch 2.13 on), the zeros it makes for the dropped output die
        # at their last use; before, and for the loss's real gradient, at the graph's end.
        def bw(tangents_1: torch.Tensor, tangents_2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h = tangents_2 @ w  # the dropped output's gradient, last read here
            return (h * 2).sum(0) * tangents_1

        gm = make_fx(bw)(torch.ones((), device=device), torch.zeros(16, 8, device=device), torch.randn(8, 32, device=device))
        dropped = working_set.dropped_tangents(gm.graph)
        boxed = hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed")
        self.assertEqual(sorted(n.name for n in dropped), ["tangents_2_1"] if boxed else [])
        names = [n.name for n in gm.graph.nodes]
        held = dict(zip(names, working_set.held_bytes(gm.graph, dropped=dropped)))
        scalar, big, w, mm = 4, 16 * 8 * 4, 8 * 32 * 4, 16 * 32 * 4
        self.assertEqual(held["mm"], scalar + big + w + mm)
        self.assertEqual(held["sum_1"], scalar + w + mm + 32 * 4 + (0 if boxed else big))

    def test_inductors_rewrites_addmm_and_buffers_written_in_place(self, device: str) -> None:
        # An add of a matmul read by nothing else is one addmm (the matmul's own output never
        # made); a pointwise kernel writes its output over an input of its bytes that dies in it.
        def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            acc = a @ b + c  # addmm: 16 x 32
            d = torch.relu(acc @ b.t())  # mm (16 x 8), relu writes over it
            return d * 3

        gm = make_fx(f)(torch.randn(16, 8, device=device), torch.randn(8, 32, device=device), torch.randn(16, 32, device=device))
        nodes = {n.name: n for n in gm.graph.nodes}
        self.assertFalse(working_set.materialized(nodes["mm"]))
        self.assertTrue(working_set.materialized(nodes["add"]))
        held = dict(zip(nodes, working_set.held_bytes(gm.graph, inputs=False)))
        self.assertEqual(held["add"], 16 * 32 * 4)  # the addmm's output alone
        self.assertEqual(held["mm_1"], 16 * 32 * 4 + 16 * 8 * 4)  # the addmm's output, read here
        self.assertEqual(held["mul"], 16 * 8 * 4)  # relu fused into mul, written over mm_1

    def test_a_saved_tensor_written_over_an_input_only_its_kernel_reads(self, device: str) -> None:
        # A saved tensor is left out (the plan counts it), but a pointwise kernel making it
        # over an input that dies there takes that input's bytes; not where another node of
        # the fused kernel reads the input too (a reduction beside it): Inductor writes
        # neither over it.
        def alone(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = x @ w  # 16 x 32 floats, read by the add alone
            s = h + 1  # saved
            return s.sum(0), s

        def beside_a_reduction(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = x @ w
            m = (h * 2).mean()
            s = h + 1  # saved
            return m, s

        h = 16 * 32 * 4
        for f, at_add in ((alone, 0), (beside_a_reduction, h + 4)):
            with self.subTest(f.__name__):
                gm = make_fx(f)(torch.randn(16, 8, device=device), torch.randn(8, 32, device=device))
                nodes = {n.name: n for n in gm.graph.nodes}
                held = dict(zip(nodes, working_set.held_bytes(gm.graph, [nodes["add"]], inputs=False)))
                self.assertEqual(held["mm"], h)
                self.assertEqual(held["add"], at_add)

    def test_memory_order_frees_before_it_allocates(self, device: str) -> None:
        # Graph order makes the big product before the sum that frees x; the least peak
        # memory first order runs the sum first, as Inductor's reorder would.
        def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x.exp() * 2
            big = w @ w.t()
            return y.sum(0), big

        gm = make_fx(f)(torch.randn(64, 64, device=device), torch.randn(64, 8, device=device))
        x, w = list(gm.graph.nodes)[:2]
        order = inductor_order.memory_order(gm.graph)
        at = {n.name: i for i, n in enumerate(order)}
        self.assertLess(at["sum_1"], at["mm"])
        fx_peak = max(working_set.held_bytes(gm.graph, dropped=[x]))
        self.assertLess(max(working_set.held_bytes(gm.graph, dropped=[x], order=order)), fx_peak)

    def test_a_fused_kernel_runs_once_all_its_inputs_are_made(self, device: str) -> None:
        # The residual stream a recomputing partition rebuilds in the backward: each block's
        # sum is read by a matmul (so it is made), and Inductor fuses the chain of sums into one
        # kernel writing all of them: it runs after every block's projection, so no order
        # runs the first sum (and frees its projection) before the last projection is made.
        def f(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h1 = x + torch.relu(a @ w)
            h2 = h1 + torch.relu(b @ w)
            h3 = h2 + torch.relu(c @ w)
            return h1 @ w.t(), h2 @ w.t(), h3 @ w.t()

        args = [torch.randn(16, 32, device=device)] + [torch.randn(16, 8, device=device) for _ in range(3)]
        gm = make_fx(f)(*args, torch.randn(8, 32, device=device))
        nodes = {n.name: n for n in gm.graph.nodes}
        fused = inductor_order.fused_kernels(gm.graph)
        self.assertEqual([n.name for n in fused[nodes["add"]]], ["add", "add_1", "add_2"])
        order = [n.name for n in inductor_order.memory_order(gm.graph)]
        self.assertLess(max(order.index(m) for m in ("mm", "mm_1", "mm_2")), min(order.index(a) for a in ("add", "add_1", "add_2")))

    def test_no_fused_kernel_across_a_matmul(self, device: str) -> None:
        # The second sum reads a matmul of the first: one kernel cannot hold both.
        def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h1 = x + 1
            h2 = h1 + h1 @ w
            return h2 @ w

        gm = make_fx(f)(torch.randn(16, 32, device=device), torch.randn(32, 32, device=device))
        self.assertEqual(inductor_order.fused_kernels(gm.graph), {})

    def test_inductor_keeps_the_graph_order_unless_the_reorder_holds_less(self, device: str) -> None:
        # Inductor's reorder takes its least peak memory first order only where its own
        # estimate of that order's peak is lower than the graph's; else the graph's runs.
        def sum_first(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x.exp() * 2
            big = w @ w.t()  # made before the sum that frees x, in the graph's order
            return y.sum(0), big

        def chain(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h1 = x + torch.relu(a @ w)  # the two sums one kernel: nothing to gain
            h2 = h1 + torch.relu(b @ w)
            return h1 @ w.t(), h2 @ w.t()

        small = [torch.randn(16, 8, device=device) for _ in range(2)]
        for f, args, reordered in (
            (sum_first, [torch.randn(64, 64, device=device), torch.randn(64, 8, device=device)], True),
            (chain, [torch.randn(16, 32, device=device), *small, torch.randn(8, 32, device=device)], False),
        ):
            with self.subTest(f.__name__):
                graph = make_fx(f)(*args).graph
                lpmf = inductor_order.memory_order(graph)
                self.assertEqual(inductor_order.inductor_estimate(graph, lpmf) < inductor_order.inductor_estimate(graph), reordered)
                self.assertEqual(inductor_order.inductor_order(graph), lpmf if reordered else list(graph.nodes))


class TestOutputAliases(TestCase):
    def records(self, device: str, hooks: tuple) -> list:
        lm, ids = _llama(device)
        compiled = torch.compile(lm, backend="aot_eager")  # HF's model itself: its outputs are the graph's
        with saved_tensor_records() as found:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                loss = compiled(input_ids=ids, labels=ids).loss  # HF's default call: the cache on
            loss.backward()
        (graph,) = found
        return graph.records

    def test_budget_plans_what_an_output_shares(self, device: str) -> None:
        shared = [r for r in self.records(device, budget(0.5)) if r.aliases_output]
        planned = {r.name for r in shared}
        self.assertTrue(planned)
        # The cache's keys and values (2 layers: 4 tensors of 2 x 2 x 64 x 32) and the logits.
        self.assertGreaterEqual(len(planned), 4)
        for r in shared:  # the plan decided it, or the partitioner's knapsack recomputes it
            self.assertTrue(r.option is not None or r.decided_by == "partitioner", (r.name, r.decided_by, r.reason))

    def test_plain_hooks_leave_them_to_upstreams_rule(self, device: str) -> None:
        filtered = [r for r in self.records(device, bf16()) if r.reason and "donated" in r.reason]
        self.assertGreaterEqual(len(filtered), 4)


class TestPredictedPeak(TestCase):
    def assert_predicted_within_a_tenth(self, step, device: str) -> None:
        """``step`` compiles one graph under a budget: the step's peak its plan predicts
        is within 10% of a warm step's measured peak."""
        with saved_tensor_records() as found:
            step()
        step()
        measured = peak_bytes(step, device)
        (plan,) = [p for g in found for p in g.plans]
        self.assertLess(
            abs(plan.predicted_peak_bytes - measured),
            0.1 * measured,
            f"predicted {plan.predicted_peak_bytes} at {plan.predicted_peak_at}, measured {measured}",
        )

    @pytest.mark.slow
    def test_predicted_within_a_tenth_of_measured(self, device: str) -> None:
        lm, ids = _llama(device, vocab=4096)
        for call in ("hf_default", "bench"):
            for fraction in (0.3, 0.9):
                with self.subTest(call=call, fraction=fraction):
                    torch._dynamo.reset()
                    compiled = torch.compile(lm)
                    extra = {} if call == "hf_default" else {"use_cache": False}

                    def step() -> None:
                        with torch.autograd.graph.saved_tensors_hooks(*budget(fraction)):
                            loss = compiled(input_ids=ids, labels=ids, **extra).loss
                        loss.backward()
                        lm.zero_grad(set_to_none=True)

                    self.assert_predicted_within_a_tenth(step, device)

    @pytest.mark.slow
    def test_loss_in_the_graph_predicted_within_a_tenth(self, device: str) -> None:
        # The loss compiled with the model (the bench's call), the logits most of what the
        # step holds: Inductor writes the logits' gradient in place of the saved logits,
        # which die in that kernel (the backward gets them donated); counting both
        # predicted 0.98x of no hooks where the step peaked at 0.67x.
        from torch_patches.testing.models import causal_lm_loss

        lm, ids = _llama(device, vocab=4096)
        model = causal_lm_loss(lm)
        compiled = torch.compile(model)

        def step() -> None:
            with torch.autograd.graph.saved_tensors_hooks(*budget(0.9)):
                loss = compiled(ids)
            loss.backward()
            model.zero_grad(set_to_none=True)

        self.assert_predicted_within_a_tenth(step, device)

    @pytest.mark.slow
    def test_loss_apart_predicted_within_a_tenth(self, device: str) -> None:
        # The loss compiled on its own (after a graph break, or as torchtitan compiles it):
        # it saves its input, the logits another op made, and its backward writes their
        # gradient over them where the caller dropped them (donated_inputs): one logits'
        # bytes at the peak, not two.
        generator = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 4096, (1024,), generator=generator).to(device)
        h = torch.randn(1024, 64, generator=generator).to(device)
        w = torch.randn(64, 4096, generator=generator).to(device).requires_grad_()
        compiled = torch.compile(lambda logits: torch.nn.functional.cross_entropy(logits, labels))

        def step() -> None:
            with torch.autograd.graph.saved_tensors_hooks(*budget(0.9)):
                loss = compiled(h @ w)  # made by autograd before the graph
            loss.backward()
            w.grad = None

        self.assert_predicted_within_a_tenth(step, device)


class TestAtOrBelowStock(TestCase):
    @pytest.mark.slow
    def test_hf_default_call_at_or_below_stock(self, device: str) -> None:
        # HF GPT-2 at HF's default call, compiled whole (the loss after a graph break) at
        # 0.3: the model's graph met the budget with int8 while stock's knapsack, exact but
        # estimated slower than the margin allows, held less at its forward's end beside
        # the logits the loss reads (0.74x of no hooks against stock's 0.72x, as predicted by
        # the fx model). Priced by Inductor's accounting, the plan's graphs are held at or
        # below the knapsack's (the ceiling, within its rounding): the step at or below
        # stock's peak (within the allocator's rounding, 1%).
        try:
            from torch_patches.testing.models import hf_gpt2

            lm = hf_gpt2(vocab=8192, dim=256, layers=2, heads=4, seq=256).to(device)
        except ImportError:
            raise unittest.SkipTest("needs transformers") from None
        ids = torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(0)).to(device)
        peaks = {}
        for row in ("budget", "stock"):
            torch._dynamo.reset()
            compiled = torch.compile(lm)
            hooks = budget(0.3) if row == "budget" else None

            def step() -> None:
                with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
                    loss = compiled(input_ids=ids, labels=ids).loss
                loss.backward()
                lm.zero_grad(set_to_none=True)

            with (
                torch._functorch.config.patch(activation_memory_budget=1.0 if hooks else 0.3),
                graph_caches_off(),
                saved_tensor_records() as found,
            ):
                step()
                peaks[row] = peak_bytes(step, device)
            if hooks:
                plans = [p for g in found for p in g.plans]
        self.assertLessEqual(peaks["budget"], 1.01 * peaks["stock"], peaks)
        # The model's graph, priced by Inductor's accounting, held at or below stock's
        # knapsack at the fraction (the ceiling): the plan stands only there.
        self.assertTrue(any("at or below" in p.accounting and "activation_memory_budget = 0.3" in p.accounting for p in plans), plans)


class _ThinMLP(torch.nn.Module):
    """8 residual blocks of ``wide -> thin -> wide`` with SiLU gating: the partitioner's
    knapsack at 0.5 recomputes the blocks' wide outputs in the backward beside what it still
    holds, and peaks above the step without a budget (stock's non-monotonic case)."""

    def __init__(self, wide: int = 2048, thin: int = 32) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {"down": torch.nn.Linear(wide, thin), "gate": torch.nn.Linear(wide, thin), "up": torch.nn.Linear(thin, wide)}
            )
            for _ in range(8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["up"](torch.nn.functional.silu(b["gate"](x)) * b["down"](x))
        return x.square().mean()


class TestNeverAboveNoBudget(TestCase):
    def peak(self, device: str, fraction: float | None, stock: bool = False) -> int:
        """A warm step's measured peak; the plans it compiled are left in ``self.plans``."""
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _ThinMLP().to(device)
        x = torch.randn(512, 2048, device=device)
        compiled = torch.compile(model)
        if fraction is None:
            knobs = contextlib.nullcontext()
        elif stock:
            knobs = torch._functorch.config.patch(activation_memory_budget=fraction)
        else:
            knobs = torch_patches.config.patch(activation_memory_budget=fraction)

        def step() -> None:
            compiled(x).backward()
            model.zero_grad(set_to_none=True)

        with knobs:
            with saved_tensor_records() as found:
                step()
            step()
            measured = peak_bytes(step, device)
        self.plans = [p for g in found for p in g.plans]
        return measured

    @pytest.mark.slow
    def test_a_budget_never_raises_the_peak(self, device: str) -> None:
        none = self.peak(device, None)
        with torch_patches.config.patch(activation_budget_partitioner_recompute=True):
            # The case is the one that fails: stock's own knapsack at 0.5 peaks above no budget.
            torch_patches.unapply()
            try:
                self.assertGreater(self.peak(device, 0.5, stock=True), none)
            finally:
                torch_patches.apply()
            for fraction in (0.5, 0.3):
                with self.subTest(fraction=fraction):
                    measured = self.peak(device, fraction)
                    self.assertLessEqual(measured, none)
                    # Predicted within a tenth: at 0.5 the step peaks at the forward's end, in
                    # one fused kernel reading the last block's input and the up projection's
                    # output and writing the input's stored form and the loss's kept tensor
                    # beside them (13% under where a stored form only appeared once its full
                    # tensor was freed).
                    (plan,) = self.plans
                    self.assertLess(abs(plan.predicted_peak_bytes - measured), 0.1 * measured, (plan.predicted_peak_at, measured))

    @pytest.mark.slow
    def test_priced_as_cuda_the_knapsack_that_rebuilds_the_stream_stays_out(self, device: str) -> None:
        """At CUDA's rates (on any device) the partitioner's knapsack at 0.5 is exact and
        recomputes quickly enough to be taken over the plan's int8 storage, unless it peaks
        above the step without a budget.  It does: its backward rebuilds every block's sum in
        one fused kernel after every block's up projection, and Inductor, finding no order
        that holds less, runs the graph's order (1.09x of no budget, measured on the CPU).
        Predicted in a least-peak-memory-first order that runs each sum right after its own
        projection, it looked no higher than no budget and was taken."""
        none = self.peak(device, None)
        with (
            copy_engine_everywhere(),
            torch_patches.config.patch(**CUDA_RATES),
            torch_patches.config.patch(activation_budget_partitioner_recompute=True),
        ):
            measured = self.peak(device, 0.5)
        self.assertLessEqual(measured, none)
        (plan,) = self.plans
        self.assertIn("int8", {u.option for u in plan.units})


instantiate_device_type_tests(TestHeldBytes, globals())
instantiate_device_type_tests(TestOutputAliases, globals())
instantiate_device_type_tests(TestPredictedPeak, globals())
instantiate_device_type_tests(TestAtOrBelowStock, globals())
instantiate_device_type_tests(TestNeverAboveNoBudget, globals())


if __name__ == "__main__":
    run_tests()
