"""Find the loss that a language model's head feeds, whatever it computes, where it works row
by row over the vocabulary, and compute it in chunks of tokens (:mod:`.chunked_rows`).

A *region* starts at the LM head's matmul ``linear(h, W, b)`` (``h``: ``[..., tokens,
hidden]``) and takes in every op that reads it, directly or not, in the torch-level graph
Dynamo records, until sums over the tokens end it.  Each op's value keeps track of where its
tokens are (a dimension, possibly merged with static ones by a view); an op is taken in only
where it works on each token on its own:

- elementwise ops and casts (the other operands broadcast, or cut with the tokens where they
  have them: labels, masks, old log-probabilities, a teacher's logits);
- ops over other dimensions than the tokens': ``logsumexp``, ``(log_)softmax``, ``sum``,
  ``mean``, ``amax`` over the vocabulary, ``gather`` at the labels, indexing or stacking the
  batch (TRL's ``selective_log_softmax`` loops over the sequences), ``(un)squeeze``, views
  that merge the tokens with static dimensions (``view(-1, V)``);
- ``cross_entropy``, ``nll_loss`` (no class weights) and ``kl_div``, per token or summed;
- a slice of the tokens straight after the matmul (``logits[:, :-1]``): the hidden states are
  sliced instead.

``sum`` or ``mean`` over the tokens (of all of them, or of each sequence's: ``[batch]``),
``cross_entropy`` / ``nll_loss`` / ``kl_div`` reduced, end the region: those are its outputs,
and each is the sum over chunks of the same op on a chunk (a mean divides the chunk's sum by
the whole count).  Anything else that reads a token's row with another's (a softmax over the
tokens, a cumulative sum, a roll), an output of the region read beside the tokens, or the
logits returned whole: no region, and the reason is logged.

Cross-entropy alone keeps its own chunked head (:mod:`.loss_head`, its backward written by
hand); a region is what the budget chunks where more reads the logits: a z-loss beside it,
DPO's and GRPO's log-probabilities, distillation's KL.  Compile time only.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd.chunked_rows import RowsSpec, chunked_rows
from torch_patches._functorch._aot_autograd.loss_region_ops import (
    _LINEARS,
    LossRegion,
    NotRowWise,
    RegionBuilder,
    Rows,
    _grad_modes,
    _linear_args,
    _value,
)
from torch_patches._functorch._aot_autograd.utils import size_hint

__all__ = ["LossRegion", "find_region", "rewrite_region", "rewrite_regions", "summary"]


def _head_slice(linear: fx.Node, ndim: int) -> tuple[fx.Node, tuple[Any, ...] | None]:
    """Where the matmul's one reader slices its tokens (``logits[:, :-1]``): that slice and
    its index, else the matmul."""
    users = list(linear.users)
    if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[0] is not linear:
        return linear, None
    index = users[0].args[1]
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) > ndim - 1 or not all(isinstance(i, slice) for i in idx):
        return linear, None
    return users[0], idx


def find_region(linear: fx.Node) -> LossRegion:
    """The row-wise region the LM head ``linear`` feeds, or why not."""
    region = LossRegion(linear=linear)
    h, w, _ = _linear_args(linear)
    hv, wv = _value(h), _value(w)
    if not isinstance(hv, torch.Tensor) or not isinstance(wv, torch.Tensor) or hv.dim() < 2 or wv.dim() != 2:
        region.why_not = "not a matmul of hidden states by a weight matrix"
        return region
    if not all(isinstance(d, int) for d in wv.shape):
        region.why_not = "a symbolic hidden size or vocabulary"
        return region
    start, region.head_index = _head_slice(linear, hv.dim())
    region.start, region.axis, region.vocab = start, hv.dim() - 2, wv.shape[0]
    shape = _value(start).shape
    region.tokens, region.all_tokens = size_hint(shape[region.axis]), size_hint(math.prod(shape[:-1]))
    region.dynamic = not all(isinstance(d, int) for d in shape)
    b = RegionBuilder(region, _grad_modes(linear.graph))
    b.env[start], b.rows[start] = b.x, Rows(region.axis)
    try:
        node = start.next
        while node.op != "root":
            inputs = node.all_input_nodes
            if node.op == "output":
                held = [a.name for a in inputs if a in b.rows]
                if held:
                    raise NotRowWise(f"the graph returns {', '.join(held)} whole")
            elif any(a in b.rows for a in inputs):
                b.step(node)
            elif any(a in b.ended or a in b.tainted for a in inputs):
                b.tainted.add(node)
            node = node.next
    except NotRowWise as e:
        region.why_not = str(e)
        return region
    except Exception as e:  # a graph this matcher does not understand: no region, and why
        region.why_not, region.failed = f"the matcher failed: {type(e).__name__}: {e}", True
        return region
    if not region.outputs:
        region.why_not = "no sum over the tokens reads the logits"
        return region
    b.graph.output(tuple(b.env[o] for o in region.outputs))
    region.graph = b.graph
    return region


def rewrite_region(gm: fx.GraphModule, region: LossRegion, chunks: int) -> str | None:
    """Replace ``region`` in ``gm`` by one :func:`~.chunked_rows.chunked_rows` call; None,
    else why not (``gm`` unchanged)."""
    graph, linear = gm.graph, region.linear
    h, w, bias = _linear_args(linear)
    order = {n: i for i, n in enumerate(graph.nodes)}
    keys = [k for k, _ in region.operands]
    reads = [k if isinstance(k, fx.Node) else k[1] for k in keys] + [a for a in (h, w, bias) if isinstance(a, fx.Node)]
    modes = _grad_modes(graph)
    mode = {modes[n] for n in [*region.nodes, *region.outputs] if n is not linear and n not in region.pulled}
    if len(mode) != 1:
        return "its ops run under different grad modes"
    at = max(reads, key=order.__getitem__).next
    while at.op != "output" and modes[at] not in mode:  # where the region's own grad mode holds
        at = at.next
    readers = [u for o in region.outputs for u in o.users]
    if at.op == "output" or (readers and order[at] > min(order[u] for u in readers)):
        return f"its operands are computed after its sums are read, or under another grad mode ({at.name})"
    name = f"_loss_region_{sum(1 for n, _ in gm.named_children() if n.startswith('_loss_region_'))}"
    gm.add_submodule(name, fx.GraphModule(torch.nn.Module(), cast(fx.Graph, region.graph), class_name="LossRegion"))
    with graph.inserting_before(at):  # in the order made
        sub = graph.get_attr(name)
        if region.head_index is not None:
            h = graph.call_function(operator.getitem, (h, region.head_index))
        tokens = _value(region.start).shape[region.axis]
        if not isinstance(tokens, int):
            tokens = graph.call_method("size", (h, region.axis))
        operands = []
        for key in keys:
            if isinstance(key, fx.Node):
                operands.append(key)
                continue
            _, target, ii = key
            operands.append(graph.call_method("sum", (graph.call_function(operator.ne, (target, ii)),)))
        spec = RowsSpec(axis=region.axis, operands=tuple(r.where() if r else None for _, r in region.operands), chunks=chunks)
        args: tuple[Any, ...] = (sub, spec, tokens, h, w, bias, *operands)  # the spec: a constant argument
        call = graph.call_function(chunked_rows, args)
    for k, out in enumerate(region.outputs):
        with graph.inserting_after(call):
            got = graph.call_function(operator.getitem, (call, k))
        got.meta["example_value"] = _value(out)
        out.replace_all_uses_with(got)
    gone = {linear, cast(fx.Node, region.start), *region.nodes, *region.outputs}
    for node in sorted(gone, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    gm.recompile()
    return None


def summary(region: LossRegion, chunks: int) -> str:
    """A chunked region in words, for the plan's summary, the log and ``report()``."""
    tokens = f"{region.all_tokens} tokens" + (" at the length compiled for, symbolic" if region.dynamic else "")
    return (
        f"{region.describe()} in {chunks} chunks of tokens ({tokens} x {region.vocab} vocabulary, "
        f"{len(region.nodes)} row-wise ops, {len(region.outputs)} sums over the tokens): the unchunked "
        f"region's float32 (tokens x vocabulary) tensors hold {region.logits_bytes} B each, a chunk's "
        f"{region.logits_bytes // max(1, chunks)} B; each chunk's logits recomputed in the backward (one more "
        "matmul of the head) and the region run again on them"
    )


def rewrite_regions(
    gm: fx.GraphModule, linears: list[fx.Node], taken: set[fx.Node], chunks_of: Callable[[LossRegion], int]
) -> list[tuple[LossRegion, int]]:
    """Chunk the region of each of ``linears`` (matmuls of ``gm`` that may be an LM head) not
    in ``taken`` (a head chunked already), in ``chunks_of(region)`` chunks.  Adds the matmuls
    chunked to ``taken`` (a teacher's head pulled into a region too); returns each region
    tried with its chunks (``why_not`` set where it was not chunked), for the caller to log."""
    done = []
    for linear in linears:
        if linear in taken:
            continue
        region = find_region(linear)
        chunks = chunks_of(region)
        if region.why_not is None:
            region.why_not = rewrite_region(gm, region, chunks)
        if region.why_not is None:
            taken.update([linear, *(n for n in region.nodes if n.target in _LINEARS)])
        done.append((region, chunks))
    return done
