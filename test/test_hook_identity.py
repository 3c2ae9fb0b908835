"""Hook identity: a compiled graph runs each hook as of this call, never a stale graph.

Every test varies exactly one hidden dependency of a hook (test/identity_deps.py: closure
cells, globals, attributes of modules / classes / instances / namespaces / nn.Modules,
parameters and buffers, code of called functions / staticmethods / ``forward``, defaults,
partials, bound methods, callable instances, captured tensors, GraphModule buffers, fx.wrap
leaves) and checks the compiled step against

* a fresh compile with the new value (the graph was rebuilt, not reused), and
* the same compiled function with the hooks as plain Python hooks (eager hook semantics on
  the same saved tensors: with ``saved_tensors_hooks_filtering_mode="all"`` both hook every
  saved tensor, so under aot_eager the gradients are bit-exact),

with exactly one recompile for the change and none for the same hooks recreated.
Fresh-process cache claims (same hooks hit, a changed dependency misses or bypasses) are in
``TestHookIdentityAcrossProcesses`` (slow).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import warnings

import hypothesis
import hypothesis.strategies as st
import identity_cfg
import identity_deps as deps
import pytest
import torch
import torch._functorch.config as functorch_config
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend
from torch.testing._internal.common_utils import parametrize

from torch_patches import config as tp_config
from torch_patches._functorch._aot_autograd import hook_identity as hook_keys
from torch_patches._functorch._aot_autograd.hook_identity import hook_identity
from torch_patches._functorch._aot_autograd.hook_walk import Keying, tensor_keying
from torch_patches.hooks import inlineable
from torch_patches.testing import TestCase, hook_warnings, instantiate_device_type_tests


def fn(x):
    return x.sin().exp().cos()


def python_hooks(hooks):
    """The same hooks as plain Python hooks (not inlineable): eager hook semantics."""
    pack, unpack = hooks
    return (lambda t: pack(t)), (lambda t: unpack(t))


def step(compiled, hooks, device="cpu"):
    x = torch.linspace(-1, 1, 32, device=device).view(4, 8).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        compiled(x).sum().backward()
    return x.grad


class IdentityTestCase(TestCase):
    def setUp(self):
        super().setUp()
        deps.set_all(1.0)
        self.addCleanup(deps.set_all, 1.0)
        patch = functorch_config.patch(saved_tensors_hooks_filtering_mode="all")
        patch.__enter__()
        self.addCleanup(patch.__exit__, None, None, None)

    def assertSameGrad(self, a, b, backend):  # noqa: N802
        if backend == "aot_eager":
            self.assertEqual(a, b, atol=0, rtol=0)
        else:
            self.assertEqual(a, b, atol=1e-5, rtol=1e-5)

    def check_change(self, name, a, b, backend="aot_eager", device="cpu"):
        """Hooks of kind ``name`` with value a, then b: one recompile (none for a tensor
        the hooks read, a runtime input of the graphs), b's gradients."""
        kind = deps.KINDS[name]
        kind.set(a)
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(fn, backend=counter)
        grad_a = step(compiled, kind.hooks(), device)
        step(compiled, kind.hooks(), device)  # recreated, unchanged: no recompile
        self.assertEqual(counter.frame_count, 1, f"{name}: recreated hooks recompiled")
        kind.set(b)
        grad_b = step(compiled, kind.hooks(), device)
        again = step(compiled, kind.hooks(), device)
        if kind.lifted:
            self.assertEqual(counter.frame_count, 1, f"{name}: a graph input's new values recompiled")
        else:
            self.assertEqual(counter.frame_count, 2, f"{name}: a change must recompile once")
        self.assertSameGrad(grad_b, again, backend)
        # Eager hook semantics on the same compiled graph, as of now.
        reference = step(torch.compile(fn, backend=backend), python_hooks(kind.hooks()), device)
        self.assertSameGrad(grad_b, reference, backend)
        # A fresh compile with the new value.
        torch._dynamo.reset()
        fresh = step(torch.compile(fn, backend=backend), kind.hooks(), device)
        self.assertSameGrad(grad_b, fresh, backend)
        # The dependency really changes the gradients: a stale graph would be caught.
        self.assertFalse(torch.allclose(grad_a, grad_b), f"{name}: values do not change the result")


class TestHookIdentity(IdentityTestCase):
    @parametrize("name", sorted(deps.KINDS))  # a test per kind: each is four compiles
    def test_every_kind_aot_eager(self, device, name):
        self.check_change(name, 1.0, 2.0, device=device)

    @pytest.mark.slow  # 25 generated changes; fast twin: test_every_kind_aot_eager (each kind, fixed values)
    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(
        name=st.sampled_from(sorted(deps.KINDS)),
        values=st.lists(st.sampled_from(deps.VALUES), min_size=2, max_size=2, unique=True),
    )
    def test_generated_changes_aot_eager(self, device, name, values):
        torch._dynamo.reset()
        deps.set_all(1.0)
        self.check_change(name, *values, device=device)

    @pytest.mark.slow
    def test_every_kind_inductor(self, device):
        for name in sorted(deps.KINDS):
            with self.subTest(kind=name):
                torch._dynamo.reset()
                deps.set_all(1.0)
                self.check_change(name, 1.0, 3.0, backend="inductor", device=device)

    def test_outcomes(self, device):
        # (a) keyed by value: valid across processes; (b) process-local: keyed by identity.
        for name, kind in deps.KINDS.items():
            with self.subTest(kind=name):
                digest, reasons = hook_keys.hooks_cache_key(*kind.hooks())
                if kind.outcome == "a":
                    self.assertIsNotNone(digest, reasons)
                else:
                    self.assertIsNone(digest)
                    self.assertIn("keyed by identity", reasons[0])

    def test_recreated_hooks_do_not_recompile(self, device):
        for name in ("closure", "partial", "bound_method", "callable_instance", "graph_module_buffer"):
            with self.subTest(kind=name):
                torch._dynamo.reset()
                counter = CompileCounterWithBackend("aot_eager")
                compiled = torch.compile(fn, backend=counter)
                for _ in range(6):
                    step(compiled, deps.KINDS[name].hooks(), device)
                self.assertEqual(counter.frame_count, 1)

    def test_recreated_object_at_reused_address(self, device):
        # A callable recreated every step with another setting: CPython often places it at
        # the address of the one just freed. Every step must run its own setting.
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter)
        reference = {}
        for s in (1.0, 2.0):
            pair = inlineable(deps.pack, deps.CallableUnpack(s))
            reference[s] = step(torch.compile(fn, backend="aot_eager"), python_hooks(pair), device)
        for i in range(8):
            s = (1.0, 2.0)[i % 2]
            grad = step(compiled, inlineable(deps.pack, deps.CallableUnpack(s)), device)
            self.assertEqual(grad, reference[s], atol=0, rtol=0)
        self.assertEqual(counter.frame_count, 2)

    def test_python_hooks_around_graph_compiled_without_hooks(self, device):
        # Stock torch reuses the graph (it is the same); the hooks then run as Python hooks,
        # under the hook contract (only floating-point saved tensors reach them).
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(lambda x: (x.sin() * (x > 0)).exp(), backend=counter)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        compiled(x).sum().backward()
        seen = []

        def pack(t):
            seen.append(t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            compiled(x).sum().backward()
        self.assertEqual(counter.frame_count, 1)
        self.assertTrue(seen)
        self.assertTrue(all(d.is_floating_point for d in seen), seen)

    def test_library_factory_hooks_are_keyed_by_what_they_were_made_with(self, device):
        # A hook a library's factory made (torch's own ready-made hooks, upstream) is keyed
        # by the library's version and by its closure and defaults: the same factory called
        # with another dtype is another hook.
        def factory(dtype, scale=2.0):
            def pack(x, scale=scale):
                return (x * scale).to(dtype)

            def unpack(x):
                return x.to(torch.float32) / scale

            for f in (pack, unpack):
                f.__module__ = "torch.utils.hooks"  # as if torch defined it
            return inlineable(pack, unpack)

        key = hook_keys.hooks_guard_key(factory(torch.bfloat16))
        self.assertEqual(hook_keys.hooks_guard_key(factory(torch.bfloat16)), key)
        self.assertNotEqual(hook_keys.hooks_guard_key(factory(torch.float16)), key)
        self.assertNotEqual(hook_keys.hooks_guard_key(factory(torch.bfloat16, 4.0)), key)
        self.assertNotEqual(hook_keys.hooks_cache_key(*factory(torch.float16))[0], hook_keys.hooks_cache_key(*factory(torch.bfloat16))[0])

    def test_config_is_part_of_the_key(self, device):
        hooks = deps.KINDS["module_attr"].hooks()
        base = hook_keys.hooks_cache_key(*hooks)[0]
        key = hook_keys.hooks_guard_key(hooks)
        for knob, patch in (
            ("hook_placement", lambda: tp_config.patch(hook_placement="boundary")),
            ("unpack_prefetch_distance", lambda: tp_config.patch(unpack_prefetch_distance=1)),
            ("reload_prefetch_distance", lambda: tp_config.patch(reload_prefetch_distance=7)),
            ("hooked_saved_tensor_dtypes", lambda: tp_config.patch(hooked_saved_tensor_dtypes="all")),
            ("validate_unpack", lambda: tp_config.patch(validate_unpack=False)),
        ):
            with self.subTest(knob=knob), patch():
                self.assertNotEqual(hook_keys.hooks_cache_key(*hooks)[0], base)
                self.assertNotEqual(hook_keys.hooks_guard_key(hooks), key)

    def test_config_change_recompiles(self, device):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter)
        hooks = deps.KINDS["global"].hooks()
        step(compiled, hooks, device)
        with tp_config.patch(hook_placement="boundary"):
            step(compiled, hooks, device)
        self.assertEqual(counter.frame_count, 2)


class TestCapturedTensors(IdentityTestCase):
    def captured(self, tensor, device):
        def unpack(t):
            return t / 2 * tensor.reshape(-1)[0]

        hooks = inlineable(deps.pack, unpack)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: inlined
            grad = step(torch.compile(fn, backend="aot_eager", fullgraph=True), hooks, device)
        reference = step(torch.compile(fn, backend="aot_eager"), python_hooks(hooks), device)
        self.assertEqual(grad, reference, atol=0, rtol=0)
        return hooks

    def test_zero_dim_small_and_requires_grad(self, device):
        for t in (
            torch.tensor(2.0, device=device),
            torch.full((3,), 2.0, device=device),
            torch.tensor(2.0, device=device, requires_grad=True),
            torch.nn.Parameter(torch.full((2, 2), 2.0, device=device)),
        ):
            with self.subTest(shape=tuple(t.shape), requires_grad=t.requires_grad):
                torch._dynamo.reset()
                self.captured(t, device)

    def test_graph_module_zero_dim_buffer(self, device):
        hooks = deps.KINDS["graph_module_buffer"].hooks()
        grad = step(torch.compile(fn, backend="aot_eager", fullgraph=True), hooks, device)
        self.assertEqual(grad, step(torch.compile(fn, backend="aot_eager"), python_hooks(hooks), device))

    def test_ten_million_elements(self, device):
        big = torch.full((10_000_000,), 2.0, device=device)
        hooks = self.captured(big, device)
        ident = hook_identity(hooks[1])
        # Keyed by identity and version, never read element by element; kept alive.
        self.assertTrue(ident.local)
        self.assertTrue(any(p is big for p in ident.pins))


class _Tagged(torch.Tensor):
    """A plain tensor subclass (no ``__torch_dispatch__``): a small one is still no plain tensor."""


def _tensor_keys(key):
    """The walk's entries for tensors in a hook's key."""
    if isinstance(key, tuple):
        if key[:1] == ("tensor",):
            yield key
        for part in key:
            yield from _tensor_keys(part)


class TestTensorKeying(TestCase):
    """One rule (``hook_walk.tensor_keying``) says how a captured tensor is keyed; the walk
    keys by it and the identity pins exactly the tensors it keys by identity."""

    def test_value_identity_and_lifted(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse CSR is in beta
            csr = torch.eye(3).to_sparse_csr()
        cases = {
            "small dense": (torch.full((3,), 2.0), Keying.VALUE),
            "small subclass": (torch.full((3,), 2.0).as_subclass(_Tagged), Keying.IDENTITY),
            "small sparse COO": (torch.eye(3).to_sparse(), Keying.VALUE),
            "small sparse CSR": (csr, Keying.VALUE),
            "large dense": (torch.full((10_000,), 2.0), Keying.IDENTITY),
        }
        for name, (t, expected) in cases.items():
            with self.subTest(name):
                self.assertEqual(tensor_keying(t), expected)
                ident = hook_identity(inlineable(lambda x: x, lambda x, t=t: x * 2)[1])
                (entry,) = _tensor_keys(ident.key)
                self.assertIn(expected.value, entry)
                self.assertEqual(any(p is t for p in ident.pins), expected is Keying.IDENTITY)
                self.assertEqual(bool(ident.local), expected is Keying.IDENTITY)
        # A tensor the graphs take as a runtime input: keyed by its metadata, not pinned.
        large = torch.full((10_000,), 2.0)
        ident = hook_identity(inlineable(lambda x: x, lambda x, t=large: x * t)[1], lift=True)
        (entry,) = _tensor_keys(ident.key)
        self.assertEqual(tensor_keying(large, frozenset({id(large)})), Keying.LIFTED)
        self.assertEqual(entry[-1], Keying.LIFTED.value)
        self.assertFalse(any(p is large for p in ident.pins))


class TestNotKeyable(IdentityTestCase):
    def test_opaque_object_is_not_inlined(self, device):
        lock = threading.Lock()

        def unpack(t):
            with lock:
                return t / 2

        hooks = inlineable(deps.pack, unpack)
        self.assertTrue(hook_keys.unkeyable_reasons(hooks))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grad = step(torch.compile(fn, backend="aot_eager"), hooks, device)
        messages = hook_warnings(caught)
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("cannot see", messages[0])
        self.assertEqual(grad, step(torch.compile(fn, backend="aot_eager"), python_hooks(hooks), device))
        with self.assertRaisesRegex(Exception, "cannot be inlined"):
            torch._dynamo.reset()
            step(torch.compile(fn, backend="aot_eager", fullgraph=True), hooks, device)

    def test_values_that_change_at_every_call_are_not_inlined(self, device):
        # Eager draws a new value at every unpack; a compiled graph would replay one.
        import random
        import time
        import uuid

        for unpack in (
            lambda t: t / 2 * random.random(),
            lambda t: t / 2 * random.uniform(1.0, 2.0),
            lambda t: t / 2 * (time.time() % 1.0),
            lambda t: t / 2 * len(str(uuid.uuid4())),
            lambda t: t / 2 * len(os.urandom(4)),
        ):
            reasons = hook_keys.unkeyable_reasons(inlineable(deps.pack, unpack))
            self.assertTrue(reasons, unpack)
            self.assertIn("changes at every call", reasons[0])
        with self.assertRaisesRegex(Exception, "changes at every call"):
            step(torch.compile(fn, backend="aot_eager", fullgraph=True), inlineable(deps.pack, lambda t: t * random.random()), device)

    def test_constant_getattr_keys_only_named_attributes(self, device):
        # getattr with a constant name reads one attribute, which is keyed; a computed name
        # keys every attribute of the module (computed_attribute_name kind).
        from torch_patches._functorch._aot_autograd.hook_code import ALL_ATTRS, _code_info

        def constant(t):
            return t * getattr(identity_cfg, "SCALE", 1.0) * identity_cfg.nested.inner.scale

        def computed(t, name="SCALE"):
            return t * getattr(identity_cfg, name)

        self.assertNotIn(ALL_ATTRS, _code_info(constant.__code__).names)
        self.assertIn(ALL_ATTRS, _code_info(computed.__code__).names)
        for dynamic in (
            lambda t: t * vars(identity_cfg)["SCALE"],
            lambda t: t * identity_cfg.__dict__["SCALE"],
            lambda t: t * globals()["GLOBAL_NAME"],
        ):
            self.assertIn(ALL_ATTRS, _code_info(dynamic.__code__).names)

    def test_dynamic_import_is_not_inlined(self, device):
        import importlib

        def unpack(t):
            return t / 2 * importlib.import_module("identity_imported").SCALE

        reasons = hook_keys.unkeyable_reasons(inlineable(deps.pack, unpack))
        self.assertTrue(any("imports a module named at run time" in r for r in reasons), reasons)

    def test_print_is_reported_without_touching_streams(self, device):
        def pack(t):
            print("packing")
            return t * 2

        hooks = inlineable(pack, deps.pack)
        self.assertIn("side effects or runs dynamic code (calls print())", hook_keys.unkeyable_reasons(hooks)[0])

    def test_two_hooks_with_one_name_warn_once_each(self, device):
        def make(lock):
            def unpack(t):
                with lock:
                    return t / 2

            return inlineable(deps.pack, unpack)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for lock in (threading.Lock(), threading.RLock()):
                torch._dynamo.reset()
                step(torch.compile(fn, backend="aot_eager"), make(lock), device)
        messages = hook_warnings(caught)
        self.assertEqual(len(messages), 2, messages)

    def test_other_threads_printing_during_compiles_lose_nothing(self, device):
        import io

        out = io.StringIO()
        stop = threading.Event()
        written = [0]

        def chatter():
            while not stop.is_set():
                print("line", file=sys.stdout)
                written[0] += 1

        old = sys.stdout
        sys.stdout = out
        try:
            thread = threading.Thread(target=chatter)
            thread.start()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for name in ("closure", "module_attr", "partial"):
                    torch._dynamo.reset()
                    step(torch.compile(fn, backend="aot_eager", fullgraph=True), deps.KINDS[name].hooks(), device)
            stop.set()
            thread.join()
        finally:
            sys.stdout = old
        self.assertEqual(out.getvalue().count("line\n"), written[0])


instantiate_device_type_tests(TestHookIdentity, globals())
instantiate_device_type_tests(TestCapturedTensors, globals())
instantiate_device_type_tests(TestNotKeyable, globals())


WORKER = os.path.join(os.path.dirname(__file__), "identity_worker.py")

#: Kinds checked across processes: every one a user reported as a wrong cache hit, and more.
CROSS_PROCESS_KINDS = (
    "module_attr",
    "nested_attr",
    "class_attr",
    "object_attr",
    "namespace_attr",
    "nn_module_attr",
    "nn_module_buffer",
    "called_function_code",
    "staticmethod_code",
    "nn_module_forward_code",
    "closure",
    "global",
    "partial",
    "callable_instance",
    "fx_wrap_leaf_code",
    "big_tensor_inplace",
    "computed_attribute_name",
    "module_imported_in_body",
    "environ",
)


@pytest.mark.slow
class TestHookIdentityAcrossProcesses(TestCase):
    """P1 (value A) and P2 (value B) share a cache dir; P3 (B) has an empty one: P2 == P3.

    Each kind has a cache directory of its own; the P1 runs of every kind happen in one fresh
    process, the P2 runs in another (they share only the C++ compiler's kernels)."""

    def run_workers(self, runs):
        """``runs`` (cache dir, spec) in one fresh process: their results, in order."""
        env = dict(os.environ)
        env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
        spec = {"runs": [dict(s, cache_dir=d) for d, s in runs]}
        proc = subprocess.run([sys.executable, WORKER, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        results = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(runs) :]]
        for result in results:
            result["grad"] = torch.tensor(result["grad"])
        return results

    def test_one_dependency_changed_in_a_fresh_process(self):
        with tempfile.TemporaryDirectory() as root:
            shared = {name: os.path.join(root, name) for name in CROSS_PROCESS_KINDS}
            # P3 last: before each kind's run both processes ran the same kinds.
            *first, p3 = self.run_workers(
                [(shared[name], dict(kind=name, value=1.0)) for name in CROSS_PROCESS_KINDS]
                + [(os.path.join(root, "fresh"), dict(kind="global", value=2.0))]
            )
            second = self.run_workers([(shared[name], dict(kind=name, value=2.0)) for name in CROSS_PROCESS_KINDS])
        for name, p1, p2 in zip(CROSS_PROCESS_KINDS, first, second):
            with self.subTest(kind=name):
                self.assertEqual(p2["grad"], p3["grad"], atol=1e-6, rtol=1e-6)
                self.assertFalse(torch.allclose(p1["grad"], p2["grad"]))
                if deps.KINDS[name].lifted:
                    # A runtime input of the graphs: keyed by metadata, so the second
                    # process hits and computes with its own value (p3's gradients).
                    self.assertEqual(p2["aot"].get("autograd_cache_hit"), 1, p2["aot"])
                    continue
                if deps.KINDS[name].outcome == "a":
                    self.assertEqual(p1["aot"].get("autograd_cache_miss"), 1, p1["aot"])
                    self.assertEqual(p2["aot"].get("autograd_cache_miss"), 1, p2["aot"])
                else:
                    self.assertEqual(p2["aot"].get("autograd_cache_bypass"), 1, p2["aot"])
                self.assertNotIn("autograd_cache_hit", p2["aot"])

    def test_same_hooks_hit_in_a_fresh_process(self):
        kinds = ("module_attr", "callable_instance", "nn_module_forward_code", "fx_wrap_leaf_code")
        with tempfile.TemporaryDirectory() as root:
            runs = [(os.path.join(root, name), dict(kind=name, value=2.0)) for name in kinds]
            first, second = self.run_workers(runs), self.run_workers(runs)
        for name, p1, p2 in zip(kinds, first, second):
            with self.subTest(kind=name):
                self.assertEqual(p2["aot"].get("autograd_cache_hit"), 1, p2["aot"])
                self.assertEqual(p1["grad"], p2["grad"], atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
