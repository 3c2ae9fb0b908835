"""Small models built from configs, shared by the tests, ``python -m torch_patches bench``,
``python -m torch_patches report`` and the research harness (``benchmarks/``).

* :func:`build_model` / :func:`example_input` / :func:`blocks_of`: the bench's models
  (``mlp8``, ``transformer``, ``llama``), described by a :class:`ModelShape` (a bench row,
  :class:`~torch_patches.bench.case.Case`).
* :func:`hf_llama` / :func:`hf_gpt2` / :func:`hf_vit` and :func:`causal_lm_loss`: Hugging Face
  models built from configs (random init, no download; they need ``transformers``).
* :func:`report_step`: one training step of a built-in model, for ``report --model``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, Protocol


class ModelShape(Protocol):
    """What the bench's model builders read of a row (:class:`~torch_patches.bench.case.Case`)."""

    model: str
    dim: int
    blocks: int
    batch: int
    device: str


# ------------------------------------------------------------ Hugging Face models


def llama_mlp_dim(dim: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, a multiple of 32."""
    return max(32, (8 * dim // 3 + 31) // 32 * 32)


def hf_llama(*, vocab: int, dim: int, layers: int, heads: int, seq: int, mlp_dim: int | None = None) -> Any:
    """``transformers.LlamaForCausalLM`` from a config: hidden ``dim``, ``layers`` layers,
    ``heads`` attention (and key-value) heads, RoPE up to ``seq`` positions, SDPA, untied
    embeddings; the MLP ``mlp_dim`` wide (default :func:`llama_mlp_dim`). Raises ImportError
    without transformers."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=llama_mlp_dim(dim) if mlp_dim is None else mlp_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def hf_gpt2(*, vocab: int, dim: int, layers: int, heads: int, seq: int) -> Any:
    """``transformers.GPT2LMHeadModel`` from a config, without dropout, SDPA. Raises
    ImportError without transformers."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_embd=dim,
        n_layer=layers,
        n_head=heads,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


#: HF causal-LM families beside Llama and GPT-2, by name: (config class, model class, the
#: config beyond the sizes :func:`hf_family` sets). Each keeps its own defaults otherwise
#: (Gemma 2's soft-caps and tied embeddings, Mixtral's router, GPT-NeoX's parallel block...).
HF_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_implementation": "eager"}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 1}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"attention_dropout": 0.0, "hidden_dropout": 0.0}),
}


def hf_family(family: str, *, vocab: int, dim: int, layers: int, heads: int, seq: int) -> Any:
    """The HF causal LM of ``family`` (:data:`HF_FAMILIES`) from a config: hidden ``dim``,
    ``layers`` layers, ``heads`` attention (and key-value) heads of ``dim // heads``, the MLP
    :func:`llama_mlp_dim` wide, positions up to ``seq``. Raises ImportError without
    transformers."""
    import transformers

    config, model, extra = HF_FAMILIES[family]
    sizes = dict(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=llama_mlp_dim(dim),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=dim // heads,
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return getattr(transformers, model)(getattr(transformers, config)(**sizes, **extra))


#: Causal language models by name: builders taking ``vocab, dim, layers, heads, seq``.
LANGUAGE_MODELS: dict[str, Callable[..., Any]] = {
    "llama": hf_llama,
    "gpt2": hf_gpt2,
    **{family: functools.partial(hf_family, family) for family in HF_FAMILIES},
}


def decoder_layers(lm: Any) -> list[Any]:
    """The decoder layers of a model of :data:`LANGUAGE_MODELS`, or of a PEFT model wrapping
    one (Llama's ``model.layers``, GPT-2's ``transformer.h``)."""
    inner = lm.get_decoder()
    return list(getattr(inner, "layers", None) or inner.h)


def compile_per_layer(lm: Any, backend: str = "inductor", loss: bool = False) -> None:
    """Compile each decoder layer of ``lm`` (a model of :data:`LANGUAGE_MODELS`) on its own,
    as FSDP2 and torchtitan compile, and with ``loss`` its loss function on its own too
    (torchtitan compiles the loss apart); the embedding and the head stay eager."""
    import torch

    for layer in decoder_layers(lm):
        layer.compile(backend=backend)
    if loss:
        lm.loss_function = torch.compile(lm.loss_function, backend=backend)


#: How a causal language model is called (:func:`causal_lm_loss`).
CALLS = ("bench", "hf_default", "torchtitan")


#: The losses a causal language model is trained with on its logits (:func:`causal_lm_loss`'s
#: ``loss=``): ``"ce"`` the next-token cross-entropy; ``"smoothing"`` with a label smoothing of
#: 0.1 (HF Trainer's ``label_smoothing_factor``); ``"zloss"`` HF's loss plus ``1e-4`` times the
#: mean squared log-sum-exp of the logits; ``"dpo"`` DPO's sigmoid loss, the batch's first half
#: the chosen completions and its second the rejected, each sequence's second half its
#: completion, log-probabilities as TRL's ``selective_log_softmax`` computes them, against a
#: reference's (fixed); ``"grpo"`` GRPO's clipped per-token ratio against the log-probabilities
#: detached (TRL's one update a generation), each sequence's mean over its completion, an
#: advantage of +1 or -1 a sequence; ``"kl"`` distillation: the KL of the student's log-softmax
#: to a teacher's (an LM of the same config, frozen) at temperature 2, ``batchmean``.
LOSSES = ("ce", "smoothing", "zloss", "dpo", "grpo", "kl")


def selective_log_softmax(logits: Any, index: Any) -> Any:
    """TRL's ``trl.trainer.utils.selective_log_softmax`` for float32 logits: the label's logit
    less its row's log-sum-exp, the log-sum-exp taken one sequence at a time."""
    import torch

    selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])


def causal_lm_loss(lm: Any, call: str = "bench", loss: str = "ce", teacher: Any = None) -> Any:
    """A module wrapping the causal language model ``lm`` (as ``.lm``): called with token
    ids, it returns the mean next-token loss.

    ``call="bench"``: without a KV cache (``use_cache=False``, as training runs): with HF's
    cache on, each decoder layer compiled on its own recompiles (its guard reads whether the
    cache's own layer is filled yet), so past Dynamo's ``recompile_limit`` (8) the other
    layers run eagerly.  ``call="hf_default"``: as HF Trainer calls it, ``labels=`` given and
    ``use_cache`` at the model's default (on): ``lm`` returns its logits and the cache's keys
    and values beside the loss (when ``lm`` itself is compiled, outputs of its graph), and
    the caller keeps only the loss.  ``call="torchtitan"``: the model returns its logits
    (no labels, no cache) and the loss is torchtitan's ``cross_entropy_loss`` on them
    (``loss_fn``: the compiler compiles it apart, as torchtitan does), the labels shifted by
    padding as HF shifts them.

    ``loss`` other than ``"ce"`` (:data:`LOSSES`): the loss computed on the logits in the
    same module, the model called as ``call`` says (``"zloss"`` adds to HF's own loss);
    ``"kl"`` needs ``teacher``."""
    import torch
    import torch.nn.functional as F

    if call not in CALLS:
        raise ValueError(f"call must be one of {CALLS}, got {call!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if loss == "kl" and teacher is None:
        raise ValueError("loss='kl' needs a teacher model")
    if loss != "ce" and call == "torchtitan":
        raise ValueError("call='torchtitan' computes torchtitan's cross-entropy: loss must be 'ce'")
    extra = {"use_cache": False} if call == "bench" else {}

    class CausalLMLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm
            self.loss_fn = cross_entropy_loss
            self.teacher = [teacher]  # not a submodule: frozen, not the model's parameters

        def forward(self, ids: Any) -> Any:
            if call == "torchtitan":
                labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
                return self.loss_fn(self.lm(input_ids=ids, use_cache=False).logits, labels)
            if loss in ("ce", "zloss"):
                out = self.lm(input_ids=ids, labels=ids, **extra)
                if loss == "ce":
                    return out.loss
                return out.loss + 1e-4 * torch.logsumexp(out.logits.float(), dim=-1).pow(2).mean()
            logits = self.lm(input_ids=ids, **extra).logits
            vocab, (batch, seq) = logits.shape[-1], ids.shape
            if loss == "smoothing":
                labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
                return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1), label_smoothing=0.1)
            if loss == "kl":
                with torch.no_grad():
                    t = self.teacher[0](input_ids=ids, use_cache=False).logits
                s = F.log_softmax(logits.float() / 2.0, dim=-1)
                p = F.softmax(t.float() / 2.0, dim=-1)
                return F.kl_div(s.view(-1, vocab), p.view(-1, vocab), reduction="batchmean") * 4.0
            completion = (torch.arange(seq, device=ids.device) >= seq // 2).float().expand(batch, seq)
            logps = selective_log_softmax(logits[:, :-1].float(), ids[:, 1:])
            mask = completion[:, 1:]
            if loss == "dpo":
                seq_logps = (logps * mask).sum(-1)
                half = batch // 2
                ref = torch.zeros_like(seq_logps)  # a reference model's, computed before the step
                margin = (seq_logps[:half] - ref[:half]) - (seq_logps[half:] - ref[half:])
                return -F.logsigmoid(0.1 * margin).mean()
            adv = torch.where(torch.arange(batch, device=ids.device) % 2 == 0, 1.0, -1.0)
            ratio = torch.exp(logps - logps.detach())
            clipped = torch.clamp(ratio, 0.8, 1.2)
            per_token = -torch.min(ratio * adv.unsqueeze(1), clipped * adv.unsqueeze(1))
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    return CausalLMLoss()


def chunked_by_hand_loss(lm: Any, chunks: int = 8) -> Any:
    """A module wrapping the causal language model ``lm`` (as ``.lm``) whose loss is written
    by hand in ``chunks`` chunks of tokens, each chunk's head and cross-entropy under
    ``torch.utils.checkpoint`` (what torchtune and Liger users write): the model's body returns
    its last hidden states, no (tokens x vocabulary) tensor outlives its chunk.  Called with
    token ids, it returns the mean next-token loss, labels shifted by padding as HF shifts
    them (Gemma 2's ``final_logit_softcapping`` applied)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    cap = getattr(lm.config, "final_logit_softcapping", None)

    def chunk_loss(h: Any, y: Any) -> Any:
        logits = lm.get_output_embeddings()(h).float()
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")

    class ChunkedByHand(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: Any) -> Any:
            labels = F.pad(ids, (0, 1), value=-100)[:, 1:].flatten()
            h = self.lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state.flatten(0, 1)
            total = sum(checkpoint(chunk_loss, hc, yc, use_reentrant=False) for hc, yc in zip(h.chunk(chunks), labels.chunk(chunks)))
            return total / (labels != -100).sum()

    return ChunkedByHand()


def cross_entropy_loss(pred: Any, labels: Any) -> Any:
    """torchtitan's ``cross_entropy_loss``: the logits flattened over the tokens and upcast,
    a mean over the targets other than -100."""
    import torch

    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)


# ------------------------------------------------------------------ bench models


#: Tokens per sequence of the llama model (its RoPE angles reach this).
LLAMA_SEQ = 256
LLAMA_VOCAB = 4096


def build_model(case: ModelShape) -> Any:
    import torch

    d = case.dim

    class Block(torch.nn.Module):
        # A thin MLP block whose saved activations dominate memory.
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(d, 2 * d, bias=False)
            self.down = torch.nn.Linear(2 * d, d, bias=False)

        def forward(self, x: Any) -> Any:
            h = self.up(x)
            h = torch.nn.functional.gelu(h) * h.sigmoid()
            return x + self.down(h)

    class TransformerBlock(torch.nn.Module):
        def __init__(self, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.norm1 = torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
            self.proj = torch.nn.Linear(d, d, bias=False)
            self.norm2 = torch.nn.LayerNorm(d)
            self.mlp = Block()

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.norm2(x))

    if case.model == "llama":
        return _llama(case)
    if case.model == "mlp8":
        return torch.nn.Sequential(*[Block() for _ in range(case.blocks)])
    if case.model == "transformer":
        return torch.nn.Sequential(*[TransformerBlock() for _ in range(case.blocks)])
    raise ValueError(f"unknown model {case.model!r}")


def _llama(case: ModelShape) -> Any:
    """Hugging Face Llama from a config (random init, no download; needs transformers):
    hidden ``dim``, ``blocks`` layers, RoPE, SDPA. Called with token ids, returns the loss."""
    try:
        lm = hf_llama(vocab=LLAMA_VOCAB, dim=case.dim, layers=case.blocks, heads=4, seq=LLAMA_SEQ, mlp_dim=2 * case.dim)
    except ImportError as e:
        raise RuntimeError('--models llama needs transformers: pip install -e ".[models]"') from e
    return causal_lm_loss(lm)


def example_input(case: ModelShape) -> Any:
    import torch

    if case.model == "llama":
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, LLAMA_VOCAB, (max(case.batch // LLAMA_SEQ, 1), LLAMA_SEQ), generator=gen)
        return ids.to(case.device)
    if case.model == "transformer":
        seq = 128
        return torch.randn(max(case.batch // seq, 1), seq, case.dim, device=case.device)
    return torch.randn(case.batch, case.dim, device=case.device)


def blocks_of(model: Any, case: ModelShape) -> list[Any]:
    """The repeated blocks of a bench model: the Sequential's children, Llama's decoder layers."""
    if case.model == "llama":
        return decoder_layers(model.lm)
    return list(model)


def hf_vit(*, dim: int, layers: int, heads: int, image: int, patch: int, labels: int) -> Any:
    """``transformers.ViTForImageClassification`` from a config, without dropout. Raises
    ImportError without transformers."""
    import transformers

    config = transformers.ViTConfig(
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * dim,
        image_size=image,
        patch_size=patch,
        num_labels=labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return transformers.ViTForImageClassification(config)


def report_step(name: str, device: str, backend: str = "inductor") -> Callable[[], Any]:
    """One training step (forward and backward, compiled with ``backend``) of a small
    built-in model, for ``python -m torch_patches report``: ``llama``, ``gpt2`` (HF, 2
    layers of width 128, vocab 1024, 2 x 128 tokens), ``vit`` (HF ViT, 2 layers of width 128,
    32 x 32 images in 4 x 4 patches, batch 8) or ``mlp8`` (8 blocks of width 128, batch
    2048). The HF models need transformers."""
    import torch

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    try:
        if name in LANGUAGE_MODELS:
            model = causal_lm_loss(LANGUAGE_MODELS[name](vocab=1024, dim=128, layers=2, heads=4, seq=128)).to(device)
            inputs: tuple[Any, ...] = (torch.randint(0, 1024, (2, 128), generator=gen).to(device),)
        elif name == "vit":
            vit = hf_vit(dim=128, layers=2, heads=4, image=32, patch=4, labels=10).to(device)
            labels = torch.randint(0, 10, (8,), generator=gen).to(device)

            def vit_loss(pixels: Any) -> Any:
                return vit(pixel_values=pixels, labels=labels).loss

            model, inputs = vit_loss, (torch.randn(8, 3, 32, 32, generator=gen).to(device),)
        elif name == "mlp8":
            shape = types.SimpleNamespace(model="mlp8", device=device, batch=2048, dim=128, blocks=8)
            model = build_model(shape).to(device)
            inputs = (torch.randn(2048, 128, generator=gen).to(device).requires_grad_(),)
        else:
            raise ValueError(f"unknown model {name!r}: llama, gpt2, vit or mlp8")
    except ImportError as e:
        raise RuntimeError(f"--model {name} needs transformers: pip install -e '.[models]'") from e
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        out = compiled(*inputs)
        (out if out.dim() == 0 else out.square().mean()).backward()

    return step
