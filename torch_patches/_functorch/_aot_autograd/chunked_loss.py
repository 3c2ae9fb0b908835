"""A language model's loss head computed chunk by chunk over the tokens, exactly.

The head of a causal language model is ``cross_entropy(g(linear(h, W, b)), y)``: ``h`` the
last hidden states (tokens x hidden), ``W`` the LM head's weight (vocabulary x hidden), ``g``
what the model does to its logits before the loss, in order (Gemma 2's soft-cap
``c * tanh(x / c)``, an upcast to float32, a scale).  Unchunked, autograd saves a (tokens x
vocabulary) tensor for the backward (the logits or their log-probabilities) and the
backward materialises a gradient of the same size beside it: at the vocabularies models
train with (32k-256k tokens) those are the step's largest tensors.

:class:`ChunkedLinearCrossEntropy` computes the same loss and gradients over chunks of
tokens.  The forward computes each chunk's logits, their log-sum-exp and the target's
logit; the loss is the sum over chunks (divided by the number of targets other than
``ignore_index`` for ``reduction="mean"``).  What the backward reads per chunk is that
chunk's raw logits (``linear(h_c, W, b)``, before ``g``: one tensor per chunk, so that the
budget planner can keep, offload or recompute each on its own), its log-sum-exp and
targets, ``h`` and ``W``; it rebuilds ``softmax(g(x))`` chunk by chunk, adds the incoming
gradient of the logits the model returns (if it returns them), and accumulates ``dL/dh``
and ``dL/dW`` (the weight's gradient in float32) chunk by chunk.  No (tokens x vocabulary)
tensor is made but the chunks' and, where the model returns its logits, those logits.  The
same matmuls as unchunked: one in the forward, two in the backward.

Exact up to floating-point reassociation: the sums over the vocabulary are the same; the
weight's gradient is a sum of per-chunk products instead of one product.

Used by the loss-head rewrite (:mod:`.loss_head`), which puts it in the graph Dynamo hands
to AOTAutograd; AOTAutograd traces through it, forward and backward, the chunks unrolled.
Compile time: nothing here runs per compiled call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch

__all__ = ["HeadSpec", "ChunkedLinearCrossEntropy", "after", "chunk_bounds", "chunked_linear_cross_entropy", "keeps_logits_exactly"]

#: The transforms a head may apply between its matmul and the loss, by name, each with one
#: constant: ``("softcap", c)``: ``c * tanh(x / c)``; ``("upcast", None)``: to float32;
#: ``("scale", s)``: ``x * s``.
TRANSFORMS = ("softcap", "upcast", "scale")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What a loss head does between the LM head's matmul and the loss.

    ``transforms``: ``(name, constant)`` pairs of :data:`TRANSFORMS`, in the order the model
    applies them; ``returns``: where the model also returns its logits, how many of the
    transforms they have been through (0: the matmul's output; None: not returned);
    ``recompute``: where the logits are returned, the backward recomputes each chunk's
    instead of saving them;
    ``ignore_index``, ``reduction`` ("mean" or "sum") and ``label_smoothing`` as
    ``F.cross_entropy``'s (a smoothed token's loss: ``lse - (1 - e) z_y - e mean(z)``);
    ``chunks``: how many chunks of tokens."""

    transforms: tuple[tuple[str, float | None], ...] = ()
    returns: int | None = None
    recompute: bool = False
    ignore_index: int = -100
    reduction: str = "mean"
    chunks: int = 8
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {self.reduction!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {self.chunks}")
        for name, _ in self.transforms:
            if name not in TRANSFORMS:
                raise ValueError(f"unknown transform {name!r}: one of {TRANSFORMS}")
        if self.returns is not None and not 0 <= self.returns <= len(self.transforms):
            raise ValueError(f"returns must be None or in [0, {len(self.transforms)}], got {self.returns}")
        if self.returns is not None and not self.recompute and not keeps_logits_exactly(self.transforms, self.returns):
            raise ValueError("a soft-cap before the returned logits' last transform needs recompute=True")


def keeps_logits_exactly(transforms: tuple[tuple[str, float | None], ...], returns: int) -> bool:
    """Whether the backward can take the gradient back through ``transforms`` from the
    returned logits (after ``returns`` of them) alone: a soft-cap's derivative is read off its
    output, so none may come before the returned logits' last transform."""
    return all(name != "softcap" for name, _ in transforms[: max(0, returns - 1)])


def chunk_bounds(tokens: int | torch.SymInt, chunks: int) -> list[tuple[Any, Any]]:
    """``chunks`` contiguous ranges covering ``range(tokens)``, as even as they can be (the
    first ones one longer), none empty.  Where ``tokens`` is symbolic (dynamic shapes), the
    chunks are counted as given and each is ``ceil(tokens / chunks)`` long, the last ones
    shorter (empty where ``tokens`` is less than ``chunks``): no guard on ``tokens``."""
    if isinstance(tokens, torch.SymInt):
        size = (tokens + chunks - 1) // chunks
        return [(torch.sym_min(i * size, tokens), torch.sym_min((i + 1) * size, tokens)) for i in range(chunks)]
    chunks = max(1, min(chunks, tokens))
    size, extra = divmod(tokens, chunks)
    out, start = [], 0
    for i in range(chunks):
        end = start + size + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _apply(x: torch.Tensor, name: str, c: float | None) -> torch.Tensor:
    if name == "upcast":
        return x.float()
    c = cast(float, c)  # a soft-cap's and a scale's constant
    if name == "softcap":
        return torch.tanh(x / c) * c
    return x * c


def _stages(x: torch.Tensor, transforms: tuple[tuple[str, float | None], ...]) -> list[torch.Tensor]:
    """``x`` and its value after each of ``transforms``, in order."""
    out = [x]
    for name, c in transforms:
        out.append(_apply(out[-1], name, c))
    return out


def _grad_back(g: torch.Tensor, y: torch.Tensor | None, dtype: torch.dtype, name: str, c: float | None) -> torch.Tensor:
    """The gradient ``g`` of a transform's output ``y`` taken to its input (of ``dtype``); a
    soft-cap's derivative read off its output: ``1 - (y / c)^2``."""
    if name == "softcap":
        t = cast(torch.Tensor, y) / cast(float, c)  # a soft-cap's output is kept
        g = g * (1 - t * t)
    elif name == "scale":
        g = g * cast(float, c)
    return g.to(dtype)


@torch.library.custom_op("saved_tensors_hooks::accumulate_mm_", mutates_args=("acc",))
def accumulate_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place, in ``acc``'s dtype (float32 where ``a`` and ``b`` are lower:
    on CUDA the matmul accumulates in it, elsewhere its operands are upcast).  A mutating op,
    so that AOTAutograd functionalizes it and Inductor writes it back in place (its reinplace
    pass): the weight's gradient accumulates in one buffer over the chunks."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.ops.aten.addmm.dtype_out(acc, a, b, acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@accumulate_mm_.register_fake
def _(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


@torch.library.custom_op("saved_tensors_hooks::after", mutates_args=())
def after(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` made once ``token`` is: an order between chunks.  Inductor fuses
    the same kernel of independent chunks into one (they read the same scalars), which keeps
    several chunks' (tokens x vocabulary) tensors alive at once; a chunk whose inputs pass
    through this after the previous chunk's result cannot be fused with it.  ``x`` is small
    (a chunk's targets or hidden states, an incoming gradient).  Not a tensor the budget's
    plan recomputes through: what it may recompute (a chunk's logits) never reads it."""
    return x.clone()


@after.register_fake
def _(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _accumulate(acc: torch.Tensor | None, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``acc + g^T h`` in float32 (or the operands' dtype where it is wider), into one
    buffer over the chunks (:func:`accumulate_mm_`): no chunk's product outlives its chunk,
    and the accumulator is not copied per chunk."""
    if acc is None:
        wide = torch.float32 if g.dtype in (torch.bfloat16, torch.float16) else g.dtype
        acc = torch.zeros(g.shape[1], h.shape[1], dtype=wide, device=g.device)
    accumulate_mm_(acc, g.t(), h)
    return acc


def _chunk_loss(z: torch.Tensor, t: torch.Tensor, ignore_index: int, smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's log-sum-exp per token and its summed loss over the targets kept (with
    ``smoothing``, each token's is ``lse - (1 - e) z_y - e mean(z)``, as
    ``F.cross_entropy``'s ``label_smoothing``)."""
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    picked = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    if smoothing:
        picked = (1 - smoothing) * picked + smoothing * z.mean(dim=-1)
    return lse, torch.where(valid, lse - picked, 0).sum()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(g(linear(h, W, b)), y)`` over chunks of tokens (see the module).

    ``forward(h, weight, bias, target, spec)``: ``h`` (tokens x hidden), ``weight``
    (vocabulary x hidden), ``bias`` (vocabulary) or None, ``target`` (tokens) of class
    indices; returns ``(logits, loss)``: ``logits`` the model's (tokens x vocabulary)
    logits where ``spec.returns`` is not None (else None).

    Where the logits are not returned, each chunk's are computed on their own and saved for
    the backward (the budget plan may recompute each).  Where they are, they are computed
    whole, the loss reads them chunk by chunk, and the backward reads them again
    (``spec.recompute`` False: the logits are saved) or recomputes each chunk's from ``h`` and
    ``W`` (True: one more matmul, nothing of (tokens x vocabulary) saved)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, spec: HeadSpec) -> Any:
        bounds = chunk_bounds(h.shape[0], spec.chunks)
        k = spec.returns
        logits = None
        if k is not None:
            logits = _stages(torch.nn.functional.linear(h, weight, bias), spec.transforms[:k])[-1]
        saved, lses = [], []
        total: torch.Tensor | None = None
        for start, end in bounds:
            if logits is None:
                x = torch.nn.functional.linear(h[start:end], weight, bias)
                saved.append(x)
                z = _stages(x, spec.transforms)[-1]
            else:
                z = _stages(logits[start:end], spec.transforms[k:])[-1]
            t = target[start:end]
            lse, part = _chunk_loss(z, t if total is None else after(t, total), spec.ignore_index, spec.label_smoothing)
            total = part if total is None else total + part
            lses.append(lse)
        if logits is not None and not spec.recompute:
            saved = [logits]
        count = (target != spec.ignore_index).sum()
        total = cast(torch.Tensor, total)  # one chunk at least
        loss = total / count if spec.reduction == "mean" else total
        ctx.spec, ctx.bounds, ctx.n_saved, ctx.has_bias = spec, bounds, len(saved), bias is not None
        ctx.dtypes = [t.dtype for t in _stages(torch.empty((), dtype=h.dtype, device="meta"), spec.transforms)]
        ctx.save_for_backward(h, weight, bias, target, count, *saved, *lses)
        return logits, loss

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor | None, grad_loss: torch.Tensor) -> Any:
        spec, bounds, k = ctx.spec, ctx.bounds, ctx.spec.returns
        h, weight, bias, target, count, *rest = ctx.saved_tensors
        saved, lses = rest[: ctx.n_saved], rest[ctx.n_saved :]
        scale = grad_loss / count if spec.reduction == "mean" else grad_loss
        grad_h = []
        grad_w: torch.Tensor | None = None
        grad_b: torch.Tensor | None = None
        stages: Sequence[torch.Tensor | None]
        for i, ((start, end), lse) in enumerate(zip(bounds, lses)):
            if k is None:
                stages = _stages(saved[i], spec.transforms)
            elif spec.recompute:
                stages = _stages(torch.nn.functional.linear(h[start:end], weight, bias), spec.transforms)
            else:
                kept: list[torch.Tensor | None] = [None] * k  # the stages before the saved logits (not kept)
                kept.extend(_stages(saved[0][start:end], spec.transforms[k:]))
                stages = kept
            if grad_w is not None:
                scale = after(scale, grad_w)  # this chunk after the last one's
            g = _softmax_grad(cast(torch.Tensor, stages[-1]), lse, target[start:end], spec.ignore_index, scale, spec.label_smoothing)
            for j in reversed(range(len(spec.transforms))):
                if k == j + 1 and grad_logits is not None:
                    g = g + grad_logits[start:end]
                g = _grad_back(g, stages[j + 1], ctx.dtypes[j], *spec.transforms[j])
            if k == 0 and grad_logits is not None:
                g = g + grad_logits[start:end]
            grad_h.append(g @ weight)
            grad_w = _accumulate(grad_w, g, h[start:end])
            if ctx.has_bias:
                bpart = (g.float() if g.dtype in (torch.bfloat16, torch.float16) else g).sum(0)
                grad_b = bpart if grad_b is None else grad_b + bpart
        grad_b = grad_b.to(weight.dtype) if grad_b is not None else None  # summed in float32
        return torch.cat(grad_h), cast(torch.Tensor, grad_w).to(weight.dtype), grad_b, None, None


def _softmax_grad(
    z: torch.Tensor, lse: torch.Tensor, t: torch.Tensor, ignore_index: int, scale: torch.Tensor, smoothing: float = 0.0
) -> torch.Tensor:
    """The gradient of a chunk's summed loss over its logits ``z``: ``softmax(z) - onehot``
    on the targets kept (``- (1 - e) onehot - e / V`` with label smoothing ``e``), times
    ``scale``."""
    p = torch.exp(z - lse.unsqueeze(1))
    if smoothing:
        p = p - smoothing / z.shape[1]
    hit = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == t.unsqueeze(1)
    return torch.where(hit, p - (1 - smoothing), p) * torch.where(t != ignore_index, scale, 0).unsqueeze(1).to(z.dtype)


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, spec: HeadSpec
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:class:`ChunkedLinearCrossEntropy` on ``h`` flattened to (tokens x hidden) and
    ``target`` to (tokens): ``(logits, loss)``, ``logits`` in ``h``'s leading shape (None
    where ``spec.returns`` is None)."""
    lead = h.shape[:-1]
    logits, loss = ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, bias, target.reshape(-1), spec)
    if logits is not None:
        logits = logits.view(*lead, logits.shape[-1])
    return logits, loss
