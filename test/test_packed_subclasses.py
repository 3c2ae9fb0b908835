"""Pack hooks that return a tensor subclass (data and scale in one tensor class).

The inliner traces pack followed by the subclass's ``__tensor_flatten__`` and unpack preceded
by ``__tensor_unflatten__``: only the inner tensors (and, with dynamic shapes, the sizes)
travel from the forward graph to the backward graph. Stock torch raises NotImplementedError
for such hooks; before this they fell back to eager hooks with an internal FakeTensor error.
"""

import pytest
import torch
from torch._dynamo.test_case import run_tests
from torch.testing._internal.two_tensor import TwoTensor

from torch_patches.hooks import inlineable
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    TestCase,
    hook_nodes,
    instantiate_device_type_tests,
)
from torch_patches.testing._internal.saved_tensors_hooks_fixtures import RowScaled, exact_scaled_pack, row_scaled_pack, row_scaled_unpack


def layer(x, w):
    return (x @ w).sin() @ w


def nested_pack(x):
    x = x.detach()
    return TwoTensor(TwoTensor(x * 2, x), x * 4)


def nested_unpack(t):
    return (t.a.a + t.a.b * 2 + t.b) / 8  # exact: (2x + 2x + 4x) / 8


def grads(fn, args, hooks):
    args = [a.detach().clone().requires_grad_() for a in args]
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        fn(*args).sum().backward()
    return [a.grad for a in args]


def inputs(device, n=16, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=gen).to(device), torch.randn(d, d, generator=gen).to(device) / d**0.5]


class TestPackedSubclasses(TestCase):
    def test_flattened_between_graphs_exact(self, device):
        hooks = inlineable(exact_scaled_pack, row_scaled_unpack)
        args = inputs(device)
        rec = AotEagerAndRecordGraphs()
        compiled = grads(torch.compile(layer, backend=rec, fullgraph=True), args, hooks)
        for got, want in zip(compiled, grads(layer, args, hooks)):
            self.assertEqual(got, want, atol=0, rtol=0)
        fw, bw = rec.fw_graphs[0], rec.bw_graphs[0]
        self.assertTrue(hook_nodes(fw) and hook_nodes(bw))
        # Only plain tensors cross: data and scale of each packed tensor.
        for node in bw.graph.find_nodes(op="placeholder"):
            self.assertNotIsInstance(node.meta["val"], RowScaled)
        packed = [n.name for n in bw.graph.find_nodes(op="placeholder") if "_packed_" in n.name]
        self.assertTrue(packed and len(packed) % 2 == 0, packed)

    def test_lossy_packed_form_compresses(self, device):
        hooks = inlineable(row_scaled_pack, row_scaled_unpack)
        args = inputs(device)
        rec = AotEagerAndRecordGraphs()
        ref = grads(layer, args, (lambda t: t, lambda t: t))
        eager = grads(layer, args, hooks)
        compiled = grads(torch.compile(layer, backend=rec, fullgraph=True), args, hooks)

        def err(got):
            return max(((g - r).norm() / r.norm()).item() for g, r in zip(got, ref))

        self.assertLessEqual(err(compiled), 1.5 * err(eager))
        self.assertGreater(err(compiled), 0)  # it did compress
        dtypes = {n.meta["val"].dtype for n in rec.bw_graphs[0].graph.find_nodes(op="placeholder") if "_packed_" in n.name}
        self.assertEqual(dtypes, {torch.bfloat16, torch.float32})  # bf16 rows, f32 scales

    def test_nested_subclass_dynamic_shapes(self, device):
        hooks = inlineable(nested_pack, nested_unpack)
        fn = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
        for n in (16, 24):
            args = inputs(device, n=n, seed=n)
            for got, want in zip(grads(fn, args, hooks), grads(layer, args, hooks)):
                self.assertEqual(got, want, atol=0, rtol=0)

    @pytest.mark.slow
    def test_inductor(self, device):
        for pack, unpack in ((exact_scaled_pack, row_scaled_unpack), (nested_pack, nested_unpack)):
            torch._dynamo.reset()
            hooks = inlineable(pack, unpack)
            fn = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=True)
            for n in (16, 24):
                args = inputs(device, n=n, seed=n)
                for got, want in zip(grads(fn, args, hooks), grads(layer, args, hooks)):
                    self.assertEqual(got, want, atol=1e-4, rtol=1e-4)

    def test_unpack_returning_a_subclass_is_an_error(self, device):
        hooks = inlineable(row_scaled_pack, lambda packed: packed)
        with self.assertRaisesHookError(r"returns a tensor subclass \(RowScaled\)"):
            grads(torch.compile(layer, backend="aot_eager", fullgraph=True), inputs(device), hooks)


instantiate_device_type_tests(TestPackedSubclasses, globals())


if __name__ == "__main__":
    run_tests()
