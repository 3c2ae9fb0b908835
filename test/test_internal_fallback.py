"""No internal error of ours reaches a user (issue 58).

Where the inliner, the budget planner, the graph rewrite or the partitioner patch's retry
fails on a graph with an error of its own, that compile falls back to what stock torch does
with the same hooks or budget (``_functorch/_aot_autograd/inline_fallback.py``):

* the graphs are the partition the inliner was handed, not a half-rewritten one (the failure
  is injected after part of the rewrite already happened; the graphs compiled equal those of
  the same step without hooks);
* the ambient hooks run as Python hooks (gradients as eager hooks give them); a budget
  pair's graph runs without them (gradients equal the step without hooks); hooks entered
  inside the region are not applied;
* one ``SavedTensorsHookWarning`` naming the hooks or the budget, the graph and the error;
  the records say ``fallback``; the compilation is marked not cacheable;
* a user's error still raises: a hook breaking its contract under
  ``untraceable_hook="error"``, a knob with a value it does not accept; and
  ``config.internal_error_fallback = False`` raises the internal error itself.

One test per phase: collect, plan, trace, rewrite (after the packs went in, and after the
saved values were rewired), the partitioner patch's retry (after the forward took the
knapsack's graph), and the partitioner patch itself.
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import torch
from torch._dynamo.test_case import run_tests

from torch_patches import config as tp_config
from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches._functorch import partitioners
from torch_patches._functorch._aot_autograd import (
    compile_facts,
    graph_surgery,
    hook_tracing,
    saved_tensor_collect,
)
from torch_patches._functorch._aot_autograd.activation_budget import partition_choice, planner
from torch_patches.hooks import bf16, budget, inlineable
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    SavedTensorsHookWarning,
    TestCase,
    instantiate_device_type_tests,
    normalize_graph,
    saved_tensor_records as recording,
)


class Injected(KeyError):
    """The internal error a test injects."""


def failing_after(original, calls: int = 1):
    """``original``, raising :class:`Injected` after its ``calls``-th call ran (so that what it
    changed stays changed)."""
    count = [0]

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        count[0] += 1
        if count[0] >= calls:
            raise Injected("injected")
        return out

    return wrapper


def failing(*args, **kwargs):
    raise Injected("injected")


class RecordingFacts(AotEagerAndRecordGraphs):
    """aot_eager recording the graphs and, per compilation, why it must not be cached."""

    def __init__(self):
        super().__init__()
        self.not_cacheable = []

    def __call__(self, gm, example_inputs):
        out = super().__call__(gm, example_inputs)
        self.not_cacheable.append(compile_facts.not_cacheable_reasons())
        return out


def f(x, w):
    h = (x @ w).tanh()
    return (h @ w.t()).sigmoid().pow(2).sum()


def g(x, w):
    # The product is saved for pow's backward, after tanh's output is freed: recomputing it
    # halves the saved bytes (test_budget's TestRecomputeInGraphs).
    return (x @ w).pow(2).tanh().sum()


#: fn -> its step's graphs (normalised) and gradients without hooks.
_PLAIN: dict = {}


class TestInternalFallback(TestCase):
    def setUp(self):
        super().setUp()
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 16, generator=gen, requires_grad=True)
        self.w = torch.randn(16, 16, generator=gen, requires_grad=True)
        # The plan over the default partition (its cheap recomputation would meet the budget
        # before any plan ran); the retry is the test's own.
        knob = tp_config.patch(activation_budget_partitioner_recompute=False)
        knob.__enter__()
        self.addCleanup(knob.__exit__, None, None, None)

    def step(self, pair, backend, fn=f):
        self.x.grad = self.w.grad = None
        with contextlib.ExitStack() as stack:
            if pair is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*pair))
            loss = fn(self.x, self.w) if backend is None else torch.compile(fn, backend=backend)(self.x, self.w)
        loss.backward()
        return [self.x.grad.clone(), self.w.grad.clone()]

    def fallback_step(self, pair, fn=f):
        """One compiled step under ``pair`` (a fresh Dynamo): its gradients, the recording
        backend, the records and our warnings."""
        torch._dynamo.reset()
        backend = RecordingFacts()
        with warnings.catch_warnings(record=True) as caught, recording() as compiled:
            warnings.simplefilter("always")
            grads = self.step(pair, backend, fn)
        ours = [str(w.message) for w in caught if issubclass(w.category, SavedTensorsHookWarning)]
        return grads, backend, compiled, ours

    def plain_graphs(self, fn=f):
        """The graphs of ``fn``'s step without hooks (the same inputs in every test: kept)."""
        if fn not in _PLAIN:
            torch._dynamo.reset()
            backend = AotEagerAndRecordGraphs()
            grads = self.step(None, backend, fn)
            _PLAIN[fn] = [normalize_graph(g) for g in backend.fw_graphs + backend.bw_graphs], grads
        return _PLAIN[fn][0]

    def plain_grads(self, fn=f):
        self.plain_graphs(fn)
        return _PLAIN[fn][1]

    def check(self, pair, what, fn=f):
        """The step fell back once: one warning naming ``what`` and the error; the graphs
        those of the step without hooks; the records and the facts say so; gradients as
        eager code with the same hooks gives them."""
        grads, backend, compiled, ours = self.fallback_step(pair, fn)
        internal = [m for m in ours if "internal error" in m]
        self.assertEqual(len(internal), 1, ours)
        self.assertIn(what, internal[0])
        self.assertIn("Injected: 'injected'", internal[0])
        self.assertRegex(internal[0], rf"into graph \d+/\d+ of {fn.__name__} ")
        self.assertEqual([c.fallback.startswith("internal error, ") for c in compiled if c.fallback], [True])
        self.assertTrue(any("fell back from an internal error" in r for r in backend.not_cacheable[0]), backend.not_cacheable)
        self.assertEqual([normalize_graph(g) for g in backend.fw_graphs + backend.bw_graphs], self.plain_graphs(fn))
        torch._dynamo.reset()
        return grads

    def check_budget(self, *patches, options=None, fn=f):
        fraction = 0.3 if options is None else 0.5
        with contextlib.ExitStack() as stack:
            for target, name, replacement in patches:
                stack.enter_context(mock.patch.object(target, name, replacement))
            grads = self.check(budget(fraction, options=options), f"budget({fraction} of the saved bytes", fn)
        # A budget's eager hooks keep every tensor: the step without hooks.
        self.assertGradsEqual(grads, self.plain_grads(fn))

    def check_pair(self, *patches):
        pair = bf16(where=None)
        with contextlib.ExitStack() as stack:
            for target, name, replacement in patches:
                stack.enter_context(mock.patch.object(target, name, replacement))
            grads = self.check(pair, "bf16_pack")
        # The pair ran as Python hooks: what eager code with them gives, within bf16's
        # rounding of the tensors each saves (they save different ones).
        want = self.step(pair, None)
        self.assertGradsEqual(grads, want, atol=1e-2, rtol=1e-2)
        self.assertFalse(all(torch.equal(g, p) for g, p in zip(grads, self.plain_grads())))

    # ------------------------------------------------------------- one per phase

    def test_collect(self, device):
        self.check_budget((saved_tensor_collect, "collect", failing))

    def test_plan(self, device):
        self.check_budget((planner, "plan", failing))

    def test_trace(self, device):
        self.check_pair((hook_tracing, "trace_pair", failing))

    def test_rewrite_after_the_packs(self, device):
        # Packs inserted into the forward, then the first unpack fails: both graphs go back.
        self.check_pair((graph_surgery, "insert_unpack", failing))
        self.check_budget((graph_surgery, "insert_recompute", failing), options=("recompute",), fn=g)

    def test_rewrite_after_rewiring(self, device):
        original = graph_surgery.rewire_saved
        self.check_pair((graph_surgery, "rewire_saved", failing_after(original)))
        self.check_budget((graph_surgery, "rewire_saved", failing_after(original)))

    def test_constants_go_with_the_rewrite(self, device):
        # A hook computing with a constant tensor: the rewrite sets it on the modules; put
        # back, they hold no such attribute.
        pair = inlineable(lambda t: t * torch.tensor(2.0), lambda p: p / torch.tensor(2.0))
        with mock.patch.object(graph_surgery, "rewire_saved", failing_after(graph_surgery.rewire_saved)):
            grads, backend, compiled, ours = self.fallback_step(pair)
        self.assertEqual(len([m for m in ours if "internal error" in m]), 1, ours)
        for gm in backend.fw_graphs + backend.bw_graphs:
            self.assertEqual([k for k in vars(gm) if k.startswith("_saved_tensors_hook_constant")], [])
        self.assertGradsEqual(grads, self.plain_grads())

    def test_partition_choice_after_adopting(self, device):
        # The partition choice moved the knapsack's forward into the caller's module, then failed: the
        # default partition comes back.
        with tp_config.patch(activation_budget_partitioner_recompute=True):
            self.check_budget(
                (partition_choice, "_better", lambda *a, **k: (True, "taken (test)")),
                (partition_choice, "adopt", failing_after(partition_choice.adopt, calls=1)),
            )

    def test_partitioner_patch(self, device):
        # The partitioner patch itself fails: upstream's own partition, which the budget
        # then plans as usual.
        with tp_config.patch(activation_budget_partitioner_recompute=True):
            with mock.patch.object(partitioners, "_recomputes_unsafely", failing):
                grads, backend, compiled, ours = self.fallback_step(budget(0.3))
        internal = [m for m in ours if "internal error" in m]
        self.assertEqual(len(internal), 1, ours)
        self.assertRegex(internal[0], r"the budget's partition failed on graph \d+/\d+ of f .*Injected: 'injected'")
        self.assertTrue(any("fell back from an internal error" in r for r in backend.not_cacheable[0]), backend.not_cacheable)
        self.assertEqual([c.fallback for c in compiled], [None])
        self.assertEqual(len(compiled[0].plans), 1)
        plain = self.plain_grads()
        for got, want in zip(grads, plain):  # within the plan's lossy storage
            self.assertLess(((got - want).norm() / want.norm()).item(), 0.05)

    def test_in_region_scope(self, device):
        # Hooks entered inside the region have no eager form once Dynamo traced them: their
        # tensors are kept as they are (the step without hooks).
        pair = bf16(where=None)

        def scoped(x, w):
            with torch.autograd.graph.saved_tensors_hooks(*pair):
                h = (x @ w).tanh()
            return (h @ w.t()).sigmoid().pow(2).sum()

        with mock.patch.object(graph_surgery, "rewire_saved", failing):
            grads = self.check(None, "entered in the region", fn=scoped)
        self.assertGradsEqual(grads, self.plain_grads())  # f: the same step, no scope

    # ------------------------------------------------------------- what still raises

    def test_fallback_off_raises_the_error(self, device):
        with tp_config.patch(internal_error_fallback=False), mock.patch.object(graph_surgery, "rewire_saved", failing):
            with self.assertRaisesRegex(Exception, "injected") as caught:
                self.fallback_step(bf16(where=None))
        self.assertIsInstance(getattr(caught.exception, "inner_exception", caught.exception), Injected)

    def test_user_errors_still_raise(self, device):
        # A hook whose unpack returns another dtype, under untraceable_hook="error".
        bad = inlineable(lambda t: t.to(torch.bfloat16), lambda p: p)
        with tp_config.patch(untraceable_hook="error"), self.assertRaisesHookError("dtype mismatch"):
            self.fallback_step(bad)
        # A knob with a value it does not accept.
        with tp_config.patch(hook_placement="nowhere"):
            with self.assertRaisesRegex(Exception, "hook_placement must be") as caught:
                self.fallback_step(bf16(where=None))
        self.assertIsInstance(getattr(caught.exception, "inner_exception", None), SavedTensorsHookConfigError)
        with tp_config.patch(numerics_allowlist={"aten::mm": {"self": "fp4"}}):
            with self.assertRaisesRegex(Exception, "a storage level is one of") as caught:
                self.fallback_step(bf16())
        self.assertIsInstance(getattr(caught.exception, "inner_exception", None), SavedTensorsHookConfigError)

    def test_one_warning_per_hooks_and_site(self, device):
        # Every recompile of the same failure warns once.
        with mock.patch.object(graph_surgery, "rewire_saved", failing):
            first = self.fallback_step(budget(0.3))[3]
            again = self.fallback_step(budget(0.3))[3]
        self.assertEqual(len([m for m in first if "internal error" in m]), 1)
        self.assertEqual([m for m in again if "internal error" in m], [])


instantiate_device_type_tests(TestInternalFallback, globals())


if __name__ == "__main__":
    run_tests()
