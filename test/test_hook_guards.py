"""Guards on saved-tensor hooks compare content, not identity.

Upstream guards on the hooks' id(): a training loop that recreates an identical hook pair
every step recompiles every step. We guard on a digest of the hooks' code, constants and
captured values: recreated identical hooks never recompile, a changed hook recompiles once and
is the one used.
"""

import torch
import torch.fx
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend

from torch_patches.hooks import inlineable
from torch_patches.testing import TestCase, instantiate_device_type_tests


def make_hooks(kind, scale):
    def pack(t):
        return (t * scale).to(torch.bfloat16)

    def unpack(t):
        return t.to(torch.float32) / scale

    if kind == "graph_module":
        return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)
    return inlineable(pack, unpack)


def fn(x):
    return x.sin().exp().cos()


class TestHookGuards(TestCase):
    def run_steps(self, device, kind, scales):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter)
        grads = []
        for scale in scales:
            x = torch.linspace(-1, 1, 32, device=device).view(4, 8).requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(*make_hooks(kind, scale)):
                compiled(x).sum().backward()
            grads.append(x.grad)
        return counter.frame_count, grads

    def test_recreated_identical_hooks_do_not_recompile(self, device):
        for kind in ("graph_module", "marked_function"):
            with self.subTest(kind=kind):
                torch._dynamo.reset()
                frames, _ = self.run_steps(device, kind, [2.0] * 10)
                self.assertEqual(frames, 1)

    def test_changed_constant_recompiles_once_and_is_used(self, device):
        for kind in ("graph_module", "marked_function"):
            with self.subTest(kind=kind):
                torch._dynamo.reset()
                frames, grads = self.run_steps(device, kind, [2.0] * 5 + [3.0] * 5)
                self.assertEqual(frames, 2)
                # The bf16 rounding depends on the scale: the gradients tell the hooks apart.
                torch._dynamo.reset()
                _, fresh = self.run_steps(device, kind, [3.0])
                self.assertGradsEqual([grads[-1]], fresh, exact=True)
                self.assertFalse(torch.equal(grads[0], grads[-1]))

    def test_changed_code_recompiles(self, device):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        pairs = [
            (lambda t: t * 2, lambda t: t / 2),
            (lambda t: t * 2, lambda t: t / 2),  # same code again: no recompile
            (lambda t: t * 4, lambda t: t / 4),
        ]
        for pack, unpack in pairs:
            hooks = torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                compiled(x).sum().backward()
        self.assertEqual(counter.frame_count, 2)


instantiate_device_type_tests(TestHookGuards, globals())


if __name__ == "__main__":
    run_tests()
