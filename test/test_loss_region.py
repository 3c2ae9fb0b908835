"""Losses that read the head's logits row by row, chunked over the tokens (issue 79):
``chunked_rows.py`` and ``loss_region.py``.

* :class:`ChunkedRows` equals the region run whole, and its gradients, in float64, over
  generated regions (a log-probability at the label, a z-loss, a KL to a teacher's logits, a
  clipped ratio; a soft-cap or a scale before; sums over every token, each sequence's sums,
  means; a bias; an operand that takes gradients; any number of chunks).
* The region on the graphs Dynamo records for the losses users train with past cross-entropy:
  HF's loss with a z-loss beside it, DPO's per-sequence log-probabilities as TRL's
  ``selective_log_softmax`` computes them, GRPO's clipped per-token ratio, distillation's KL to
  a teacher's logits; and what it leaves alone, with why (a softmax over the tokens, a
  cumulative sum, logits returned whole, a sum over the tokens read beside them).
* A teacher's head and softmax run on each chunk with the student's (its hidden states cut
  with the tokens), under ``no_grad`` in the step as the bench's distillation runs it.
* Under a budget each step's loss and gradients equal the eager step's, the head chunked once,
  at lengths that change too (one graph with a symbolic length); a golden of the region's
  chunk graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch._dynamo.test_case import run_tests

import torch_patches
from torch_patches._functorch._aot_autograd import chunked_rows, loss_region
from torch_patches._functorch._aot_autograd.chunked_rows import ChunkedRows, RowsSpec
from torch_patches.hooks import budget
from torch_patches.testing import AotEagerAndRecordGraphs, TestCase, instantiate_device_type_tests, saved_tensor_records

# ------------------------------------------------------------------ the losses, as users write them


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``trl.trainer.utils.selective_log_softmax`` (float32 branch): the label's logit
    less each row's log-sum-exp, the log-sum-exp taken one sequence at a time."""
    selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return selected - lse


def z_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (labels padded and shifted, ``ignore_index=-100``) and a z-loss."""
    labels = F.pad(ids, (0, 1), value=-100)[..., 1:].reshape(-1)
    ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels, ignore_index=-100)
    return ce + 1e-4 * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def dpo(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """DPO's sigmoid loss: each sequence's log-probability of its completion (pairs: the
    chosen half of the batch, then the rejected), against a reference's."""
    logps = (selective_log_softmax(logits[:, :-1], ids[:, 1:]) * mask[:, 1:]).sum(-1)
    n = ids.shape[0] // 2
    margin = (logps[:n] - ref[:n]) - (logps[n:] - ref[n:])
    return -F.logsigmoid(0.1 * margin).mean()


def grpo(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """GRPO's clipped per-token ratio, each sequence's mean over its completion."""
    logps = selective_log_softmax(logits[:, :-1], ids[:, 1:])
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.min(ratio * adv.unsqueeze(1), clipped * adv.unsqueeze(1))
    m = mask[:, 1:]
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def distill(logits: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL of the student's tempered log-softmax to the teacher's, ``batchmean``."""
    s = F.log_softmax(logits.float() / 2.0, dim=-1)
    t = F.softmax(teacher.float() / 2.0, dim=-1)
    v = logits.shape[-1]
    return F.kl_div(s.view(-1, v), t.view(-1, v), reduction="batchmean") * 4.0


def forms(batch: int, seq: int, vocab: int, device: str) -> dict[str, tuple]:
    """Each form's loss and its extra inputs, seeded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
    extra = {
        "z_loss": (z_loss, ()),
        "dpo": (dpo, (mask, torch.randn(batch, generator=g))),
        "grpo": (grpo, (mask, -7 * torch.rand(batch, seq - 1, generator=g), torch.randn(batch, generator=g))),
        "distill": (distill, (torch.randn(batch, seq, vocab, generator=g),)),
    }
    return {name: (fn, ids.to(device), tuple(a.to(device) for a in args)) for name, (fn, args) in extra.items()}


# ------------------------------------------------------------------ ChunkedRows


def _logp(x, y, t):
    return x.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _z(x, y, t):
    return x.logsumexp(-1).pow(2)


def _kl(x, y, t):
    return F.kl_div(x.log_softmax(-1), t.softmax(-1), reduction="none").sum(-1)


def _ratio(x, y, t):
    r = torch.exp(_logp(x, y, t) + 3.0)
    return -torch.min(r * 0.7, torch.clamp(r, 0.8, 1.2) * 0.7)


PER_TOKEN = {"logp": _logp, "z": _z, "kl": _kl, "ratio": _ratio}
BEFORE = {"none": lambda x: x, "softcap": lambda x: torch.tanh(x / 3.0) * 3.0, "scale": lambda x: x * 0.5}


@st.composite
def regions(draw: st.DrawFn) -> dict:
    outputs = draw(
        st.lists(st.tuples(st.sampled_from(sorted(PER_TOKEN)), st.sampled_from(["sum", "per_sequence", "mean"])), min_size=1, max_size=3)
    )
    return dict(
        outputs=outputs,
        before=draw(st.sampled_from(sorted(BEFORE))),
        batch=draw(st.integers(1, 3)),
        tokens=draw(st.integers(1, 9)),
        vocab=draw(st.integers(2, 11)),
        chunks=draw(st.integers(1, 7)),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _region(case: dict):
    def region(tokens, x, y, t):
        z = BEFORE[case["before"]](x)
        outs = []
        for name, reduce in case["outputs"]:
            v = PER_TOKEN[name](z, y, t)
            outs.append(v.sum() if reduce == "sum" else v.sum(-1) if reduce == "per_sequence" else v.sum() / (v.shape[0] * tokens))
        return tuple(outs)

    return region


class TestChunkedRows(TestCase):
    apply_patches = False

    @settings(max_examples=25, deadline=None)
    @given(case=regions())
    def test_equals_the_region_run_whole_float64(self, device: str, case: dict) -> None:
        g = torch.Generator().manual_seed(case["seed"])
        b, n, v, d = case["batch"], case["tokens"], case["vocab"], 5
        opts = dict(dtype=torch.float64, device=device)
        h = torch.randn(b, n, d, generator=g).to(**opts).requires_grad_()
        w = torch.randn(v, d, generator=g).to(**opts).requires_grad_()
        bias = torch.randn(v, generator=g).to(**opts).requires_grad_() if case["bias"] else None
        y = torch.randint(0, v, (b, n), generator=g).to(device)
        t = torch.randn(b, n, v, generator=g).to(**opts).requires_grad_()  # a teacher's logits, with a gradient
        region = _region(case)
        spec = RowsSpec(axis=1, operands=((1, 1, 1), (1, 1, 1)), chunks=case["chunks"])
        leaves = [x for x in (h, w, bias, t) if x is not None]

        def loss_and_grads(outs):
            weights = [torch.linspace(-1, 1, o.numel(), **opts).view(o.shape) for o in outs]
            total = sum((o * r).sum() for o, r in zip(outs, weights))
            return [o.detach() for o in outs] + list(torch.autograd.grad(total, leaves, materialize_grads=True))

        want = loss_and_grads(region(n, F.linear(h, w, bias), y, t))
        got = loss_and_grads(ChunkedRows.apply(region, spec, n, h, w, bias, y, t))
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e)

    def test_merged_tokens(self, device: str) -> None:
        """An operand whose tokens are merged with the batch (HF's labels flattened to
        ``[batch x tokens]``) is cut the same way as the logits it lines up with."""
        h = torch.randn(3, 7, 4, device=device, requires_grad=True)
        w = torch.randn(11, 4, device=device, requires_grad=True)
        y = torch.randint(0, 11, (21,), device=device)

        def region(tokens, x, y):
            return (F.cross_entropy(x.flatten(0, 1), y, reduction="sum"),)

        spec = RowsSpec(axis=1, operands=((0, 3, 1),), chunks=3)
        (got,) = chunked_rows.chunked_rows(region, spec, 7, h, w, None, y)
        (want,) = region(7, F.linear(h, w), y)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w)))


# ------------------------------------------------------------------ the region in Dynamo's graph


def dynamo_regions(fn, *args) -> list[loss_region.LossRegion]:
    """The region :func:`loss_region.find_region` finds at each ``linear`` of the graph
    Dynamo records for ``fn(*args)``."""
    found = []
    torch._dynamo.reset()  # each form compiled afresh, at static shapes

    def backend(gm, example_inputs):
        linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear)]
        found.extend(loss_region.find_region(n) for n in linears)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return found


class TestRegion(TestCase):
    apply_patches = False  # the matcher alone, on stock Dynamo graphs

    def region(self, fn, *extra) -> loss_region.LossRegion:
        h = torch.randn(4, 8, 16, requires_grad=True)
        w = torch.randn(50, 16, requires_grad=True)
        ids = torch.randint(0, 50, (4, 8))
        (region,) = dynamo_regions(lambda h, w, ids, *extra: fn(F.linear(h, w), ids, *extra), h, w, ids, *extra)
        return region

    def test_the_forms(self, device: str) -> None:
        cases = forms(4, 8, 50, "cpu")
        for name, outputs, operands in [
            ("z_loss", 2, [(0, 4, 1), None]),  # the labels flattened with the batch; their count
            ("dpo", 1, [(1, 1, 1), (1, 1, 1)]),  # the labels, the mask: the tokens after a slice
            ("grpo", 1, [(1, 1, 1), (1, 1, 1), None, None, (1, 1, 1)]),  # labels, old log-probs, advantages (twice), mask
            ("distill", 1, [(1, 1, 1)]),  # the teacher's logits, cut: their softmax taken per chunk
        ]:
            with self.subTest(name):
                fn, _, extra = cases[name]
                region = self.region(fn, *extra)
                self.assertIsNone(region.why_not)
                self.assertEqual(len(region.outputs), outputs)
                self.assertEqual([r.where() if r else None for _, r in region.operands], operands)
        self.assertEqual(self.region(cases["dpo"][0], *cases["dpo"][2]).head_index, (slice(None), slice(None, -1)))

    def test_a_teachers_head_chunked_with_it(self, device: str) -> None:
        """Distillation where the teacher's logits are made in the step (its head's matmul):
        the teacher's head, its softmax and the view run on each chunk too, the teacher's
        hidden states cut with the student's."""
        h, h_t = torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, 12)
        w, w_t = torch.randn(50, 16, requires_grad=True), torch.randn(50, 12)
        ids = torch.randint(0, 50, (4, 8))
        student, teacher = dynamo_regions(lambda h, w, ids, h_t, w_t: distill(F.linear(h, w), ids, F.linear(h_t, w_t)), h, w, ids, h_t, w_t)
        self.assertIsNone(student.why_not)
        self.assertEqual(
            [(getattr(k, "name", k), r.where() if r else None) for k, r in student.operands], [("l_h_t_", (1, 1, 1)), ("l_w_t_", None)]
        )
        self.assertIn(torch._C._nn.linear, [n.target for n in student.nodes])

    def test_what_it_leaves_alone(self, device: str) -> None:
        cases = {
            "works across the tokens": lambda x, ids: x.softmax(1).sum(),
            "not an op known": lambda x, ids: x.logsumexp(-1).cumsum(-1).sum(),
            "returns": lambda x, ids: (x.logsumexp(-1).sum(), x),
            "beside them": lambda x, ids: (x - x.mean(1, keepdim=True)).pow(2).sum(),
            "class weights": lambda x, ids: F.cross_entropy(x.view(-1, 50), ids.view(-1), weight=torch.ones(50)),
            "indexes the tokens": lambda x, ids: x.logsumexp(-1)[:, 3].sum(),
        }
        for why, fn in cases.items():
            with self.subTest(why):
                region = self.region(fn)
                self.assertIsNotNone(region.why_not)
                self.assertIn(why, region.why_not)

    def test_chunk_graph(self, device: str) -> None:
        """Distillation's region as one chunk runs it: the student's tempered log-softmax, the
        teacher's logits cut with the tokens and their softmax taken on the chunk, the KL's
        ``batchmean`` as the chunk's sum over the whole count (the batch times the tokens)."""
        teacher = torch.randn(4, 8, 50)
        region = self.region(distill, teacher)
        code = torch.fx.GraphModule(torch.nn.Module(), region.graph).code
        self.assertExpectedInline(
            "\n".join(line.strip() for line in code.strip().splitlines()[1:]),
            """\
float_1 = logits.float();  logits = None
truediv = float_1 / 2.0;  float_1 = None
log_softmax = truediv.log_softmax(dim = -1);  truediv = None
flatten = log_softmax.flatten(0, 1);  log_softmax = None
float_2 = operand_1.float();  operand_1 = None
truediv_1 = float_2 / 2.0;  float_2 = None
softmax = truediv_1.softmax(dim = -1);  truediv_1 = None
flatten_1 = softmax.flatten(0, 1);  softmax = None
kl_div = torch.nn.functional.kl_div(flatten, flatten_1, log_target = False, reduction = 'sum');  flatten = flatten_1 = None
mul = tokens * 4;  tokens = None
truediv_2 = kl_div / mul;  kl_div = mul = None
return (truediv_2,)""",
        )


# ------------------------------------------------------------------ under a budget


def _llama(vocab: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class TestUnderABudget(TestCase):
    def check(self, device: str, name: str, backend) -> list[str]:
        """``name``'s loss on HF Llama's logits, compiled in one step with them under
        ``budget(0.1)`` (exact options): the loss and every gradient eager's; returns the
        plans' loss-head summaries."""
        torch.manual_seed(0)
        lm = _llama(512).to(device).train()
        fn, ids, extra = forms(4, 24, 512, device)[name]

        def step(ids, *extra):
            return fn(lm(input_ids=ids, use_cache=False).logits, ids, *extra)

        def run(compiled: bool) -> list[torch.Tensor]:
            lm.zero_grad(set_to_none=True)
            if compiled:
                torch._dynamo.reset()
                with (
                    torch_patches.config.patch(chunked_loss_head="on"),
                    torch.autograd.graph.saved_tensors_hooks(*budget(0.1, options=("recompute",))),
                ):
                    loss = torch.compile(step, backend=backend)(ids, *extra)
            else:
                loss = step(ids, *extra)
            loss.backward()
            return [loss.detach()] + [p.grad.clone() for p in lm.parameters()]

        want = run(False)
        with saved_tensor_records() as found:
            got = run(True)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        return [h for g in found for p in g.plans for h in p.loss_heads]

    def test_dpo_equals_eager(self, device: str) -> None:
        """The fast tier's one form: DPO (a head slice, TRL's loop over the sequences, a sum a
        sequence, the pairs' sigmoid after the region)."""
        backend = AotEagerAndRecordGraphs()
        heads = self.check(device, "dpo", backend)
        self.assertEqual(len([n for g in backend.graphs for n in g.graph.nodes if n.target is chunked_rows.chunked_rows]), 1)
        self.assertEqual(len(heads), 1)

    @pytest.mark.slow
    def test_each_form_equals_eager(self, device: str) -> None:
        for name in ("z_loss", "dpo", "grpo", "distill"):
            with self.subTest(name):
                backend = AotEagerAndRecordGraphs()
                heads = self.check(device, name, backend)
                calls = [n for g in backend.graphs for n in g.graph.nodes if n.target is chunked_rows.chunked_rows]
                self.assertEqual(len(calls), 1)
                self.assertEqual(len(heads), 1)
                self.assertIn("in 16 chunks of tokens", heads[0])

    @pytest.mark.slow
    def test_a_teacher_run_in_the_step(self, device: str) -> None:
        """Distillation as the bench computes it (``models.causal_lm_loss(loss="kl")``): the
        teacher's forward under ``no_grad`` in the same graph, its head pulled into the
        region, which runs where grad is enabled again; loss and gradients eager's."""
        from torch_patches.testing.models import causal_lm_loss

        torch.manual_seed(0)
        step = causal_lm_loss(_llama(512).to(device).train(), loss="kl", teacher=_llama(512).to(device).eval().requires_grad_(False))
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)

        def run(fn) -> list[torch.Tensor]:
            step.zero_grad(set_to_none=True)
            loss = fn(ids)
            loss.backward()
            return [loss.detach()] + [p.grad.clone() for p in step.lm.parameters()]

        want = run(step)
        backend = AotEagerAndRecordGraphs()
        with (
            torch_patches.config.patch(chunked_loss_head="on"),
            torch.autograd.graph.saved_tensors_hooks(*budget(0.1, options=("recompute",))),
        ):
            got = run(torch.compile(step, backend=backend))
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        (call,) = [n for g in backend.graphs for n in g.graph.nodes if n.target is chunked_rows.chunked_rows]
        self.assertFalse(
            [n for n in call.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear and "lm_head" in str(n.args[1])]
        )

    @pytest.mark.slow
    def test_lengths_that_change(self, device: str) -> None:
        """Batches padded to their longest example: the second length compiles with a symbolic
        one, whose region is chunked too (its chunks counted at the hint, sized symbolically);
        each length's loss and gradients are eager's."""
        torch.manual_seed(0)
        lm = _llama(512).to(device).train()
        backend = AotEagerAndRecordGraphs()

        def step(ids, *extra):
            return dpo(lm(input_ids=ids, use_cache=False).logits, ids, *extra)

        compiled = torch.compile(step, backend=backend)
        for length in (296, 280, 264):  # more tokens than the chunks squared: no guard on a chunk of 0 or 1
            _, ids, extra = forms(4, length, 512, device)["dpo"]
            lm.zero_grad(set_to_none=True)
            with (
                torch_patches.config.patch(chunked_loss_head="on"),
                torch.autograd.graph.saved_tensors_hooks(*budget(0.1, options=("recompute",))),
            ):
                loss = compiled(ids, *extra)
            loss.backward()
            got = [loss.detach()] + [p.grad.clone() for p in lm.parameters()]
            lm.zero_grad(set_to_none=True)
            eager = step(ids, *extra)
            eager.backward()
            for a, e in zip(got, [eager.detach()] + [p.grad.clone() for p in lm.parameters()]):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        calls = [n for g in backend.graphs for n in g.graph.nodes if n.target is chunked_rows.chunked_rows]
        self.assertEqual(len(calls), 2)  # the first length's graph, and one for every length after it
        self.assertIsInstance(calls[1].args[2], torch.fx.Node)  # the number of tokens, symbolic

    @pytest.mark.slow
    def test_each_form_under_inductor(self, device: str) -> None:
        """Through Inductor: the chunks ordered one after the other (``after``), the weight's
        gradient accumulated in place."""
        for name in ("z_loss", "dpo", "grpo", "distill"):
            with self.subTest(name):
                self.assertEqual(len(self.check(device, name, "inductor")), 1)


instantiate_device_type_tests(TestChunkedRows, globals())
instantiate_device_type_tests(TestRegion, globals())
instantiate_device_type_tests(TestUnderABudget, globals())

if __name__ == "__main__":
    run_tests()
