"""Golden graphs: where inlined saved-tensor hooks land in the AOT forward/backward graphs.

Things to note when reading the goldens:
* a ``# pack(x)`` node sits right after ``x``'s last forward use, so ``x`` is freed
  there (``x = None``) and only the packed tensor is returned for the backward;
* a ``# unpack(x)`` node sits right before the first backward node that reads ``x``;
* by default (filtering mode "donated") inputs, parameters and their views are not
  hooked: packing them would free nothing;
* the partitioner often saves both ``x`` and ``detach(x)``; only ``x`` is packed, and the
  backward's ``detach`` reads ``x``'s unpacked tensor (one compressed copy, not two).
"""

import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests

import torch_patches.config as tp_config
from torch_patches.hooks import inlineable
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    InductorAndRecordGraphs,
    TestCase,
    hook_nodes,
    instantiate_device_type_tests,
)
from torch_patches.testing._internal.saved_tensors_hooks_fixtures import BF16, DTYPE, EXACT, FLAT, check_placed_at_use


class TestInlinePlacement(TestCase):
    def compile_step(self, fn, *inputs, hooks=BF16, backend=None, dynamic=False):
        backend = backend or AotEagerAndRecordGraphs()
        compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = compiled(*inputs)
        out.sum().backward()
        self.assertEqual(len(backend.fw_graphs), 1)
        check_placed_at_use(self, backend.fw_graphs[0], backend.bw_graphs[0])
        return backend

    def test_linear(self, device):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        w = torch.randn(16, 8, device=device, requires_grad=True)
        rec = self.compile_step(lambda x, w: F.linear(x, w).relu().sin(), x, w)
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_w: "f32[16, 8]", primals_x: "f32[4, 8]"):
        t: "f32[8, 16]" = torch.ops.aten.t.default(primals_w);  primals_w = None
        mm: "f32[4, 16]" = torch.ops.aten.mm.default(primals_x, t)
        relu: "f32[4, 16]" = torch.ops.aten.relu.default(mm);  mm = None
        sin: "f32[4, 16]" = torch.ops.aten.sin.default(relu)
        relu_packed: "bf16[4, 16]" = torch.ops.aten._to_copy.default(relu, dtype = torch.bfloat16);  relu = None  # pack(relu)
        t_3: "f32[16, 8]" = torch.ops.aten.t.default(t);  t = None
        return (sin, primals_x, relu_packed, t_3)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", relu_packed: "bf16[4, 16]", t_3: "f32[16, 8]", tangents_1: "f32[4, 16]"):
        relu_unpacked: "f32[4, 16]" = torch.ops.aten._to_copy.default(relu_packed, dtype = torch.float32);  relu_packed = None  # unpack(relu)
        cos: "f32[4, 16]" = torch.ops.aten.cos.default(relu_unpacked)
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(tangents_1, cos);  tangents_1 = cos = None
        detach: "f32[4, 16]" = torch.ops.aten.detach.default(relu_unpacked);  relu_unpacked = None
        detach_1: "f32[4, 16]" = torch.ops.aten.detach.default(detach);  detach = None
        threshold_backward: "f32[4, 16]" = torch.ops.aten.threshold_backward.default(mul, detach_1, 0);  mul = detach_1 = None
        t: "f32[16, 4]" = torch.ops.aten.t.default(threshold_backward)
        mm: "f32[16, 8]" = torch.ops.aten.mm.default(t, primals_x);  t = primals_x = None
        t_1: "f32[8, 16]" = torch.ops.aten.t.default(mm);  mm = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(threshold_backward, t_3);  threshold_backward = t_3 = None
        t_2: "f32[16, 8]" = torch.ops.aten.t.default(t_1);  t_1 = None
        return (t_2, mm_1)""",
        )

    def test_mlp_block(self, device):
        def block(x, w1, w2):
            h = F.linear(x, w1)
            h = F.gelu(h) * h.sigmoid()
            return x + F.linear(h, w2)

        x = torch.randn(4, 8, device=device, requires_grad=True)
        w1 = torch.randn(16, 8, device=device, requires_grad=True)
        w2 = torch.randn(8, 16, device=device, requires_grad=True)
        rec = self.compile_step(block, x, w1, w2)
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_w1: "f32[16, 8]", primals_w2: "f32[8, 16]", primals_x: "f32[4, 8]"):
        t: "f32[8, 16]" = torch.ops.aten.t.default(primals_w1);  primals_w1 = None
        mm: "f32[4, 16]" = torch.ops.aten.mm.default(primals_x, t)
        gelu: "f32[4, 16]" = torch.ops.aten.gelu.default(mm)
        sigmoid: "f32[4, 16]" = torch.ops.aten.sigmoid.default(mm)
        mm_packed: "bf16[4, 16]" = torch.ops.aten._to_copy.default(mm, dtype = torch.bfloat16);  mm = None  # pack(mm)
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(gelu, sigmoid);  gelu = None
        sigmoid_packed: "bf16[4, 16]" = torch.ops.aten._to_copy.default(sigmoid, dtype = torch.bfloat16);  sigmoid = None  # pack(sigmoid)
        t_1: "f32[16, 8]" = torch.ops.aten.t.default(primals_w2);  primals_w2 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(mul, t_1)
        mul_packed: "bf16[4, 16]" = torch.ops.aten._to_copy.default(mul, dtype = torch.bfloat16);  mul = None  # pack(mul)
        add: "f32[4, 8]" = torch.ops.aten.add.Tensor(primals_x, mm_1);  mm_1 = None
        t_4: "f32[8, 16]" = torch.ops.aten.t.default(t_1);  t_1 = None
        t_8: "f32[16, 8]" = torch.ops.aten.t.default(t);  t = None
        return (add, primals_x, mm_packed, sigmoid_packed, mul_packed, t_4, t_8)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", mm_packed: "bf16[4, 16]", sigmoid_packed: "bf16[4, 16]", mul_packed: "bf16[4, 16]", t_4: "f32[8, 16]", t_8: "f32[16, 8]", tangents_1: "f32[4, 8]"):
        t: "f32[8, 4]" = torch.ops.aten.t.default(tangents_1)
        mul_unpacked: "f32[4, 16]" = torch.ops.aten._to_copy.default(mul_packed, dtype = torch.float32);  mul_packed = None  # unpack(mul)
        mm: "f32[8, 16]" = torch.ops.aten.mm.default(t, mul_unpacked);  t = mul_unpacked = None
        t_1: "f32[16, 8]" = torch.ops.aten.t.default(mm);  mm = None
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(tangents_1, t_4);  t_4 = None
        t_2: "f32[8, 16]" = torch.ops.aten.t.default(t_1);  t_1 = None
        mm_unpacked: "f32[4, 16]" = torch.ops.aten._to_copy.default(mm_packed, dtype = torch.float32);  mm_packed = None  # unpack(mm)
        gelu: "f32[4, 16]" = torch.ops.aten.gelu.default(mm_unpacked)
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm_1, gelu);  gelu = None
        sigmoid_unpacked: "f32[4, 16]" = torch.ops.aten._to_copy.default(sigmoid_packed, dtype = torch.float32);  sigmoid_packed = None  # unpack(sigmoid)
        mul_1: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm_1, sigmoid_unpacked);  mm_1 = None
        detach: "f32[4, 16]" = torch.ops.aten.detach.default(sigmoid_unpacked);  sigmoid_unpacked = None
        detach_1: "f32[4, 16]" = torch.ops.aten.detach.default(detach);  detach = None
        sigmoid_backward: "f32[4, 16]" = torch.ops.aten.sigmoid_backward.default(mul, detach_1);  mul = detach_1 = None
        gelu_backward: "f32[4, 16]" = torch.ops.aten.gelu_backward.default(mul_1, mm_unpacked);  mul_1 = mm_unpacked = None
        add: "f32[4, 16]" = torch.ops.aten.add.Tensor(sigmoid_backward, gelu_backward);  sigmoid_backward = gelu_backward = None
        t_3: "f32[16, 4]" = torch.ops.aten.t.default(add)
        mm_2: "f32[16, 8]" = torch.ops.aten.mm.default(t_3, primals_x);  t_3 = primals_x = None
        t_5: "f32[8, 16]" = torch.ops.aten.t.default(mm_2);  mm_2 = None
        mm_3: "f32[4, 8]" = torch.ops.aten.mm.default(add, t_8);  add = t_8 = None
        add_1: "f32[4, 8]" = torch.ops.aten.add.Tensor(tangents_1, mm_3);  tangents_1 = mm_3 = None
        t_6: "f32[16, 8]" = torch.ops.aten.t.default(t_5);  t_5 = None
        return (t_6, t_2, add_1)""",
        )

    def test_residual_stack(self, device):
        def stack(x, ws):
            for w in ws:
                x = x + F.linear(x, w).tanh()
            return x

        x = torch.randn(4, 8, device=device, requires_grad=True)
        ws = [torch.randn(8, 8, device=device, requires_grad=True) for _ in range(3)]
        rec = self.compile_step(stack, x, ws)
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_ws_0: "f32[8, 8]", primals_ws_1: "f32[8, 8]", primals_ws_2: "f32[8, 8]", primals_x: "f32[4, 8]"):
        t: "f32[8, 8]" = torch.ops.aten.t.default(primals_ws_0);  primals_ws_0 = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(primals_x, t)
        tanh: "f32[4, 8]" = torch.ops.aten.tanh.default(mm);  mm = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(tanh)
        add: "f32[4, 8]" = torch.ops.aten.add.Tensor(primals_x, tanh);  tanh = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(primals_ws_1);  primals_ws_1 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(add, t_1)
        tanh_1: "f32[4, 8]" = torch.ops.aten.tanh.default(mm_1);  mm_1 = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(tanh_1)
        add_1: "f32[4, 8]" = torch.ops.aten.add.Tensor(add, tanh_1);  tanh_1 = None
        add_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(add, dtype = torch.bfloat16);  add = None  # pack(add)
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(primals_ws_2);  primals_ws_2 = None
        mm_2: "f32[4, 8]" = torch.ops.aten.mm.default(add_1, t_2)
        tanh_2: "f32[4, 8]" = torch.ops.aten.tanh.default(mm_2);  mm_2 = None
        detach_2: "f32[4, 8]" = torch.ops.aten.detach.default(tanh_2)
        add_2: "f32[4, 8]" = torch.ops.aten.add.Tensor(add_1, tanh_2);  tanh_2 = None
        add_1_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(add_1, dtype = torch.bfloat16);  add_1 = None  # pack(add_1)
        detach_3: "f32[4, 8]" = torch.ops.aten.detach.default(detach_2);  detach_2 = None
        detach_3_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(detach_3, dtype = torch.bfloat16);  detach_3 = None  # pack(detach_3)
        t_5: "f32[8, 8]" = torch.ops.aten.t.default(t_2);  t_2 = None
        detach_4: "f32[4, 8]" = torch.ops.aten.detach.default(detach_1);  detach_1 = None
        detach_4_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(detach_4, dtype = torch.bfloat16);  detach_4 = None  # pack(detach_4)
        t_9: "f32[8, 8]" = torch.ops.aten.t.default(t_1);  t_1 = None
        detach_5: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        detach_5_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(detach_5, dtype = torch.bfloat16);  detach_5 = None  # pack(detach_5)
        t_13: "f32[8, 8]" = torch.ops.aten.t.default(t);  t = None
        return (add_2, primals_x, add_packed, add_1_packed, detach_3_packed, t_5, detach_4_packed, t_9, detach_5_packed, t_13)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", add_packed: "bf16[4, 8]", add_1_packed: "bf16[4, 8]", detach_3_packed: "bf16[4, 8]", t_5: "f32[8, 8]", detach_4_packed: "bf16[4, 8]", t_9: "f32[8, 8]", detach_5_packed: "bf16[4, 8]", t_13: "f32[8, 8]", tangents_1: "f32[4, 8]"):
        detach_3_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(detach_3_packed, dtype = torch.float32);  detach_3_packed = None  # unpack(detach_3)
        tanh_backward: "f32[4, 8]" = torch.ops.aten.tanh_backward.default(tangents_1, detach_3_unpacked);  detach_3_unpacked = None
        t: "f32[8, 4]" = torch.ops.aten.t.default(tanh_backward)
        add_1_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(add_1_packed, dtype = torch.float32);  add_1_packed = None  # unpack(add_1)
        mm: "f32[8, 8]" = torch.ops.aten.mm.default(t, add_1_unpacked);  t = add_1_unpacked = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(mm);  mm = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(tanh_backward, t_5);  tanh_backward = t_5 = None
        add: "f32[4, 8]" = torch.ops.aten.add.Tensor(tangents_1, mm_1);  tangents_1 = mm_1 = None
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(t_1);  t_1 = None
        detach_4_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(detach_4_packed, dtype = torch.float32);  detach_4_packed = None  # unpack(detach_4)
        tanh_backward_1: "f32[4, 8]" = torch.ops.aten.tanh_backward.default(add, detach_4_unpacked);  detach_4_unpacked = None
        t_3: "f32[8, 4]" = torch.ops.aten.t.default(tanh_backward_1)
        add_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(add_packed, dtype = torch.float32);  add_packed = None  # unpack(add)
        mm_2: "f32[8, 8]" = torch.ops.aten.mm.default(t_3, add_unpacked);  t_3 = add_unpacked = None
        t_4: "f32[8, 8]" = torch.ops.aten.t.default(mm_2);  mm_2 = None
        mm_3: "f32[4, 8]" = torch.ops.aten.mm.default(tanh_backward_1, t_9);  tanh_backward_1 = t_9 = None
        add_1: "f32[4, 8]" = torch.ops.aten.add.Tensor(add, mm_3);  add = mm_3 = None
        t_6: "f32[8, 8]" = torch.ops.aten.t.default(t_4);  t_4 = None
        detach_5_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(detach_5_packed, dtype = torch.float32);  detach_5_packed = None  # unpack(detach_5)
        tanh_backward_2: "f32[4, 8]" = torch.ops.aten.tanh_backward.default(add_1, detach_5_unpacked);  detach_5_unpacked = None
        t_7: "f32[8, 4]" = torch.ops.aten.t.default(tanh_backward_2)
        mm_4: "f32[8, 8]" = torch.ops.aten.mm.default(t_7, primals_x);  t_7 = primals_x = None
        t_8: "f32[8, 8]" = torch.ops.aten.t.default(mm_4);  mm_4 = None
        mm_5: "f32[4, 8]" = torch.ops.aten.mm.default(tanh_backward_2, t_13);  tanh_backward_2 = t_13 = None
        add_2: "f32[4, 8]" = torch.ops.aten.add.Tensor(add_1, mm_5);  add_1 = mm_5 = None
        t_10: "f32[8, 8]" = torch.ops.aten.t.default(t_8);  t_8 = None
        return (t_10, t_6, t_2, add_2)""",
        )

    def test_tuple_pack_dtype_and_tensor(self, device):
        # The dtype leaf is a constant: it is baked into the unpack graph, not saved.
        x = torch.randn(4, 8, device=device, requires_grad=True)
        rec = self.compile_step(lambda x: x.sin().exp().cos(), x, hooks=DTYPE)
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]"):
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(primals_x)
        exp: "f32[4, 8]" = torch.ops.aten.exp.default(sin);  sin = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(exp)
        exp_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(exp, dtype = torch.bfloat16);  exp = None  # pack(exp)
        return (cos, primals_x, exp_packed)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", exp_packed: "bf16[4, 8]", tangents_1: "f32[4, 8]"):
        exp_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(exp_packed, dtype = torch.float32);  exp_packed = None  # unpack(exp)
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(exp_unpacked)
        neg: "f32[4, 8]" = torch.ops.aten.neg.default(sin);  sin = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(tangents_1, neg);  tangents_1 = neg = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(exp_unpacked);  exp_unpacked = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        mul_1: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul, detach_1);  mul = detach_1 = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(primals_x);  primals_x = None
        mul_2: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul_1, cos);  mul_1 = cos = None
        return (mul_2)""",
        )

    def test_shape_changing_pack(self, device):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        rec = self.compile_step(lambda x: x.sin().exp().cos(), x, hooks=FLAT)
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]"):
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(primals_x)
        exp: "f32[4, 8]" = torch.ops.aten.exp.default(sin);  sin = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(exp)
        view_default: "f32[32]" = torch.ops.aten.view.default(exp, [-1]);  exp = None  # pack(exp)
        exp_packed: "f32[32]" = torch.ops.aten.mul.Tensor(view_default, 2);  view_default = None  # pack(exp)
        return (cos, primals_x, exp_packed)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", exp_packed: "f32[32]", tangents_1: "f32[4, 8]"):
        div_tensor: "f32[32]" = torch.ops.aten.div.Tensor(exp_packed, 2);  exp_packed = None  # unpack(exp)
        exp_unpacked: "f32[4, 8]" = torch.ops.aten.view.default(div_tensor, [4, 8]);  div_tensor = None  # unpack(exp)
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(exp_unpacked)
        neg: "f32[4, 8]" = torch.ops.aten.neg.default(sin);  sin = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(tangents_1, neg);  tangents_1 = neg = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(exp_unpacked);  exp_unpacked = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        mul_1: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul, detach_1);  mul = detach_1 = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(primals_x);  primals_x = None
        mul_2: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul_1, cos);  mul_1 = cos = None
        return (mul_2)""",
        )

    def test_dynamic_shapes(self, device):
        # The shape-changing hook under dynamic shapes: its sizes are symbolic and the
        # backward reads them from the saved symints.
        x = torch.randn(4, 8, device=device, requires_grad=True)
        rec = self.compile_step(lambda x: x.sin().exp().cos(), x, hooks=FLAT, dynamic=True)
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_s27: "Sym(s27)", primals_s77: "Sym(s77)", primals_x: "f32[s77, s27]"):
        sin: "f32[s77, s27]" = torch.ops.aten.sin.default(primals_x)
        exp: "f32[s77, s27]" = torch.ops.aten.exp.default(sin);  sin = None
        cos: "f32[s77, s27]" = torch.ops.aten.cos.default(exp)
        exp_packed_1: "Sym(s27)" = torch.ops.aten.sym_size.int(exp, 1)  # pack(exp)
        exp_packed_0: "Sym(s77)" = torch.ops.aten.sym_size.int(exp, 0)  # pack(exp)
        view_default: "f32[s27*s77]" = torch.ops.aten.view.default(exp, [-1]);  exp = None  # pack(exp)
        exp_packed_2: "f32[s27*s77]" = torch.ops.aten.mul.Tensor(view_default, 2);  view_default = None  # pack(exp)
        return (cos, primals_x, exp_packed_2, primals_s27, primals_s77, exp_packed_0, exp_packed_1)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_s27: "Sym(s27)", primals_s77: "Sym(s77)", exp_packed_0: "Sym(s77)", exp_packed_1: "Sym(s27)", primals_x: "f32[s77, s27]", exp_packed_2: "f32[s27*s77]", tangents_1: "f32[s77, s27]"):
        div_tensor: "f32[s27*s77]" = torch.ops.aten.div.Tensor(exp_packed_2, 2);  exp_packed_2 = None  # unpack(exp)
        exp_unpacked: "f32[s77, s27]" = torch.ops.aten.view.default(div_tensor, [exp_packed_0, exp_packed_1]);  div_tensor = exp_packed_0 = exp_packed_1 = None  # unpack(exp)
        sin: "f32[s77, s27]" = torch.ops.aten.sin.default(exp_unpacked)
        neg: "f32[s77, s27]" = torch.ops.aten.neg.default(sin);  sin = None
        mul: "f32[s77, s27]" = torch.ops.aten.mul.Tensor(tangents_1, neg);  tangents_1 = neg = None
        detach: "f32[s77, s27]" = torch.ops.aten.detach.default(exp_unpacked);  exp_unpacked = None
        detach_1: "f32[s77, s27]" = torch.ops.aten.detach.default(detach);  detach = None
        mul_1: "f32[s77, s27]" = torch.ops.aten.mul.Tensor(mul, detach_1);  mul = detach_1 = None
        cos: "f32[s77, s27]" = torch.ops.aten.cos.default(primals_x);  primals_x = None
        mul_2: "f32[s77, s27]" = torch.ops.aten.mul.Tensor(mul_1, cos);  mul_1 = cos = None
        return (None, None, mul_2)""",
        )

    def _filtering_mode(self, device, mode):
        # The weight is a module parameter: a static input, which "no_static" leaves alone.
        lin = torch.nn.Linear(8, 8, bias=False, device=device)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        with functorch_config.patch(saved_tensors_hooks_filtering_mode=mode):
            return self.compile_step(lambda x: lin(x).sin().cos(), x, hooks=EXACT)

    def test_filtering_mode_donated(self, device):
        rec = self._filtering_mode(device, "donated")
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_lin_parameters_weight: "f32[8, 8]", primals_x: "f32[4, 8]"):
        t: "f32[8, 8]" = torch.ops.aten.t.default(primals_lin_parameters_weight)
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(primals_x, t);  t = None
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(mm)
        mm_packed: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mm, 2);  mm = None  # pack(mm)
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(sin);  sin = None
        return (cos, primals_lin_parameters_weight, primals_x, mm_packed)""",
        )

    def test_filtering_mode_no_static(self, device):
        # Inputs are hooked too, but not static inputs (parameters in a module).
        rec = self._filtering_mode(device, "no_static")
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_lin_parameters_weight: "f32[8, 8]", primals_x: "f32[4, 8]"):
        t: "f32[8, 8]" = torch.ops.aten.t.default(primals_lin_parameters_weight)
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(primals_x, t);  t = None
        primals_x_packed: "f32[4, 8]" = torch.ops.aten.mul.Tensor(primals_x, 2);  primals_x = None  # pack(primals_x)
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(mm)
        mm_packed: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mm, 2);  mm = None  # pack(mm)
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(sin);  sin = None
        return (cos, primals_lin_parameters_weight, primals_x_packed, mm_packed)""",
        )

    def test_filtering_mode_all(self, device):
        rec = self._filtering_mode(device, "all")
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_lin_parameters_weight: "f32[8, 8]", primals_x: "f32[4, 8]"):
        t: "f32[8, 8]" = torch.ops.aten.t.default(primals_lin_parameters_weight)
        primals_lin_parameters_weight_packed: "f32[8, 8]" = torch.ops.aten.mul.Tensor(primals_lin_parameters_weight, 2);  primals_lin_parameters_weight = None  # pack(primals_lin_parameters_weight)
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(primals_x, t);  t = None
        primals_x_packed: "f32[4, 8]" = torch.ops.aten.mul.Tensor(primals_x, 2);  primals_x = None  # pack(primals_x)
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(mm)
        mm_packed: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mm, 2);  mm = None  # pack(mm)
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(sin);  sin = None
        return (cos, primals_lin_parameters_weight_packed, primals_x_packed, mm_packed)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_lin_parameters_weight_packed: "f32[8, 8]", primals_x_packed: "f32[4, 8]", mm_packed: "f32[4, 8]", tangents_1: "f32[4, 8]"):
        mm_unpacked: "f32[4, 8]" = torch.ops.aten.div.Tensor(mm_packed, 2);  mm_packed = None  # unpack(mm)
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(mm_unpacked)
        sin_1: "f32[4, 8]" = torch.ops.aten.sin.default(sin);  sin = None
        neg: "f32[4, 8]" = torch.ops.aten.neg.default(sin_1);  sin_1 = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(tangents_1, neg);  tangents_1 = neg = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(mm_unpacked);  mm_unpacked = None
        mul_1: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul, cos);  mul = cos = None
        t: "f32[8, 4]" = torch.ops.aten.t.default(mul_1)
        primals_x_unpacked: "f32[4, 8]" = torch.ops.aten.div.Tensor(primals_x_packed, 2);  primals_x_packed = None  # unpack(primals_x)
        mm: "f32[8, 8]" = torch.ops.aten.mm.default(t, primals_x_unpacked);  t = primals_x_unpacked = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(mm);  mm = None
        primals_lin_parameters_weight_unpacked: "f32[8, 8]" = torch.ops.aten.div.Tensor(primals_lin_parameters_weight_packed, 2);  primals_lin_parameters_weight_packed = None  # unpack(primals_lin_parameters_weight)
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(primals_lin_parameters_weight_unpacked);  primals_lin_parameters_weight_unpacked = None
        t_3: "f32[8, 8]" = torch.ops.aten.t.default(t_2);  t_2 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(mul_1, t_3);  mul_1 = t_3 = None
        t_4: "f32[8, 8]" = torch.ops.aten.t.default(t_1);  t_1 = None
        return (t_4, mm_1)""",
        )

    def test_prefetch_distance(self, device):
        # Each unpack is issued two backward nodes before its first use.
        x = torch.randn(4, 8, device=device, requires_grad=True)
        with tp_config.patch(unpack_prefetch_distance=2):
            backend = AotEagerAndRecordGraphs()
            compiled = torch.compile(lambda x: x.sin().exp().cos().tanh(), backend=backend)
            with torch.autograd.graph.saved_tensors_hooks(*BF16):
                compiled(x).sum().backward()
        self.assertExpectedGraph(
            backend.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", exp_packed: "bf16[4, 8]", detach_2: "f32[4, 8]", tangents_1: "f32[4, 8]"):
        exp_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(exp_packed, dtype = torch.float32);  exp_packed = None  # unpack(exp)
        tanh_backward: "f32[4, 8]" = torch.ops.aten.tanh_backward.default(tangents_1, detach_2);  tangents_1 = detach_2 = None
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(exp_unpacked)
        neg: "f32[4, 8]" = torch.ops.aten.neg.default(sin);  sin = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(tanh_backward, neg);  tanh_backward = neg = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(exp_unpacked);  exp_unpacked = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        mul_1: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul, detach_1);  mul = detach_1 = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(primals_x);  primals_x = None
        mul_2: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul_1, cos);  mul_1 = cos = None
        return (mul_2)""",
        )

    def test_boundary_placement_matches_upstream(self, device):
        # config.hook_placement="boundary" reproduces upstream's placement: every pack at the
        # forward epilogue, every unpack at the backward prologue.
        x = torch.randn(4, 8, device=device, requires_grad=True)
        with tp_config.patch(hook_placement="boundary"):
            backend = AotEagerAndRecordGraphs()
            compiled = torch.compile(lambda x: x.sin().exp().cos(), backend=backend)
            with torch.autograd.graph.saved_tensors_hooks(*BF16):
                compiled(x).sum().backward()
        self.assertExpectedGraph(
            backend.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]"):
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(primals_x)
        exp: "f32[4, 8]" = torch.ops.aten.exp.default(sin);  sin = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(exp)
        exp_packed: "bf16[4, 8]" = torch.ops.aten._to_copy.default(exp, dtype = torch.bfloat16);  exp = None  # pack(exp)
        return (cos, primals_x, exp_packed)""",
        )
        self.assertExpectedGraph(
            backend.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", exp_packed: "bf16[4, 8]", tangents_1: "f32[4, 8]"):
        exp_unpacked: "f32[4, 8]" = torch.ops.aten._to_copy.default(exp_packed, dtype = torch.float32);  exp_packed = None  # unpack(exp)
        sin: "f32[4, 8]" = torch.ops.aten.sin.default(exp_unpacked)
        neg: "f32[4, 8]" = torch.ops.aten.neg.default(sin);  sin = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(tangents_1, neg);  tangents_1 = neg = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(exp_unpacked);  exp_unpacked = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        mul_1: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul, detach_1);  mul = detach_1 = None
        cos: "f32[4, 8]" = torch.ops.aten.cos.default(primals_x);  primals_x = None
        mul_2: "f32[4, 8]" = torch.ops.aten.mul.Tensor(mul_1, cos);  mul_1 = cos = None
        return (mul_2)""",
        )

    def test_inductor_receives_placed_graphs(self, device):
        def block(x, w1, w2):
            return x + F.linear(F.gelu(F.linear(x, w1)), w2)

        x = torch.randn(4, 8, device=device, requires_grad=True)
        w1 = torch.randn(16, 8, device=device, requires_grad=True)
        w2 = torch.randn(8, 16, device=device, requires_grad=True)
        rec = self.compile_step(block, x, w1, w2, backend=InductorAndRecordGraphs(kernels=False))
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_w1: "f32[16, 8]", primals_w2: "f32[8, 16]", primals_x: "f32[4, 8]"):
        permute: "f32[8, 16]" = torch.ops.aten.permute.default(primals_w1, [1, 0]);  primals_w1 = None
        mm: "f32[4, 16]" = torch.ops.aten.mm.default(primals_x, permute)
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm, 0.5)
        mul_1: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm, 0.7071067811865476)
        mm_packed: "bf16[4, 16]" = torch.ops.prims.convert_element_type.default(mm, torch.bfloat16);  mm = None  # pack(mm)
        erf: "f32[4, 16]" = torch.ops.aten.erf.default(mul_1);  mul_1 = None
        add: "f32[4, 16]" = torch.ops.aten.add.Tensor(erf, 1);  erf = None
        mul_2: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mul, add);  mul = add = None
        permute_1: "f32[16, 8]" = torch.ops.aten.permute.default(primals_w2, [1, 0]);  primals_w2 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(mul_2, permute_1)
        mul_2_packed: "bf16[4, 16]" = torch.ops.prims.convert_element_type.default(mul_2, torch.bfloat16);  mul_2 = None  # pack(mul_2)
        add_1: "f32[4, 8]" = torch.ops.aten.add.Tensor(primals_x, mm_1);  mm_1 = None
        permute_4: "f32[8, 16]" = torch.ops.aten.permute.default(permute_1, [1, 0]);  permute_1 = None
        permute_8: "f32[16, 8]" = torch.ops.aten.permute.default(permute, [1, 0]);  permute = None
        return (add_1, primals_x, mm_packed, mul_2_packed, permute_4, permute_8)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_x: "f32[4, 8]", mm_packed: "bf16[4, 16]", mul_2_packed: "bf16[4, 16]", permute_4: "f32[8, 16]", permute_8: "f32[16, 8]", tangents_1: "f32[4, 8]"):
        permute: "f32[8, 4]" = torch.ops.aten.permute.default(tangents_1, [1, 0])
        mul_2_unpacked: "f32[4, 16]" = torch.ops.prims.convert_element_type.default(mul_2_packed, torch.float32);  mul_2_packed = None  # unpack(mul_2)
        mm: "f32[8, 16]" = torch.ops.aten.mm.default(permute, mul_2_unpacked);  permute = mul_2_unpacked = None
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(tangents_1, permute_4);  permute_4 = None
        mm_unpacked: "f32[4, 16]" = torch.ops.prims.convert_element_type.default(mm_packed, torch.float32);  mm_packed = None  # unpack(mm)
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm_unpacked, 0.7071067811865476)
        erf: "f32[4, 16]" = torch.ops.aten.erf.default(mul);  mul = None
        add: "f32[4, 16]" = torch.ops.aten.add.Tensor(erf, 1);  erf = None
        mul_1: "f32[4, 16]" = torch.ops.aten.mul.Tensor(add, 0.5);  add = None
        mul_2: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm_unpacked, mm_unpacked)
        mul_3: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mul_2, -0.5);  mul_2 = None
        exp: "f32[4, 16]" = torch.ops.aten.exp.default(mul_3);  mul_3 = None
        mul_4: "f32[4, 16]" = torch.ops.aten.mul.Tensor(exp, 0.3989422804014327);  exp = None
        mul_5: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm_unpacked, mul_4);  mm_unpacked = mul_4 = None
        add_1: "f32[4, 16]" = torch.ops.aten.add.Tensor(mul_1, mul_5);  mul_1 = mul_5 = None
        mul_6: "f32[4, 16]" = torch.ops.aten.mul.Tensor(mm_1, add_1);  mm_1 = add_1 = None
        permute_1: "f32[16, 4]" = torch.ops.aten.permute.default(mul_6, [1, 0])
        mm_2: "f32[16, 8]" = torch.ops.aten.mm.default(permute_1, primals_x);  permute_1 = primals_x = None
        mm_3: "f32[4, 8]" = torch.ops.aten.mm.default(mul_6, permute_8);  mul_6 = permute_8 = None
        add_2: "f32[4, 8]" = torch.ops.aten.add.Tensor(tangents_1, mm_3);  tangents_1 = mm_3 = None
        return (mm_2, mm, add_2)""",
        )


class TestStructuredTrace(TestCase):
    def test_tlparse_artifact_has_graphs_before_and_after(self, device):
        # As upstream's inliner: one structured-trace artifact with the four graphs.
        import logging

        from torch._logging._internal import trace_log

        records = []

        class Capture(logging.Handler):
            def emit(self, record):
                records.append(record)

        handler = Capture()
        trace_log.addHandler(handler)
        level = trace_log.level
        trace_log.setLevel(logging.DEBUG)
        try:
            x = torch.randn(4, 8, device=device, requires_grad=True)
            w = torch.randn(8, 8, device=device, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(*BF16):
                torch.compile(lambda x, w: (x @ w).sin() @ w, backend="aot_eager")(x, w).sum().backward()
        finally:
            trace_log.removeHandler(handler)
            trace_log.setLevel(level)
        ours = [r for r in records if (getattr(r, "metadata", {}).get("artifact") or {}).get("name") == "aot_saved_tensors_hooks_graphs"]
        self.assertEqual(len(ours), 1)
        payload = ours[0].payload
        for prefix in ("forward_graph_pre", "backward_graph_pre", "forward_graph_post", "backward_graph_post"):
            self.assertIn(f"aot_{prefix}_saved_tensors_hooks:", payload)
        self.assertIn("torch.bfloat16", payload.split("aot_forward_graph_post_saved_tensors_hooks:")[1])

    def test_graphs_printed_only_for_a_listener(self, device):
        # The artifact's text is the graphs' readable code, printed as it is collected: a
        # compile with no structured trace written (no handler on its logger; torch's lazy
        # one, where no trace directory is set, removes itself at the first event) prints
        # none of the inliner's graphs.
        import sys
        from unittest import mock

        from torch._logging._internal import trace_log

        from torch_patches._functorch._aot_autograd import inline_phases

        printed_by_us = []
        print_readable = torch.fx.GraphModule.print_readable

        def recording(gm, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code is not inline_phases._log_graphs.__code__:
                frame = frame.f_back
            printed_by_us.append(frame is not None)
            return print_readable(gm, *args, **kwargs)

        x = torch.randn(4, 8, device=device, requires_grad=True)
        w = torch.randn(8, 8, device=device, requires_grad=True)
        rec = AotEagerAndRecordGraphs()
        with (
            mock.patch.object(trace_log, "handlers", []),
            mock.patch.object(torch.fx.GraphModule, "print_readable", recording),
            torch.autograd.graph.saved_tensors_hooks(*BF16),
        ):
            torch.compile(lambda x, w: (x @ w).sin() @ w, backend=rec)(x, w).sum().backward()
        self.assertTrue(hook_nodes(rec.fw_graphs[0]), "not inlined")
        self.assertNotIn(True, printed_by_us)


def bf16_pack_fn(x):
    return x.to(torch.bfloat16)


def bf16_unpack_fn(x):
    return x.to(torch.float32)


def context_reading_pack(x):
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    _get_saved_tensor_hook_context()["_node"]  # depends on which saved tensor this is
    return x.to(torch.bfloat16)


class TestTraceReuse(TestCase):
    """A hook is traced once per saved-tensor metadata, not once per saved tensor."""

    def count_traces(self, device, pack, unpack):
        """How many times compiling called ``pack`` (once per trace; inlined hooks are not
        called at run time), and the saved tensors hooked. Observed from outside (a
        profile function), so it holds for the upstream form too."""
        import sys

        calls = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code is pack.__code__:
                calls.append(frame.f_code.co_name)

        blocks = [torch.randn(16, 16, device=device, requires_grad=True) for _ in range(4)]

        def f(x, *ws):
            for w in ws:
                x = (x @ w).sin()
            return x

        x = torch.randn(8, 16, device=device, requires_grad=True)
        rec = AotEagerAndRecordGraphs()
        with torch.autograd.graph.saved_tensors_hooks(*inlineable(pack, unpack)):
            sys.setprofile(profile)
            try:
                out = torch.compile(f, backend=rec)(x, *blocks)
            finally:
                sys.setprofile(None)
            out.sum().backward()
        hooked = {m["saved"] for m in hook_nodes(rec.fw_graphs[0]).values()}
        return len(calls), hooked

    def test_same_shapes_trace_once(self, device):
        traces, hooked = self.count_traces(device, bf16_pack_fn, bf16_unpack_fn)
        self.assertGreaterEqual(len(hooked), 4)
        self.assertGreater(traces, 0)
        self.assertLess(traces, len(hooked))

    def test_hook_reading_its_context_traces_per_saved_tensor(self, device):
        traces, hooked = self.count_traces(device, context_reading_pack, bf16_unpack_fn)
        self.assertGreaterEqual(traces, len(hooked))


instantiate_device_type_tests(TestInlinePlacement, globals())
instantiate_device_type_tests(TestStructuredTrace, globals())
instantiate_device_type_tests(TestTraceReuse, globals())


if __name__ == "__main__":
    run_tests()
