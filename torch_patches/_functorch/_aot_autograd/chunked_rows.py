"""A language model's head and any loss that works row by row over its vocabulary, computed
chunk by chunk over the tokens, exactly.

:mod:`.chunked_loss` writes cross-entropy's forward and backward by hand.  The losses users
train with past pre-training read the same (tokens x vocabulary) logits in other ways: a
z-loss squares their log-sum-exp, DPO sums each sequence's log-probabilities of its labels,
GRPO clips a per-token ratio of them, distillation takes a KL divergence to a teacher's
logits.  Each is a *region* of the graph from the head's matmul to sums over the tokens whose
ops work on each token's row of the vocabulary on its own (found by :mod:`.loss_region`):
such a region's sums over the tokens are the sums, over chunks of tokens, of the same region
run on each chunk.

:class:`ChunkedRows` runs a region so.  The forward computes each chunk's logits
``linear(h_c, W, b)``, runs the region on them and on the chunk of each operand that has
the tokens (labels, masks, a teacher's logits), and adds the chunks' partial sums; it saves
nothing of (tokens x vocabulary).  The backward recomputes each chunk's logits (one more
matmul of the head), takes them through the region again under autograd (the region's own
derivatives, no hand-written one), then through the matmul by hand: ``dL/dh`` chunk by
chunk, ``dL/dW`` accumulated in one float32 buffer.  No (tokens x vocabulary) tensor is made
but a chunk's.  The chunks run one after another (:func:`~.chunked_loss.after`): each
chunk's hidden states are copied after the previous chunk's result, so that no fusion of
Inductor's keeps two chunks' logits alive at once.

Exact up to floating-point reassociation (the sums over tokens are summed chunk by chunk).
Used by the rewrite in :mod:`.loss_region`; AOTAutograd traces through it, forward and
backward, the chunks unrolled.  Compile time: nothing here runs per compiled call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch

from torch_patches._functorch._aot_autograd.chunked_loss import _accumulate, after, chunk_bounds

__all__ = ["RowsSpec", "ChunkedRows", "chunked_rows"]


@dataclasses.dataclass(frozen=True)
class RowsSpec:
    """How a region is cut.  ``axis``: the hidden states' dimension of tokens that is cut
    (the one before the hidden size); ``operands``: for each operand of the region, where its
    tokens are (``(dim, outer, inner)``: its dimension ``dim`` holds ``outer x tokens x
    inner`` entries, the tokens' dimension merged with ``outer`` before and ``inner`` after
    it; ``None``: the operand is read whole by every chunk); ``chunks``: how many chunks."""

    axis: int
    operands: tuple[tuple[int, int, int] | None, ...]
    chunks: int = 8

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {self.chunks}")


def _cut(x: torch.Tensor, where: tuple[int, int, int] | None, start: Any, end: Any) -> torch.Tensor:
    """The tokens ``[start, end)`` of an operand laid out as ``where`` says."""
    if where is None:
        return x
    dim, outer, inner = where
    if outer == 1 and inner == 1:
        return x[(slice(None),) * dim + (slice(start, end),)]
    tokens = x.shape[dim] // (outer * inner)
    split = x.unflatten(dim, (outer, tokens, inner))
    return split[(slice(None),) * (dim + 1) + (slice(start, end),)].flatten(dim, dim + 2)


def _join(parts: list[torch.Tensor], where: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of :func:`_cut` over every chunk: the chunks' tensors put back whole."""
    dim, outer, inner = where
    if outer == 1 and inner == 1:
        return torch.cat(parts, dim)
    split = [p.unflatten(dim, (outer, p.shape[dim] // (outer * inner), inner)) for p in parts]
    return torch.cat(split, dim + 1).flatten(dim, dim + 2)


class ChunkedRows(torch.autograd.Function):
    """``region(tokens, linear(h, W, b), *operands)`` over chunks of tokens (see the module).

    ``region`` returns a tuple of sums over the tokens (of any shape: a scalar, one value a
    sequence); ``tokens`` is the length of ``h``'s dimension ``spec.axis`` (an int, or a
    symbolic one under dynamic shapes), which a region's means divide by."""

    @staticmethod
    def forward(
        ctx: Any,
        region: Callable[..., tuple[torch.Tensor, ...]],
        spec: RowsSpec,
        tokens: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *operands: torch.Tensor,
    ) -> Any:
        bounds = chunk_bounds(h.shape[spec.axis], spec.chunks)
        lead = (slice(None),) * spec.axis
        totals = None
        for start, end in bounds:
            h_c = h[lead + (slice(start, end),)]
            x = torch.nn.functional.linear(h_c if totals is None else after(h_c, totals[0]), weight, bias)
            parts = region(tokens, x, *(_cut(o, w, start, end) for o, w in zip(operands, spec.operands)))
            totals = list(parts) if totals is None else [t + p for t, p in zip(totals, parts)]
        ctx.region, ctx.spec, ctx.tokens, ctx.bounds, ctx.has_bias = region, spec, tokens, bounds, bias is not None
        ctx.save_for_backward(h, weight, bias, *operands)
        return tuple(totals or ())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        spec = ctx.spec
        h, weight, bias, *operands = ctx.saved_tensors
        n = len(operands)
        wanted = [i for i, g in enumerate(grads) if g is not None]
        needs = [ctx.needs_input_grad[6 + i] for i in range(n)]
        lead = (slice(None),) * spec.axis
        grad_h: list[torch.Tensor] = []
        grad_ops: list[list[torch.Tensor]] = [[] for _ in range(n)]
        grad_w: torch.Tensor | None = None
        grad_b: torch.Tensor | None = None
        for start, end in ctx.bounds:
            h_c = h[lead + (slice(start, end),)]
            with torch.no_grad():
                saved = torch.nn.functional.linear(h_c if grad_w is None else after(h_c, grad_w), weight, bias)
            with torch.enable_grad():
                x = saved.detach().requires_grad_(True)
                cut = [_cut(o, w, start, end).detach().requires_grad_(need) for o, w, need in zip(operands, spec.operands, needs)]
                outs = ctx.region(ctx.tokens, x, *cut)
                inputs = [x] + [c for c, need in zip(cut, needs) if need]
                got = torch.autograd.grad([outs[i] for i in wanted], inputs, [grads[i] for i in wanted], allow_unused=True)
            g = got[0] if got[0] is not None else torch.zeros_like(saved)
            grad_h.append((g @ weight.to(g.dtype)).to(h.dtype))
            g2, h2 = g.reshape(-1, g.shape[-1]), h_c.reshape(-1, h_c.shape[-1])
            grad_w = _accumulate(grad_w, g2, h2)
            if ctx.has_bias:
                part = (g2.float() if g2.dtype in (torch.bfloat16, torch.float16) else g2).sum(0)
                grad_b = part if grad_b is None else grad_b + part
            for i, got_i in zip([i for i in range(n) if needs[i]], got[1:]):
                grad_ops[i].append(got_i if got_i is not None else torch.zeros_like(cut[i]))
        ops_grads = [
            _join(parts, w) if parts and w is not None else (sum(parts) if parts else None) for parts, w in zip(grad_ops, spec.operands)
        ]
        grad_b = grad_b.to(weight.dtype) if grad_b is not None else None
        grad_w = cast(torch.Tensor, grad_w)  # one chunk at least
        return (None, None, None, torch.cat(grad_h, spec.axis), grad_w.to(weight.dtype), grad_b, *ops_grads)


def chunked_rows(
    region: Callable[..., tuple[torch.Tensor, ...]],
    spec: RowsSpec,
    tokens: Any,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *operands: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """:class:`ChunkedRows`: the region's sums over the tokens, in the region's order."""
    return ChunkedRows.apply(region, spec, tokens, h, weight, bias, *operands)
