"""In-graph CPU activation offload (``torch_patches.cpu_offload``, issue 7).

* The ops (``saved_tensors_hooks::offload``, ``reload_start``, ``reload_wait``): exact round trips
  on CPU for every dtype, strides kept for dense tensors, fake implementations under make_fx
  (real, fake and symbolic), ``torch.library.opcheck``.
* Inlined placement (goldens): each offload right after its saved tensor's last forward use;
  in the backward, ``reload_start`` ``config.reload_prefetch_distance`` nodes ahead of
  ``reload_wait``, which sits right before the first use.
* Numerics with ``fullgraph=True`` on aot_eager and inductor: gradients with ``cpu_offload``
  equal the no-hook gradients bit for bit (aot_eager: exactly; inductor: exactly as well,
  as the copies are exact and we compare against the same backend); ``chain(fp8_rowwise(),
  cpu_offload())`` equals ``fp8_rowwise()`` alone bit for bit on aot_eager, and is within
  fp8 tolerance of the no-hook gradients.
* Recreated ``cpu_offload()`` pairs (alone and chained) never recompile.
* Inductor never reuses the buffer an offload reads (the device-to-host copy reads it
  asynchronously on CUDA).
* CUDA only (skipped without a GPU): pinned host memory, side-stream copies.
"""

from __future__ import annotations

import contextlib
import re
import unittest
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch.fx.experimental.proxy_tensor import make_fx

import torch_patches.config as tp_config
from torch_patches.hooks import chain, cpu_offload, fp8_rowwise, is_inlineable, offload as offload_mod
from torch_patches.testing import (
    HAS_CUDA,
    AotEagerAndRecordGraphs,
    InductorAndRecordGraphs,
    TestCase,
    graph_caches_off,
    hook_nodes,
    instantiate_device_type_tests,
)

ops = torch.ops.saved_tensors_hooks


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ w1)
    h = torch.tanh(h @ w2)
    return (h @ w3).sum()


def mlp_inputs(device: str, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8, 32), (32, 32), (32, 4)]
    return [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]


def grads_of(fn: Any, inputs: list[torch.Tensor], pair: Any = None) -> list[torch.Tensor]:
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    if pair is None:
        loss = fn(*inputs)
    else:
        with torch.autograd.graph.saved_tensors_hooks(*pair):
            loss = fn(*inputs)
    return list(torch.autograd.grad(loss, inputs))


# An identity whose backward raises at run time (in the compiled backward, between a
# reload_start and its reload_wait), noting how many reloads were in flight then.
_raised_with_in_flight: list[int] = []


@torch.library.custom_op("offload_test::fails_in_backward", mutates_args=())
def _fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_fails_in_backward.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("offload_test::raise_in_backward", mutates_args=())
def _raise_in_backward(g: torch.Tensor) -> torch.Tensor:
    _raised_with_in_flight.append(len(offload_mod._in_flight))
    raise RuntimeError("boom")


@_raise_in_backward.register_fake
def _(g: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(g)


_fails_in_backward.register_autograd(lambda ctx, g: torch.ops.offload_test.raise_in_backward(g))
ops_test = torch.ops.offload_test


def offload_chain() -> Any:
    return chain(fp8_rowwise(), cpu_offload())


class TestOffloadOps(TestCase):
    def test_round_trip_exact(self, device: str) -> None:
        cases = [
            torch.randn(5, 7, device=device),
            torch.randn(7, 5, device=device).t(),  # dense, transposed strides
            torch.randn(4, 6, device=device)[:, ::2],  # not dense
            torch.randn((), device=device, dtype=torch.float64),
            torch.empty(0, 3, device=device),
            torch.randn(3, 4, device=device).to(torch.bfloat16),
            torch.randint(-5, 5, (6,), device=device),
            torch.rand(2, 3, device=device) > 0.5,
            torch.randn(2, 3, device=device, dtype=torch.complex64),
        ]
        for x in cases:
            with self.subTest(dtype=str(x.dtype), shape=tuple(x.shape), stride=x.stride()):
                cpu = ops.offload(x, True)
                self.assertEqual(cpu.device, torch.device("cpu"))
                self.assertEqual((cpu.dtype, cpu.shape), (x.dtype, x.shape))
                if is_non_overlapping_and_dense(x):
                    self.assertEqual(cpu.stride(), x.stride())
                self.assertNotEqual(cpu.data_ptr(), x.data_ptr() if x.numel() else -1)
                back = ops.reload_wait(ops.reload_start(cpu, x.device), cpu, x.device)
                self.assertEqual(back.device, x.device)
                self.assertTrue(torch.equal(back, x))
                self.assertEqual(back.stride(), cpu.stride())
                if x.numel():
                    self.assertNotEqual(back.data_ptr(), cpu.data_ptr())
                pack, unpack = cpu_offload(pin_memory=False)
                restored = unpack(pack(x))
                self.assertTrue(torch.equal(restored, x))
                self.assertEqual(restored.stride(), x.stride())  # gaps included

    def test_reload_wait_consumes_its_ticket(self, device: str) -> None:
        cpu = ops.offload(torch.randn(3, device=device), False)
        ticket = ops.reload_start(cpu, torch.device(device))
        ops.reload_wait(ticket, cpu, torch.device(device))
        with self.assertRaisesRegex(RuntimeError, "no reload in flight"):
            ops.reload_wait(ticket, cpu, torch.device(device))

    def test_unwaited_ticket_releases_its_copy(self, device: str) -> None:
        cpu = ops.offload(torch.randn(3, device=device), False)
        before = len(offload_mod._in_flight)
        ticket = ops.reload_start(cpu, torch.device(device))
        self.assertEqual(len(offload_mod._in_flight), before + 1)
        del ticket
        self.assertEqual(len(offload_mod._in_flight), before)

    def test_backward_raising_between_start_and_wait_leaks_nothing(self, device: str) -> None:
        # The inliner puts reload_start several nodes ahead of reload_wait; a backward that
        # raises in between must not keep the reloaded tensors alive.
        def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x @ w)
            return ops_test.fails_in_backward(h.sin()).sum()

        x, w = (torch.randn(8, 8, device=device, requires_grad=True) for _ in range(2))
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        with torch.autograd.graph.saved_tensors_hooks(*cpu_offload(pin_memory=False)):
            loss = compiled(x, w)
        before = len(offload_mod._in_flight)
        with self.assertRaisesRegex(RuntimeError, "boom"):
            loss.backward()
        self.assertGreater(_raised_with_in_flight[-1], before)  # reloads were under way
        del loss
        self.assertEqual(len(offload_mod._in_flight), before)

    def test_fake_impls_under_make_fx(self, device: str) -> None:
        pack, unpack = cpu_offload()
        x = torch.randn(6, 4, device=device).t()
        for mode in ("real", "fake", "symbolic"):
            with self.subTest(mode=mode):
                gm = make_fx(lambda t: unpack(pack(t)), tracing_mode=mode)(x)
                targets = [
                    n.target
                    for n in gm.graph.nodes
                    if n.op == "call_function" and n.target in (ops.offload.default, ops.reload_start.default, ops.reload_wait.default)
                ]
                self.assertEqual(
                    targets,
                    [ops.offload.default, ops.reload_start.default, ops.reload_wait.default],
                )
                vals = {n.target: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
                self.assertEqual(vals[ops.offload.default].device, torch.device("cpu"))
                self.assertEqual(vals[ops.offload.default].stride(), x.stride())
                self.assertEqual(vals[ops.reload_start.default].dtype, torch.int64)
                out = vals[ops.reload_wait.default]
                self.assertEqual((out.device, out.dtype, out.stride()), (x.device, x.dtype, x.stride()))
                self.assertTrue(torch.equal(gm(x), x))

    def test_opcheck(self, device: str) -> None:
        x = torch.randn(4, 5, device=device)
        torch.library.opcheck(ops.offload.default, (x, False))
        cpu = ops.offload(x, False)
        # reload_wait consumes its ticket, so opcheck (which calls an op repeatedly) checks
        # reload_start only, and not its output *values* (a new ticket per call); the pair
        # is checked by the round trips above.
        torch.library.opcheck(ops.reload_start.default, (cpu, x.device), test_utils=("test_schema", "test_faketensor"))

    def test_factory_is_inlineable_and_stable(self, device: str) -> None:
        from torch_patches._functorch._aot_autograd.hook_identity import hooks_guard_key

        a, b = cpu_offload(), cpu_offload()
        self.assertTrue(all(is_inlineable(f) for f in a))
        self.assertEqual(hooks_guard_key(a), hooks_guard_key(b))
        self.assertNotEqual(hooks_guard_key(a), hooks_guard_key(cpu_offload(pin_memory=False)))
        self.assertEqual(hooks_guard_key(offload_chain()), hooks_guard_key(offload_chain()))

    def test_chain_round_trip(self, device: str) -> None:
        x = torch.randn(8, 33, device=device)
        # The formats on a plain tensor (as eager hooks the default where keeps a tensor
        # that does not require grad exact).
        pack, unpack = chain(fp8_rowwise(where=None), cpu_offload())
        packed = pack(x)
        # fp8 payload and float32 scales both moved to the host; the dtype stays a constant.
        _, _, inner = packed
        self.assertEqual([p[0].device.type for p in inner], ["cpu", "cpu"])
        self.assertEqual([p[0].dtype for p in inner], [torch.float8_e4m3fn, torch.float32])
        fp8_pack, fp8_unpack = fp8_rowwise(where=None)
        self.assertTrue(torch.equal(unpack(packed), fp8_unpack(fp8_pack(x))))


class TestOffloadCompiled(TestCase):
    def test_graphs(self, device: str) -> None:
        def layer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            h = torch.mm(x, w1).relu().sin()
            return torch.mm(h, w2).cos().sum()

        rec = AotEagerAndRecordGraphs()
        x, w1, w2 = (torch.randn(8, 8, device=device, requires_grad=True) for _ in range(3))
        with tp_config.patch(reload_prefetch_distance=3):
            with torch.autograd.graph.saved_tensors_hooks(*cpu_offload()):
                loss = torch.compile(layer, backend=rec, fullgraph=True)(x, w1, w2)
        loss.backward()
        # Forward: relu, mm_1 and t (= sin, transposed for mm_1's weight gradient) are each
        # offloaded right after their last forward use. Backward: each reload_wait sits right
        # before the first use, its reload_start 3 nodes earlier (reload_prefetch_distance,
        # capped by the placeholders for mm_1); relu's copy overlaps mul, t's and two mms.
        self.assertExpectedGraph(
            rec.fw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_w1: "f32[8, 8]", primals_w2: "f32[8, 8]", primals_x: "f32[8, 8]"):
        mm: "f32[8, 8]" = torch.ops.aten.mm.default(primals_x, primals_w1)
        relu: "f32[8, 8]" = torch.ops.aten.relu.default(mm);  mm = None
        sin: "f32[8, 8]" = torch.ops.aten.sin.default(relu)
        relu_packed: "f32[8, 8]" = torch.ops.saved_tensors_hooks.offload.default(relu, True);  relu = None  # pack(relu)
        mm_1: "f32[8, 8]" = torch.ops.aten.mm.default(sin, primals_w2)
        cos: "f32[8, 8]" = torch.ops.aten.cos.default(mm_1)
        mm_1_packed: "f32[8, 8]" = torch.ops.saved_tensors_hooks.offload.default(mm_1, True);  mm_1 = None  # pack(mm_1)
        sum_1: "f32[]" = torch.ops.aten.sum.default(cos);  cos = None
        t: "f32[8, 8]" = torch.ops.aten.t.default(sin);  sin = None
        t_packed: "f32[8, 8]" = torch.ops.saved_tensors_hooks.offload.default(t, True);  t = None  # pack(t)
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(primals_w2);  primals_w2 = None
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(primals_x);  primals_x = None
        t_3: "f32[8, 8]" = torch.ops.aten.t.default(primals_w1);  primals_w1 = None
        return (sum_1, relu_packed, mm_1_packed, t_packed, t_1, t_2, t_3)""",
        )
        self.assertExpectedGraph(
            rec.bw_graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, relu_packed: "f32[8, 8]", mm_1_packed: "f32[8, 8]", t_packed: "f32[8, 8]", t_1: "f32[8, 8]", t_2: "f32[8, 8]", t_3: "f32[8, 8]", tangents_1: "f32[]"):
        reload_start_default: "i64[]" = torch.ops.saved_tensors_hooks.reload_start.default(mm_1_packed, device(type='DEVICE'), [8, 1])  # unpack(mm_1)
        expand: "f32[8, 8]" = torch.ops.aten.expand.default(tangents_1, [8, 8]);  tangents_1 = None
        mm_1_unpacked: "f32[8, 8]" = torch.ops.saved_tensors_hooks.reload_wait.default(reload_start_default, mm_1_packed, device(type='DEVICE'), [8, 1]);  reload_start_default = mm_1_packed = None  # unpack(mm_1)
        sin: "f32[8, 8]" = torch.ops.aten.sin.default(mm_1_unpacked);  mm_1_unpacked = None
        reload_start_default_1: "i64[]" = torch.ops.saved_tensors_hooks.reload_start.default(t_packed, device(type='DEVICE'), [1, 8])  # unpack(t)
        neg: "f32[8, 8]" = torch.ops.aten.neg.default(sin);  sin = None
        reload_start_default_2: "i64[]" = torch.ops.saved_tensors_hooks.reload_start.default(relu_packed, device(type='DEVICE'), [8, 1])  # unpack(relu)
        mul: "f32[8, 8]" = torch.ops.aten.mul.Tensor(expand, neg);  expand = neg = None
        t_unpacked: "f32[8, 8]" = torch.ops.saved_tensors_hooks.reload_wait.default(reload_start_default_1, t_packed, device(type='DEVICE'), [1, 8]);  reload_start_default_1 = t_packed = None  # unpack(t)
        mm: "f32[8, 8]" = torch.ops.aten.mm.default(t_unpacked, mul);  t_unpacked = None
        mm_1: "f32[8, 8]" = torch.ops.aten.mm.default(mul, t_1);  mul = t_1 = None
        relu_unpacked: "f32[8, 8]" = torch.ops.saved_tensors_hooks.reload_wait.default(reload_start_default_2, relu_packed, device(type='DEVICE'), [8, 1]);  reload_start_default_2 = relu_packed = None  # unpack(relu)
        cos: "f32[8, 8]" = torch.ops.aten.cos.default(relu_unpacked)
        mul_1: "f32[8, 8]" = torch.ops.aten.mul.Tensor(mm_1, cos);  mm_1 = cos = None
        detach: "f32[8, 8]" = torch.ops.aten.detach.default(relu_unpacked);  relu_unpacked = None
        detach_1: "f32[8, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        threshold_backward: "f32[8, 8]" = torch.ops.aten.threshold_backward.default(mul_1, detach_1, 0);  mul_1 = detach_1 = None
        mm_2: "f32[8, 8]" = torch.ops.aten.mm.default(t_2, threshold_backward);  t_2 = None
        mm_3: "f32[8, 8]" = torch.ops.aten.mm.default(threshold_backward, t_3);  threshold_backward = t_3 = None
        return (mm_2, mm, mm_3)""",
        )

    def unpack_order(self, rec: AotEagerAndRecordGraphs) -> dict[str, tuple[int, int]]:
        """saved name -> (index of its last reload_start, index of its first reload_wait)."""
        marks = hook_nodes(rec.bw_graphs[0])
        starts: dict[str, int] = {}
        waits: dict[str, int] = {}
        for i, node in enumerate(rec.bw_graphs[0].graph.nodes):
            if node.name not in marks:
                continue
            saved = marks[node.name]["saved"]
            if node.target is ops.reload_start.default:
                starts[saved] = i
            elif node.target is ops.reload_wait.default:
                waits.setdefault(saved, i)
        self.assertEqual(set(starts), set(waits))
        return {s: (starts[s], waits[s]) for s in starts}

    def test_prefetch_distance_knobs(self, device: str) -> None:
        inputs = mlp_inputs(device)
        gaps = {}
        for reload_d, unpack_d in ((0, 0), (4, 0), (1, 3)):
            rec = AotEagerAndRecordGraphs()
            torch._dynamo.reset()
            with tp_config.patch(reload_prefetch_distance=reload_d, unpack_prefetch_distance=unpack_d):
                grads_of(torch.compile(mlp, backend=rec, fullgraph=True), inputs, cpu_offload())
            order = self.unpack_order(rec)
            self.assertTrue(order)
            self.assertTrue(all(s < w for s, w in order.values()), order)
            gaps[(reload_d, unpack_d)] = order
        # Distance 0: reload_start immediately before its reload_wait.
        self.assertTrue(all(w - s == 1 for s, w in gaps[(0, 0)].values()), gaps[(0, 0)])
        # A distance moves reload_start ahead; max() of the two knobs counts.
        self.assertGreater(sum(w - s for s, w in gaps[(4, 0)].values()), len(gaps[(4, 0)]))
        self.assertGreater(sum(w - s for s, w in gaps[(1, 3)].values()), len(gaps[(1, 3)]))

    def check_numerics(self, device: str, backend: str) -> None:
        inputs = mlp_inputs(device)
        rec = AotEagerAndRecordGraphs() if backend == "aot_eager" else InductorAndRecordGraphs()
        with functorch_config.patch(saved_tensors_hooks_filtering_mode="all"):
            torch._dynamo.reset()
            ref = grads_of(torch.compile(mlp, backend=backend, fullgraph=True), inputs)
            torch._dynamo.reset()
            got = grads_of(torch.compile(mlp, backend=rec, fullgraph=True), inputs, cpu_offload())
        self.assertTrue(hook_nodes(rec.fw_graphs[0]) and hook_nodes(rec.bw_graphs[0]), "not inlined")
        fw_targets = {n.target for n in rec.fw_graphs[0].graph.nodes}
        self.assertIn(ops.offload.default, fw_targets)
        # Offload is exact: the same gradients as the same backend without hooks.
        self.assertGradsEqual(got, ref, exact=True)
        self.assertGradsEqual(grads_of(mlp, inputs, cpu_offload()), grads_of(mlp, inputs), exact=True)

        # Compress, then offload: exactly fp8_rowwise's result (offloading is lossless), and
        # close to the no-hook gradients.
        with functorch_config.patch(saved_tensors_hooks_filtering_mode="all"):
            torch._dynamo.reset()
            fp8 = grads_of(torch.compile(mlp, backend=backend, fullgraph=True), inputs, fp8_rowwise())
            torch._dynamo.reset()
            rec = AotEagerAndRecordGraphs() if backend == "aot_eager" else InductorAndRecordGraphs()
            chained = grads_of(torch.compile(mlp, backend=rec, fullgraph=True), inputs, offload_chain())
        targets = [n.target for n in rec.bw_graphs[0].graph.nodes]
        self.assertEqual(targets.count(ops.reload_start.default), targets.count(ops.reload_wait.default))
        self.assertGreaterEqual(targets.count(ops.reload_start.default), 2)
        if backend == "aot_eager":
            self.assertGradsEqual(chained, fp8, exact=True)
        else:
            self.assertGradsEqual(chained, fp8, atol=1e-5, rtol=1e-5)
        # fp8 e4m3 keeps 3 mantissa bits (relative error up to 2^-4 per saved element): the
        # gradients stay within a few percent of the no-hook ones, in norm.
        for i, (c, r) in enumerate(zip(chained, ref)):
            rel = ((c - r).norm() / r.norm()).item()
            self.assertLess(rel, 0.1, f"gradient {i}")

    def test_numerics_aot_eager(self, device: str) -> None:
        self.check_numerics(device, "aot_eager")

    @pytest.mark.slow  # Inductor's compile; fast twins: the aot_eager numerics, the Inductor codegen test
    def test_numerics_inductor(self, device: str) -> None:
        self.check_numerics(device, "inductor")

    def test_recreated_pairs_do_not_recompile(self, device: str) -> None:
        for name, factory in (("cpu_offload", cpu_offload), ("fp8+offload", offload_chain)):
            with self.subTest(name):
                torch._dynamo.reset()
                counter = CompileCounterWithBackend("aot_eager")
                compiled = torch.compile(mlp, backend=counter, fullgraph=True)
                inputs = mlp_inputs(device)
                first = None
                for _ in range(4):
                    grads = grads_of(compiled, inputs, factory())
                    first = first or grads
                    self.assertGradsEqual(grads, first, exact=True)
                self.assertEqual(counter.frame_count, 1)

    def test_inductor_frees_offloaded_buffers_without_reuse(self, device: str) -> None:
        # On CUDA the device-to-host copy still reads an offloaded buffer after offload
        # returns: Inductor must not hand that buffer to a later kernel (`bufN = bufM;
        # del bufM  # reuse`); mm outputs of one shape give it every opportunity. Nor may
        # the kernel reading it last write its output into it in place: gelu's input is
        # offloaded before the fused gelu kernel runs (Inductor realizes pointwise ops
        # lazily), and that kernel is the in-place candidate (same `# reuse` line). But it
        # must free it right after the offload (`del bufM`), or nothing is saved.
        from torch._inductor.utils import run_and_get_code

        def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
            a = F.gelu(torch.mm(x, w1))
            b = torch.mm(a.sin(), w2)
            c = torch.mm(b.relu(), w3)
            return torch.mm(c.tanh(), w3).sum()

        inputs = [torch.randn(16, 16, device=device, requires_grad=True) for _ in range(4)]
        compiled = torch.compile(f, backend="inductor", fullgraph=True)
        pair = cpu_offload()

        def step() -> torch.Tensor:
            with torch.autograd.graph.saved_tensors_hooks(*pair):
                return compiled(*inputs)

        with graph_caches_off():
            _, codes = run_and_get_code(step)
        fw = codes[0]
        offloaded = set(re.findall(r"saved_tensors_hooks\.offload\.default\((?:reinterpret_tensor\()?(buf\d+)", fw))
        self.assertTrue(offloaded, fw)
        reused = set(re.findall(r"= (buf\d+); del buf\d+  # reuse", fw))
        self.assertFalse(offloaded & reused, fw)
        lines = fw.splitlines()
        for buf in offloaded:
            at = next(i for i, line in enumerate(lines) if re.search(rf"offload\.default\((reinterpret_tensor\()?{buf}\b", line))
            freed = next((i for i, line in enumerate(lines) if line.strip() == f"del {buf}"), len(lines))
            # Right after its last reader: a kernel between the offload and the `del` must
            # read the buffer (the fused kernel of gelu reading mm's output), none other.
            between = [line.strip() for line in lines[at + 1 : freed]]
            kernels = [b for b in between if re.search(r"cpp_fused|triton_|extern_kernels|\.default\(", b)]
            self.assertTrue(
                freed < len(lines) and all(re.search(rf"\b{buf}\b", k) for k in kernels),
                f"{buf} not freed right after its offload and last reader:\n{fw}",
            )

    @pytest.mark.slow  # two Inductor compiles; fast twin: TestOffloadOrderPatch (the wrapper alone)
    def test_peak_memory_reorder_keeps_the_inliners_order(self, device: str) -> None:
        # Inductor's reorder_for_peak_memory counts offload's host copy as device memory and
        # cannot see the device tensor reload_start allocates (it outputs a 0-d CPU ticket):
        # on an H100 (torch 2.11, mlp8 8192 x 4096) its chosen order started every reload at
        # the backward's start, a peak of 1.00x of no hooks where the inliner's order gives
        # 0.55x. Graphs holding these ops are planned with no candidate order (Inductor logs
        # only the baseline's estimate); other graphs still try theirs.
        inputs = mlp_inputs(device)
        with graph_caches_off(), torch._inductor.config.patch(reorder_for_peak_memory=True):
            for hooks, candidates in ((cpu_offload(), False), (None, True)):
                torch._dynamo.reset()
                with self.assertLogs("torch._inductor.memory", level="INFO") as logs:
                    grads_of(torch.compile(mlp, backend="inductor", fullgraph=True), inputs, hooks)
                planned = [m for m in logs.output if "Baseline peak memory" in m]
                tried = [m for m in logs.output if "topological_sort_" in m]
                self.assertEqual(len(planned), 2, logs.output)  # the forward and the backward
                self.assertEqual(bool(tried), candidates, logs.output)

    def test_eager_hooks_exact(self, device: str) -> None:
        # Not compiled: the pair runs as ordinary saved-tensor hooks.
        inputs = mlp_inputs(device)
        self.assertGradsEqual(grads_of(mlp, inputs, cpu_offload()), grads_of(mlp, inputs), exact=True)
        self.assertGradsEqual(grads_of(mlp, inputs, offload_chain()), grads_of(mlp, inputs, fp8_rowwise()), exact=True)


@unittest.skipIf(not HAS_CUDA, "no CUDA device")
class TestOffloadCUDA(TestCase):
    """The stream path (measured on an H100: benchmarks/results/gpu-check.md)."""

    def test_offload_is_pinned_and_async(self) -> None:
        x = torch.randn(1024, 1024, device="cuda")
        cpu = ops.offload(x, True)
        self.assertTrue(cpu.is_pinned())
        self.assertFalse(ops.offload(x, False).is_pinned())
        back = ops.reload_wait(ops.reload_start(cpu, x.device), cpu, x.device)
        self.assertTrue(torch.equal(back, x))

    def test_source_freed_early_stays_intact(self) -> None:
        # The source is dropped right after offload and its memory immediately requested
        # again (and overwritten) on the current stream: the op holds the source until the
        # current stream has waited for its copy, so that allocation cannot take it early.
        for _ in range(5):
            x = torch.randn(2048, 2048, device="cuda")
            expect = x.cpu()
            cpu = ops.offload(x, True)
            del x
            y = torch.empty(2048, 2048, device="cuda").fill_(7.0)
            back = ops.reload_wait(ops.reload_start(cpu, y.device), cpu, y.device)
            self.assertTrue(torch.equal(back.cpu(), expect))

    def test_compiled_cuda(self) -> None:
        inputs = mlp_inputs("cuda")
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            ref = grads_of(torch.compile(mlp, backend=backend, fullgraph=True), inputs)
            torch._dynamo.reset()
            got = grads_of(torch.compile(mlp, backend=backend, fullgraph=True), inputs, cpu_offload())
            self.assertGradsEqual(got, ref, exact=True)

    def test_compiled_cuda_large_copies_race_nothing(self) -> None:
        # Copies of 16 MiB take long enough for any kernel Inductor let write an offloaded
        # buffer (reuse, in place: the fused gelu after mm) to overwrite it mid-copy.
        gen = torch.Generator().manual_seed(0)
        inputs = [(torch.randn(s, generator=gen) / s[0] ** 0.5).cuda().requires_grad_() for s in [(2048, 2048)] * 4]
        torch._dynamo.reset()
        ref = grads_of(torch.compile(mlp, backend="inductor", fullgraph=True), inputs)
        torch._dynamo.reset()
        compiled = torch.compile(mlp, backend="inductor", fullgraph=True)
        for _ in range(3):
            got = grads_of(compiled, inputs, cpu_offload())
            self.assertGradsEqual(got, ref, exact=True)

    def test_offloaded_step_frees_device_memory(self) -> None:
        # Before issue 39's fix, on an H100: the allocated peak equalled no hooks' (every
        # reload hoisted to the backward's start) and the active and reserved bytes were
        # 1.8x no hooks' (record_stream kept each offloaded block until the GPU passed its
        # free, and the host runs a step ahead). Now: well below, with nothing held past
        # its copy (active == allocated).
        def block() -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False), torch.nn.GELU(), torch.nn.Linear(2048, 1024, bias=False))

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[block() for _ in range(4)]).cuda()
        x = torch.randn(8192, 1024, device="cuda", requires_grad=True)

        def measure(hooks: Any) -> tuple[int, int, list[torch.Tensor]]:
            torch._dynamo.reset()
            fn = torch.compile(model, backend="inductor")

            def step() -> list[torch.Tensor]:
                with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
                    y = fn(x)
                return list(torch.autograd.grad(y.square().sum(), [x, *model.parameters()]))

            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = step()
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            return stats["allocated_bytes.all.peak"] - base, stats["active_bytes.all.peak"] - base, grads

        ref_peak, _, ref = measure(None)
        peak, active, got = measure(cpu_offload())
        self.assertGradsEqual(got, ref, exact=True)
        self.assertLess(peak, 0.6 * ref_peak, (peak, ref_peak))
        self.assertLessEqual(active, peak + 2**20, (active, peak))


# upstream: not exported
class TestOffloadOrderPatch(unittest.TestCase):
    # The wrapper of reorder_for_peak_memory alone (the patch form's; upstream changes the
    # function itself), no compile: scheduler nodes holding an
    # offload op get no candidate orders, other graphs keep theirs.
    def test_graphs_with_offload_ops_keep_their_order(self) -> None:
        from types import SimpleNamespace

        from torch_patches._inductor.memory import make_reorder_for_peak_memory

        def snode(name: str, op: Any) -> Any:
            inner = SimpleNamespace(node=SimpleNamespace(op_overload=op), get_name=lambda: name)
            return SimpleNamespace(get_nodes=lambda: [inner])

        calls = []
        wrapped = make_reorder_for_peak_memory(lambda nodes, *args, **kwargs: calls.append((args, kwargs)) or nodes)
        plain = [snode("buf0", torch.ops.aten.mm.default), snode("buf1", None)]
        held = [*plain, snode("buf2", torch.ops.saved_tensors_hooks.reload_start.default)]
        orders = ["topological_sort_lpmf", "topological_sort_bfs"]
        self.assertIs(wrapped(plain, {}, {}, set(), set(), orders), plain)
        self.assertIs(wrapped(held, {}, {}, set(), set(), orders), held)
        wrapped(held, {}, {}, set(), set(), methods=orders)
        wrapped(plain, {}, {}, set(), set(), methods=orders)
        self.assertEqual([c[0][4:] for c in calls[:2]], [(orders,), ([],)])
        self.assertEqual([c[1] for c in calls[2:]], [{"methods": []}, {"methods": orders}])


instantiate_device_type_tests(TestOffloadOps, globals())
instantiate_device_type_tests(TestOffloadCompiled, globals())


if __name__ == "__main__":
    run_tests()
