"""Facts torch_patches' stages hand each other ride on the compilation's TracingContext.

The inliner's decision (were the ambient hooks inlined), the not-cacheable reasons and the
in-graph scopes live in ``torch_patches._functorch._aot_autograd.compile_facts.CompileFacts`` on the
``TracingContext`` of the compilation that produced them: two compilations never see each
other's, and nothing is left behind in module state.
"""

import threading
import warnings

import torch
from torch._dynamo.test_case import run_tests
from torch._functorch.aot_autograd import aot_function

from torch_patches._functorch._aot_autograd import compile_facts
from torch_patches.hooks import bf16, inlineable
from torch_patches.testing import SavedTensorsHookError, TestCase, instantiate_device_type_tests


def reads_values_pack(x):
    return x * x.sum().item()  # untraceable: .item()


def reads_values_unpack(x):
    return x


class TestCompileFacts(TestCase):
    def test_facts_live_on_the_tracing_context(self, device):
        seen = []

        def backend(gm, example_inputs):
            from torch._dynamo.backends.debugging import aot_eager

            compiled = aot_eager(gm, example_inputs)
            from torch._guards import TracingContext

            seen.append((TracingContext.try_get(), compile_facts.facts()))
            return compiled

        x = torch.randn(8, 8, device=device, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(*bf16(where=None)):
            torch.compile(lambda x: x.sin().sin(), backend=backend)(x).sum().backward()
        ((ctx, facts),) = seen
        self.assertIs(vars(ctx)[compile_facts._ATTR], facts)
        self.assertEqual(facts.hooks_inlined[1], True)
        self.assertEqual(facts.not_cacheable, [])
        self.assertIsNone(compile_facts.facts())  # outside a compilation: nothing

    def test_accessors_answer_for_the_current_compilation(self, device):
        from torch._guards import TracingContext, tracing

        self.assertEqual(compile_facts.not_cacheable_reasons(), [])  # no compilation
        self.assertFalse(compile_facts.mark_not_cacheable("outside"))
        with tracing(TracingContext(None)):
            self.assertIsNone(compile_facts.inlined("key"))  # not tried
            compile_facts.record_inlined("key", False)
            self.assertIs(compile_facts.inlined("key"), False)
            self.assertIsNone(compile_facts.inlined("other hooks"))  # the ambient hooks changed
            self.assertTrue(compile_facts.mark_not_cacheable("why"))
            self.assertEqual(compile_facts.not_cacheable_reasons(), ["why"])
        self.assertEqual(compile_facts.not_cacheable_reasons(), [])

    def test_concurrent_compiles_keep_their_own_decisions(self, device):
        # One thread's hooks fall back to eager (untraceable), the other's inline: each
        # compiled function runs its own hooks at run time.
        calls = {"fallback": 0}

        def counting_unpack(x):
            calls["fallback"] += 1
            return x

        results = {}

        def run(name, hooks):
            x = torch.randn(8, 8, device=device, requires_grad=True)
            w = torch.randn(8, 8, device=device, requires_grad=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    out = torch.compile(lambda x, w: (x @ w) @ w, backend="aot_eager")(x, w)
            out.sum().backward()
            results[name] = x.grad

        fallback = inlineable(reads_values_pack, counting_unpack)
        threads = [
            threading.Thread(target=run, args=("fallback", fallback)),
            threading.Thread(target=run, args=("inlined", bf16(where=None))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(set(results), {"fallback", "inlined"})
        self.assertGreater(calls["fallback"], 0)  # ran as an eager hook

    def test_aot_without_dynamo_raises_instead_of_falling_back(self, device):
        # No TracingContext: nothing could tell the runtime wrapper the hooks stayed eager.
        fn = aot_function(lambda x, w: (x @ w) @ w, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm)
        x = torch.randn(8, 8, device=device, requires_grad=True)
        w = torch.randn(8, 8, device=device, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(*inlineable(reads_values_pack, reads_values_unpack)):
            with self.assertRaisesRegex(SavedTensorsHookError, r"\.item\(\)"):
                fn(x, w)


instantiate_device_type_tests(TestCompileFacts, globals())


if __name__ == "__main__":
    run_tests()
