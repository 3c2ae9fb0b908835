"""The numerics allowlist: which saved tensors the lossy hooks may compress.

One test per decision, on small graphs, compiled (the backward graph is known: every reader
of a saved tensor must have an entry for the argument it reads it as) and eager (only the
producer is known at pack time):

* an attention's log-sum-exp is kept exact, its query, key, value and output compressed;
* an op with no entry keeps what it reads exact; a user entry (``tolerate``) compresses it,
  and changing the list recompiles;
* bounded ``exp`` forms (GELU, SiLU, a log-probability) and ``pow`` by 1..3 pass, the rest
  of ``exp`` and roots/inverses do not;
* a tensor that tolerates bf16 but not 8 bits takes ``fp8_rowwise``'s ``otherwise`` pair.
"""

import functools

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests
from torch._dynamo.testing import CompileCounterWithBackend

from torch_patches import config as tp_config
from torch_patches._functorch._aot_autograd import saved_numerics
from torch_patches.hooks import bf16, fp8_rowwise, int8_rowwise, numerics, numerics_safe, select, tolerate
from torch_patches.hooks.select import SavedTensorInfo, _Kept
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    InductorAndRecordGraphs,
    TestCase,
    hook_nodes,
    instantiate_device_type_tests,
)


def attention(x, wq, wk, wv, wo):
    b, t, d = x.shape
    q, k, v = (F.linear(x, w).view(b, t, 2, d // 2).transpose(1, 2) for w in (wq, wk, wv))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(a.transpose(1, 2).reshape(b, t, d), wo)


def attention_inputs(device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=gen).to(device).requires_grad_()
    ws = [(torch.randn(32, 32, generator=gen) / 32**0.5).to(device).requires_grad_() for _ in range(4)]
    return [x, *ws]


def run(fn, args, hooks):
    args = [a.detach().clone().requires_grad_() for a in args]
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        fn(*args).sum().backward()
    return [a.grad for a in args]


def recording(pair):
    """``pair`` with a pack that records (input, what is stored) for every saved tensor
    (eager; through ``otherwise`` pairs: ``(bf16 tensor, dtype)``, a row-wise tuple, or the
    kept tensor's ``_Kept``)."""
    from torch_patches.hooks.select import _Otherwise

    seen = []

    def pack(t):
        out = pair[0](t)
        stored = out
        while isinstance(stored, _Otherwise):
            stored = stored.packed
        seen.append((t, stored))
        return out

    return (pack, pair[1]), seen


def saved_sources(gm):
    """Forward node name -> its target, for the recorded forward graph."""
    return {n.name: n for n in gm.graph.nodes}


class TestAllowlistCompiled(TestCase):
    def compiled_decisions(self, fn, args, hooks, backend="aot_eager"):
        rec = AotEagerAndRecordGraphs() if backend == "aot_eager" else InductorAndRecordGraphs(kernels=False)
        run(torch.compile(fn, backend=rec, fullgraph=True), args, hooks)
        fw = rec.fw_graphs[0]
        hooked = {meta["saved"] for meta in hook_nodes(fw).values()}
        return fw, hooked

    def test_attention_statistics_kept_qkv_out_compressed(self, device):
        for backend in ("aot_eager", "inductor"):
            with self.subTest(backend=backend):
                torch._dynamo.reset()
                fw, hooked = self.compiled_decisions(attention, attention_inputs(device), fp8_rowwise(), backend)
                nodes = saved_sources(fw)
                sdpa = [n for n in fw.graph.nodes if "scaled_dot_product" in str(n.target)]
                self.assertEqual(len(sdpa), 1, [str(n.target) for n in fw.graph.nodes])
                outs = {n.args[1]: n.name for n in sdpa[0].users if n.target.__name__ == "getitem"}
                self.assertNotIn(outs[1], hooked)  # log-sum-exp: exact
                # q, k, v (the op's inputs, through views) and its output are compressed.
                qkv = [a for a in sdpa[0].args[:3]]
                for arg in qkv:
                    self.assertTrue(
                        arg.name in hooked
                        or any(u.name in hooked for u in arg.users)
                        or any(a.name in hooked for a in arg.all_input_nodes),
                        (arg.name, hooked),
                    )
                self.assertTrue(
                    any(name in hooked for name in nodes if name.startswith("getitem")) or any("detach" in name for name in hooked), hooked
                )

    def test_reason_names_the_reader_and_argument(self, device):
        seen = []

        def where(info):
            seen.append(info)
            return numerics_safe(info)

        run(
            torch.compile(attention, backend="aot_eager", fullgraph=True),
            attention_inputs(device),
            select(*fp8_rowwise(where=None), where=where),
        )
        lse = [i for i in seen if i.producer and i.producer.startswith("getitem:1 of")]
        self.assertEqual([i.tolerance for i in lse], ["exact"])
        self.assertIn("statistics", lse[0].why)
        q = [i for i in seen if i.readers and any("[query]" in r for r in i.readers)]
        self.assertEqual([i.tolerance for i in q], [numerics.ATTENTION_QK])
        # A linear layer's input meets the gradient in x^T @ dy, a parameter's gradient: fp8.
        weights = [
            i for i in seen if i.readers and all(r.startswith(("aten.mm", "aten.view", "aten.t.", "aten.permute")) for r in i.readers)
        ]
        self.assertTrue(weights, [(i.name, i.readers) for i in seen])
        self.assertEqual({i.tolerance for i in weights}, {"fp8"})

    def test_lse_reader_entry_is_exact_even_without_the_producer_rule(self, device):
        # The log-sum-exp is exact twice over: as a statistics output, and because the
        # backward kernel's logsumexp argument has no entry.
        fw, bw, saved, bw_input = self.traced_attention_backward(device)
        found = saved_numerics.verdict(bw_input, bw_input, saved_numerics.tangent_dependent(bw.graph))
        self.assertEqual(found.level, "exact")
        self.assertIn("[logsumexp]", found.why)

    def traced_attention_backward(self, device):
        rec = AotEagerAndRecordGraphs()
        run(torch.compile(attention, backend=rec, fullgraph=True), attention_inputs(device), fp8_rowwise(where=lambda i: False))
        fw, bw = rec.fw_graphs[0], rec.bw_graphs[0]
        sdpa_bw = next(n for n in bw.graph.nodes if "scaled_dot_product" in str(n.target))
        schema = [a.name for a in sdpa_bw.target._schema.arguments]
        bw_input = sdpa_bw.args[schema.index("logsumexp")]
        return fw, bw, None, bw_input

    def test_unknown_op_keeps_its_input_user_entry_compresses_it(self, device):
        @torch.library.custom_op("tp_numerics_test::scale", mutates_args=())
        def scale(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        @torch.library.custom_op("tp_numerics_test::scale_backward", mutates_args=())
        def scale_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return grad * 3 + 0 * x

        scale.register_fake(lambda x: torch.empty_like(x))
        scale_backward.register_fake(lambda grad, x: torch.empty_like(grad))

        def setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return torch.ops.tp_numerics_test.scale_backward(grad, x)

        scale.register_autograd(backward, setup_context=setup)

        def fn(x, w):
            return torch.ops.tp_numerics_test.scale(x @ w).sum(-1)

        gen = torch.Generator().manual_seed(0)
        args = [torch.randn(8, 16, generator=gen).to(device), torch.randn(16, 16, generator=gen).to(device)]
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        seen = []

        def where(info):
            seen.append(info)
            return numerics_safe(info)

        hooks = select(*fp8_rowwise(where=None), where=where)
        run(compiled, args, hooks)
        mm = [i for i in seen if i.producer == "aten.mm.default"]
        self.assertEqual(len(mm), 1)
        self.assertEqual(mm[0].tolerance, "exact")
        self.assertIn("tp_numerics_test.scale_backward.default[x]", mm[0].why)
        with tp_config.patch(numerics_allowlist={}):
            tolerate(torch.ops.tp_numerics_test.scale_backward.default, "x")
            self.assertEqual(tp_config.numerics_allowlist, {"tp_numerics_test::scale_backward.default": {"x": "int8"}})
            seen.clear()
            run(compiled, args, hooks)  # the list is part of the graph's identity: recompiles
            self.assertEqual(counter.frame_count, 2)
            self.assertEqual([i.tolerance for i in seen if i.producer == "aten.mm.default"], ["int8"])
            with self.assertRaisesRegex(ValueError, "has no argument 'y'"):
                tolerate(torch.ops.tp_numerics_test.scale_backward.default, "y")

    def test_rope_angles_kept_in_bf16_too(self, device):
        def rope(x, w, wf):
            angles = (x @ wf) * 64.0
            return ((x @ w) * angles.cos()).sum()

        gen = torch.Generator().manual_seed(0)
        args = [torch.randn(32, 16, generator=gen).to(device)] + [torch.randn(16, 16, generator=gen).to(device) for _ in range(2)]
        seen = []
        run(
            torch.compile(rope, backend="aot_eager", fullgraph=True),
            args,
            select(*bf16(where=None), where=lambda i: seen.append(i) or numerics_safe(i, "bf16")),
        )
        angles = [i for i in seen if i.readers and any(r.startswith("aten.cos") for r in i.readers)]
        self.assertEqual([i.tolerance for i in angles], ["exact"])

    def test_otherwise_takes_what_tolerates_only_bf16(self, device):
        # With attention's query and key marked bf16-only, fp8_rowwise(otherwise=bf16())
        # stores them in bf16 and everything else it may in fp8.
        entry = {
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward": {"query": "bf16", "key": "bf16"},
            "aten::_scaled_dot_product_efficient_attention_backward": {"query": "bf16", "key": "bf16"},
            "aten::_scaled_dot_product_flash_attention_backward": {"query": "bf16", "key": "bf16"},
        }
        with tp_config.patch(numerics_allowlist=entry):
            rec = AotEagerAndRecordGraphs()
            run(torch.compile(attention, backend=rec, fullgraph=True), attention_inputs(device), fp8_rowwise(otherwise=bf16()))
        fw = rec.fw_graphs[0]
        packed = {}
        for n in fw.graph.nodes:
            meta = hook_nodes(fw).get(n.name)
            if meta is not None and meta["role"] == "pack" and isinstance(n.meta.get("val"), torch.Tensor):
                packed.setdefault(meta["saved"], set()).add(n.meta["val"].dtype)
        stores = {name: (torch.bfloat16 in dtypes, torch.float8_e4m3fn in dtypes) for name, dtypes in packed.items()}
        self.assertIn((True, False), stores.values(), stores)  # q, k: bf16
        self.assertIn((False, True), stores.values(), stores)  # v, out...: fp8


class TestAllowlistEager(TestCase):
    def test_attention_statistics_kept_activations_compressed(self, device):
        hooks, seen = recording(int8_rowwise())
        run(attention, attention_inputs(device), hooks)
        kept = [t for t, out in seen if isinstance(out, _Kept)]
        packed = [t for t, out in seen if isinstance(out, tuple)]
        # log-sum-exp (does not require grad) and the leaves (x, weights) stay exact.
        self.assertTrue(any(t.dim() == 3 and not t.requires_grad for t in kept), [t.shape for t in kept])
        self.assertTrue(all(t.requires_grad and t.grad_fn is not None for t in packed))
        self.assertGreaterEqual(len(packed), 4)  # q, k, v, out (and the attention's input)

    def test_fp8_is_bf16_in_eager(self, device):
        # Eager cannot tell a weight-gradient operand (fp8) from a gradient's coefficient
        # (int8): fp8_rowwise() stores eager activations with its otherwise pair, bf16.
        hooks, seen = recording(fp8_rowwise())
        run(attention, attention_inputs(device), hooks)
        stored = [out for _, out in seen if isinstance(out, tuple)]
        self.assertGreaterEqual(len(stored), 4)
        self.assertEqual({out[0].dtype for out in stored}, {torch.bfloat16})

    def test_eager_verdicts(self, device):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        self.assertEqual(numerics.eager_verdict(x)[0], "exact")  # a leaf
        y = x * 2
        self.assertEqual(numerics.eager_verdict(y)[0], "int8")  # never fp8: the reader is unknown
        self.assertEqual(numerics.eager_verdict(y.detach())[0], "exact")
        a, b = y.split(4, dim=-1)
        self.assertEqual(numerics.eager_verdict(b)[0], "int8")  # output 1 of a split: data
        _, mean, rstd = torch.native_layer_norm(y, [8], None, None, 1e-5)
        self.assertEqual(numerics.eager_verdict(rstd)[0], "exact")
        self.assertEqual(numerics.eager_verdict(y.logsumexp(-1))[0], "exact")
        self.assertEqual(numerics.eager_verdict(torch.rsqrt(y.pow(2).mean(-1)))[0], "exact")


class TestAllowlistRules(TestCase):
    """The walk on hand-written backward graphs: placeholders ``x`` (the saved tensor) and
    ``tangents_1``."""

    def level(self, fn):
        gm = fx.symbolic_trace(fn)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "x")
        return saved_numerics.verdict(x, x, saved_numerics.tangent_dependent(gm.graph))

    def test_bounded_exp_forms(self, device):
        aten = torch.ops.aten
        bounded = {
            "-x^2": lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.exp.default(aten.mul.Tensor(aten.mul.Tensor(x, x), -0.5))),
            "-x^2 (pow)": lambda x, tangents_1: aten.mul.Tensor(
                tangents_1, aten.exp.default(aten.neg.default(aten.pow.Tensor_Scalar(x, 2)))
            ),
            "logistic": lambda x, tangents_1: aten.mul.Tensor(
                tangents_1, aten.div.Tensor(x, aten.add.Tensor(aten.exp.default(aten.neg.default(x)), 1))
            ),
            "sigmoid": lambda x, tangents_1: aten.mul.Tensor(
                tangents_1, aten.reciprocal.default(aten.add.Tensor(aten.exp.default(aten.neg.default(x)), 1))
            ),
        }
        for name, fn in bounded.items():
            found = self.level(fn)
            self.assertEqual(found.level, "int8", (name, found))
        amplifying = {
            "exp": lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.exp.default(x)),
            "not inverted": lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.mul.Tensor(aten.add.Tensor(aten.exp.default(x), 1), x)),
            "+x^2": lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.exp.default(aten.mul.Tensor(aten.mul.Tensor(x, x), 0.5))),
            "linear exponent": lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.exp.default(aten.mul.Tensor(x, -0.5))),
            "logits (sub, exp)": lambda x, tangents_1: aten.mul.Tensor(
                tangents_1, aten.exp.default(aten.sub.Tensor(x, aten.amax.default(x, [-1], True)))
            ),
        }
        for name, fn in amplifying.items():
            found = self.level(fn)
            self.assertEqual(found.level, "exact", (name, found))
            self.assertIn("aten.exp.default", found.why)

    def test_pow_roots_inverses_division(self, device):
        aten = torch.ops.aten

        def power(p):
            return lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.pow.Tensor_Scalar(x, p))

        for p, level in ((1, "int8"), (2, "int8"), (3, "int8"), (0.5, "exact"), (-1, "exact"), (4, "exact")):
            found = self.level(power(p))
            self.assertEqual(found.level, level, (p, found))
        self.assertEqual(self.level(lambda x, tangents_1: aten.div.Tensor(tangents_1, x)).level, "exact")
        self.assertEqual(self.level(lambda x, tangents_1: aten.mul.Tensor(aten.div.Tensor(x, 3.0), tangents_1)).level, "int8")
        self.assertEqual(self.level(lambda x, tangents_1: aten.mul.Tensor(tangents_1, aten.rsqrt.default(x))).level, "exact")

    def test_walk_stops_at_the_gradient(self, device):
        aten = torch.ops.aten

        def fn(x, tangents_1):
            g = aten.mul.Tensor(tangents_1, x)  # x meets the gradient here: proportional
            return aten.exp.default(g)  # a (strange) op on the gradient is not x's concern

        self.assertEqual(self.level(fn).level, "int8")

    def test_log_probability_exp_is_bounded(self, device):
        # Inductor's decomposed log_softmax backward: grad - exp(out) * sum(grad).
        aten = torch.ops.aten

        def fn(x, tangents_1):
            return aten.sub.Tensor(tangents_1, aten.mul.Tensor(aten.exp.default(x), aten.sum.dim_IntList(tangents_1, [-1], True)))

        gm = fx.symbolic_trace(fn)
        x = next(n for n in gm.graph.nodes if n.name == "x")
        gradients = saved_numerics.tangent_dependent(gm.graph)
        fw = fx.Graph()
        logits = fw.placeholder("logits")
        saved = fw.call_function(aten._log_softmax.default, (logits, -1, False))
        self.assertEqual(saved_numerics.verdict(saved, x, gradients).level, "int8")
        other = fw.call_function(aten.mm.default, (logits, logits))
        self.assertEqual(saved_numerics.verdict(other, x, gradients).level, "exact")

    def test_every_builtin_entry_names_a_real_argument(self, device):
        # A typo in the list would silently keep a tensor exact; every overload's schema
        # is checked (entries for ops this torch lacks are allowed).
        for key, args in numerics.BUILTIN.items():
            ns, name = key.split("::")
            packet = getattr(getattr(torch.ops, ns), name.split(".")[0], None)
            if packet is None:
                continue
            names = {a.name for o in packet.overloads() for a in getattr(packet, o)._schema.arguments}
            for arg, level in args.items():
                self.assertIn(level, numerics.LEVELS)
                if arg != numerics.ALL_ARGS:
                    self.assertTrue(arg in names or not names, (key, arg, sorted(names)))


class TestStorageLevels(TestCase):
    """``numerics_safe`` and the ready-made pairs: which storage each asks for."""

    def test_numerics_safe_levels_and_size(self, device):
        def info(**kw):
            base = dict(
                name="t",
                producer="aten.mm.default",
                dtype=torch.float32,
                shape=(64, 64),
                nbytes=16384,
                backward_consumers=("aten.mm.default",),
                is_input=False,
                scope="ambient",
            )
            base.update(kw)
            return SavedTensorInfo(**base)

        self.assertTrue(numerics_safe(info(), "fp8"))
        self.assertTrue(numerics_safe(info(tolerance="bf16")))  # bf16, the least lossy, by default
        self.assertFalse(numerics_safe(info(tolerance="bf16"), "int8"))
        self.assertTrue(numerics_safe(info(tolerance="int8"), "int8"))
        self.assertFalse(numerics_safe(info(tolerance="int8"), "fp8"))
        self.assertFalse(numerics_safe(info(tolerance="exact")))
        self.assertFalse(numerics_safe(info(shape=(64, 1))))
        self.assertFalse(numerics_safe(info(shape=())))
        with tp_config.patch(lossy_min_bytes=1 << 20):
            self.assertFalse(numerics_safe(info()))
        with tp_config.patch(lossy_hooks_numerics_safe=False):
            self.assertTrue(numerics_safe(info(tolerance="exact")))
        with self.assertRaisesRegex(ValueError, "storage level"):
            numerics_safe(info(), "fp4")

    def test_factories_ask_for_their_storage(self, device):
        from torch_patches.hooks.select import unwrap_select

        for factory, storage in ((bf16, "bf16"), (int8_rowwise, "int8"), (fp8_rowwise, "fp8")):
            where = unwrap_select(factory())[2]
            self.assertIsInstance(where, functools.partial)
            self.assertEqual(where.keywords, {"storage": storage})


instantiate_device_type_tests(TestAllowlistCompiled, globals())
instantiate_device_type_tests(TestAllowlistEager, globals())
instantiate_device_type_tests(TestAllowlistRules, globals())
instantiate_device_type_tests(TestStorageLevels, globals())


if __name__ == "__main__":
    run_tests()
