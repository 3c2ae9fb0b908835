"""Generated training steps under every hook and budget (issue 58): the next graph our
compiler code cannot handle, looked for.

Each example is a random program (``generated_steps.py``: views, in-place ops, several
outputs with some dropped, ``no_grad`` islands, integer and bool tensors, outputs aliasing
saved tensors, checkpointed regions of every kind, graph breaks, dropout) compiled under one
of: ``budget(F)`` at several fractions (and ``config.activation_memory_budget``), the
ready-made hooks (``bf16``, ``int8_rowwise``, ``fp8_rowwise``, ``cpu_offload``) and ``chain``.
With ``config.internal_error_fallback = False`` (an internal error raises, so none hides in a
fallback) it checks:

* it compiles and runs wherever the same program compiles without hooks (a program stock
  torch itself cannot compile is not ours, and is skipped);
* the gradients equal those of the same program compiled without hooks: exactly where every
  storage option taken is exact (keep, recompute, offload), else within the lossiest option's
  bound: at most twice the error of eager code storing every saved tensor that way.

A handful of examples run in the fast tier (aot_eager); the slow tier runs
``GENERATED_STEPS_EXAMPLES`` (default 80, about two minutes on CI's two cores, within the
whole suite's time) and a few with Inductor.  Thousands, before changing the compiler code
(CONTRIBUTING.md):
``GENERATED_STEPS_EXAMPLES=2000 python -m pytest test/test_generated_steps.py -m slow -k many``
(the last: 2,000 passing, 0 failing, 163 rejected: programs stock torch cannot compile, or
non-finite; 104 minutes on two shared cores, torch 2.13).
Every failure a run found is a test below (``TestFound``), with the program that found it.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from generated_steps import HypothesisSource, Program, draw_program, leaves, make_params, run, source_text
from torch._dynamo.test_case import run_tests

from torch_patches import config as tp_config
from torch_patches.hooks import bf16, budget, chain, cpu_offload, fp8_rowwise, int8_rowwise
from torch_patches.testing import TestCase, saved_tensor_records

#: The hooks an example runs under: name -> a function giving the pair (None: the knob).
HOOKS = {
    "budget0.1": lambda: budget(0.1),
    "budget0.3": lambda: budget(0.3),
    "budget0.5": lambda: budget(0.5),
    "budget0.9": lambda: budget(0.9),
    "budget0.3_storage": lambda: budget(0.3, options=("bf16", "int8", "offload")),
    "budget0.3_recompute": lambda: budget(0.3, options=("recompute",)),
    "knob0.4": lambda: None,
    "bf16": bf16,
    "int8_rowwise": int8_rowwise,
    "fp8_rowwise": fp8_rowwise,
    "cpu_offload": cpu_offload,
    "fp8_then_offload": lambda: chain(fp8_rowwise(), cpu_offload()),
}
#: The lossy storage of a hook (None: exact, or the budget's plans say).
HOOK_OPTION = {"bf16": "bf16", "int8_rowwise": "int8", "fp8_rowwise": "fp8", "fp8_then_offload": "fp8"}
#: The eager pair that stores every saved floating tensor as an option does.
EAGER_OPTION = {
    "bf16": lambda: bf16(where=None),
    "int8": lambda: int8_rowwise(where=None),
    "fp8": lambda: fp8_rowwise(where=None),
}
LOSS_ORDER = ("bf16", "int8", "fp8")


class ProgramFailed(Exception):
    """The program fails without hooks too: not ours."""


def step_grads(program: Program, device: str, backend: str | None, pair=None, knob=None, seed: int = 0):
    """The gradients of one step of ``program`` (compiled with ``backend``; None: eager),
    under ``pair`` (or the budget knob)."""
    params = make_params(program, device)
    torch._dynamo.reset()
    fn = (lambda x: run(program, params, x)) if backend is not None else (lambda x: run(program, params, x, eager=True))
    if backend is not None:
        fn = torch.compile(fn, backend=backend, dynamic=program.dynamic or None)
    with contextlib.ExitStack() as stack:
        if knob is not None:
            stack.enter_context(tp_config.patch(activation_memory_budget=knob))
        if pair is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*pair))
        torch.manual_seed(seed)
        loss, *aux = fn(params["x"])
    loss.backward()
    return [None if t.grad is None else t.grad.clone() for t in leaves(params)]


def worst_error(got, ref) -> float:
    pairs = [(g, r) for g, r in zip(got, ref) if r is not None and g is not None]
    if not pairs:
        return 0.0
    scale = max(r.norm().item() for _, r in pairs)
    return max(((g - r).norm() / max(r.norm().item(), 1e-3 * scale, 1e-12)).item() for g, r in pairs)


def lossiest(option_names) -> str | None:
    names = {name.split("+")[0] for name in option_names}
    found = [o for o in LOSS_ORDER if o in names]
    return found[-1] if found else None


class GeneratedCase(TestCase):
    def check(self, program: Program, hook: str, device: str = "cpu", backend: str = "aot_eager") -> None:
        """One example (module docstring)."""
        try:
            ref = step_grads(program, device, backend)
        except Exception as e:  # noqa: BLE001 - stock torch's own limits: not ours
            raise ProgramFailed(f"{type(e).__name__}: {e}") from e
        if any(g is not None and not torch.isfinite(g).all() for g in ref):
            raise ProgramFailed("non-finite gradients without hooks")
        with warnings.catch_warnings(record=True) as caught, saved_tensor_records() as compiled:
            warnings.simplefilter("always")
            with tp_config.patch(internal_error_fallback=False):
                got = step_grads(program, device, backend, HOOKS[hook](), knob=0.4 if hook.startswith("knob") else None)
        fallbacks = [c.fallback for c in compiled if c.fallback]
        self.assertEqual(fallbacks, [], "hooks fell back to eager hooks")
        self.assertEqual([g is None for g in got], [g is None for g in ref])
        option = HOOK_OPTION.get(hook) or lossiest(u.option for c in compiled for p in c.plans for u in p.units)
        if option is None:
            self.assertGradsEqual(got, ref, atol=1e-5, rtol=1e-4)
            return
        eager_plain = step_grads(program, device, None)
        eager_lossy = step_grads(program, device, None, EAGER_OPTION[option]())
        bound = 2 * worst_error(eager_lossy, eager_plain)
        ours = worst_error(got, ref)
        self.assertLessEqual(ours, bound + 1e-4, f"{option}: {ours:.3g} against eager's {bound / 2:.3g}")
        del caught


def _examples() -> int:
    return int(os.environ.get("GENERATED_STEPS_EXAMPLES", "80"))


class TestGeneratedSteps(GeneratedCase):
    def example(self, data, hooks, backend="aot_eager", max_stmts=8):
        program = draw_program(HypothesisSource(data), max_stmts=max_stmts)
        hook = data.draw(st.sampled_from(hooks))
        hypothesis.note(source_text(program))
        hypothesis.note(f"hooks: {hook}, backend: {backend}")
        try:
            self.check(program, hook, backend=backend)
        except ProgramFailed as e:
            hypothesis.reject() if "non-finite" in str(e) else hypothesis.assume(False)

    @hypothesis.settings(max_examples=3, deadline=None, derandomize=True, database=None)
    @hypothesis.given(data=st.data())
    def test_few(self, data):
        self.example(data, tuple(HOOKS), max_stmts=4)

    @pytest.mark.slow
    @hypothesis.settings(
        max_examples=_examples(), deadline=None, derandomize=True, database=None, suppress_health_check=list(hypothesis.HealthCheck)
    )
    @hypothesis.given(data=st.data())
    def test_many(self, data):
        self.example(data, tuple(HOOKS))

    @pytest.mark.slow
    @hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(data=st.data())
    def test_inductor(self, data):
        self.example(data, ("budget0.3", "bf16", "fp8_rowwise", "knob0.4"), backend="inductor", max_stmts=5)


class TestFound(GeneratedCase):
    """The programs the generator found failing, each fixed (the issue's run of 2,000)."""

    def test_dropout_under_the_partitioners_knapsack(self):
        # v1 = dropout(x, 0.25); loss = mean(v1 ** 2) + mean((v1 @ w0) ** 2), under
        # activation_memory_budget = 0.4 (ours). Upstream's knapsack at 0.4 recomputes the
        # dropout in the backward without its RNG state (another mask: stock's own
        # activation_memory_budget gets these gradients wrong), and the budget took that
        # partition over its floor. Neither the cheap recomputation nor the weighed knapsack
        # is taken where it recomputes a random op.
        self.check(Program(8, 3, (("dropout", 0, 0.25),), (1,), ((1, "self"),)), "knob0.4")

    def test_dropout_under_the_partitioners_cheap_recomputation(self):
        # v1 = x * x; v2 = dropout(v1); v4 = sigmoid(v2) under no_grad, read by w0's
        # gradient. Under budget(0.9) the partitioner's more aggressive min-cut (its
        # solution just under a budget of 1) rebuilds v4 in the backward from x, dropout
        # included. The default partition's saved values dropped from a candidate are
        # followed back to what it keeps: a random op among them keeps the default.
        stmts = (("binary", "mul", 0, 0), ("dropout", 1, 0.25), ("dropout", 1, 0.0), ("nograd", "sigmoid", 2))
        self.check(Program(4, 2, stmts, (1, 4)), "budget0.9")

    def test_buffer_updated_twice(self):
        # v1 = x + buf after buf is updated in place, buf updated again from v1's layer
        # norm, v4 = where(x > 0, x, v1). Under budget(0.5) the partitioner's more aggressive
        # min-cut, and under budget(0.1) its knapsack, rebuild v1 in the backward from the
        # buffer, which by then holds its last update (stock's own activation_memory_budget
        # gets these gradients wrong). Neither is taken where it reads an input the graph
        # mutates that the default partition does not.
        stmts = (("buffer", 0), ("nograd", "layer_norm", 1), ("buffer", 2), ("mask", "where", 0, 1))
        program = Program(4, 2, stmts, (1, 4), ((4, "self"), (1, "t")))
        for hook in ("budget0.5", "budget0.1"):
            with self.subTest(hook=hook):
                self.check(program, hook)

    def test_offloaded_expanded_view(self):
        # v3 = v1[:1].expand(n, n) (v1 a user autograd.Function's output), read by the loss's
        # matmul, which saves it: strides (0, 1). The offload copies it compact; the reload
        # wrote that into a tensor of the saved strides, whose elements share memory ("more
        # than one element of the written-to tensor refers to a single memory location").
        # Laid out as the view reads it now.
        program = Program(4, 1, (("function", 0, 0), ("view", "unsqueeze", 1), ("view", "expand", 2)), (3,))
        for hook in ("cpu_offload", "fp8_then_offload"):
            with self.subTest(hook=hook):
                self.check(program, hook)

    def test_multiple_outputs_with_dynamic_shapes(self):
        # v1 = tanh(x); v2 = v1 - max(v1) + gather(v1, argmax), dynamic=True, budget(0.5).
        # The cost model hinted each input's value but a tuple's (max's values and indices):
        # the getitems' bytes stayed symbolic, the knapsack's weighed time a SymFloat, and
        # formatting it in the partitioner patch's reason raised TypeError.
        self.check(Program(4, 1, (("unary", "tanh", 0), ("multi", "max", 1, True)), (2,), dynamic=True), "budget0.5")

    def test_random_op_in_a_checkpointed_region(self):
        # The KeyError in a generated program: dropout in a checkpointed region saves
        # its RNG state under another name in the backward.
        region = (("linear", 0, 0), ("dropout", 1, 0.25), ("unary", "tanh", 2))
        program = Program(8, 1, (("unary", "sin", 0), ("checkpoint", "non_reentrant", (1,), region)), (2,))
        self.check(program, "budget0.1")


if __name__ == "__main__":
    run_tests()
