"""Real models (Hugging Face transformers and timm, built from configs: random init, no
downloads): one compiled training step with each ready-made lossy hook, gradient error against
the step without hooks, compared with the same hook's error in eager.

Llama has RoPE: the compiled graph saves the rotation angles (eager saves their cos/sin);
the numerics-safe default of the lossy hooks leaves them alone, so the compiled error stays
within 1.5x of eager's. Needs ``pip install -e ".[models]"`` (transformers) and timm
(``pip install --no-deps timm``, see ``_import_timm``); each model whose library is missing is
skipped alone. Marked slow.

Sizes keep the file near 4 minutes on 2 CPU cores (each model compiles once per hook and
backend; Inductor's compile dominates): Llama has 2 layers, the others 1.
Dropout is off (GPT-2's config defaults to 0.1): with it two steps without hooks already
differ by ~90%, and the 1.5x bound would hold for any hook.
"""

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
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


class _Anything(type):
    """A class whose every attribute is another such class."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StandIn(types.ModuleType):
    """A module whose every attribute is an :class:`_Anything`."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []
        module.__version__ = "99.0"


@contextlib.contextmanager
def _stand_ins(roots: set[str]):
    """Serve imports of ``roots`` (and their submodules) with stand-ins while inside; remove
    them from ``sys.modules`` after, so nothing else sees them."""
    finder = _StandInFinder(roots)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m.split(".")[0] in roots]:
            del sys.modules[name]


def _import_timm():
    """timm (imported on first use: its import takes seconds, and the fast tier collects this
    file too).

    timm's package import reads torchvision (``FrozenBatchNorm2d``, its data transforms) and
    PIL at module level; a ViT uses neither. torchvision's PyPI wheels are CUDA builds pinned
    to one torch release: beside a CPU torch they fail to load, and installing timm with its
    dependencies replaces the CPU torch. So timm is installed with ``--no-deps`` and, when
    torchvision or PIL cannot be imported, those imports are served by inert stand-ins for
    the duration of ``import timm`` only.
    """
    if "timm" in sys.modules:
        return sys.modules["timm"]
    missing = set()
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a CUDA build beside a CPU torch (RuntimeError)
        missing.add("torchvision")
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    if importlib.util.find_spec("PIL") is None:
        missing.add("PIL")
    with _stand_ins(missing) if missing else contextlib.nullcontext():
        import timm
    return timm


#: timm is installed (the ``timm_vit`` test needs it).
HAS_TIMM = importlib.util.find_spec("timm") is not None


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=1000,
        n_embd=256,
        n_layer=1,
        n_head=4,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def vit():
    cfg = transformers.ViTConfig(
        image_size=64,
        patch_size=8,
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=512,
        num_labels=10,
        attn_implementation="sdpa",
    )
    model = transformers.ViTForImageClassification(cfg)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(4, 3, 64, 64, generator=gen)
    labels = torch.randint(0, 10, (4,), generator=gen)
    return model, lambda m: m(pixel_values=pixels, labels=labels).loss


def timm_vit():
    _import_timm()
    from timm.models.vision_transformer import VisionTransformer

    # Built directly (no registry entry, no pretrained config): fused qkv, exact GELU, SDPA.
    model = VisionTransformer(
        img_size=64,
        patch_size=8,
        embed_dim=256,
        depth=1,
        num_heads=4,
        mlp_ratio=2.0,
        num_classes=10,
    )
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(4, 3, 64, 64, generator=gen)
    labels = torch.randint(0, 10, (4,), generator=gen)
    return model, lambda m: torch.nn.functional.cross_entropy(m(pixels), labels)


#: name -> (builder, whether the library it needs is installed).
MODELS = {
    "llama": (llama, transformers is not None),
    "gpt2": (gpt2, transformers is not None),
    "vit": (vit, transformers is not None),
    "timm_vit": (timm_vit, HAS_TIMM),
}


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
    """Largest ``||g - g_ref|| / ||g_ref||`` over the parameters. Gradients that are zero in
    exact arithmetic (an attention key bias: softmax ignores a constant added to a row's
    logits) hold only rounding noise, so parameters whose reference gradient is below 1e-6 of
    the largest are left out."""
    floor = 1e-6 * max(g.norm().item() for g in ref.values())
    kept = [n for n in ref if ref[n].norm() > floor]
    return max(((got[n] - ref[n]).norm() / ref[n].norm()).item() for n in kept)


@pytest.mark.slow
class TestRealModels(TestCase):
    def check(self, name, backend):
        torch.manual_seed(0)
        model, loss_of = MODELS[name][0]()
        ref = grads(model, loss_of)
        # The eager reference of each hook, as plain Python hooks on eager's saved tensors.
        # Eager knows less than the compiler (the tensor, not the op that will read it), so
        # fp8_rowwise() as eager hooks stores nothing in fp8 (bf16 where eager's rule allows
        # int8); compiled, it stores weight-gradient operands in fp8 and the rest in bf16. Its
        # reference is therefore fp8 on every tensor eager's rule lets take int8: a superset
        # of what the compiled hook puts in fp8, and coarser than its bf16 elsewhere.
        references = {
            "bf16": hooks.bf16(),
            "fp8_rowwise": hooks.fp8_rowwise(where=functools.partial(hooks.numerics_safe, storage="int8"), otherwise=None),
        }
        for factory in (hooks.bf16, hooks.fp8_rowwise):
            with self.subTest(model=name, hook=factory.__name__, backend=backend):
                pack, unpack = references[factory.__name__]
                eager = worst_error(grads(model, loss_of, pair=(lambda t: pack(t), lambda p: unpack(p))), ref)
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=backend)
                ours = worst_error(grads(model, loss_of, compiled, factory()), ref)
                self.assertLessEqual(ours, 1.5 * eager, f"{name} {factory.__name__} {backend}: {ours:.3g} vs eager {eager:.3g}")


def _add_tests() -> None:
    # One test per model and backend, each skipped alone when its library is missing.
    for name, (_, installed) in MODELS.items():
        for backend in ("aot_eager", "inductor"):

            def test(self, name=name, backend=backend):
                self.check(name, backend)

            test.__name__ = f"test_{name}_{backend}"
            needs = "timm (pip install --no-deps timm)" if name == "timm_vit" else ('transformers (pip install -e ".[models]")')
            test = unittest.skipUnless(installed, f"needs {needs}")(test)
            setattr(TestRealModels, test.__name__, test)


_add_tests()


if __name__ == "__main__":
    run_tests()
