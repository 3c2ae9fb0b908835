"""The loss head in chunks (issue 57): ``chunked_loss.py`` and ``loss_head.py``.

* :class:`ChunkedLinearCrossEntropy` equals ``cross_entropy(g(linear(h, W, b)), y)`` and its
  gradients (float64: to rounding; float32: within reassociation), over generated heads
  (tokens, vocabulary, chunks, soft-cap / upcast / scale in any order, returned logits
  and where they are returned, recomputed or saved, bias, ignore_index, mean or sum).
* The pattern, on the graphs Dynamo records: HF's ``ForCausalLMLoss`` (Llama, Qwen2, Gemma
  2's soft-cap; GPT-2's loss follows a graph break, so its body graph has no loss and its
  loss graph no head), torchtitan's ``cross_entropy_loss``, ``F.cross_entropy(linear(h),
  y)``, a sum over ``num_items_in_batch``; and what it leaves alone, with why (class
  weights, label smoothing, a per-token loss, an op between the head and the loss).
* Under a budget the rewritten step's loss and gradients equal the unchunked eager step's;
  goldens of the rewritten head.
"""

from __future__ import annotations

import unittest

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch._dynamo.test_case import run_tests

import torch_patches
from torch_patches._functorch._aot_autograd import loss_head
from torch_patches._functorch._aot_autograd.chunked_loss import HeadSpec, _stages, chunk_bounds, chunked_linear_cross_entropy
from torch_patches.hooks import budget
from torch_patches.testing import AotEagerAndRecordGraphs, TestCase, instantiate_device_type_tests, saved_tensor_records
from torch_patches.testing.models import HF_FAMILIES


def reference(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, spec: HeadSpec
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The unchunked head: ``cross_entropy(g(linear(h, w, b)), y)`` and its returned logits."""
    stages = _stages(F.linear(h, w, b), spec.transforms)
    loss = F.cross_entropy(
        stages[-1].reshape(-1, w.shape[0]),
        y.reshape(-1),
        ignore_index=spec.ignore_index,
        reduction=spec.reduction,
        label_smoothing=spec.label_smoothing,
    )
    return (stages[spec.returns] if spec.returns is not None else None), loss


def loss_and_grads(fn, h, w, b, y, spec) -> list[torch.Tensor]:
    """The loss and the gradients of ``loss + <logits, r>`` (a fixed ``r``: the returned
    logits' own gradient flows too) for ``h``, ``w`` and ``b``."""
    logits, loss = fn(h, w, b, y, spec)
    total = loss
    if logits is not None:
        r = torch.linspace(-1, 1, logits.numel(), dtype=torch.float64, device=logits.device).view(logits.shape).to(logits.dtype)
        total = total + (logits * r).sum()
    leaves = [t for t in (h, w, b) if t is not None]
    return [loss.detach(), *torch.autograd.grad(total, leaves)]


TRANSFORMS = st.lists(
    st.sampled_from([("softcap", 3.0), ("softcap", 30.0), ("upcast", None), ("scale", 0.5), ("scale", 2.0)]),
    max_size=3,
).map(tuple)


@st.composite
def heads(draw: st.DrawFn) -> tuple[HeadSpec, dict]:
    transforms = draw(TRANSFORMS)
    returns = draw(st.one_of(st.none(), st.integers(0, len(transforms))))
    recompute = draw(st.booleans()) if returns is not None else False
    if returns is not None and any(n == "softcap" for n, _ in transforms[: max(0, returns - 1)]):
        recompute = True  # a soft-cap's derivative is read off its output: only the returned one is saved
    spec = HeadSpec(
        transforms=transforms,
        returns=returns,
        recompute=recompute,
        reduction=draw(st.sampled_from(["mean", "sum"])),
        chunks=draw(st.integers(1, 9)),
        ignore_index=draw(st.sampled_from([-100, 0])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 0.3])),
    )
    shape = {
        "tokens": draw(st.integers(1, 23)),
        "vocab": draw(st.integers(2, 17)),
        "hidden": draw(st.integers(1, 6)),
        "bias": draw(st.booleans()),
        "ignored": draw(st.floats(0, 0.5)),
        "seed": draw(st.integers(0, 2**16)),
    }
    return spec, shape


class TestChunkedLinearCrossEntropy(TestCase):
    def inputs(self, shape: dict, dtype: torch.dtype, device: str, spec: HeadSpec):
        g = torch.Generator().manual_seed(shape["seed"])
        t, v, hd = shape["tokens"], shape["vocab"], shape["hidden"]
        h = torch.randn(t, hd, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
        w = torch.randn(v, hd, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
        b = torch.randn(v, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_() if shape["bias"] else None
        y = torch.randint(0, v, (t,), generator=g)
        y[torch.rand(t, generator=g) < shape["ignored"]] = spec.ignore_index
        return h, w, b, y.to(device)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(heads())
    def test_equals_unchunked_float64(self, device: str, case: tuple[HeadSpec, dict]) -> None:
        spec, shape = case
        h, w, b, y = self.inputs(shape, torch.float64, device, spec)
        got = loss_and_grads(chunked_linear_cross_entropy, h, w, b, y, spec)
        want = loss_and_grads(reference, h, w, b, y, spec)
        # An upcast is ``.float()``: from float64 it rounds to float32, in both heads, and the
        # probabilities' rounding (float32's epsilon, about 1e-7) reaches every gradient
        # scaled by the other operand, however small the gradient itself.
        upcast = any(n == "upcast" for n, _ in spec.transforms)
        tol, atol = (1e-5, 1e-6 * (1 + h.abs().max().item() * w.abs().max().item())) if upcast else (1e-10, 0.0)
        for a, e in zip(got, want):
            if e.isnan().any():  # every target ignored: 0 / 0 in both
                self.assertTrue(a.isnan().all() and e.isnan().all())
                continue
            self.assertLessEqual((a - e).abs().max().item(), tol * max(e.abs().max().item(), 1e-6) + atol)

    def test_float32_within_reassociation_and_bfloat16_as_close_as_unchunked(self, device: str) -> None:
        spec = HeadSpec(transforms=(("softcap", 30.0), ("upcast", None)), returns=1, chunks=5)
        shape = {"tokens": 64, "vocab": 257, "hidden": 32, "bias": False, "ignored": 0.2, "seed": 0}
        h, w, b, y = self.inputs(shape, torch.float64, device, spec)
        exact = loss_and_grads(reference, h, w, b, y, spec)
        for dtype, rtol in ((torch.float32, 2e-5), (torch.bfloat16, None)):
            low = [t.detach().to(dtype).requires_grad_() for t in (h, w)]
            got = loss_and_grads(chunked_linear_cross_entropy, *low, None, y, spec)
            unchunked = loss_and_grads(reference, *low, None, y, spec)
            for a, u, e in zip(got, unchunked, exact):
                err = ((a.double() - e).abs().max() / e.abs().max()).item()
                if rtol is not None:
                    self.assertLess(err, rtol)
                else:  # no further from float64 than the unchunked head in bfloat16 (x2)
                    self.assertLess(err, 2 * ((u.double() - e).abs().max() / e.abs().max()).item() + 1e-3)

    def test_chunk_bounds(self, device: str) -> None:
        self.assertEqual(chunk_bounds(10, 3), [(0, 4), (4, 7), (7, 10)])
        self.assertEqual(chunk_bounds(2, 5), [(0, 1), (1, 2)])
        # A symbolic number of tokens: as many chunks as asked, ceil(tokens / chunks) long,
        # the last ones shorter or empty, and no guard on the number.
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = ShapeEnv()
        tokens = env.create_symintnode(env.create_symbol(10, source=ConstantSource("tokens")), hint=10)
        bounds = chunk_bounds(tokens, 4)
        self.assertEqual(len(chunk_bounds(tokens, 16)), 16)
        self.assertEqual(env.guards, [])

        def hint(size):
            return size if isinstance(size, int) else size.node.hint

        self.assertEqual([(hint(a), hint(b)) for a, b in bounds], [(0, 3), (3, 6), (6, 9), (9, 10)])
        with self.assertRaisesRegex(ValueError, "needs recompute=True"):
            HeadSpec(transforms=(("softcap", 3.0), ("scale", 2.0)), returns=2)


def _input_shapes(gm: torch.fx.GraphModule) -> list:
    """The sizes of a Dynamo graph's tensor inputs, flattened."""
    values = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    return [d for v in values if isinstance(v, torch.Tensor) for d in v.shape]


# ------------------------------------------------------------------ the pattern


def dynamo_heads(fn, *args) -> list[loss_head.LossHead]:
    """The loss heads :func:`loss_head.find_loss_heads` finds in the graph Dynamo records
    for ``fn(*args)``."""
    found = []

    def backend(gm, example_inputs):
        found.extend(loss_head.find_loss_heads(gm))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return found


def _view_read_elsewhere(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = F.linear(h, w).view(-1, 50)  # a view of the logits, returned: not a transform's output
    return F.cross_entropy(flat, y.view(-1)), flat


class TestPattern(TestCase):
    apply_patches = False  # the matcher alone, on stock Dynamo graphs

    def setUp(self) -> None:
        super().setUp()
        self.h = torch.randn(2, 8, 16, requires_grad=True)
        self.w = torch.randn(50, 16, requires_grad=True)
        self.y = torch.randint(0, 50, (2, 8))

    def head(self, fn) -> loss_head.LossHead:
        (head,) = dynamo_heads(fn, self.h, self.w, self.y)
        return head

    def test_plain_and_torchtitans(self, device: str) -> None:
        head = self.head(lambda h, w, y: F.cross_entropy(F.linear(h, w).flatten(0, 1), y.flatten(0, 1)))
        self.assertIsNone(head.why_not)
        self.assertEqual((head.tokens, head.vocab, head.hidden, head.transforms, head.returned), (16, 50, 16, [], None))
        # torchtitan's cross_entropy_loss: the logits flattened and upcast, a sum.
        head = self.head(lambda h, w, y: F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), y.flatten(0, 1), reduction="sum"))
        self.assertEqual((head.why_not, head.transforms, head.reduction), (None, [("upcast", None)], "sum"))

    def test_label_smoothing(self, device: str) -> None:
        head = self.head(lambda h, w, y: F.cross_entropy(F.linear(h, w).view(-1, 50), y.view(-1), label_smoothing=0.1))
        self.assertEqual((head.why_not, head.label_smoothing), (None, 0.1))

    def test_softcap_and_returned_logits(self, device: str) -> None:
        def gemma(h, w, y):
            logits = torch.tanh(F.linear(h, w) / 30.0) * 30.0
            return logits, F.cross_entropy(logits.float().view(-1, 50), y.view(-1), ignore_index=-100)

        head = self.head(gemma)
        self.assertIsNone(head.why_not)
        self.assertEqual((head.transforms, head.returned_stage), ([("softcap", 30.0), ("upcast", None)], 1))

    def test_what_it_leaves_alone(self, device: str) -> None:
        cases = {
            "class weights": lambda h, w, y: F.cross_entropy(F.linear(h, w).view(-1, 50), y.view(-1), weight=torch.ones(50)),
            "reduction='none'": lambda h, w, y: F.cross_entropy(F.linear(h, w).view(-1, 50), y.view(-1), reduction="none"),
            "relu": lambda h, w, y: F.cross_entropy(F.relu(F.linear(h, w)).view(-1, 50), y.view(-1)),
            "matmul": lambda h, w, y: F.cross_entropy(h.view(-1, 16) @ w.t(), y.view(-1)),
            "read elsewhere": _view_read_elsewhere,
        }
        for why, fn in cases.items():
            with self.subTest(why):
                head = self.head(fn)
                self.assertIsNotNone(head.why_not)
                self.assertIn(why, head.why_not)


# ------------------------------------------------------------------ under a budget


#: HF causal-LM families: (config class, model class, extra config) by name. Mixtral's
#: experts as batched matmuls: its default, grouped_mm, runs float32 under torch.compile as
#: transformers' fallback op, whose autograd formula reads ``offs.tolist()`` in some
#: releases (5.15; not 5.23): AOTAutograd cannot trace it, every graph holding the experts
#: fails and Dynamo breaks it, and the head runs eagerly, unchunked. The head is tested here.
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}), **HF_FAMILIES}
FAMILIES["mixtral"] = (*FAMILIES["mixtral"][:2], {**FAMILIES["mixtral"][2], "experts_implementation": "batched_mm"})


def _hf(family: str, vocab: int = 512):
    try:
        import transformers
    except ImportError:
        raise unittest.SkipTest("needs transformers") from None
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        )
    config, model, extra = FAMILIES[family]
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return getattr(transformers, model)(getattr(transformers, config)(**common, **extra))


#: Exact options only: the body's saved tensors are kept or recomputed, so the step's
#: gradients equal eager's but for the head's reassociation.
EXACT = dict(options=("recompute",))


class TestUnderABudget(TestCase):
    def step(self, lm, ids, hooks=None, backend=None) -> list[torch.Tensor]:
        lm.zero_grad(set_to_none=True)
        fn = lm if backend is None else torch.compile(lm, backend=backend)
        if hooks is None:
            loss = fn(input_ids=ids, labels=ids).loss
        else:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in lm.parameters() if p.grad is not None]

    def check_family(self, family: str, device: str, chunked: bool = True, vocab: int = 512) -> AotEagerAndRecordGraphs:
        torch.manual_seed(0)
        lm = _hf(family, vocab).to(device).train()
        ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
        want = self.step(lm, ids)
        backend = AotEagerAndRecordGraphs()
        with torch_patches.config.patch(chunked_loss_head="on"), saved_tensor_records() as found:
            got = self.step(lm, ids, budget(0.1, **EXACT), backend)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        calls = [n for g in backend.graphs for n in g.graph.nodes if n.target is loss_head.chunked_linear_cross_entropy]
        self.assertEqual(len(calls), 1 if chunked else 0)
        # The plan's summary (the log, report()) says so.
        heads = [h for g in found for p in g.plans for h in p.loss_heads]
        self.assertEqual(len(heads), 1 if chunked else 0)
        if chunked:
            self.assertIn(f"16 chunks of tokens (48 tokens x {vocab} vocabulary)", heads[0])
        return backend

    def head_golden(self, backend: AotEagerAndRecordGraphs) -> str:
        """The rewritten head in the Dynamo graph: the chunked call with its arguments (the
        hidden states, the head's weight, its bias, the targets, the spec) and what reads its
        two results, named by role and metadata (HF names its graph's nodes differently
        across releases)."""
        gm = backend.graphs[0]
        (call,) = [n for n in gm.graph.nodes if n.target is loss_head.chunked_linear_cross_entropy]

        def describe(arg) -> str:
            value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
            if value is None:
                return repr(arg)
            kind = "param" if isinstance(value, torch.nn.Parameter) else arg.op
            return f"{kind} {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"

        lines = [f"chunked_linear_cross_entropy({', '.join(describe(a) for a in call.args)})"]
        for use in call.users:
            readers = sorted(u.op if u.op == "output" else str(u.target) for u in use.users)
            lines.append(f"  [{use.args[1]}] {describe(use)} -> {', '.join(readers)}")
        return "\n".join(lines)

    def test_llama(self, device: str) -> None:
        # Things to note: HF returns the logits (returns=0, the matmul's output) and upcasts
        # them for the loss; under budget(0.1) each chunk's are recomputed in the backward.
        backend = self.check_family("llama", device)
        self.assertExpectedInline(
            self.head_golden(backend),
            """\
chunked_linear_cross_entropy(call_function float32[2, 24, 32], param float32[512, 32], None, call_method int64[48], HeadSpec(transforms=(('upcast', None),), returns=0, recompute=True, ignore_index=-100, reduction='mean', chunks=16, label_smoothing=0.0))
  [1] call_function float32[] -> output
  [0] call_function float32[2, 24, 512] -> output""",
        )

    def test_qwen2(self, device: str) -> None:
        backend = self.check_family("qwen2", device)
        self.assertExpectedInline(
            self.head_golden(backend),
            """\
chunked_linear_cross_entropy(call_function float32[2, 24, 32], param float32[512, 32], None, call_method int64[48], HeadSpec(transforms=(('upcast', None),), returns=0, recompute=True, ignore_index=-100, reduction='mean', chunks=16, label_smoothing=0.0))
  [1] call_function float32[] -> output
  [0] call_function float32[2, 24, 512] -> output""",
        )

    def test_gemma2_softcap(self, device: str) -> None:
        # Things to note: the soft-cap is part of the logits Gemma 2 returns (returns=1).
        backend = self.check_family("gemma2", device)
        self.assertExpectedInline(
            self.head_golden(backend),
            """\
chunked_linear_cross_entropy(call_function float32[2, 24, 32], param float32[512, 32], None, call_method int64[48], HeadSpec(transforms=(('softcap', 30.0), ('upcast', None)), returns=1, recompute=True, ignore_index=-100, reduction='mean', chunks=16, label_smoothing=0.0))
  [1] call_function float32[] -> output
  [0] call_function float32[2, 24, 512] -> output""",
        )

    def test_gpt2_loss_after_a_graph_break(self, device: str) -> None:
        # GPT-2's loss follows a graph break: its head and its loss are in two graphs,
        # nothing to chunk; the step is unchanged.
        self.check_family("gpt2", device, chunked=False)

    @pytest.mark.slow
    def test_families_at_realistic_vocabularies(self, device: str) -> None:
        # Every family's head is found and chunked, the step exact, at 32k and 128k tokens.
        for family in FAMILIES:
            for vocab in (32768, 131072):
                with self.subTest(family=family, vocab=vocab):
                    torch._dynamo.reset()
                    self.check_family(family, device, vocab=vocab)

    @pytest.mark.slow  # four lengths, eager beside compiled; the fast tier keeps chunk_bounds' symbolic case
    def test_lengths_that_change_one_graph_chunked_at_every_length(self, device: str) -> None:
        """Batches padded to their longest example (HF Trainer's and TRL's collators): the
        second length recompiles with a symbolic number of tokens.  The head is chunked in
        that graph too, its chunks counted at the hint and sized symbolically, so no later
        length recompiles (every chunk non-empty and longer than one token: more tokens than
        the chunks squared, 16 x 16 here), and every length's loss and gradients equal
        eager's."""
        torch.manual_seed(0)
        lm = _hf("llama").to(device).train()
        backend = AotEagerAndRecordGraphs()
        with torch_patches.config.patch(chunked_loss_head="on"):
            for n in (160, 144, 136, 130):
                with self.subTest(tokens=2 * n):
                    ids = torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(n)).to(device)
                    want = self.step(lm, ids)
                    got = self.step(lm, ids, budget(0.1, **EXACT), backend)
                    for a, e in zip(got, want):
                        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        self.assertEqual(len(backend.graphs), 2)  # the first length's, then one for every other
        calls = [n for g in backend.graphs for n in g.graph.nodes if n.target is loss_head.chunked_linear_cross_entropy]
        self.assertEqual([call.args[4].chunks for call in calls], [16, 16])
        self.assertTrue(any(isinstance(d, torch.SymInt) for d in _input_shapes(backend.graphs[1])))

    def check_loss_on_the_logits(self, device: str, loss_fn, fraction: float) -> HeadSpec:
        """``loss_fn(logits, ids)`` on HF Llama's logits, compiled in one step with them under
        ``budget(fraction)`` (exact options): the loss and every gradient eager's, the head
        chunked once; returns its spec."""
        torch.manual_seed(0)
        lm = _hf("llama").to(device).train()
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)

        def step(ids):
            return loss_fn(lm(input_ids=ids, use_cache=False).logits, ids)

        def run(compiled: bool) -> list[torch.Tensor]:
            lm.zero_grad(set_to_none=True)
            if compiled:
                hooks = budget(fraction, **EXACT)
                with torch_patches.config.patch(chunked_loss_head="on"), torch.autograd.graph.saved_tensors_hooks(*hooks):
                    loss = torch.compile(step, backend=backend)(ids)
            else:
                loss = step(ids)
            loss.backward()
            return [loss.detach()] + [p.grad.clone() for p in lm.parameters()]

        backend = AotEagerAndRecordGraphs()
        want, got = run(False), run(True)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        (call,) = [n for g in backend.graphs for n in g.graph.nodes if n.target is loss_head.chunked_linear_cross_entropy]
        return call.args[4]

    def test_label_smoothing_on_the_returned_logits(self, device: str) -> None:
        """HF's logits, the loss taken on them with label smoothing (what HF Trainer's
        ``label_smoothing_factor`` asks for, written as ``F.cross_entropy``), the labels
        shifted by padding as HF's ForCausalLMLoss shifts them."""

        def smoothed(logits, ids):
            labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1), label_smoothing=0.1)

        self.assertEqual(self.check_loss_on_the_logits(device, smoothed, 0.1).label_smoothing, 0.1)

    def test_torchtitans_call_and_a_sum_over_items(self, device: str) -> None:
        def titan(logits, ids):  # torchtitan's cross_entropy_loss, labels shifted as its data loader shifts them, a sum over items
            labels = torch.roll(ids, -1, 1)
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / 7.0

        spec = self.check_loss_on_the_logits(device, titan, 0.3)
        self.assertEqual((spec.returns, spec.reduction), (None, "sum"))

    def test_off_and_auto_below_the_size(self, device: str) -> None:
        for mode in ("off", "auto"):  # auto: the tiny head's logits are under the minimum
            with self.subTest(mode), torch_patches.config.patch(chunked_loss_head=mode):
                torch._dynamo.reset()
                lm = _hf("llama").to(device).train()
                backend = AotEagerAndRecordGraphs()
                ids = torch.randint(0, 512, (2, 24)).to(device)
                with torch.autograd.graph.saved_tensors_hooks(*budget(0.3)):
                    torch.compile(lm, backend=backend)(input_ids=ids, labels=ids).loss.backward()
                self.assertFalse([n for g in backend.graphs for n in g.graph.nodes if n.target is loss_head.chunked_linear_cross_entropy])


instantiate_device_type_tests(TestChunkedLinearCrossEntropy, globals())
instantiate_device_type_tests(TestPattern, globals())
instantiate_device_type_tests(TestUnderABudget, globals())

if __name__ == "__main__":
    run_tests()
