"""Saved activation inputs handed to the backward that computes their gradients
(``torch_patches/_functorch/_aot_autograd/donated_inputs.py``).

The loss compiled apart from the model (torchtitan's call): the logits enter the loss's
graph as an input, the graph saves them, and its backward computes their gradient.  Under a
budget, where the caller dropped the logits, the gradient is written over them (one tokens x
vocabulary tensor held in the backward, not two); where the caller holds them or a view of
them, or autograd will run the backward again, over a copy: the caller's tensor is never
touched.  Gradients equal eager's in every case.
"""

from __future__ import annotations

import contextlib
import importlib.util
import unittest

import pytest
import torch
from torch._dynamo.test_case import run_tests

from torch_patches import config as tp_config
from torch_patches._functorch._aot_autograd.donated_inputs import owned_or_copy, save_apart
from torch_patches.hooks import budget
from torch_patches.testing import (
    CUDA_RATES,
    InductorAndRecordGraphs,
    TestCase,
    copy_engine_everywhere,
    instantiate_device_type_tests,
    peak_bytes,
    saved_tensor_records,
)
from torch_patches.testing.models import cross_entropy_loss  # torchtitan's loss

TOKENS, DIM, VOCAB = 2048, 32, 4096


def kept_budget() -> tuple:
    """``budget(0.1)`` without the offloads: the logits (read by ``exp``, off the numerics
    allowlist, so never stored lossy) are kept, the case a donation is for, on every device.
    Where a copy engine offers them (CUDA), offloading the logits meets the budget and the
    backward reads its own reloaded copy: nothing kept, nothing to donate."""
    return budget(0.1, options=("bf16", "int8", "fp8", "recompute"))


class TestDonatedInputs(TestCase):
    def setUp(self) -> None:
        super().setUp()
        torch.manual_seed(0)

    def inputs(self, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.randn(2, TOKENS // 2, DIM, device=device)
        w = torch.randn(DIM, VOCAB, device=device, requires_grad=True)
        y = torch.randint(0, VOCAB, (2, TOKENS // 2), device=device)
        y[0, :7] = -100
        return h, w, y

    def eager_grad(self, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(cross_entropy_loss(h @ w, y), [w])
        return g

    def test_gradient_written_over_the_dropped_logits(self, device: str) -> None:
        h, w, y = self.inputs(device)
        loss_fn = torch.compile(cross_entropy_loss, backend="inductor")
        seen: dict[str, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(*kept_budget()):
            for _ in range(2):
                logits = h @ w
                seen["logits"] = logits.untyped_storage().data_ptr()
                logits.register_hook(lambda g: seen.__setitem__("grad", g.untyped_storage().data_ptr()))
                loss = loss_fn(logits, y)
                del logits  # as torchtitan's loop drops them
                (g,) = torch.autograd.grad(loss, [w])
                self.assertEqual(seen["grad"], seen["logits"])
        torch.testing.assert_close(g, self.eager_grad(h, w, y))

    def test_held_logits_or_a_view_of_them_are_not_touched(self, device: str) -> None:
        h, w, y = self.inputs(device)
        loss_fn = torch.compile(cross_entropy_loss, backend="inductor")
        expected = self.eager_grad(h, w, y)
        with torch.autograd.graph.saved_tensors_hooks(*kept_budget()):
            logits = h @ w
            before = logits.detach().clone()
            (g,) = torch.autograd.grad(loss_fn(logits, y), [w])
            self.assertEqual(logits, before)
            torch.testing.assert_close(g, expected)
            logits = h @ w
            row = logits[1]
            loss = loss_fn(logits, y)
            del logits
            (g,) = torch.autograd.grad(loss, [w])
            self.assertEqual(row, before[1])
            torch.testing.assert_close(g, expected)

    def test_the_callers_in_place_change_is_still_caught(self, device: str) -> None:
        # As without the donation: the saved logits share the caller's version counter.
        h, w, y = self.inputs(device)
        with torch.autograd.graph.saved_tensors_hooks(*kept_budget()):
            logits = h @ w
            loss = torch.compile(cross_entropy_loss, backend="inductor")(logits, y)
        with torch.no_grad():
            logits.mul_(2)
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            loss.backward()

    def test_a_backward_run_again_reads_the_logits_intact(self, device: str) -> None:
        h, w, y = self.inputs(device)
        expected = self.eager_grad(h, w, y)
        # Stock refuses retain_graph where the graph donates its own saved intermediates;
        # without them the second backward must see the logits as the forward left them.
        with torch._functorch.config.patch(donated_buffer=False), torch.autograd.graph.saved_tensors_hooks(*kept_budget()):
            loss = torch.compile(cross_entropy_loss, backend="inductor")(h @ w, y)
            first = torch.autograd.grad(loss, [w], retain_graph=True)[0]
            second = torch.autograd.grad(loss, [w])[0]
        torch.testing.assert_close(first, expected)
        torch.testing.assert_close(second, expected)

    def ops_in_graphs(self, device: str, hooks: bool = True) -> tuple[list[str], list[str]]:
        h, w, y = self.inputs(device)
        backend = InductorAndRecordGraphs(kernels=False)  # the graphs are what it reads
        ctx = torch.autograd.graph.saved_tensors_hooks(*kept_budget()) if hooks else contextlib.nullcontext()
        with ctx:
            loss = torch.compile(cross_entropy_loss, backend=backend)(h @ w, y)
        loss.backward()
        ours = (save_apart, owned_or_copy)
        return tuple([str(n.target) for n in g.graph.nodes if n.target in ours] for g in (backend.fw_graphs[0], backend.bw_graphs[0]))

    def test_the_two_ops_and_when_they_are_left_out(self, device: str) -> None:
        self.assertEqual(
            self.ops_in_graphs(device), (["saved_tensors_hooks.save_apart.default"], ["saved_tensors_hooks.owned_or_copy.default"])
        )
        with tp_config.patch(donate_activation_inputs=False):
            self.assertEqual(self.ops_in_graphs(device), ([], []))
        torch._dynamo.reset()
        self.assertEqual(self.ops_in_graphs(device, hooks=False), ([], []))  # no budget

    def test_predicted_and_measured_peak(self, device: str) -> None:
        """The plan counts the logits' gradient written over them: its predicted peak within
        10% of a warm step's measured one, about one logits' bytes below the same step's
        without the donation."""
        h, w, y = self.inputs(device)
        logits_bytes = TOKENS * VOCAB * 4
        results = {}
        for donate in (True, False):
            torch._dynamo.reset()
            loss_fn = torch.compile(cross_entropy_loss, backend="inductor")

            def step() -> None:
                torch.autograd.grad(loss_fn(h @ w, y), [w])

            with tp_config.patch(donate_activation_inputs=donate), torch.autograd.graph.saved_tensors_hooks(*kept_budget()):
                with saved_tensor_records() as found:
                    step()
                step()
                (plan,) = [p for g in found for p in g.plans]
                results[donate] = (plan.predicted_peak_bytes, peak_bytes(step, device))
        (predicted, measured), (_, undonated) = results[True], results[False]
        self.assertLess(abs(predicted - measured), 0.1 * measured, f"predicted {predicted}, measured {measured}")
        self.assertGreater(undonated - measured, 0.9 * logits_bytes, f"{undonated} without, {measured} with")

    def test_predicted_peak_of_offloaded_logits(self, device: str) -> None:
        """Where a copy engine offers it (CUDA, faked here with CUDA's rates), plain
        ``budget(0.1)`` offloads the logits: the backward reads its own reloaded copy and
        Inductor writes the logits' gradient over it.  The predicted peak holds one logits'
        bytes besides the reloads it keeps room for ahead (``ahead_bytes``), not two (measured
        on an H200: 34079744 B)."""
        h, w, y = self.inputs(device)
        logits_bytes = TOKENS * VOCAB * 4
        loss_fn = torch.compile(cross_entropy_loss, backend="inductor")
        with (
            copy_engine_everywhere(),
            tp_config.patch(**CUDA_RATES),
            torch.autograd.graph.saved_tensors_hooks(*budget(0.1)),
            saved_tensor_records() as found,
        ):
            torch.autograd.grad(loss_fn(h @ w, y), [w])
        (plan,) = [p for g in found for p in g.plans]
        self.assertEqual({u.option for u in plan.units if u.device_bytes == 0 and u.copy_bytes == logits_bytes}, {"offload"})
        held = plan.predicted_peak_bytes - plan.ahead_bytes
        self.assertLess(
            abs(held - logits_bytes), 0.05 * logits_bytes, (plan.predicted_peak_bytes, plan.ahead_bytes, plan.predicted_peak_at)
        )


class TestTorchtitansCall(TestCase):
    @pytest.mark.slow
    @unittest.skipIf(importlib.util.find_spec("transformers") is None, "needs transformers")
    def test_hf_llama_loss_apart_equals_eager_and_the_loss_chunked_by_hand(self, device: str) -> None:
        """An HF Llama called as torchtitan calls it (the model compiled, the loss compiled
        apart) under a budget: the logits donated, loss and gradients equal the same step's
        without the donation (the plan's int8 storage elsewhere in the body is the same in
        both); and the loss written by hand in chunks (the benchmarks' reference row) is the
        eager model's loss."""
        from torch_patches.testing.models import causal_lm_loss, chunked_by_hand_loss, hf_llama

        torch.manual_seed(0)
        lm = hf_llama(vocab=4096, dim=64, layers=1, heads=2, seq=128).to(device)
        ids = torch.randint(0, 4096, (2, 128), device=device)
        model = causal_lm_loss(lm, "torchtitan")

        def loss_and_grads(fn) -> list[torch.Tensor]:
            loss = fn(ids)
            return [loss.detach(), *torch.autograd.grad(loss, list(lm.parameters()))]

        def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:  # within float32 reassociation
            for g, w in zip(got, want, strict=True):
                self.assertLess(((g - w).norm() / w.norm()).item(), 1e-4)

        expected = loss_and_grads(model)
        assert_close(loss_and_grads(chunked_by_hand_loss(lm)), expected)
        runs = {}
        for donate in (False, True):
            torch._dynamo.reset()
            model.lm = torch.compile(lm)
            model.loss_fn = torch.compile(cross_entropy_loss)
            with tp_config.patch(donate_activation_inputs=donate), torch.autograd.graph.saved_tensors_hooks(*kept_budget()):
                with saved_tensor_records() as found:
                    runs[donate] = loss_and_grads(model)
            self.assertEqual(any(p.donated_inputs for g in found for p in g.plans), donate)
        assert_close(runs[True], runs[False])


instantiate_device_type_tests(TestDonatedInputs, globals())
instantiate_device_type_tests(TestTorchtitansCall, globals())

if __name__ == "__main__":
    run_tests()
