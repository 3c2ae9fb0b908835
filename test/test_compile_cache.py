"""Compile caches with saved-tensor hooks, across fresh processes.

AOTAutogradCache keys a graph on the hooks' *content* (the ``user_cache_hash`` of the hook
subgraphs torch_patches installs: code, constants, the user_cache_hash of fx.wrap leaves, and
the torch_patches config that changes compiled graphs). Every case runs the same training step
in fresh processes sharing one cache directory (test/cache_worker.py), and checks the cache
counters and that the gradients are those of the hook that was asked for.
"""

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.fx
from cache_worker import run_in_one_fresh_process
from torch._dynamo.test_case import run_tests

import torch_patches
from torch_patches._dynamo.output_graph import hook_subgraph
from torch_patches._functorch._aot_autograd.hook_identity import hook_cache_hash, hooks_cache_key
from torch_patches.hooks import cache_hash, inlineable
from torch_patches.testing import TestCase


@cache_hash("v1")
def hashed(x):
    return x


def unhashed(x):
    return x


torch.fx.wrap("hashed")
torch.fx.wrap("unhashed")


@pytest.mark.slow
class TestCompileCache(TestCase):
    def setUp(self):
        super().setUp()
        self.cache_dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.cache_dir.cleanup)

    def step(self, **spec):
        (result,) = self.steps(spec)
        return result

    def steps(self, *specs, cache_dirs=None, package_root=None):
        """``specs`` one after the other in one fresh process (each in its own cache dir
        of ``cache_dirs``, else this test's; the torch_patches under ``package_root``, else
        this one): their results."""
        runs = []
        for i, spec in enumerate(specs):
            spec = {"hook": "gm", "scale": 2.0, "backend": "inductor", **spec}
            runs.append((spec, cache_dirs[i] if cache_dirs else self.cache_dir.name))
        proc, results = run_in_one_fresh_process(runs, package_root)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        return results

    def assertSameGrads(self, result, other):  # noqa: N802
        self.assertGradsEqual(result["grads"], other["grads"], exact=True)

    def assertDifferentGrads(self, result, other):  # noqa: N802
        # Lossy bf16 hooks: the scale changes the rounding, so gradients identify the hook.
        self.assertFalse(torch.allclose(result["grads"][0], other["grads"][0]))

    def assertCache(self, result, state):  # noqa: N802
        self.assertEqual(result["aot"].get(f"autograd_cache_{state}", 0), 1, result["aot"])

    def test_same_hooks_hit_in_fresh_process(self):
        # The library's offload hooks call torch.ops.saved_tensors_hooks.offload: an attribute
        # name, not a captured object (the module's `offload` CustomOpDef is not read).
        hooks = ("gm", "marked", "cpu_offload", "fp8_rowwise+cpu_offload")
        # Every hook once in a fresh process (misses), then again in another (hits).
        firsts = self.steps(*(dict(hook=hook) for hook in hooks))
        seconds = self.steps(*(dict(hook=hook) for hook in hooks))
        for hook, first, second in zip(hooks, firsts, seconds):
            with self.subTest(hook=hook):
                self.assertCache(first, "miss")
                self.assertCache(second, "hit")
                self.assertEqual(second["inductor"].get("fxgraph_cache_miss", 0), 0)
                # The hit runs the graphs compiled for these hooks, and only those: a
                # Python hook re-run on the packed tensors would change the gradients.
                self.assertSameGrads(second, first)

    def test_changed_inductor_patches_miss_inductor_cache(self):
        # Another release of the patch set, whose offload lowering differs by a comment
        # line, compiled into the same cache directories (the default keeps them across
        # upgrades). AOTAutogradCache misses (the hooks' key holds our source); Inductor's
        # cache misses for the graphs holding offload ops (code generated under the other
        # release's lowering and order is never served) and still hits for the others.
        other_release = os.path.join(self.cache_dir.name, "other_release")
        shutil.copytree(
            os.path.dirname(torch_patches.__file__),
            os.path.join(other_release, "torch_patches"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        with open(os.path.join(other_release, "torch_patches", "_inductor", "lowering.py"), "a") as f:
            f.write("# another release\n")
        hooks = ("cpu_offload", "gm")
        dirs = [os.path.join(self.cache_dir.name, hook) for hook in hooks]
        before = self.steps(*(dict(hook=hook) for hook in hooks), cache_dirs=dirs, package_root=other_release)
        after = self.steps(*(dict(hook=hook) for hook in hooks), cache_dirs=dirs)
        for hook, first, second in zip(hooks, before, after):
            with self.subTest(hook=hook):
                self.assertCache(first, "miss")
                self.assertCache(second, "miss")
                self.assertSameGrads(second, first)
        offload, plain = after
        self.assertEqual(offload["inductor"], {"fxgraph_cache_miss": 2})
        self.assertEqual(plain["inductor"], {"fxgraph_cache_hit": 2})

    def test_changed_budget_misses_once(self):
        # The plan is a function of the budget: a changed budget misses (and plans anew),
        # the same budget hits, in the hook form and the config form alike.
        # Both forms, each in a cache directory of its own, side by side in each fresh process.
        forms = ("hook", "config")
        dirs = [os.path.join(self.cache_dir.name, form) for form in forms]

        def step(fraction):
            return self.steps(
                dict(hook="budget", budget=fraction),
                dict(hook="none", config={"activation_memory_budget": fraction}),
                cache_dirs=dirs,
            )

        results = [step(f) for f in (0.5, 0.5, 1.0, 1.0, 0.5)]
        for i, form in enumerate(forms):
            with self.subTest(form=form):
                half, half_hit, whole, whole_again, again = (r[i] for r in results)
                self.assertCache(half, "miss")
                self.assertCache(half_hit, "hit")
                self.assertCache(whole, "miss")  # everything fits: everything kept
                # 0.5 keeps less for the backward (it recomputes or compresses relu's output),
                # and a hit runs the plan its budget made.
                self.assertLess(half["saved_bytes"], whole["saved_bytes"])
                self.assertCache(whole_again, "hit")
                self.assertEqual(whole_again["saved_bytes"], whole["saved_bytes"])
                self.assertCache(again, "hit")
                self.assertEqual(again["saved_bytes"], half["saved_bytes"])
                self.assertSameGrads(again, half)

    def test_input_leafness_is_keyed(self):
        # A budget's plan depends on whether autograd produced the graph's input: a call with
        # a non-leaf input misses the entry a leaf input wrote, and hits its own.
        leaf, non_leaf, again = self.steps(
            dict(hook="budget", budget=0.5), dict(hook="budget", budget=0.5, non_leaf=True), dict(hook="budget", budget=0.5, non_leaf=True)
        )
        self.assertCache(leaf, "miss")
        self.assertCache(non_leaf, "miss")
        self.assertCache(again, "hit")
        self.assertSameGrads(again, non_leaf)

    def test_changed_constant_misses_and_new_hook_runs(self):
        two = self.step(scale=2.0)
        self.assertCache(two, "miss")
        three = self.step(scale=3.0)
        self.assertCache(three, "miss")  # a miss compiles the hook it is given
        self.assertDifferentGrads(three, two)
        # Both entries now live side by side.
        again = self.step(scale=2.0)
        self.assertCache(again, "hit")
        self.assertSameGrads(again, two)

    def test_hooks_entered_in_region_are_keyed_by_content(self):
        # The scope's content digest is in the code of a stand-in subgraph on the graph.
        two = self.step(hook="marked", in_region=True)
        self.assertCache(two, "miss")
        hit = self.step(hook="marked", in_region=True)
        self.assertCache(hit, "hit")
        self.assertSameGrads(hit, two)
        three = self.step(hook="marked", in_region=True, scale=3.0)
        self.assertCache(three, "miss")
        self.assertDifferentGrads(three, two)
        # Not the entry of the same hooks entered around the compiled call.
        self.assertCache(self.step(hook="marked"), "miss")
        # The whole torch_patches config is part of the scope's key, as for ambient hooks.
        boundary = {"hook_placement": "boundary"}
        self.assertCache(self.step(hook="marked", in_region=True, config=boundary), "miss")
        self.assertCache(self.step(hook="marked", in_region=True, config=boundary), "hit")
        self.assertCache(self.step(hook="marked", config={"unpack_prefetch_distance": 1}), "miss")

    def test_leaf_without_user_cache_hash_is_keyed_by_its_code(self):
        # make_fx traces through fx.wrap leaves: their code (walked like the hook's own) keys
        # the entry; test_hook_identity checks that a changed leaf misses.
        first = self.step(hook="leaf")
        self.assertCache(first, "miss")
        hit = self.step(hook="leaf")
        self.assertCache(hit, "hit")
        self.assertSameGrads(hit, first)

    def test_leaf_with_user_cache_hash_hits_and_value_change_misses(self):
        first = self.step(hook="leaf", leaf_hash="v1")
        self.assertCache(first, "miss")
        hit = self.step(hook="leaf", leaf_hash="v1")
        self.assertCache(hit, "hit")
        self.assertSameGrads(hit, first)
        self.assertCache(self.step(hook="leaf", leaf_hash="v2"), "miss")

    def test_eager_fallback_is_not_cached(self):
        # An untraceable hook falls back to eager hooks (one warning) in every process: a
        # cached graph would run with the hooks disabled and no warning.
        runs = [self.step(hook="marked", untraceable=True) for _ in range(2)]
        for result in runs:
            self.assertEqual(result["aot"].get("autograd_cache_hit", 0), 0, result["aot"])
            self.assertEqual(result["aot"].get("autograd_cache_saved", 0), 0, result["aot"])
            self.assertEqual(len(result["warnings"]), 1, result["warnings"])
        self.assertSameGrads(runs[1], runs[0])

    def test_aot_eager_uses_the_new_hook(self):
        # aot_eager has no AOTAutogradCache: every process compiles, with its own hook;
        # the result equals this process's own aot_eager compile of the same hook.
        from cache_worker import build_hooks, model

        for scale in (2.0, 3.0):
            result = self.step(backend="aot_eager", scale=scale)
            self.assertEqual(result["aot"], {"total": 1, "ok": 1})
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(8, 8, generator=gen, requires_grad=True)
            w = torch.randn(8, 8, generator=gen, requires_grad=True)
            torch._dynamo.reset()
            with torch.autograd.graph.saved_tensors_hooks(*build_hooks({"hook": "gm", "scale": scale})):
                out = torch.compile(model, backend="aot_eager")(x, w)
            out.sum().backward()
            self.assertGradsEqual(result["grads"], [x.grad, w.grad], exact=True)


class TestInductorCacheKey(TestCase):
    # Fast twin of TestCompileCache.test_changed_inductor_patches_miss_inductor_cache: the FX
    # graph cache key of a graph holding an offload op follows our source, others do not.
    def test_offload_graphs_are_keyed_on_our_source(self):
        from torch._inductor.codecache import compiled_fx_graph_hash
        from torch.fx.experimental.proxy_tensor import make_fx

        from torch_patches.hooks import offload  # noqa: F401 - defines the ops

        x = torch.randn(4, 4)
        with_offload = make_fx(lambda x: torch.ops.saved_tensors_hooks.offload.default(x.sin(), False))(x)
        without = make_fx(lambda x: x.sin().cos())(x)

        def keys():
            return [compiled_fx_graph_hash(gm, [x], {}, [])[0] for gm in (with_offload, without)]

        ours = keys()
        with mock.patch("torch_patches._inductor.codecache.own_source_digest", return_value="another release"):
            other = keys()
        self.assertNotEqual(ours[0], other[0])
        self.assertEqual(ours[1], other[1])

    def test_backward_graphs_keyed_where_their_incoming_gradients_are_freed(self):
        # A backward compiled where Inductor's memory model frees its incoming gradients at
        # their last use (torch 2.13 on, inductor.incoming_gradients_freeable) is ordered for
        # that: its entry is never served to a process that counts them otherwise.
        from torch._inductor.codecache import FxGraphHashDetails

        from torch_patches._functorch._aot_autograd.utils import incoming_gradients_boxed
        from torch_patches._inductor.codecache import FREED_GRADIENTS_ATTR

        g = torch.fx.Graph()
        x, t = g.placeholder("primals_1"), g.placeholder("tangents_1")
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (x, t)),))
        gm = torch.fx.GraphModule({}, g)

        def marked(is_backward):
            details = FxGraphHashDetails(gm, [torch.ones(2), torch.ones(2)], {"is_backward": is_backward}, [])
            return hasattr(details, FREED_GRADIENTS_ATTR)

        self.assertEqual(marked(True), incoming_gradients_boxed())
        self.assertFalse(marked(False))
        torch_patches.unapply()
        self.assertFalse(marked(True))


class TestHookCacheKey(TestCase):
    apply_patches = False

    def test_key_is_stable_and_content_sensitive(self):
        def make(scale):
            def pack(x):
                return (x * scale).to(torch.bfloat16)

            return pack

        gm = torch.fx.symbolic_trace(make(2.0))
        self.assertEqual(hook_cache_hash(gm), hook_cache_hash(torch.fx.symbolic_trace(make(2.0))))
        self.assertNotEqual(hook_cache_hash(gm)[0], hook_cache_hash(torch.fx.symbolic_trace(make(4.0)))[0])
        fn = inlineable(make(2.0), make(2.0))[0]
        self.assertEqual(hook_cache_hash(fn), hook_cache_hash(inlineable(make(2.0), make(2.0))[0]))
        self.assertNotEqual(hook_cache_hash(fn)[0], hook_cache_hash(inlineable(make(5.0), make(5.0))[0])[0])

    def test_key_across_processes(self):
        # The golden: the digest of a fixed hook is the same in every process and release
        # (this one, after many compiles, and a fresh one).
        code = (
            "import torch, torch.fx\n"
            "from torch_patches._functorch._aot_autograd.hook_identity import hook_cache_hash\n"
            "def pack(x):\n    return (x * 2.0).to(torch.bfloat16)\n"
            "print(hook_cache_hash(torch.fx.symbolic_trace(pack))[0])\n"
        )
        here = io.StringIO()
        with contextlib.redirect_stdout(here):
            exec(code, {})
        fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        digests = {here.getvalue().strip(), fresh.strip()}
        self.assertEqual(len(digests), 1)
        self.assertExpectedInline(digests.pop(), """71c3053a54cc5a7ed169934f""")

    def test_process_local_parts_have_no_key(self):
        big = torch.randn(100, 100)

        def pack(x):
            return x * big

        digest, reasons = hook_cache_hash(inlineable(pack, pack)[0])
        self.assertIsNone(digest)
        self.assertIn("float32[100, 100]", reasons[0])

        def with_hashed(x):
            return hashed(x) * 2

        def with_unhashed(x):
            return unhashed(x) * 2

        hashed_key = hook_cache_hash(torch.fx.symbolic_trace(with_hashed))[0]
        self.assertIsNotNone(hashed_key)
        # An fx.wrap leaf without a user_cache_hash is keyed by its code.
        self.assertIsNotNone(hook_cache_hash(torch.fx.symbolic_trace(with_unhashed))[0])

    def test_installed_subgraph_carries_the_key(self):
        gm = torch.fx.symbolic_trace(lambda x: x * 2)
        key = hooks_cache_key(gm, gm)
        sub = hook_subgraph(gm, "pack", key)
        (call,) = [n for n in sub.graph.nodes if n.op == "call_function"]
        self.assertTrue(call.meta["is_wrapped"])
        self.assertIn(key[0], call.meta["user_cache_hash"])


class TestStandIns(TestCase):
    def test_compiles_leave_no_fx_leaf_registrations(self):
        # The stand-ins' generated code registers them as fx.wrap leaves, one entry per
        # GraphModule for the process's life, which every later trace walks: compiling a
        # hooked step again and again must not grow that registry.
        from torch.fx import _symbolic_trace

        def registered():
            return sum(1 for _, name in _symbolic_trace._wrapped_fns_to_patch if "saved_tensors_" in name)

        w = torch.randn(4, 4, requires_grad=True)
        counts = []
        for _ in range(3):
            torch._dynamo.reset()
            with torch.autograd.graph.saved_tensors_hooks(*torch_patches.hooks.bf16()):
                torch.compile(lambda x: (x @ w).sin().sum(), backend="aot_eager")(torch.randn(4, 4)).backward()
            counts.append(registered())
        self.assertLessEqual(max(counts), 2, counts)


if __name__ == "__main__":
    run_tests()
