"""Real models (Hugging Face transformers, built from configs: random init, no downloads):
one compiled training step with each ready-made lossy hook, gradient error against the step
without hooks, compared with the same hook's error in eager.

Llama has RoPE: the compiled graph saves the rotation angles (eager saves their cos/sin);
the numerics-safe default of the lossy hooks leaves them alone, so the compiled error stays
within 1.5x of eager's. Needs ``pip install -e ".[models]"``; marked slow.
"""

import unittest

import pytest
import torch
from torch._dynamo.test_case import run_tests

from torch_patches import hooks
from torch_patches.testing import TestCase


try:
    import transformers
except ImportError:  # pragma: no cover - the [models] extra is not installed
    transformers = None


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=1000, n_embd=256, n_layer=2, n_head=4, n_positions=256,
        attn_implementation="sdpa",
    )
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def vit():
    cfg = transformers.ViTConfig(
        image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, num_labels=10, attn_implementation="sdpa",
    )
    model = transformers.ViTForImageClassification(cfg)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(4, 3, 64, 64, generator=gen)
    labels = torch.randint(0, 10, (4,), generator=gen)
    return model, lambda m: m(pixel_values=pixels, labels=labels).loss


MODELS = {"llama": llama, "gpt2": gpt2, "vit": vit}


def grads(model, loss_of, run=None, pair=None):
    model.zero_grad(set_to_none=True)
    run = model if run is None else run
    if pair is None:
        loss_of(run).backward()
    else:
        with torch.autograd.graph.saved_tensors_hooks(*pair):
            loss_of(run).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_error(got, ref):
    return max(((got[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref if ref[n].norm() > 0)


@pytest.mark.slow
@unittest.skipIf(transformers is None, 'needs the [models] extra: pip install -e ".[models]"')
class TestRealModels(TestCase):
    def check(self, name, backend):
        torch.manual_seed(0)
        model, loss_of = MODELS[name]()
        ref = grads(model, loss_of)
        for factory in (hooks.bf16, hooks.fp8_rowwise):
            with self.subTest(model=name, hook=factory.__name__, backend=backend):
                pack, unpack = factory()
                # As plain Python hooks: eager semantics on eager's saved tensors.
                eager = worst_error(grads(model, loss_of, pair=(lambda t: pack(t), lambda p: unpack(p))), ref)
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=backend)
                ours = worst_error(grads(model, loss_of, compiled, factory()), ref)
                self.assertLessEqual(ours, 1.5 * eager, f"{name} {factory.__name__} {backend}: {ours:.3g} vs eager {eager:.3g}")

    def test_aot_eager(self):
        for name in MODELS:
            self.check(name, "aot_eager")

    def test_inductor(self):
        for name in MODELS:
            self.check(name, "inductor")


if __name__ == "__main__":
    run_tests()
