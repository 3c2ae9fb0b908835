"""Numerics of inlined saved-tensor hooks: gradients against eager hooks on the same model.

Two references:
* eager autograd running the same hooks as Python functions. Eager and the compiled graph may
  save different tensors (the partitioner recomputes some, saves others), so lossy hooks are
  compared with a tolerance;
* the same compiled graph with the hooks as Python functions (eager hook semantics on the
  partitioner's saved set). With ``saved_tensors_hooks_filtering_mode="all"`` both hook every
  saved tensor, so under aot_eager the gradients must be bit-exact.
"""

import contextlib

import hypothesis
import hypothesis.strategies as st
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend

import torch_patches.testing._internal.saved_tensors_hooks_fixtures as H
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    TestCase,
    hook_nodes,
    instantiate_device_type_tests,
)

#: name -> (GraphModule hooks, the same hooks as Python functions, lossless?)
HOOKS = {
    "exact": (H.EXACT, (H.exact_pack, H.exact_unpack), True),
    "bf16": (H.BF16, (H.bf16_pack, H.bf16_unpack), False),
    "dtype_tuple": (H.DTYPE, (H.dtype_pack, H.dtype_unpack), False),
    "flat_shape": (H.FLAT, (H.flat_pack, H.flat_unpack), True),
}

# Operations a generated model chains; each takes (h, weights, index) and returns h of the
# same shape. They cover views, in-place ops on intermediates, masks and reductions.
OPS = {
    "linear": lambda h, ws, i: F.linear(h, ws[i % len(ws)]),
    "sin": lambda h, ws, i: h.sin(),
    "tanh": lambda h, ws, i: h.tanh(),
    "gelu_gate": lambda h, ws, i: F.gelu(h) * h.sigmoid(),
    "relu": lambda h, ws, i: h.relu(),
    "leaky_where": lambda h, ws, i: torch.where(h > 0, h, 0.1 * h),
    "square": lambda h, ws, i: h * h,
    "transpose_view": lambda h, ws, i: (h.t().contiguous() * 1.5).t(),
    "reshape_view": lambda h, ws, i: h.reshape(-1, 2).softmax(-1).reshape(h.shape) * h,
    "inplace_after_use": lambda h, ws, i: _inplace_after_use(h),
    "layer_norm": lambda h, ws, i: F.layer_norm(h, h.shape[-1:]),
    "residual": lambda h, ws, i: h + F.linear(h, ws[i % len(ws)]).tanh(),
}


def _inplace_after_use(h):
    # A saved intermediate (the input of exp) mutated in place after the op that saved it ran.
    a = h * 2
    b = a.exp().clamp(max=10.0)
    a.add_(1)
    return a * b


def make_model(ops):
    def model(x, *ws):
        h = x
        for i, name in enumerate(ops):
            h = OPS[name](h, ws, i)
        return h

    return model


def make_inputs(device, dim, *, n_weights=2, seed=0, x_requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, dim, generator=gen).to(device).requires_grad_(x_requires_grad)
    ws = [(torch.randn(dim, dim, generator=gen) / dim**0.5).to(device).requires_grad_() for _ in range(n_weights)]
    return [x, *ws]


def float_only(pack, unpack):
    """Eager hooks under our default dtype policy: masks and indices are saved as they are."""

    def pack_float(t):
        return (True, pack(t)) if t.dtype.is_floating_point else (False, t)

    def unpack_float(p):
        hooked, value = p
        return unpack(value) if hooked else value

    return pack_float, unpack_float


def grads_of(fn, inputs, hooks, *, backend=None, backward_twice=False):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    f = torch.compile(fn, backend=backend, fullgraph=True) if backend else fn
    ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
    with ctx:
        out = f(*inputs)
    loss = (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum()
    loss.backward(retain_graph=backward_twice)
    if backward_twice:
        loss.backward()
    return [t.grad for t in inputs]


class TestInlineNumerics(TestCase):
    def check(self, ops, hook, device, *, backend="aot_eager", seed=0):
        gm_hooks, py_hooks, lossless = HOOKS[hook]
        py_hooks = float_only(*py_hooks)
        fn = make_model(ops)
        inputs = make_inputs(device, 8, seed=seed)
        eager = grads_of(fn, inputs, py_hooks)
        torch._dynamo.reset()
        rec = AotEagerAndRecordGraphs() if backend == "aot_eager" else backend
        ours = grads_of(fn, inputs, gm_hooks, backend=rec)
        # Against eager autograd with the same hooks.
        tol = dict(atol=1e-5, rtol=1e-5) if lossless else dict(atol=0.1, rtol=0.05)
        self.assertGradsEqual(ours, eager, **tol)
        if backend != "aot_eager":
            return
        # A packed tensor is no longer returned for the backward: only its packed form is.
        fw = rec.fw_graphs[0]
        returned = {n.name for n in fw.graph.output_node().args[0] if hasattr(n, "name")}
        for info in hook_nodes(fw).values():
            self.assertNotIn(info["saved"], returned)
        # Against the same compiled graph with Python hooks on the same saved set: exact.
        # (For lossy hooks this also proves every floating-point saved tensor was hooked.)
        with functorch_config.patch(saved_tensors_hooks_filtering_mode="all"):
            torch._dynamo.reset()
            python = grads_of(fn, inputs, py_hooks, backend="aot_eager")
            torch._dynamo.reset()
            inlined = grads_of(fn, inputs, gm_hooks, backend="aot_eager")
        self.assertGradsEqual(inlined, python, exact=True)

    @hypothesis.settings(max_examples=8, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=4),
        hook=st.sampled_from(sorted(HOOKS)),
        seed=st.integers(0, 2**16),
    )
    def test_generated_models_aot_eager(self, device, ops, hook, seed):
        hypothesis.note(f"ops={ops} hook={hook}")
        self.check(["linear", *ops], hook, device, seed=seed)

    @hypothesis.settings(max_examples=3, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=3),
        hook=st.sampled_from(sorted(HOOKS)),
        reorder=st.booleans(),
    )
    def test_generated_models_inductor(self, device, ops, hook, reorder):
        with inductor_config.patch(reorder_for_peak_memory=reorder):
            self.check(["linear", *ops], hook, device, backend="inductor")

    def test_inductor_reorder_on_and_off(self, device):
        ops = ["linear", "gelu_gate", "residual", "layer_norm"]
        for reorder in (True, False):
            with self.subTest(reorder_for_peak_memory=reorder):
                with inductor_config.patch(reorder_for_peak_memory=reorder):
                    torch._dynamo.reset()
                    self.check(ops, "bf16", device, backend="inductor")

    def test_views_and_inplace_among_saved(self, device):
        self.check(["linear", "transpose_view", "inplace_after_use", "reshape_view"], "exact", device)
        self.check(["linear", "transpose_view", "inplace_after_use", "reshape_view"], "bf16", device)

    def test_inputs_not_requiring_grad(self, device):
        fn = make_model(["linear", "gelu_gate", "linear", "sin"])
        inputs = make_inputs(device, 8, x_requires_grad=False)
        eager = grads_of(fn, inputs, float_only(*HOOKS["exact"][1]))
        ours = grads_of(fn, inputs, HOOKS["exact"][0], backend="aot_eager")
        self.assertIsNone(ours[0])
        self.assertGradsEqual(ours, eager, atol=1e-6, rtol=1e-6)

    def test_retain_graph(self, device):
        # Unpack runs in every backward; the packed tensors stay saved until the graph dies.
        fn = make_model(["linear", "gelu_gate", "sin"])
        inputs = make_inputs(device, 8)
        once = grads_of(fn, inputs, H.BF16, backend="aot_eager")
        torch._dynamo.reset()
        twice = grads_of(fn, inputs, H.BF16, backend="aot_eager", backward_twice=True)
        self.assertGradsEqual(twice, [None if g is None else 2 * g for g in once], exact=True)

    def test_double_backward_is_a_clear_error(self, device):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        f = torch.compile(lambda x: x.sin().exp(), backend="aot_eager")
        with torch.autograd.graph.saved_tensors_hooks(*H.EXACT):
            y = f(x)
        with self.assertRaisesRegex(RuntimeError, "does not currently support double backward"):
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            g.sum().backward()

    def test_dynamic_shapes_no_recompile(self, device):
        fn = make_model(["linear", "gelu_gate", "reshape_view"])
        counter = CompileCounterWithBackend("aot_eager")
        f = torch.compile(fn, backend=counter, dynamic=True)
        for batch in (4, 6, 10):
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, 8, generator=gen).to(device).requires_grad_()
            (w,) = make_inputs(device, 8, n_weights=1)[1:]
            eager = grads_of(fn, [x, w], float_only(H.flat_pack, H.flat_unpack))
            with torch.autograd.graph.saved_tensors_hooks(*H.FLAT):
                out = f(x, w)
            (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
            self.assertGradsEqual([x.grad, w.grad], eager, atol=1e-5, rtol=1e-5)
        self.assertEqual(counter.frame_count, 1)

    def test_inlined_hooks_do_not_also_run_at_runtime(self, device):
        # A GraphModule hook whose Python call is counted: it is called while the graphs
        # are traced, never again when the compiled graphs run.
        calls = {"pack": 0, "unpack": 0}

        def counted(gm, role):
            class Counted(type(gm)):
                def __call__(self, *args, **kwargs):
                    calls[role] += 1
                    return super().__call__(*args, **kwargs)

            gm.__class__ = Counted
            return gm

        pack = counted(torch.fx.symbolic_trace(H.exact_pack), "pack")
        unpack = counted(torch.fx.symbolic_trace(H.exact_unpack), "unpack")
        f = torch.compile(lambda x: x.sin().exp().cos(), backend="aot_eager")
        x = torch.randn(4, 8, device=device, requires_grad=True)
        for step in range(3):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                f(x).sum().backward()
            if step == 0:
                after_compile = dict(calls)
        self.assertEqual(calls, after_compile)


instantiate_device_type_tests(TestInlineNumerics, globals())


if __name__ == "__main__":
    run_tests()
