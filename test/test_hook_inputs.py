"""Tensors ambient hooks read are runtime inputs of the compiled graphs.

A hook that reads a tensor the loop updates in place (a delayed scale) is traced with that
tensor as an input (``hook_inputs.find_inputs``, ``_dynamo/symbolic_convert.py``): Dynamo
guards its metadata, never its values or identity. Checked here:

* the issue's example: an inlineable pair ``(x * scale).to(bf16)`` / ``p.float() / scale``
  on a 4-layer MLP with ``scale.mul_(0.8).add_(0.05)`` after every step compiles once, and
  every step's gradients equal the same hooks as eager Python hooks on the same compiled
  function (bit for bit under aot_eager) and a fresh compile with the current value;
* rebinding the name to another tensor of the same metadata compiles nothing and reads it;
  other metadata recompiles once;
* the forward graph takes the tensor as an input (no constant), the backward reads it as
  it is when the backward runs (an update in between is seen, as eager's unpack sees it);
* compiled autograd and dynamic shapes: the same, one compile;
* hooks entered inside the region: the same, the tensors being inputs at sources built from
  the hooks' own; two scopes reading different tensors of one metadata stay two scopes;
* what cannot be lifted: a hook reading the tensor's value into Python is not inlined (one
  warning; an error under fullgraph); a tensor subclass stays a constant, keyed by value,
  and a warning names the hook, the path and the reason;
* across fresh processes sharing a cache directory, a second process with another value
  hits AOTAutogradCache and computes with its own value, ambient and in-region (slow).
"""

import contextlib
import itertools
import os
import tempfile
import warnings

import pytest
import torch
import torch._functorch.config as functorch_config
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend

from torch_patches.hooks import inlineable
from torch_patches.testing import AotEagerAndRecordGraphs, TestCase, hook_warnings, instantiate_device_type_tests


class Scaled:
    """An inlineable bf16 pair that scales by ``self.scale`` (a tensor the loop updates)."""

    def __init__(self, scale, device):
        self.scale = torch.tensor(scale, device=device)

    def hooks(self):
        def pack(x):
            return (x * self.scale).to(torch.bfloat16)

        def unpack(p):
            return p.to(torch.float32) / self.scale

        return inlineable(pack, unpack)


def python_hooks(hooks):
    """The same hooks as plain Python hooks (not inlineable): eager hook semantics."""
    pack, unpack = hooks
    return (lambda t: pack(t)), (lambda t: unpack(t))


def mlp(device):
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.GELU())]
    return torch.nn.Sequential(*layers).to(device)


def grads(fn, model, x, hooks=None):
    with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
        fn(x).sum().backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


class TestHookInputs(TestCase):
    def setUp(self):
        super().setUp()
        # Python hooks see every saved tensor too: the same saved set, bit-exact on aot_eager.
        patch = functorch_config.patch(saved_tensors_hooks_filtering_mode="all")
        patch.__enter__()
        self.addCleanup(patch.__exit__, None, None, None)

    def test_in_place_updates_compile_once_aot_eager(self, device):
        model, holder = mlp(device), Scaled(1.0, device)
        x = torch.randn(16, 32, device=device)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter)
        eager_hooks = torch.compile(model, backend="aot_eager")
        before = None
        for _ in range(12):
            got = grads(compiled, model, x, holder.hooks())
            want = grads(eager_hooks, model, x, python_hooks(holder.hooks()))
            self.assertGradsEqual(got, want, exact=True)
            if before is not None:  # the value reaches the graph: the rounding moves
                self.assertFalse(all(torch.equal(a, b) for a, b in zip(got, before)))
            before, last = got, holder.scale.clone()
            with torch.no_grad():
                holder.scale.mul_(0.8).add_(0.05)
        self.assertEqual(counter.frame_count, 1)
        with torch.no_grad():
            holder.scale.copy_(last)  # back to the value of the last step
        torch._dynamo.reset()
        fresh = grads(torch.compile(model, backend="aot_eager"), model, x, holder.hooks())
        self.assertGradsEqual(got, fresh, exact=True)

    @pytest.mark.slow
    def test_fifty_updates_compile_once(self, device):
        for backend, where in itertools.product(("aot_eager", "inductor"), ("ambient", "in_region")):
            with self.subTest(backend=backend, where=where):
                torch._dynamo.reset()
                model, holder = mlp(device), Scaled(1.0, device)
                x = torch.randn(16, 32, device=device)
                counter = CompileCounterWithBackend(backend)
                eager_hooks = torch.compile(model, backend=backend)
                if where == "ambient":
                    compiled = torch.compile(model, backend=counter)
                    step = lambda: grads(compiled, model, x, holder.hooks())  # noqa: E731
                else:

                    def in_region(hooks):
                        with torch.autograd.graph.saved_tensors_hooks(*hooks):
                            return model(x)

                    scoped = torch.compile(in_region, backend=counter, fullgraph=True)
                    step = lambda: grads(lambda _: scoped(holder.hooks()), model, x)  # noqa: E731
                for _ in range(50):
                    got = step()
                    want = grads(eager_hooks, model, x, python_hooks(holder.hooks()))
                    self.assertGradsEqual(got, want, exact=backend == "aot_eager")
                    with torch.no_grad():
                        holder.scale.mul_(0.8).add_(0.05)
                self.assertEqual(counter.frame_count, 1)

    def test_hooks_reading_several_tensors_compile_once(self, device):
        # A scale and an amax history, both updated every step; ambient and in-region. One
        # input object per tensor: Dynamo's no-aliasing guard compares their ids.
        scale = torch.tensor(1.5, device=device)
        history = torch.ones(4, device=device)

        def pack(x):
            return (x * scale).to(torch.bfloat16)

        def unpack(p):
            return p.to(torch.float32) / scale * (history.max() / history.max())

        hooks = inlineable(pack, unpack)
        model = mlp(device)
        x = torch.randn(16, 32, device=device)
        eager_hooks = torch.compile(model, backend="aot_eager")

        def in_region(h):
            with torch.autograd.graph.saved_tensors_hooks(*h):
                return model(x)

        ambient = CompileCounterWithBackend("aot_eager")
        scoped = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=ambient)
        compiled_scope = torch.compile(in_region, backend=scoped, fullgraph=True)
        for step in range(20):
            want = grads(eager_hooks, model, x, python_hooks(hooks))
            self.assertGradsEqual(grads(compiled, model, x, hooks), want, exact=True)
            self.assertGradsEqual(grads(lambda _: compiled_scope(hooks), model, x), want, exact=True)
            with torch.no_grad():
                scale.mul_(0.9).add_(0.07)
                history[step % 4] = step + 1.0
        self.assertEqual((ambient.frame_count, scoped.frame_count), (1, 1))

    def test_rebinding_reads_the_new_tensor(self, device):
        model, holder = mlp(device), Scaled(1.0, device)
        x = torch.randn(16, 32, device=device)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter)
        first = grads(compiled, model, x, holder.hooks())
        holder.scale = torch.tensor(3.0, device=device)  # another tensor, same metadata
        got = grads(compiled, model, x, holder.hooks())
        self.assertEqual(counter.frame_count, 1)
        self.assertFalse(all(torch.equal(a, b) for a, b in zip(got, first)))
        want = grads(torch.compile(model, backend="aot_eager"), model, x, python_hooks(holder.hooks()))
        self.assertGradsEqual(got, want, exact=True)
        holder.scale = torch.tensor([3.0], device=device)  # other metadata: one recompile
        got = grads(compiled, model, x, holder.hooks())
        self.assertEqual(counter.frame_count, 2)
        want = grads(torch.compile(model, backend="aot_eager"), model, x, python_hooks(holder.hooks()))
        self.assertGradsEqual(got, want, exact=True)

    def test_update_between_forward_and_backward_is_seen(self, device):
        # As eager's unpack: the backward reads the tensor as it is then, and autograd's
        # saved-tensor version check does not take the update for a corruption.
        model, holder = mlp(device), Scaled(1.5, device)
        x = torch.randn(16, 32, device=device)

        def step(fn, hooks):
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                loss = fn(x).sum()
            with torch.no_grad():
                holder.scale.mul_(2.0).add_(0.25)
            loss.backward()
            with torch.no_grad():
                holder.scale.sub_(0.25).div_(2.0)
            out = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            return out

        got = step(torch.compile(model, backend="aot_eager"), holder.hooks())
        want = step(torch.compile(model, backend="aot_eager"), python_hooks(holder.hooks()))
        self.assertGradsEqual(got, want, exact=True)

    def test_compiled_autograd_and_dynamic_shapes(self, device):
        model, holder = mlp(device), Scaled(1.0, device)
        reference = torch.compile(model, backend="aot_eager")
        for dynamic in (False, True):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            compiled = torch.compile(model, backend=counter, dynamic=dynamic)
            for n in (8, 12, 16) if dynamic else (16, 16, 16):
                x = torch.randn(n, 32, device=device)
                if dynamic:
                    got = grads(compiled, model, x, holder.hooks())
                else:
                    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
                        got = grads(compiled, model, x, holder.hooks())
                want = grads(reference, model, x, python_hooks(holder.hooks()))
                self.assertGradsEqual(got, want, exact=True)
                with torch.no_grad():
                    holder.scale.mul_(0.8).add_(0.05)
            self.assertEqual(counter.frame_count, 1, f"dynamic={dynamic}")

    def test_graphs_take_the_tensor_as_an_input(self, device):
        holder = Scaled(2.0, device)
        rec = AotEagerAndRecordGraphs()
        x = torch.randn(4, 8, device=device, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(*holder.hooks()):
            torch.compile(lambda x: x.sin(), backend=rec)(x).sum().backward()
        fw, bw = rec.fw_graphs[0], rec.bw_graphs[0]
        self.assertEqual(fw.graph.find_nodes(op="get_attr"), [])
        self.assertEqual(bw.graph.find_nodes(op="get_attr"), [])
        fw_inputs = fw.graph.find_nodes(op="placeholder")
        scale_input = next(n for n in fw_inputs if n.meta["val"].dim() == 0)
        self.assertTrue(any(u.target is torch.ops.aten.mul.Tensor for u in scale_input.users))
        # Saved for the backward (the unpack divides by it).
        self.assertIn(scale_input, fw.graph.output_node().args[0])
        bw_scale = next(n for n in bw.graph.find_nodes(op="placeholder") if n.name == scale_input.name)
        self.assertTrue(any(u.target is torch.ops.aten.div.Tensor for u in bw_scale.users))

    def test_input_source_does_not_depend_on_what_compiled_before(self, device):
        # The lifted tensor's source (what AOTAutogradCache's key holds of it, with the
        # Dynamo graph's input) is the hook's and the path's, whatever the process compiled
        # before: the same graph, the same key (fast twin of
        # TestHookInputsAcrossProcesses.test_cache_key_does_not_depend_on_what_compiled_before).
        holder = Scaled(2.0, device)
        inputs = []

        def backend(gm, example_inputs):
            inputs.append([n.name for n in gm.graph.find_nodes(op="placeholder")])
            return gm.forward

        x = torch.randn(4, 8, device=device, requires_grad=True)
        for compile_another_first in (False, True, True):
            torch._dynamo.reset()
            with torch.autograd.graph.saved_tensors_hooks(*holder.hooks()):
                if compile_another_first:
                    torch.compile(lambda x: x.cos(), backend="eager")(x)
                inputs.clear()
                torch.compile(lambda x: x.sin(), backend=backend)(x)
            self.assertEqual(len(inputs), 1)
            if not compile_another_first:
                first = inputs[0]
            self.assertEqual(inputs[0], first)
        self.assertEqual(len(first), 2)  # the tensor the hooks read, and x

    def test_value_read_into_python_is_not_inlined(self, device):
        scale = torch.tensor(2.0, device=device)

        def pack(x):
            return (x * scale.item()).to(torch.bfloat16)

        def unpack(p):
            return p.to(torch.float32) / scale

        hooks = inlineable(pack, unpack)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught, torch.autograd.graph.saved_tensors_hooks(*hooks):
            warnings.simplefilter("always")
            torch.compile(lambda x: x.sin(), backend="aot_eager")(x).sum().backward()
        messages = hook_warnings(caught)
        self.assertTrue(any("Falling back to eager saved-tensors hooks" in m for m in messages), messages)
        torch._dynamo.reset()
        with self.assertRaisesHookError("cannot be inlined"), torch.autograd.graph.saved_tensors_hooks(*hooks):
            torch.compile(lambda x: x.sin(), backend="aot_eager", fullgraph=True)(x).sum().backward()

    def test_in_region_scope_lifts_what_its_hooks_read(self, device):
        # Hooks entered inside the region: the tensors they read are graph inputs at sources
        # built from the hooks' own (L['hooks'][0].__closure__[0].cell_contents.scale.data).
        model, holder = mlp(device), Scaled(1.0, device)
        x = torch.randn(16, 32, device=device)
        counter = CompileCounterWithBackend("aot_eager")

        def step(hooks):
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                return model(x)

        compiled = torch.compile(step, backend=counter, fullgraph=True)
        eager_hooks = torch.compile(model, backend="aot_eager")

        def check():
            got = grads(lambda _: compiled(holder.hooks()), model, x)
            want = grads(eager_hooks, model, x, python_hooks(holder.hooks()))
            self.assertGradsEqual(got, want, exact=True)
            return got

        before = None
        for _ in range(12):  # new hooks every step, the scale updated in place
            got = check()
            if before is not None:
                self.assertFalse(all(torch.equal(a, b) for a, b in zip(got, before)))
            before = got
            with torch.no_grad():
                holder.scale.mul_(0.8).add_(0.05)
        self.assertEqual(counter.frame_count, 1)
        holder.scale = torch.tensor(3.0, device=device)  # rebinding, same metadata
        check()
        self.assertEqual(counter.frame_count, 1)
        holder.scale = torch.tensor([3.0], device=device)  # other metadata: one recompile
        check()
        self.assertEqual(counter.frame_count, 2)

    def test_in_region_scopes_reading_different_tensors(self, device):
        # Two scopes whose hooks have one content digest but read different tensors are two
        # scopes, each computing with its own tensor.
        first, second = Scaled(3.0, device), Scaled(0.7, device)  # not powers of two: bf16 rounding differs
        w = torch.randn(8, 8, device=device, requires_grad=True)
        x = torch.randn(4, 8, device=device)

        def fn(a, b):
            with torch.autograd.graph.saved_tensors_hooks(*a):
                y = (x @ w).sin()
            with torch.autograd.graph.saved_tensors_hooks(*b):
                return (y @ w).cos()

        def run(call, a, b, update=False):
            loss = call(a, b).sum()
            if update:  # between forward and backward
                with torch.no_grad():
                    first.scale.add_(1.0)
            try:
                loss.backward()
            finally:
                if update:
                    with torch.no_grad():
                        first.scale.sub_(1.0)
            grad, w.grad = w.grad, None
            return grad

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        got = run(compiled, first.hooks(), second.hooks())
        reference = torch.compile(fn, backend="aot_eager")  # graph-breaks on Python hooks
        want = run(reference, python_hooks(first.hooks()), python_hooks(second.hooks()))
        self.assertEqual(counter.frame_count, 1)
        self.assertGradsEqual([got], [want], exact=True)
        swapped = run(compiled, second.hooks(), first.hooks())
        self.assertEqual(counter.frame_count, 1)
        self.assertFalse(torch.equal(swapped, got))
        # Unlike the ambient hooks' inputs, an in-region scope's are saved for the backward
        # as the tensors themselves: an update between forward and backward is autograd's
        # in-place error, as for any tensor the forward saves (README, "Hook identity").
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            run(compiled, first.hooks(), second.hooks(), update=True)

    def test_tensor_not_lifted_is_named_in_a_warning(self, device):
        class Tagged(torch.Tensor):
            pass

        scale = torch.tensor(2.0, device=device).as_subclass(Tagged)

        def pack(x):
            return (x * scale.as_subclass(torch.Tensor)).to(torch.bfloat16)

        def unpack(p):
            return p.to(torch.float32) / scale.as_subclass(torch.Tensor)

        x = torch.randn(4, 8, device=device, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autograd.graph.saved_tensors_hooks(*inlineable(pack, unpack)):
                torch.compile(lambda x: x.sin(), backend="aot_eager")(x).sum().backward()
        messages = [str(w.message) for w in caught if "is kept as a constant" in str(w.message)]
        self.assertEqual(len(messages), 2, [str(w.message) for w in caught])
        self.assertIn("<locals>.pack: the pack hook's closure 'scale': a tensor subclass (", messages[0])
        self.assertIn("<locals>.unpack: the unpack hook's closure 'scale': a tensor subclass (", messages[1])
        self.assertIn("changing them recompiles", messages[0])


class TestTrialTraceDevices(TestCase):
    # A scope entered in a region is traced on a stand-in activation before the region
    # compiles; hooks reading tensors on one device (CUDA on a GPU; "meta" here, which every
    # build has) trace on a stand-in there, not on the CPU (CUDA variants of
    # TestHookInputs run the whole path).
    def test_stand_in_goes_where_the_hooks_tensors_are(self):
        from torch_patches._functorch._aot_autograd import hook_tracing

        scale = torch.ones(8, device="meta")
        pair = hook_tracing.HookPair(*inlineable(lambda x: (x * scale).to(torch.bfloat16), lambda p: p.float() / scale), "scope")
        error = hook_tracing.trial_trace(pair)  # the CPU's stand-in: the devices disagree
        self.assertIsNotNone(error)
        self.assertIn("meta", str(error))  # the device mismatch, in each torch version's words
        self.assertIsNone(hook_tracing.trial_trace(pair, [torch.device("meta")]))
        self.assertIsNone(hook_tracing.trial_trace(pair, [torch.device("cpu"), torch.device("meta")]))
        # Untraceable on every device: the first device's error.
        bad = hook_tracing.HookPair(*inlineable(lambda x: x * x.sum().item(), lambda p: p), "scope")
        self.assertIn("cannot be inlined", str(hook_tracing.trial_trace(bad, [torch.device("meta"), torch.device("cpu")])))


@pytest.mark.slow
class TestHookInputsAcrossProcesses(TestCase):
    def steps(self, root, scale):
        """Ambient and in-region hooks reading ``scale``, in one fresh process, each in its own
        cache dir under ``root``: their results."""
        from cache_worker import run_in_one_fresh_process

        runs = [
            (dict(hook="marked", tensor_scale=True, scale=scale, backend="inductor", in_region=r), os.path.join(root, str(r)))
            for r in (False, True)
        ]
        proc, results = run_in_one_fresh_process(runs)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        return results

    def test_cache_key_does_not_depend_on_what_compiled_before(self):
        # The same step twice in one fresh process, one cache dir: the second hits, although
        # the process compiled the first before it.
        from cache_worker import run_in_one_fresh_process

        with tempfile.TemporaryDirectory() as shared:
            spec = dict(hook="marked", tensor_scale=True, scale=2.0, backend="inductor")
            proc, (first, second) = run_in_one_fresh_process([(spec, shared), (spec, shared)])
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(first["aot"].get("autograd_cache_miss", 0), 1, first["aot"])
        self.assertEqual(second["aot"].get("autograd_cache_hit", 0), 1, second["aot"])
        self.assertGradsEqual(second["grads"], first["grads"], exact=True)

    def test_cache_hit_computes_with_its_own_value(self):
        with tempfile.TemporaryDirectory() as shared, tempfile.TemporaryDirectory() as alone:
            firsts, seconds, references = self.steps(shared, 2.0), self.steps(shared, 3.0), self.steps(alone, 3.0)
        for in_region, first, second, reference in zip((False, True), firsts, seconds, references):
            with self.subTest(in_region=in_region):
                self.assertEqual(first["aot"].get("autograd_cache_miss", 0), 1, first["aot"])
                self.assertEqual(second["aot"].get("autograd_cache_hit", 0), 1, second["aot"])
                self.assertGradsEqual(second["grads"], reference["grads"], exact=True)
                self.assertFalse(torch.allclose(first["grads"][0], second["grads"][0]))


instantiate_device_type_tests(TestHookInputs, globals())

if __name__ == "__main__":
    run_tests()
