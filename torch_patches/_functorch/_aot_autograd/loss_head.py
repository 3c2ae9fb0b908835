"""Find a language model's loss head in the graph Dynamo hands to AOTAutograd, and compute it
in chunks of tokens under an activation-memory budget.

The pattern, in the torch-level graph Dynamo records (before AOTAutograd decomposes it):

    logits = linear(h, W, b)                       # the LM head; W tied to the embedding or not
    [logits = c * tanh(logits / c)]                # Gemma 2's final_logit_softcapping
    [logits = logits.float()] [logits = logits * s]   # an upcast, a scale, in any order
    [views merging the token dimensions]           # view(-1, V), flatten(0, 1), contiguous()
    loss = cross_entropy(logits, y, ignore_index=i, reduction="mean" | "sum", label_smoothing=e)

as HF's ``ForCausalLMLoss`` (labels shifted by padding, ``ignore_index=-100``; mean, or sum
where the caller divides by ``num_items_in_batch``), torchtitan's ``cross_entropy_loss`` and a
plain ``F.cross_entropy(linear(h), y)`` produce it, with a constant label smoothing or not.
The logits at one step of the chain may also be read elsewhere (HF returns them): they come
out of the chunked head whole.  Any other loss on the logits is a region of
:mod:`.loss_region`.  The number of tokens may be symbolic (a batch's length under dynamic
shapes): the chunks are counted at its hint and sized symbolically, so one graph serves
every length.

:func:`rewrite_loss_heads` replaces each match by one call of
:func:`~.chunked_loss.chunked_linear_cross_entropy` (an autograd function AOTAutograd traces
through, chunk by chunk): the (tokens x vocabulary) log-probabilities are never saved and
the gradient is never made whole; what the backward reads is each chunk's logits, a tensor
of its own that the budget plan keeps, offloads or recomputes from ``h`` and ``W``.  It runs as
a graph finalizer of Dynamo's output graph (registered where the ambient hooks' subgraphs
are installed: ``torch_patches/_dynamo/output_graph.py``) when the ambient hooks are a budget
with room to gain: ``config.chunked_loss_head``.  The rewritten graph is what the compile
caches key.  Compile time only.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import operator
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches import _logging as tp_logging, config
from torch_patches._functorch._aot_autograd import compile_facts
from torch_patches._functorch._aot_autograd.activation_budget.cost_model import Rates
from torch_patches._functorch._aot_autograd.chunked_loss import HeadSpec, chunked_linear_cross_entropy, keeps_logits_exactly
from torch_patches._functorch._aot_autograd.loss_region_ops import _LINEARS, _linear_args, _same, _value
from torch_patches._functorch._aot_autograd.utils import size_hint

__all__ = ["LossHead", "find_loss_heads", "rewrite_loss_heads", "chunks_for"]

log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch._aot_autograd.loss_head"

_CROSS_ENTROPY = torch.nn.functional.cross_entropy
_CE_SIGNATURE = inspect.signature(torch.nn.functional.cross_entropy)
_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous"})


@dataclasses.dataclass
class LossHead:
    """One loss head found in a Dynamo graph, or why a cross-entropy is not one."""

    loss: fx.Node
    linear: fx.Node | None = None
    target: fx.Node | None = None
    transforms: list[tuple[str, float | None]] = dataclasses.field(default_factory=list)
    #: The nodes the chunked call replaces, readers before what they read (the matmul last).
    chain: list[fx.Node] = dataclasses.field(default_factory=list)
    #: The chain's node whose value the graph also reads elsewhere (the logits it returns),
    #: and how many transforms it has been through.
    returned: fx.Node | None = None
    returned_stage: int | None = None
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    tokens: int = 0
    vocab: int = 0
    hidden: int = 0
    #: The number of tokens is symbolic (``tokens`` is its hint): the chunks are counted at
    #: the hint and sized symbolically (``chunked_loss.chunk_bounds``).
    dynamic: bool = False
    why_not: str | None = None

    @property
    def logits_bytes(self) -> int:
        """Bytes of the (tokens x vocabulary) logits in float32, what the unchunked loss
        saves or makes at least once."""
        return self.tokens * self.vocab * 4

    def describe(self) -> str:
        where = f"{self.loss.name} <- {self.linear.name}" if self.linear is not None else self.loss.name
        return f"loss head {where}"


def _static_shape(node: Any) -> tuple[int, ...] | None:
    shape = _shape(node)
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return cast(tuple[int, ...], shape)


def _shape(node: Any) -> tuple[int | torch.SymInt, ...] | None:
    """A tensor node's shape, its sizes symbolic where Dynamo made them so (None for
    another value)."""
    value = _value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _constant(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _scaled(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``x * c``, ``c * x`` or ``x / c`` with a Python number ``c``: ``(x, factor)``."""
    if node.op != "call_function" or node.target not in (operator.mul, operator.truediv, torch.mul, torch.div):
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if node.target in (operator.truediv, torch.div):
        c = _constant(b)
        return (a, 1.0 / c) if isinstance(a, fx.Node) and c not in (None, 0.0) else None
    c = _constant(b)
    if isinstance(a, fx.Node) and c is not None:
        return a, c
    c = _constant(a)
    if isinstance(b, fx.Node) and c is not None:
        return b, c
    return None


def _softcapped(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """``c * tanh(x / c)``: ``(x, c, [the tanh and division nodes])``."""
    outer = _scaled(node)
    if outer is None:
        return None
    tanh, c = outer
    if tanh.op != "call_function" or tanh.target is not torch.tanh or len(tanh.users) != 1:
        return None
    scaled = tanh.args[0]
    if not isinstance(scaled, fx.Node):
        return None
    inner = _scaled(scaled)
    if inner is None or len(scaled.users) != 1 or not math.isclose(inner[1] * c, 1.0, rel_tol=1e-6):
        return None
    return inner[0], c, [tanh, scaled]


def _upcast(node: fx.Node) -> fx.Node | None:
    """``x.float()`` or ``x.to(torch.float32)``: ``x``."""
    if node.op != "call_method":
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return cast(fx.Node, node.args[0])  # a method call's self
    if node.target == "to" and not node.kwargs.keys() - {"dtype"}:
        rest = list(node.args[1:]) + list(node.kwargs.values())
        if rest == [torch.float32]:
            return cast(fx.Node, node.args[0])
    return None


def _step_back(node: fx.Node) -> tuple[fx.Node, tuple[str, float | None] | None, list[fx.Node]] | str:
    """One op of the chain between the head's matmul and the loss, walked backwards:
    ``(its input, its transform or None for a view, nodes it holds besides)``, else why not."""
    if node.op == "call_method" and node.target in _VIEWS:
        return cast(fx.Node, node.args[0]), None, []  # the view's self
    if node.op == "call_function" and node.target in (torch.flatten, torch.reshape):
        return cast(fx.Node, node.args[0]), None, []
    up = _upcast(node)
    if up is not None:
        return up, ("upcast", None), []
    capped = _softcapped(node)
    if capped is not None:
        return capped[0], ("softcap", capped[1]), capped[2]
    scaled = _scaled(node)
    if scaled is not None:
        return scaled[0], ("scale", scaled[1]), []
    return f"{node.format_node()} between the LM head and the loss"


def _match(ce: fx.Node) -> LossHead:
    """The loss head ending at the cross-entropy ``ce``, or why it is not one."""
    head = LossHead(loss=ce)
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError as e:
        head.why_not = f"cross_entropy's arguments: {e}"
        return head
    args = {**{k: p.default for k, p in _CE_SIGNATURE.parameters.items()}, **bound.arguments}
    if args["weight"] is not None:
        head.why_not = "class weights"
    elif not isinstance(args["label_smoothing"], (int, float)) or not 0 <= args["label_smoothing"] <= 1:
        head.why_not = "a label smoothing that is not a constant in [0, 1]"
    elif args["size_average"] is not None or args["reduce"] is not None:
        head.why_not = "the deprecated size_average / reduce arguments"
    elif args["reduction"] not in ("mean", "sum"):
        head.why_not = f"reduction={args['reduction']!r} (the loss per token is returned)"
    elif not isinstance(args["ignore_index"], int):
        head.why_not = "an ignore_index that is not a constant"
    if head.why_not:
        return head
    head.ignore_index, head.reduction, head.target = args["ignore_index"], args["reduction"], args["target"]
    head.label_smoothing = float(args["label_smoothing"])
    node = args["input"]
    stages: list[tuple[fx.Node, tuple[str, float | None] | None]] = []
    while isinstance(node, fx.Node) and not (node.op == "call_function" and node.target in _LINEARS):
        step = _step_back(node)
        if isinstance(step, str):
            head.why_not = step
            return head
        stages.append((node, step[1]))
        head.chain.extend([node, *step[2]])
        node = step[0]
    if not isinstance(node, fx.Node):
        head.why_not = "no LM head matmul feeds the loss"
        return head
    head.linear = node
    return _checked(head, stages)


def _checked(head: LossHead, stages: list[tuple[fx.Node, tuple[str, float | None] | None]]) -> LossHead:
    """Shapes, dtypes and readers of a matched chain; the transforms in the model's order."""
    linear = cast(fx.Node, head.linear)  # matched
    h, w, b = _linear_args(linear)
    # The tokens may be symbolic (a batch's length under dynamic shapes); the hidden size and
    # the vocabulary may not.
    h_shape, w_shape, t_shape = _shape(h), _static_shape(w), _shape(head.target)
    target = _value(head.target)
    if h_shape is None or t_shape is None:
        head.why_not = "the hidden states or the target are not tensors"
        return head
    if w_shape is None or not isinstance(h_shape[-1], int):
        head.why_not = "a symbolic hidden size or vocabulary"
        return head
    if len(w_shape) != 2 or (b is not None and _static_shape(b) != (w_shape[0],)):
        head.why_not = "the LM head's weight is not a matrix"
    elif target is None or target.dtype not in (torch.int64, torch.int32):
        head.why_not = "the target is not class indices"
    elif not _same(math.prod(h_shape[:-1]), math.prod(t_shape)):
        head.why_not = "the target's tokens are not the hidden states' tokens"
    if head.why_not:
        return head
    head.tokens, head.hidden, head.vocab = size_hint(math.prod(h_shape[:-1])), h_shape[-1], w_shape[0]
    head.dynamic = not all(isinstance(d, int) for d in h_shape)
    head.chain.append(linear)
    inside = set(head.chain) | {head.loss}
    transforms, returned, returned_stage = [], None, None
    for node, transform in [(linear, None)] + list(reversed(stages)):
        if transform is not None:
            transforms.append(transform)
        if all(u in inside for u in node.users):
            continue
        if returned is not None or (transform is None and node is not linear):
            head.why_not = f"the logits are read elsewhere at {node.name}"
            return head
        shape = _shape(node)
        if shape is None or len(shape) != len(h_shape) or not all(map(_same, shape, tuple(h_shape[:-1]) + (head.vocab,))):
            head.why_not = f"the logits read elsewhere ({node.name}) are not in the hidden states' shape"
            return head
        returned, returned_stage = node, len(transforms)
    head.transforms, head.returned, head.returned_stage = transforms, returned, returned_stage
    return head


def find_loss_heads(gm: fx.GraphModule) -> list[LossHead]:
    """Every cross-entropy of ``gm`` (a Dynamo graph), matched or with why not."""
    return [_match(n) for n in gm.graph.find_nodes(op="call_function", target=_CROSS_ENTROPY)]


def chunks_for(head: LossHead | Any, memory: float | int) -> int:
    """How many chunks of tokens, from the budget: a fraction ``F`` keeps each chunk's
    float32 logits at most about ``F / 2`` of all of them (at least 2 chunks, at most
    ``config.chunked_loss_head_max_chunks``); a budget in bytes at most a quarter of it."""
    most = max(2, config.chunked_loss_head_max_chunks)
    if isinstance(memory, float):
        wanted = math.ceil(2.0 / max(memory, 1e-3))
    else:
        wanted = math.ceil(head.logits_bytes / max(1, memory // 4))
    return max(2, min(most, wanted, head.tokens))


def _insertion_point(head: LossHead, inputs: list[Any]) -> fx.Node | None:
    """The node after which the chunked call goes: after its inputs and the returned logits'
    node; None where a reader of the returned logits comes before that."""
    order = {n: i for i, n in enumerate(head.loss.graph.nodes)}
    after = max([n for n in inputs if isinstance(n, fx.Node)] + ([head.returned] if head.returned else []), key=order.__getitem__)
    if head.returned is not None:
        nxt = [u for u in head.returned.users if u not in head.chain and u is not head.loss]
        if any(order[u] <= order[after] for u in nxt):
            return None
    return after


def recomputes_logits(head: LossHead, memory: float | int) -> bool:
    """Where the model returns its logits, whether the backward recomputes each chunk's (one
    more matmul of the head) rather than saving them: under a budget in bytes, or a fraction
    below ``config.chunked_loss_head_keep_logits_from``, or where a soft-cap comes before the
    returned logits' last transform."""
    if head.returned_stage is None:
        return False
    if not keeps_logits_exactly(tuple(head.transforms), head.returned_stage):
        return True
    return not isinstance(memory, float) or memory < config.chunked_loss_head_keep_logits_from


def _rewrite(gm: fx.GraphModule, head: LossHead, chunks: int, recompute: bool) -> str | None:
    """Replace ``head`` in ``gm`` by one chunked call; None, else why not."""
    h, w, b = _linear_args(cast(fx.Node, head.linear))
    after = _insertion_point(head, [h, w, b, head.target])
    if after is None:
        return "the returned logits are read before the loss's target is computed"
    spec = HeadSpec(
        transforms=tuple(head.transforms),
        returns=head.returned_stage,
        ignore_index=head.ignore_index,
        reduction=head.reduction,
        chunks=chunks,
        label_smoothing=head.label_smoothing,
        recompute=recompute,
    )
    graph = gm.graph
    with graph.inserting_after(after):
        args: tuple[Any, ...] = (h, w, b, head.target, spec)  # the spec: a constant argument
        call = graph.call_function(chunked_linear_cross_entropy, args)
    with graph.inserting_after(call):
        loss = graph.call_function(operator.getitem, (call, 1))
    head.loss.replace_all_uses_with(loss)
    if head.returned is not None:
        with graph.inserting_after(call):
            logits = graph.call_function(operator.getitem, (call, 0))
        inside = set(head.chain) | {head.loss}
        head.returned.replace_all_uses_with(logits, delete_user_cb=lambda u: u not in inside)
        logits.meta["example_value"] = _value(head.returned)
    loss.meta["example_value"] = _value(head.loss)
    for node in [head.loss, *head.chain]:
        if not node.users:
            graph.erase_node(node)
    return None


def _logits_fate(head: LossHead, recompute: bool) -> str:
    if head.returned is None:
        return "each chunk's logits saved for the plan to keep, offload or recompute"
    if recompute:
        return "the returned logits not saved: each chunk's recomputed in the backward"
    return "the returned logits saved for the backward"


def _candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """The matmuls that may be an LM head: under ``"auto"``, those whose float32 output holds
    at least ``chunked_loss_head_min_bytes``; under ``"on"``, those with the most features."""
    linears = [(n, _value(n)) for t in _LINEARS for n in gm.graph.find_nodes(op="call_function", target=t)]
    out = [(n, v) for n, v in linears if isinstance(v, torch.Tensor) and v.dim() >= 2]
    if config.chunked_loss_head == "auto":
        return [n for n, v in out if size_hint(v.numel()) * 4 >= config.chunked_loss_head_min_bytes]
    widest = max((v.shape[-1] for _, v in out), default=0)
    return [n for n, v in out if v.shape[-1] == widest]


def rewrite_loss_heads(gm: fx.GraphModule, memory: float | int) -> list[str]:
    """Under a budget of ``memory`` (the ambient budget pair's, a fraction or bytes), compute
    each loss head of ``gm`` whose float32 logits hold at least
    ``config.chunked_loss_head_min_bytes`` in chunks (:func:`chunks_for`): a cross-entropy
    that alone reads the logits by its own chunked head; any other loss that works row by row
    over the vocabulary as a region (:mod:`.loss_region`).  Logs each decision; returns the
    summaries of the heads chunked."""
    if config.chunked_loss_head == "off":
        return []
    from torch_patches._functorch._aot_autograd import loss_region

    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    heads = find_loss_heads(gm)
    lines = [_chunk_head(gm, h, memory, artifact) for h in heads if h.why_not is None and h.returned is None]
    taken = {cast(fx.Node, h.linear) for h in heads if h.why_not is None and h.returned is None}
    for region, chunks in loss_region.rewrite_regions(gm, _candidates(gm), taken, lambda region: chunks_for(region, memory)):
        line = loss_region.summary(region, chunks) if region.why_not is None else None
        (log.warning if region.failed else artifact.debug)(
            "%s: %s", region.describe(), line or f"not chunked as a region: {region.why_not}"
        )
        lines.append(line)
    lines += [_chunk_head(gm, h, memory, artifact) for h in heads if (h.why_not or h.returned) is not None and h.linear not in taken]
    done = [line for line in lines if line is not None]
    found = compile_facts.facts()
    if done:
        gm.recompile()
        if found is not None:
            found.loss_heads.extend(done)
    return done


def _chunk_head(gm: fx.GraphModule, head: LossHead, memory: float | int, artifact: logging.Logger) -> str | None:
    """Rewrite one cross-entropy head, logging the decision: its summary, or None."""
    why = head.why_not
    if why is None and config.chunked_loss_head == "auto" and head.logits_bytes < config.chunked_loss_head_min_bytes:
        why = f"its float32 logits hold {head.logits_bytes} B < chunked_loss_head_min_bytes"
    chunks = chunks_for(head, memory) if why is None else 0
    recompute = recomputes_logits(head, memory) if why is None else False
    if why is None:
        why = _rewrite(gm, head, chunks, recompute)
    if why is not None:
        artifact.debug("%s: not chunked: %s", head.describe(), why)
        return None
    line = summary(head, chunks, recompute)
    artifact.debug("%s", line)
    return line


def summary(head: LossHead, chunks: int, recompute: bool) -> str:
    """A chunked head in words, for the plan's summary, the log and ``report()``: its
    chunks, the (tokens x vocabulary) bytes it never saves whole, and the matmul a
    recomputation of the returned logits adds (estimated on the budget's cost model)."""
    value = _value(head.linear)
    rates = Rates.for_device(value.device if isinstance(value, torch.Tensor) else torch.device("cpu"))
    extra = ""
    if recompute:
        flops = 2 * head.tokens * head.vocab * head.hidden
        extra = f"; one more matmul of the head in the backward, est {flops / rates.flops_per_ms:.3f} ms"
    chunk = head.logits_bytes // max(1, chunks)
    tokens = f"{head.tokens} tokens" + (" at the length compiled for, symbolic" if head.dynamic else "")
    return (
        f"{head.describe()} in {chunks} chunks of tokens ({tokens} x {head.vocab} vocabulary): the "
        f"unchunked head's float32 (tokens x vocabulary) tensors hold {head.logits_bytes} B each, a chunk's "
        f"{chunk} B; {_logits_fate(head, recompute)}{extra}"
    )
