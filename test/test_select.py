"""Which saved tensors a hook compresses: ``select(pack, unpack, where=...)`` and the
numerics-safe default of the ready-made lossy hooks.

The model is RoPE in miniature: large angles (a projection times 64) feed cos/sin, which
rotate an activation. Eager saves cos/sin (bounded); the compiled graph saves
the angles and recomputes cos/sin in the backward, so a lossy hook on the angles moves them
by whole radians. The default selection leaves them alone.
"""

import torch
import torch._functorch.config as functorch_config
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend

from torch_patches.hooks import bf16, fp8_rowwise, select
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    TestCase,
    hook_nodes,
    instantiate_device_type_tests,
)


def rope(x, w, wf):
    h = x @ w
    angles = (x @ wf) * 64.0  # partitioner: saved, cos/sin recomputed in the backward
    return (h * angles.cos() + h.roll(1, -1) * angles.sin()).tanh()


def inputs(device, n=256, d=64):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen).to(device).requires_grad_()
    w = (torch.randn(d, d, generator=gen) / d**0.5).to(device).requires_grad_()
    wf = (torch.randn(d, d, generator=gen) / d**0.5).to(device).requires_grad_()
    return x, w, wf


def grads(fn, args, hooks=None):
    args = [a.detach().clone().requires_grad_() for a in args]
    ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        fn(*args).sum().backward()
    return [a.grad for a in args]


def rel_err(got, ref):
    return max(((g - r).norm() / r.norm()).item() for g, r in zip(got, ref))


class TestSelect(TestCase):
    def test_default_keeps_rope_angles_and_matches_eager_error(self, device):
        args = inputs(device)
        ref = grads(rope, args)
        for factory in (bf16, fp8_rowwise):
            with self.subTest(hook=factory.__name__):
                eager = rel_err(grads(rope, args, factory()), ref)
                torch._dynamo.reset()
                rec = AotEagerAndRecordGraphs()
                ours = rel_err(grads(torch.compile(rope, backend=rec, fullgraph=True), args, factory()), ref)
                torch._dynamo.reset()
                everything = rel_err(grads(torch.compile(rope, backend="aot_eager", fullgraph=True), args, factory(where=None)), ref)
                # Compressing the angles costs far more than the rest; the default does not.
                self.assertLessEqual(ours, 1.5 * eager, (ours, eager, everything))
                self.assertGreater(everything, 10 * ours, (ours, eager, everything))
                if factory is bf16:  # past the 1.5x budget
                    self.assertGreater(everything, 1.5 * eager, (ours, eager, everything))
                saved = {meta["saved"] for meta in hook_nodes(rec.fw_graphs[0]).values()}
                self.assertTrue(saved)  # other activations are still compressed

    def test_predicate_sees_compile_time_context(self, device):
        seen = []

        def where(info):
            seen.append(info)
            return info.nbytes >= 4096

        args = inputs(device)
        with functorch_config.patch(saved_tensors_hooks_filtering_mode="all"):
            grads(torch.compile(rope, backend="aot_eager", fullgraph=True), args, select(*bf16(where=None), where=where))
        by_consumer = {op for info in seen for op in info.backward_consumers}
        self.assertTrue(all(info.compiled and info.scope == "ambient" for info in seen))
        angles = [i for i in seen if {"aten.cos.default", "aten.sin.default"} & set(i.backward_consumers)]
        self.assertTrue(angles, by_consumer)
        self.assertIn(angles[0].producer, ("aten.mul.Tensor", "aten.mm.default"))
        self.assertEqual((angles[0].dtype, angles[0].nbytes), (torch.float32, 256 * 64 * 4))
        self.assertTrue(all(i.producer.startswith("aten.") and not i.is_input for i in seen))

    def test_eager_context_and_selection(self, device):
        seen = []
        base = bf16(where=None)
        pack, unpack = select(*base, where=lambda info: seen.append(info) or info.nbytes >= 1024)
        x = torch.randn(64, 64, device=device, requires_grad=True)
        small = torch.randn(4, device=device, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x.exp() * 3).sum() + (small.exp()).sum()
        y.backward()
        exp_info = [i for i in seen if i.producer == "ExpBackward0"]
        self.assertTrue(exp_info)
        self.assertTrue(all(i.backward_consumers is None and not i.compiled for i in seen))
        # The small exp result was kept exact: its gradient is exp(small) exactly.
        self.assertEqual(small.grad, small.detach().exp(), atol=0, rtol=0)
        self.assertNotEqual(x.grad, x.detach().exp() * 3)  # the big one went through bf16

    def test_in_region_scope_and_fullgraph(self, device):
        hooks = bf16()

        def fn(x, w, wf):
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                return rope(x, w, wf)

        args = inputs(device)
        rec = AotEagerAndRecordGraphs()
        got = grads(torch.compile(fn, backend=rec, fullgraph=True), args)
        torch._dynamo.reset()
        ambient = grads(torch.compile(rope, backend="aot_eager", fullgraph=True), args, bf16())
        self.assertGradsEqual(got, ambient, exact=True)
        self.assertTrue(hook_nodes(rec.fw_graphs[0]))

    def test_predicate_is_part_of_the_identity(self, device):
        threshold = {"bytes": 1 << 30}

        def where(info):
            return info.nbytes >= threshold["bytes"]

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(rope, backend=counter)
        args = inputs(device)
        hooks = select(*bf16(where=None), where=where)
        none_hooked = grads(compiled, args, hooks)
        threshold["bytes"] = 0
        all_hooked = grads(compiled, args, hooks)
        self.assertEqual(counter.frame_count, 2)
        self.assertFalse(torch.equal(none_hooked[0], all_hooked[0]))
        torch._dynamo.reset()
        self.assertGradsEqual(all_hooked, grads(torch.compile(rope, backend="aot_eager"), args, hooks), exact=True)

    def test_predicate_error_names_hook_and_tensor(self, device):
        def where(info):
            raise ValueError("no opinion")

        with self.assertRaisesHookError("where= predicate .*where.* raised ValueError: no opinion"):
            grads(torch.compile(rope, backend="aot_eager", fullgraph=True), inputs(device), select(*bf16(where=None), where=where))

    def test_records_name_producer_bytes_and_reason(self, device):
        from torch_patches.testing import saved_tensor_records

        with saved_tensor_records() as compiled:
            grads(torch.compile(rope, backend="aot_eager", fullgraph=True), inputs(device), bf16())
        (graph,) = compiled
        angles = [r for r in graph.records if r.decided_by == "select" and not r.hooked]
        self.assertTrue(angles, graph.records)
        for r in angles:
            self.assertEqual((r.dtype, r.shape, r.nbytes, r.tolerance), (torch.float32, (256, 64), 65536, "exact"))
            self.assertIn(r.producer, ("aten.mul.Tensor", "aten.mm.default"))
            self.assertTrue({"aten.cos.default[self]", "aten.sin.default[self]"} & set(r.readers), r.readers)
            self.assertRegex(r.reason, r"^not selected by where=\S*numerics_safe\(storage='bf16'\)")
        hooked = graph.by_decision("hooked")
        self.assertTrue(hooked)
        for r in hooked:
            self.assertIn("bf16_pack", r.hooks)
            self.assertEqual(r.packed_bytes, r.nbytes // 2)
            self.assertIsNotNone(r.pack_after)
            self.assertIsNotNone(r.unpack_before)

    def test_records_name_the_module_that_computed_them(self, device):
        # Module paths as named_modules() gives them, whether the compiled module's frame
        # calls it self or fn (torch versions differ), through ModuleList and Sequential.
        from torch_patches._functorch._aot_autograd.saved_tensor_collect import named_module_path
        from torch_patches.testing import saved_tensor_records

        for source, path in (
            ("L['self'].layers[0]._modules['fc']", "layers.0.fc"),
            ("L['fn'].3.up", "3.up"),
            ("L['self'].lm.model.layers.0.mlp", "lm.model.layers.0.mlp"),
            ("G['model'].blocks['a']", "model.blocks.a"),
            ("L['self']", ""),
        ):
            self.assertEqual(named_module_path(source), path)

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up = torch.nn.Linear(8, 16)
                self.down = torch.nn.Linear(16, 8)

            def forward(self, x):
                return x + self.down(torch.relu(self.up(x)))

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([Block(), Block()])
                self.head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return self.head(x).sum()

        model = Net().to(device)
        names = {name for name, _ in model.named_modules()}
        with saved_tensor_records() as compiled, torch.autograd.graph.saved_tensors_hooks(*bf16()):
            loss = torch.compile(model, backend="aot_eager")(torch.randn(4, 8, device=device))
        loss.backward()
        (graph,) = compiled
        activations = [r for r in graph.records if not r.is_input]
        self.assertTrue(activations)
        self.assertLessEqual({r.module for r in activations}, names)
        self.assertLessEqual({"layers.0", "layers.1"}, {r.module for r in activations})  # relu's outputs
        # A saved parameter is named by the module owning it (the batch by "").
        inputs = {r.module for r in graph.records if r.is_input}
        self.assertLessEqual(inputs, names)
        self.assertIn("layers.1.up", inputs)
        self.assertIn("module layers.1", " ".join(r.line() for r in activations))

    def test_debug_log_writes_the_records(self, device):
        from torch_patches import _logging as tp_logging
        from torch_patches.testing import saved_tensor_records

        logger = tp_logging.artifact_logger("torch._functorch._aot_autograd.graph_compile")
        with self.assertLogs(logger, level="DEBUG") as captured, saved_tensor_records() as compiled:
            grads(torch.compile(rope, backend="aot_eager", fullgraph=True), inputs(device), bf16())
        (graph,) = compiled
        messages = [r.getMessage() for r in captured.records]
        for r in graph.records:
            self.assertIn(r.line(), messages)


class TestNumericsSafe(TestCase):
    def test_gelu_input_is_compressed_under_inductor_decomposition(self, device):
        from torch_patches.testing import InductorAndRecordGraphs

        def mlp(x, w1, w2):
            return torch.nn.functional.gelu(x @ w1) @ w2

        gen = torch.Generator().manual_seed(0)
        args = [(torch.randn(64, 64, generator=gen) / 8).to(device).requires_grad_() for _ in range(3)]
        rec = InductorAndRecordGraphs(kernels=False)
        grads(torch.compile(mlp, backend=rec, fullgraph=True), args, bf16())
        fw = rec.fw_graphs[0]
        saved = {meta["saved"] for meta in hook_nodes(fw).values()}
        mm = [n.name for n in fw.graph.nodes if n.target is torch.ops.aten.mm.default]
        self.assertIn(mm[0], saved, (mm, saved))  # x @ w1: GELU's input


instantiate_device_type_tests(TestSelect, globals())
instantiate_device_type_tests(TestNumericsSafe, globals())


if __name__ == "__main__":
    run_tests()
