"""The hook contract: user hooks never corrupt gradients.

The partitioner saves tensors eager autograd would never hand to a hook (relu's and
comparisons' bool masks, argmax indices, a custom Function's int64 tensor), and an
activation hook written for floats (``x * 2`` / ``x / 2``, a cast to bf16...) would turn them
into floats that the compiled backward then reads with the wrong dtype. The contract, for
inlined hooks (GraphModule or ``torch_patches.hooks.inlineable`` functions) and for Python
hooks run by a compiled graph alike:

* by default only floating-point saved tensors reach user hooks
  (``config.hooked_saved_tensor_dtypes = "all"`` opts into every dtype);
* what unpack returns must match the saved tensor's dtype, shape and device, or a
  ``SavedTensorsHookError`` names the hook and the tensor: at compile time for inlined hooks,
  at run time for Python hooks.
"""

import unittest
import warnings

import torch
import torch.fx
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests

import torch_patches
import torch_patches.config as tp_config
from torch_patches.hooks import inlineable
from torch_patches.testing import TestCase, instantiate_device_type_tests


def double(x):
    return x * 2


def halve(x):
    return x / 2


def _kinds():
    """The same lossless-on-floats hooks as the three kinds users write."""
    return {
        "graph_module": (torch.fx.symbolic_trace(double), torch.fx.symbolic_trace(halve)),
        "marked_function": inlineable(lambda x: x * 2, lambda x: x / 2),
        "python": (double, halve),
    }


class SaveIndices(torch.autograd.Function):
    """Saves an int64 tensor computed from its input for its backward."""

    @staticmethod
    def forward(ctx, h):
        idx = (h.detach() * 4).floor().long()
        ctx.save_for_backward(idx)
        return h * 1.0

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        return grad * (idx.to(grad.dtype) + 1)


def relu_and_int64(x, w):
    # The issue's repro: a custom Function saving int64, then relu. Inductor's partitioner
    # saves relu's bool mask (``le``) and the matmul output.
    return SaveIndices.apply(F.linear(x, w)).relu()


def bool_mask(x, w):
    # Both partitioners save the comparison's bool result, not the float it came from.
    return (F.linear(x, w) > 0) * x.sin()


def argmax_gather(x, w):
    h = F.linear(x, w)
    idx = h.argmax(dim=-1, keepdim=True)
    return h.gather(-1, idx) * h.tanh()


def embedding(x, w):
    idx = (x.detach().abs() * 3).long().clamp(max=w.shape[0] - 1)
    return F.embedding(idx, w).sum(1) * x.sin()


def view_chain(x, w):
    h = F.linear(x, w).view(-1, 2, 2)
    return h.transpose(1, 2).relu().reshape(x.shape[0], -1).exp()


MODELS = {
    "relu_and_int64": relu_and_int64,
    "bool_mask": bool_mask,
    "argmax_gather": argmax_gather,
    "embedding": embedding,
    "view_chain": view_chain,
}


def grads(fn, device, hooks=None, backend=None, seed=0, dynamic=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=gen).to(device).requires_grad_()
    w = torch.randn(4, 4, generator=gen).to(device).requires_grad_()
    f = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic) if backend else fn
    if hooks is None:
        out = f(x, w)
    else:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = f(x, w)
    out.sum().backward()
    return [x.grad, w.grad]


class TestDtypePolicy(TestCase):
    def check_model(self, device, model, backend, kind):
        # The hooks are exact on floats, so a correct run equals the run without hooks.
        # (Eager autograd with these hooks is no reference here: for ``where``, ``gather``
        # and ``embedding`` it hands the mask/indices to the hooks itself and fails.)
        fn = MODELS[model]
        reference = grads(fn, device)
        ours = grads(fn, device, hooks=_kinds()[kind], backend=backend)
        self.assertGradsEqual(ours, reference, atol=1e-5, rtol=1e-5)

    def test_masks_and_indices_aot_eager(self, device):
        for model in MODELS:
            for kind in _kinds():
                with self.subTest(model=model, kind=kind):
                    torch._dynamo.reset()
                    self.check_model(device, model, "aot_eager", kind)

    def test_issue_repro_inductor(self, device):
        # Stock torch 2.13 returned 52 where eager gives 3 (the mask read as float).
        for kind in _kinds():
            with self.subTest(kind=kind):
                torch._dynamo.reset()
                self.check_model(device, "relu_and_int64", "inductor", kind)

    def test_masks_inductor(self, device):
        for model in ("bool_mask", "argmax_gather"):
            with self.subTest(model=model):
                torch._dynamo.reset()
                self.check_model(device, model, "inductor", "graph_module")

    def test_stock_torch_corrupts_python_hooks(self, device):
        # Why the policy exists: without our patches Inductor's backward hands relu's bool
        # mask and the int64 tensor to the hooks and reads their float results as if they
        # still were bool / int64.
        torch_patches.unapply()
        try:
            reference = grads(relu_and_int64, device)
            stock = grads(relu_and_int64, device, hooks=(double, halve), backend="inductor")
        except RuntimeError as e:  # some versions fail loudly instead
            self.assertIn("bool", str(e).lower())
            return
        finally:
            torch_patches.apply()
        self.assertFalse(torch.allclose(stock[0], reference[0]))  # x's gradient

    def test_dropout_mask_not_hooked(self, device):
        # aot_eager runs dropout with eager kernels in the same order: same RNG stream.
        def fn(x, w):
            return F.dropout(F.linear(x, w), p=0.5, training=True).sin()

        torch.manual_seed(0)
        reference = grads(fn, device, backend="aot_eager")
        torch._dynamo.reset()
        torch.manual_seed(0)
        ours = grads(fn, device, hooks=_kinds()["graph_module"], backend="aot_eager")
        self.assertGradsEqual(ours, reference, atol=1e-6, rtol=1e-6)

    def test_all_dtypes_opt_in(self, device):
        # With "all", integer tensors reach the hooks: a dtype-preserving hook is fine...
        keep = torch.fx.symbolic_trace(lambda x: x.clone()), torch.fx.symbolic_trace(lambda x: x.clone())
        with tp_config.patch(hooked_saved_tensor_dtypes="all"):
            ours = grads(argmax_gather, device, hooks=keep, backend="aot_eager")
            self.assertGradsEqual(ours, grads(argmax_gather, device), atol=1e-6, rtol=1e-6)
            # ...a float-only hook is caught by validation, never a silent wrong gradient.
            torch._dynamo.reset()
            with self.assertRaisesHookError("dtype mismatch.*int64"):
                grads(argmax_gather, device, hooks=_kinds()["graph_module"], backend="aot_eager")
            torch._dynamo.reset()
            with self.assertRaisesHookError("int64"):
                grads(argmax_gather, device, hooks=_kinds()["python"], backend="aot_eager")

    def test_unknown_policy_is_an_error(self, device):
        with tp_config.patch(hooked_saved_tensor_dtypes="ints"):
            with self.assertRaisesRegex(Exception, "must be 'float' or 'all'"):
                grads(bool_mask, device, hooks=_kinds()["graph_module"], backend="aot_eager")


def _bad_pairs():
    """(what is wrong, pack, unpack) for unpack results that do not match the saved tensor."""
    return {
        "dtype": (lambda x: x.to(torch.bfloat16), lambda x: x),
        "shape": (lambda x: x.reshape(-1), lambda x: x),
        "device": (lambda x: x.to("meta"), lambda x: x),
    }


class FusedQKVAttention(torch.nn.Module):
    """Causal attention over q, k and v split from one projection: each a transposed view
    with gaps, saved by SDPA's backward."""

    dim, heads = 32, 4

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(self.dim, 3 * self.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


class TestUnpackValidation(TestCase):
    def fn(self, x):
        # Saves the intermediate exp(sin(x)): hooked under every filtering mode.
        return x.sin().exp().cos()

    def test_inlined_mismatch_is_a_compile_error(self, device):
        for what, (pack, unpack) in _bad_pairs().items():
            if what == "device":
                continue  # a meta tensor cannot be produced in a traced graph's output
            pack_gm, unpack_gm = torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)
            with self.subTest(what=what):
                torch._dynamo.reset()
                x = torch.randn(4, 8, device=device, requires_grad=True)
                f = torch.compile(self.fn, backend="aot_eager", fullgraph=True)
                with torch.autograd.graph.saved_tensors_hooks(pack_gm, unpack_gm):
                    with self.assertRaisesHookError() as caught:
                        f(x)
                msg = str(caught[0])
                self.assertIn("unpack hook", msg)
                self.assertIn(f"{what} mismatch", msg)
                self.assertIn("float32[4, 8]", msg)  # the saved tensor
                self.assertIn("GraphModule", msg)  # the hook

    def test_inlined_mismatch_without_fullgraph_falls_back_and_still_fails_loudly(self, device):
        pack, unpack = inlineable(lambda x: x.to(torch.bfloat16), lambda x: x)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        f = torch.compile(self.fn, backend="aot_eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                y = f(x)
        fallbacks = [w for w in caught if "Falling back to eager" in str(w.message)]
        self.assertEqual(len(fallbacks), 1, [str(w.message) for w in caught])
        # Eager hook semantics, under the contract: the bad unpack is caught when it runs.
        with self.assertRaisesRegex(torch_patches.SavedTensorsHookError, "bfloat16"):
            y.sum().backward()

    def test_python_hook_mismatch_is_a_runtime_error(self, device):
        for what, (pack, unpack) in _bad_pairs().items():
            with self.subTest(what=what):
                torch._dynamo.reset()
                x = torch.randn(4, 8, device=device, requires_grad=True)
                f = torch.compile(self.fn, backend="aot_eager")
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    y = f(x)
                with self.assertRaises(torch_patches.SavedTensorsHookError) as cm:
                    y.sum().backward()
                msg = str(cm.exception)
                self.assertIn("unpack hook", msg)
                self.assertIn("<lambda>", msg)
                self.assertIn("float32[4, 8]", msg)

    def test_strides_are_restored(self, device):
        # unpack may return a contiguous tensor for a transposed saved tensor: the graph
        # copies it back into the saved tensor's strides, gradients stay right.
        def fn(x, w):
            return (F.linear(x, w).t() * 1.0).exp()

        hooks = torch.fx.symbolic_trace(lambda x: x.contiguous() * 2), torch.fx.symbolic_trace(lambda x: x / 2)
        self.assertGradsEqual(grads(fn, device, hooks=hooks, backend="aot_eager"), grads(fn, device), atol=1e-6, rtol=1e-6)

    def test_symbolic_strides_are_restored(self, device):
        # dynamic=True: a saved tensor's strides may be expressions of symbols the backward
        # never receives (attention's transposed q/k/v, views of one fused projection); they
        # cannot be spelled there, so the stride order is restored instead. It was a
        # NameError at the backward's first call (aot_eager), a LoweringException (Inductor).
        torch.manual_seed(0)
        model = FusedQKVAttention().to(device)
        x = torch.randn(2, 16, FusedQKVAttention.dim, device=device)

        def step(dynamic, backend="aot_eager"):
            torch._dynamo.reset()
            with torch.autograd.graph.saved_tensors_hooks(*torch_patches.hooks.bf16()):
                out = torch.compile(model, backend=backend, dynamic=dynamic)(x)
            out.sum().backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return got

        static = step(False)
        self.assertGradsEqual(step(True), static, exact=True)
        self.assertGradsEqual(step(True, "inductor"), static, atol=1e-4, rtol=1e-3)

    def test_python_hooks_get_strides_restored_inductor(self, device):
        # Python hooks (not inlineable) returning a compact copy of a view with gaps (q/k of
        # a fused projection, as in attention): Inductor's backward asserts the saved
        # tensor's strides. Stock torch fails there; the runtime contract copies the
        # result back into those strides.
        def fn(x, w):
            qkv = F.linear(x, torch.cat([w, w * 2, w * 3], 0)).view(1, 3, 3, 2, 2).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            return F.scaled_dot_product_attention(q, k, v)

        for pack in (lambda t: t.contiguous() * 2, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2) * 2):
            with self.subTest():
                torch._dynamo.reset()
                hooks = pack, lambda t: t / 2
                self.assertGradsEqual(grads(fn, device, hooks=hooks, backend="inductor"), grads(fn, device), atol=1e-5, rtol=1e-5)
        torch_patches.unapply()
        torch._dynamo.reset()
        with self.assertRaisesRegex(AssertionError, "stride"):
            grads(fn, device, hooks=(lambda t: t.contiguous() * 2, lambda t: t / 2), backend="inductor")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a second device")
    def test_python_hook_wrong_device(self, device):
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        f = torch.compile(self.fn, backend="aot_eager")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.cpu(), lambda t: t):
            y = f(x)
        with self.assertRaisesRegex(torch_patches.SavedTensorsHookError, "device"):
            y.sum().backward()


class Scale(torch.Tensor):
    """A tensor subclass with no ``__torch_dispatch__`` of its own."""


class TestHooksReadingSubclasses(TestCase):
    # Hooks that run as eager hooks (Python hooks, or inlineable ones that fell back) run at
    # a compiled graph's first call too, where upstream's runtime wrapper has entered its
    # check of the graph's custom ops: a subclass the hook reads must not meet it.
    def fn(self, x):
        return x.sin().exp().cos()

    def hooks(self, device, traceable=True):
        scale = torch.full((4,), 2.0, device=device).as_subclass(Scale)

        def pack(x):
            s = scale[0]
            if not traceable:  # .item(): not traceable, so the pair falls back to eager hooks
                s = s + x.abs().max().item() * 0
            return x * s  # a power of two: lossless, gradients equal those without hooks

        def unpack(p):
            return p / scale[0]

        return pack, unpack

    def check(self, device, pack, unpack, fallbacks):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        self.fn(x).sum().backward()
        expected, x.grad = x.grad, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                torch.compile(self.fn, backend="aot_eager")(x).sum().backward()
        fell_back = [w for w in caught if "Falling back to eager" in str(w.message)]
        self.assertEqual(len(fell_back), fallbacks, [str(w.message) for w in caught])
        self.assertGradsEqual([x.grad], [expected], exact=True)

    def test_python_hooks_read_a_subclass(self, device):
        self.check(device, *self.hooks(device), fallbacks=0)

    def test_eager_fallback_reads_a_subclass(self, device):
        self.check(device, *inlineable(*self.hooks(device, traceable=False)), fallbacks=1)


instantiate_device_type_tests(TestDtypePolicy, globals())
instantiate_device_type_tests(TestUnpackValidation, globals())
instantiate_device_type_tests(TestHooksReadingSubclasses, globals())


if __name__ == "__main__":
    run_tests()
