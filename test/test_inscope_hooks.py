"""saved_tensors_hooks entered inside a compiled region.

Stock Dynamo graph-breaks on ``torch.autograd.graph.saved_tensors_hooks(...)`` inside a
compiled function (an error under fullgraph=True). With torch_patches, inlineable hooks
entered inside the region are scopes: each saved tensor takes the hooks of the scope its
saving op ran in (its first backward reader's scope), nested scopes override, hooks are
guarded by content, and untraceable hooks are errors naming the hook (fullgraph) or
eager blocks with one warning.
"""

import contextlib
import itertools
import warnings

import torch
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend

import torch_patches
from torch_patches.hooks import inlineable
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    InductorAndRecordGraphs,
    TestCase,
    hook_nodes,
    hook_warnings,
    instantiate_device_type_tests,
)
from torch_patches.testing._internal.saved_tensors_hooks_fixtures import bf16_pack, bf16_unpack, exact_pack, exact_unpack

EXACT = inlineable(exact_pack, exact_unpack)
BF16 = inlineable(bf16_pack, bf16_unpack)


def _quarter_pack(x):
    return x * 4


def _quarter_unpack(x):
    return x / 4


QUARTER = inlineable(_quarter_pack, _quarter_unpack)


def block(x, w1, w2):
    h = x @ w1
    return F.gelu(h) @ w2


def inputs(device, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g).to(device).requires_grad_()
    ws = [(torch.randn(16, 16, generator=g) / 4).to(device).requires_grad_() for _ in range(n)]
    return x, ws


def grads_of(fn, x, ws):
    fn(x, *ws).sum().backward()
    out = [x.grad, *(w.grad for w in ws)]
    x.grad = None
    for w in ws:
        w.grad = None
    return out


def scopes_by_saved(gm):
    """saved tensor name -> scope name of its pack nodes."""
    return {info["saved"]: info["hook"].removeprefix("saved_tensors_hooks_") for info in hook_nodes(gm).values() if info["role"] == "pack"}


class TestInScopeHooks(TestCase):
    def compile_and_compare(self, fn, device, *, exact=True, backend=None, n=3):
        backend = backend or AotEagerAndRecordGraphs()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        x, ws = inputs(device, n)
        expected = grads_of(fn, x, ws)
        actual = grads_of(compiled, x, ws)
        self.assertGradsEqual(actual, expected, exact=exact)
        return backend

    def test_scope_in_region_fullgraph(self, device):
        def fn(x, w1, w2, w3):
            y = x.sin()
            with torch.autograd.graph.saved_tensors_hooks(*EXACT):
                z = block(y, w1, w2)
            return z.cos() @ w3

        backend = self.compile_and_compare(fn, device)
        # The scope covers the block: what its ops save (sin via mm, mm via gelu, gelu via
        # the second mm) is packed; what cos and the last mm save is not.
        self.assertExpectedGraph(
            backend.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_w1: "f32[16, 16]", primals_w2: "f32[16, 16]", primals_w3: "f32[16, 16]", primals_x: "f32[8, 16]"):
        sin: "f32[8, 16]" = torch.ops.aten.sin.default(primals_x)
        mm: "f32[8, 16]" = torch.ops.aten.mm.default(sin, primals_w1)
        gelu: "f32[8, 16]" = torch.ops.aten.gelu.default(mm)
        mm_packed: "f32[8, 16]" = torch.ops.aten.mul.Tensor(mm, 2);  mm = None  # pack(mm) scope_0
        mm_1: "f32[8, 16]" = torch.ops.aten.mm.default(gelu, primals_w2)
        cos: "f32[8, 16]" = torch.ops.aten.cos.default(mm_1)
        mm_2: "f32[8, 16]" = torch.ops.aten.mm.default(cos, primals_w3)
        t: "f32[16, 8]" = torch.ops.aten.t.default(cos);  cos = None
        t_1: "f32[16, 16]" = torch.ops.aten.t.default(primals_w3);  primals_w3 = None
        t_2: "f32[16, 8]" = torch.ops.aten.t.default(gelu);  gelu = None
        t_2_packed: "f32[16, 8]" = torch.ops.aten.mul.Tensor(t_2, 2);  t_2 = None  # pack(t_2) scope_0
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(primals_w2);  primals_w2 = None
        t_4: "f32[16, 8]" = torch.ops.aten.t.default(sin);  sin = None
        t_4_packed: "f32[16, 8]" = torch.ops.aten.mul.Tensor(t_4, 2);  t_4 = None  # pack(t_4) scope_0
        t_5: "f32[16, 16]" = torch.ops.aten.t.default(primals_w1);  primals_w1 = None
        return (mm_2, primals_x, mm_packed, mm_1, t, t_1, t_2_packed, t_3, t_4_packed, t_5)""",
        )

    def test_two_scopes_with_different_hooks(self, device):
        # e.g. one compression for the MLP, another for the rest of the layer.
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.saved_tensors_hooks(*EXACT):
                h = block(x, w1, w2)
            with torch.autograd.graph.saved_tensors_hooks(*QUARTER):
                return (h.sigmoid() @ w3).tanh()

        backend = self.compile_and_compare(fn, device)
        fw = backend.fw_graphs[0]
        scopes = scopes_by_saved(fw)
        self.assertEqual(set(scopes.values()), {"scope_0", "scope_1"})
        for node in fw.graph.nodes:
            info = hook_nodes(fw).get(node.name)
            if info and info["role"] == "pack":
                # EXACT packs with x * 2, QUARTER with x * 4.
                factor = {"scope_0": 2, "scope_1": 4}[scopes[info["saved"]]]
                self.assertEqual(node.args[1], factor, f"{info['saved']} packed with the wrong hooks")
        # gelu's input and (transposed) output, saved by ops of the first scope; sigmoid's
        # output by the second. tanh is the graph's output.
        self.assertEqual(scopes, {"mm": "scope_0", "t_2": "scope_0", "sigmoid": "scope_1"})

    def test_nested_scopes_inner_wins(self, device):
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.saved_tensors_hooks(*EXACT):
                h = (x @ w1).tanh()
                with torch.autograd.graph.saved_tensors_hooks(*QUARTER):
                    h = (h @ w2).tanh()
                h = (h @ w3).tanh()
            return h

        backend = self.compile_and_compare(fn, device)
        # tanh's output is saved by tanh and by the next matmul, both in the outer scope;
        # tanh_1 in the inner one. tanh_2 is the graph's output (saved as an alias of
        # it, which costs nothing and is not hooked).
        self.assertEqual(scopes_by_saved(backend.fw_graphs[0]), {"tanh": "scope_0", "tanh_1": "scope_1"})

    def test_scope_covers_part_of_a_layer(self, device):
        # Only the activation function is hooked: what gelu saves (its input, mm) is
        # packed; what the matmuls save (x, gelu's output) is not.
        def fn(x, w1, w2, w3):
            h = x @ w1
            with torch.autograd.graph.saved_tensors_hooks(*EXACT):
                h = F.gelu(h)
            return (h @ w2).relu() @ w3

        backend = self.compile_and_compare(fn, device)
        self.assertEqual(scopes_by_saved(backend.fw_graphs[0]), {"mm": "scope_0"})

    def test_ambient_hooks_outside_scope_in_region_hooks_inside(self, device):
        def fn(x, w1, w2, w3):
            h = (x @ w1).tanh()
            with torch.autograd.graph.saved_tensors_hooks(*QUARTER):
                h = (h @ w2).tanh()
            return (h @ w3).tanh()

        backend = AotEagerAndRecordGraphs()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        x, ws = inputs(device)
        with torch.autograd.graph.saved_tensors_hooks(*EXACT):
            expected = grads_of(fn, x, ws)
            actual = grads_of(compiled, x, ws)
        self.assertGradsEqual(actual, expected, exact=True)
        # tanh's output is saved by tanh (outside the scope) and by the next matmul
        # (inside): it was computed outside, so it takes the ambient hooks; tanh_1 the
        # scope's. tanh_2 is an output of the graph, saved by autograd as one.
        self.assertEqual(
            scopes_by_saved(backend.fw_graphs[0]),
            {"tanh": "ambient", "tanh_1": "scope_0"},
        )

    def test_bf16_scope_numerics_inductor(self, device):
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.saved_tensors_hooks(*BF16):
                h = block(x, w1, w2)
            return h @ w3

        backend = InductorAndRecordGraphs()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        x, ws = inputs(device)
        reference = grads_of(fn, x, ws)  # eager hooks: the same bf16 rounding
        actual = grads_of(compiled, x, ws)
        self.assertGradsEqual(actual, reference, atol=2e-2, rtol=2e-2)
        self.assertTrue(hook_nodes(backend.fw_graphs[0]))

    def test_disable_saved_tensors_hooks_in_region(self, device):
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
                h = block(x, w1, w2)
            return h @ w3

        self.compile_and_compare(fn, device)

    def test_scope_under_disable_raises_like_eager(self, device):
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
                with torch.autograd.graph.saved_tensors_hooks(*EXACT):
                    return block(x, w1, w2) @ w3

        x, ws = inputs(device)
        with self.assertRaisesRegex(RuntimeError, "no hooks here"):
            fn(x, *ws)
        with self.assertRaisesRegex(torch._dynamo.exc.Unsupported, "no hooks here"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(x, *ws)
        with self.assertRaisesRegex(RuntimeError, "no hooks here"):
            torch.compile(fn, backend="aot_eager")(x, *ws)

    def test_disable_inside_scope_raises_like_eager(self, device):
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.saved_tensors_hooks(*EXACT):
                with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
                    return block(x, w1, w2) @ w3

        x, ws = inputs(device)
        with self.assertRaisesRegex(RuntimeError, "no hooks here"):
            fn(x, *ws)
        with self.assertRaisesRegex(torch._dynamo.exc.Unsupported, "no hooks here"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(x, *ws)
        with self.assertRaisesRegex(RuntimeError, "no hooks here"):
            torch.compile(fn, backend="aot_eager")(x, *ws)

    def test_unmarked_hooks_in_region(self, device):
        def double(t):
            return t * 2

        def halve(t):
            return t / 2

        def fn(x, w1, w2, w3):
            with torch.autograd.graph.saved_tensors_hooks(double, halve):
                return block(x, w1, w2) @ w3

        x, ws = inputs(device)
        with self.assertRaisesRegex(torch._dynamo.exc.Unsupported, "double.*inlineable"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(x, *ws)
        # Without fullgraph: a graph break, the block runs eagerly with eager hooks.
        expected = grads_of(fn, x, ws)
        self.assertGradsEqual(grads_of(torch.compile(fn, backend="aot_eager"), x, ws), expected, exact=True)

    def test_recreated_hooks_do_not_recompile(self, device):
        def make(scale):
            def pack(t):
                return (t * scale).to(torch.bfloat16)

            def unpack(t):
                return t.to(torch.float32) / scale

            return inlineable(pack, unpack)

        def fn(x, w1, w2, w3, pack, unpack):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                h = block(x, w1, w2)
            return h @ w3

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        x, ws = inputs(device)
        grads = [grads_of(lambda *a: compiled(*a, *make(s)), x, ws) for s in [2.0] * 10]
        self.assertEqual(counter.frame_count, 1)
        grads += [grads_of(lambda *a: compiled(*a, *make(s)), x, ws) for s in [3.0] * 10]
        self.assertEqual(counter.frame_count, 2)
        # The new hook is the one used: its gradients are eager's with the new hook.
        torch._dynamo.reset()
        fresh = torch.compile(fn, backend="aot_eager", fullgraph=True)
        expected = grads_of(lambda *a: fresh(*a, *make(3.0)), x, ws)
        self.assertGradsEqual(grads[-1], expected, exact=True)
        self.assertFalse(torch.equal(grads[0][1], grads[-1][1]))

    def test_config_change_recompiles_scope(self, device):
        # The scope's guard holds the whole torch_patches config, as the ambient hooks' does:
        # a knob that changes what the inliner does with the scope recompiles once.
        def fn(x, w1, w2, w3):
            with torch.autograd.graph.saved_tensors_hooks(*QUARTER):
                h = block(x, w1, w2)
            return h @ w3

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        x, ws = inputs(device)
        grads_of(compiled, x, ws)
        grads_of(compiled, x, ws)
        self.assertEqual(counter.frame_count, 1)
        with torch_patches.config.patch(hook_placement="boundary"):
            grads_of(compiled, x, ws)
        self.assertEqual(counter.frame_count, 2)
        grads_of(compiled, x, ws)  # back to the first config: its graph is still cached
        self.assertEqual(counter.frame_count, 2)


# ------------------------------------------------------------------ untraceable hooks

_STATE = {"calls": 0}


def _item_pack(x):
    return x * x.abs().max().item()


def _control_flow_pack(x):
    if x.sum() > 0:
        return x * 2
    return x * 2


def _io_pack(x):
    print("packing", x.shape)
    return x * 2


def _object_pack(x):
    return [x * 2, object()]


def _mutating_pack(x):
    _STATE["calls"] += 1
    return x * 2


def _halve(x):
    return x / 2


UNTRACEABLE = {
    "item": (_item_pack, "reads a tensor's values into Python"),
    "control_flow": (_control_flow_pack, "data-dependent Python control flow"),
    "io": (_io_pack, "side effects"),
    "non_tensor_output": (_object_pack, "neither a tensor nor a constant"),
    "global_mutation": (_mutating_pack, "mutates state it captures"),
}


def _eager_unpack(x):
    return x[0] / 2 if isinstance(x, list) else x / 2


class TestUntraceableHooks(TestCase):
    """Each reason a marked hook cannot be traced: an error naming the hook and the reason
    under fullgraph=True, eager hook semantics with one warning otherwise."""

    def make(self, pack):
        return inlineable(pack, _eager_unpack)

    def check(self, device, where, kind):
        pack_fn, reason = UNTRACEABLE[kind]
        hooks = self.make(pack_fn)

        def fn(x, w1, w2, w3):
            if where == "in_region":
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    return block(x, w1, w2) @ w3
            return block(x, w1, w2) @ w3

        ambient = torch.autograd.graph.saved_tensors_hooks(*hooks) if where == "ambient" else contextlib.nullcontext()
        x, ws = inputs(device)
        with ambient:
            with self.assertRaisesHookError(f"{pack_fn.__name__}.*{reason}"):
                grads_of(torch.compile(fn, backend="aot_eager", fullgraph=True), x, ws)
            torch._dynamo.reset()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                actual = grads_of(torch.compile(fn, backend="aot_eager"), x, ws)
            ours = hook_warnings(caught)
            self.assertEqual(len(ours), 1, [str(w.message) for w in caught])
            self.assertIn(pack_fn.__name__, ours[0])
            expected = grads_of(fn, x, ws)
        self.assertGradsEqual(actual, expected, exact=True)


for _where, _kind in itertools.product(("ambient", "in_region"), UNTRACEABLE):

    def _test(self, device, _where=_where, _kind=_kind):
        self.check(device, _where, _kind)

    setattr(TestUntraceableHooks, f"test_{_kind}_{_where}", _test)


instantiate_device_type_tests(TestInScopeHooks, globals())
instantiate_device_type_tests(TestUntraceableHooks, globals())


if __name__ == "__main__":
    run_tests()
