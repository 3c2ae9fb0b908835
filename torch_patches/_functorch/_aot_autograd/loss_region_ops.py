"""The ops a loss region may hold, and how each moves the tokens (:mod:`.loss_region`).

:class:`RegionBuilder` walks the torch-level graph Dynamo records from an LM head's matmul,
op by op, keeping for each value where its tokens are (:class:`Rows`: a dimension, possibly
merged with static ones by a view), and writes the graph one chunk of tokens runs: each op
as it is (its other operands cut with the tokens where they have them, read whole where
they broadcast), sums and means over the tokens as the chunk's part of them, a reduced loss
(``cross_entropy``, ``nll_loss``, ``kl_div``) as a sum divided by the whole count.  An op it
does not know, or one that reads a token's row with another's, raises :class:`NotRowWise`
with the op and why.  Compile time only.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["LossRegion", "Rows", "NotRowWise", "RegionBuilder"]

_LINEARS = (torch._C._nn.linear, F.linear)

_ELEMENTWISE_FUNCTIONS = frozenset(
    {
        operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
        torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.log,
        torch.log1p, torch.expm1, torch.tanh, torch.sigmoid, torch.abs, torch.square, torch.sqrt,
        torch.rsqrt, torch.clamp, torch.clip, torch.minimum, torch.maximum, torch.where,
        torch.masked_fill, F.logsigmoid, F.softplus, F.relu, F.silu, torch._C._nn.log_sigmoid,
        torch._C._nn.softplus,
    }
)  # fmt: skip
_ELEMENTWISE_METHODS = frozenset(
    {
        "float", "double", "half", "bfloat16", "to", "type_as", "exp", "log", "log1p", "expm1",
        "tanh", "sigmoid", "abs", "neg", "pow", "sqrt", "rsqrt", "clamp", "clamp_min", "clamp_max",
        "clip", "square", "masked_fill", "add", "sub", "mul", "div", "contiguous", "detach",
        "__add__", "__sub__", "__mul__", "__truediv__", "__rsub__", "__radd__", "__rmul__",
    }
)  # fmt: skip
#: Ops over given dimensions: name -> (positional parameters after the input, reduces).
_OVER_DIMS: dict[str, tuple[tuple[str, ...], bool]] = {
    "sum": (("dim", "keepdim"), True),
    "mean": (("dim", "keepdim"), True),
    "amax": (("dim", "keepdim"), True),
    "amin": (("dim", "keepdim"), True),
    "logsumexp": (("dim", "keepdim"), True),
    "log_softmax": (("dim",), False),
    "softmax": (("dim",), False),
}
_SUMS_OVER_TOKENS = ("sum", "mean")
_TORCH_OVER_DIMS = {getattr(torch, n): n for n in _OVER_DIMS} | {F.log_softmax: "log_softmax", F.softmax: "softmax"}
_LOSSES = {
    F.cross_entropy: inspect.signature(F.cross_entropy),
    F.nll_loss: inspect.signature(F.nll_loss),
    F.kl_div: inspect.signature(F.kl_div),
}
_VIEWS = ("view", "reshape", "flatten")


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where a value's tokens are: its dimension ``dim`` holds ``outer x tokens x inner``."""

    dim: int
    outer: int = 1
    inner: int = 1

    def where(self) -> tuple[int, int, int]:
        return (self.dim, self.outer, self.inner)


class NotRowWise(Exception):
    """Why a region is not one: the op and the reason."""


@dataclasses.dataclass
class LossRegion:
    """A region found at one LM head, or why not."""

    linear: fx.Node
    #: The node whose value is the region's logits (the matmul, or its slice of the tokens).
    start: fx.Node | None = None
    #: The index of the tokens the region's logits take (a slice straight after the matmul).
    head_index: tuple[Any, ...] | None = None
    axis: int = 0
    nodes: list[fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    #: The region's operands: a node of the graph, or ``(op, args)`` made before the call.
    operands: list[tuple[Any, Rows | None]] = dataclasses.field(default_factory=list)
    graph: fx.Graph | None = None
    tokens: int = 0
    all_tokens: int = 0
    vocab: int = 0
    dynamic: bool = False
    why_not: str | None = None
    #: The matcher itself failed (a graph it does not understand): warned, not only logged.
    failed: bool = False
    #: Nodes computed under ``no_grad`` that the region runs on each chunk too (a teacher's
    #: head and what it does to its logits): their result detached in the region.
    pulled: list[fx.Node] = dataclasses.field(default_factory=list)

    @property
    def logits_bytes(self) -> int:
        return self.all_tokens * self.vocab * 4

    def describe(self) -> str:
        ends = ", ".join(n.name for n in self.outputs)
        return f"loss region {self.linear.name} -> {ends or '?'}"


def _grad_modes(graph: fx.Graph) -> dict[fx.Node, bool | None]:
    """The grad mode each node of a Dynamo graph runs under: what its last
    ``torch._C._set_grad_enabled`` set (None: the caller's, before any)."""
    modes: dict[fx.Node, bool | None] = {}
    mode: bool | None = None
    for node in graph.nodes:
        modes[node] = mode
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled and isinstance(node.args[0], bool):
            mode = node.args[0]
    return modes


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _same(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or symbolic) are known equal without a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _dims(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """``dim`` (an int, a sequence of them, or None for all) normalised, or None if not
    constant."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return None
    if not dims:  # an empty list reduces every dimension, as None does
        return tuple(range(ndim))
    return tuple(sorted(d % max(ndim, 1) for d in dims))


def _same_shape(a: Any, b: Any, but_last: bool = False) -> bool:
    """Whether two nodes' tensors are known to have the same shape (but their last sizes)."""
    va, vb = _value(a), _value(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dim() != vb.dim():
        return False
    sa, sb = (va.shape[:-1], vb.shape[:-1]) if but_last else (va.shape, vb.shape)
    return all(map(_same, sa, sb))


def _row_op(node: fx.Node) -> bool:
    """Whether ``node`` is an op a region may hold (the rest is checked as it is taken in)."""
    t = node.target
    if node.op == "call_method":
        return t in _ELEMENTWISE_METHODS or t in _OVER_DIMS or t in _VIEWS or t in ("unsqueeze", "squeeze")
    return t in _ELEMENTWISE_FUNCTIONS or t in _TORCH_OVER_DIMS or t in (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze)


def _static(sizes: Any) -> int:
    if not all(isinstance(s, int) for s in sizes):
        raise NotRowWise("a symbolic size merged with the tokens")
    return math.prod(sizes)


def _linear_args(linear: fx.Node) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of a ``linear`` call."""
    args = list(linear.args) + [None] * (3 - len(linear.args))
    return args[0], linear.kwargs.get("weight", args[1]), linear.kwargs.get("bias", args[2])


class RegionBuilder:
    """Walks the graph after the head's matmul, building the region's chunk graph."""

    def __init__(self, region: LossRegion, modes: dict[fx.Node, bool | None] | None = None) -> None:
        self.r = region
        self.modes = modes
        self.graph = fx.Graph()
        self.tokens = self.graph.placeholder("tokens")
        self.x = self.graph.placeholder("logits")
        self.env: dict[fx.Node, fx.Node] = {}
        self.rows: dict[fx.Node, Rows] = {}
        self.ended: set[fx.Node] = set()
        #: What the graph computes from the region's outputs (no region op may read it).
        self.tainted: set[fx.Node] = set()
        self.placeholders: dict[Any, fx.Node] = {}
        self.last = self.x
        self._downstream: set[fx.Node] | None = None

    # operands --------------------------------------------------------------------------
    def operand(self, key: Any, rows: Rows | None) -> fx.Node:
        slot = (key, rows)
        if slot not in self.placeholders:
            self.r.operands.append(slot)
            with self.graph.inserting_after(self.last):
                self.last = self.placeholders[slot] = self.graph.placeholder(f"operand_{len(self.r.operands)}")
        return self.placeholders[slot]

    def aligned(self, ext: fx.Node, out_ndim: int, rows: Rows, size: Any) -> fx.Node:
        """An operand read beside a value whose tokens are ``rows`` (broadcast from the right)."""
        value = _value(ext)
        if not isinstance(value, torch.Tensor):
            raise NotRowWise(f"{ext.name} is not a tensor")
        e = value.dim() - (out_ndim - rows.dim)
        if e < 0 or _same(value.shape[e], 1):
            return self.operand(ext, None)
        if not _same(value.shape[e], size):
            raise NotRowWise(f"{ext.name} {tuple(value.shape)} does not line up with the tokens")
        return self.pull(ext) or self.operand(ext, Rows(e, rows.outer, rows.inner))

    def pull(self, ext: fx.Node) -> fx.Node | None:
        """Where ``ext`` is computed row by row from a tensor of the logits' shape (a
        teacher's logits; or its head's matmul, which then is chunked too) and nothing but the
        region reads what it is computed through, that computation run on each chunk as well
        (no (tokens x vocabulary) operand made whole): ``ext``'s chunk, else None."""
        chain, node = [], ext
        while node.op in ("call_function", "call_method") and _row_op(node):
            tensors = [a for a in node.all_input_nodes if isinstance(_value(a), torch.Tensor)]
            if len(tensors) != 1:
                return None
            chain.append(node)
            node = tensors[0]
        linear = node.op == "call_function" and node.target in _LINEARS
        if not chain or not _same_shape(node, self.r.start):
            return None
        pulled = chain + ([node] if linear else [])
        inside = set(pulled) | self.downstream()
        if any(u not in inside for n in pulled for u in n.users):
            return None
        if linear:
            h, w, b = _linear_args(node)
            if not _same_shape(h, self.r.start, but_last=True):
                return None
            args = [self.operand(h, Rows(self.r.axis)), self.operand(w, None), self.operand(b, None) if b is not None else None]
            self.emit(node, F.linear, args, {}, Rows(self.r.axis))
        else:
            self.env[node], self.rows[node] = self.operand(node, Rows(self.r.axis)), Rows(self.r.axis)
        for n in reversed(chain):
            self.step(n)
        if not linear:
            del self.env[node], self.rows[node]
        if self.modes is not None and any(self.modes[n] is False for n in pulled):
            # A chain of one input: from a node run under no_grad on, nothing takes a gradient.
            self.r.pulled.extend(pulled)
            self.env[ext] = self.graph.call_method("detach", (self.env[ext],))
        return self.env[ext]

    def downstream(self) -> set[fx.Node]:
        """Every node the region's logits reach (what may become the region)."""
        if self._downstream is None:
            seen, todo = set(), [cast(fx.Node, self.r.start)]
            while todo:
                n = todo.pop()
                for u in n.users:
                    if u not in seen:
                        seen.add(u)
                        todo.append(u)
            self._downstream = seen
        return self._downstream

    def arg(self, a: Any, out_ndim: int, rows: Rows, size: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.env[a] if a in self.env else self.aligned(a, out_ndim, rows, size)
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x, out_ndim, rows, size) for x in a)
        return a

    # ops --------------------------------------------------------------------------------
    def step(self, node: fx.Node) -> None:
        ins = [a for a in node.all_input_nodes if a in self.rows]
        if any(a in self.ended or a in self.tainted for a in node.all_input_nodes):
            raise NotRowWise(f"{node.format_node()} reads a sum over the tokens beside them")
        out = _value(node)
        first = ins[0]
        rows = self.rows[first]
        name = node.target if node.op == "call_method" else None
        fn = node.target if node.op == "call_function" else None
        if fn in _ELEMENTWISE_FUNCTIONS or name in _ELEMENTWISE_METHODS or (fn in (torch.min, torch.max) and self._binary(node)):
            self.elementwise(node, ins, out)
        elif name in _OVER_DIMS or fn in _TORCH_OVER_DIMS:
            self.over_dims(node, cast(str, name or _TORCH_OVER_DIMS[fn]), rows)
        elif fn in _LOSSES:
            self.loss(node, cast(Callable[..., Any], fn), rows)
        elif fn is torch.gather or name == "gather":
            self.gather(node, rows)
        elif name in ("unsqueeze", "squeeze") or fn in (torch.unsqueeze, torch.squeeze):
            self.squeeze(node, cast(str, name or cast(Callable[..., Any], fn).__name__), rows)
        elif name in _VIEWS or fn in (torch.reshape, torch.flatten):
            self.view(node, rows)
        elif fn is operator.getitem:
            self.getitem(node, rows)
        elif fn in (torch.stack, torch.cat):
            self.stack(node, cast(Callable[..., Any], fn))
        else:
            raise NotRowWise(f"{node.format_node()}: not an op known to work on each token's row")

    @staticmethod
    def _binary(node: fx.Node) -> bool:
        return len(node.args) == 2 and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args)

    def emit(self, node: fx.Node, target: Any, args: Any, kwargs: Any, rows: Rows | None) -> fx.Node:
        op = "call_method" if isinstance(target, str) else "call_function"
        new = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        self.env[node] = new
        if rows is None:
            self.ended.add(node)
            self.r.outputs.append(node)
        else:
            self.rows[node] = rows
            self.r.nodes.append(node)
        return new

    def elementwise(self, node: fx.Node, ins: list[fx.Node], out: Any) -> None:
        if not isinstance(out, torch.Tensor):
            raise NotRowWise(f"{node.format_node()} is not a tensor")
        base = ins[0]
        rows = self.rows[base]
        from_right = _value(base).dim() - rows.dim
        for a in ins[1:]:
            if _value(a).dim() - self.rows[a].dim != from_right or (self.rows[a].outer, self.rows[a].inner) != (rows.outer, rows.inner):
                raise NotRowWise(f"{node.format_node()} reads two values whose tokens do not line up")
        at = Rows(out.dim() - from_right, rows.outer, rows.inner)
        size = out.shape[at.dim]
        args = [self.arg(a, out.dim(), at, size) for a in node.args]
        kwargs = {k: self.arg(v, out.dim(), at, size) for k, v in node.kwargs.items()}
        self.emit(node, node.target, args, kwargs, at)

    def bind(self, node: fx.Node, names: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
        args = list(node.args)
        kwargs = dict(node.kwargs)
        src = kwargs.pop("input", None) if not args else args.pop(0)
        for n, a in zip(names, args):
            kwargs[n] = a
        if len(args) > len(names):
            raise NotRowWise(f"{node.format_node()}: arguments not understood")
        return src, kwargs

    def over_dims(self, node: fx.Node, name: str, rows: Rows) -> None:
        names, reduces = _OVER_DIMS[name]
        functional = node.target in (F.log_softmax, F.softmax)  # F's take a _stacklevel before dtype
        src, kw = self.bind(node, names + (("_stacklevel", "dtype") if functional else ("dtype",)))
        ndim = _value(src).dim()
        dims = _dims(kw.get("dim"), ndim)
        if dims is None or (not reduces and len(dims) != 1):
            raise NotRowWise(f"{node.format_node()}: its dimensions are not constants")
        keep = bool(kw.get("keepdim", False))
        new_kw = {k: v for k, v in kw.items() if k != "_stacklevel"}
        x = self.env[src]
        if rows.dim not in dims:
            dim = rows.dim if (not reduces or keep) else rows.dim - sum(d < rows.dim for d in dims)
            self.emit(node, name, [x], new_kw, Rows(dim, rows.outer, rows.inner))
            return
        if name not in _SUMS_OVER_TOKENS:
            raise NotRowWise(f"{node.format_node()} works across the tokens")
        new_kw["dim"] = dims
        total = self.graph.call_method("sum", (x,), new_kw)
        if name == "mean":
            others = [_value(src).shape[d] for d in dims if d != rows.dim]
            count = self.graph.call_function(operator.mul, (self.tokens, _static(others) * rows.outer * rows.inner))
            total = self.graph.call_function(operator.truediv, (total, count))
        self.env[node] = total
        self.ended.add(node)
        self.r.outputs.append(node)

    def loss(self, node: fx.Node, fn: Callable[..., Any], rows: Rows) -> None:
        try:
            bound = _LOSSES[fn].bind(*node.args, **node.kwargs)
        except TypeError as e:
            raise NotRowWise(f"{node.format_node()}: {e}") from None
        args = {**{k: p.default for k, p in _LOSSES[fn].parameters.items()}, **bound.arguments}
        if args.get("size_average") is not None or args.get("reduce") is not None:
            raise NotRowWise(f"{node.format_node()}: the deprecated size_average / reduce")
        if args.get("weight") is not None:
            raise NotRowWise(f"{node.format_node()}: class weights")
        src, other = args["input"], args["target"]
        value = _value(src)
        reduction = args["reduction"]
        if fn is F.kl_div:
            per_token, target_rows = rows, rows
        else:
            if value.dim() < 2 or rows.dim == 1:
                raise NotRowWise(f"{node.format_node()}: its classes are not the vocabulary")
            per_token = Rows(rows.dim - (rows.dim > 1), rows.outer, rows.inner)
            target_rows = per_token
            if other in self.env:
                raise NotRowWise(f"{node.format_node()}: its target is computed from the logits")
        if src not in self.rows:  # kl_div's target is the logits', its input not
            if fn is not F.kl_div or not _same_shape(src, other):
                raise NotRowWise(f"{node.format_node()}: its input is not computed from the logits")
            x = self.pull(src) or self.operand(src, rows)
        else:
            x = self.env[src]
        if other in self.env:
            if self.rows[other] != rows:
                raise NotRowWise(f"{node.format_node()}: its operands' tokens do not line up")
            t = self.env[other]
        else:
            t = self.pull(other) or self.operand(other, target_rows)
            if other in self.rows and self.rows[other] != target_rows:
                raise NotRowWise(f"{node.format_node()}: its operands' tokens do not line up")
        kw = {k: v for k, v in args.items() if k not in ("input", "target", "weight", "size_average", "reduce", "reduction")}
        if reduction == "none":
            self.emit(node, fn, [x, t], {**kw, "reduction": "none"}, per_token)
            return
        total = self.graph.call_function(fn, (x, t), {**kw, "reduction": "sum"})
        if reduction == "mean" and fn is not F.kl_div:
            ii = args["ignore_index"]
            if not isinstance(ii, int):
                raise NotRowWise(f"{node.format_node()}: an ignore_index that is not a constant")
            total = self.graph.call_function(operator.truediv, (total, self.operand(("count", other, ii), None)))
        elif reduction in ("mean", "batchmean"):
            dims = range(value.dim()) if reduction == "mean" else [0]
            others = [value.shape[d] for d in dims if d != rows.dim]
            per = _static(others) * (rows.outer * rows.inner if rows.dim in dims else 1)
            count: Any = self.graph.call_function(operator.mul, (self.tokens, per)) if rows.dim in dims else per
            total = self.graph.call_function(operator.truediv, (total, count))
        elif reduction != "sum":
            raise NotRowWise(f"{node.format_node()}: reduction={reduction!r}")
        self.env[node] = total
        self.ended.add(node)
        self.r.outputs.append(node)

    def gather(self, node: fx.Node, rows: Rows) -> None:
        src, kw = self.bind(node, ("dim", "index"))
        value = _value(src)
        dim, index = kw.get("dim"), kw.get("index")
        if src not in self.rows:
            raise NotRowWise(f"{node.format_node()}: gathers at indices computed from the logits")
        if not isinstance(dim, int) or dim % value.dim() == rows.dim or index in self.env or not isinstance(index, fx.Node):
            raise NotRowWise(f"{node.format_node()}: not a gather over the vocabulary at labels")
        idx = _value(index)
        if idx.dim() != value.dim() or not _same(idx.shape[rows.dim], value.shape[rows.dim]):
            raise NotRowWise(f"{node.format_node()}: its index does not line up with the tokens")
        self.emit(node, torch.gather, [self.env[src], dim, self.operand(index, rows)], {}, rows)

    def squeeze(self, node: fx.Node, name: str, rows: Rows) -> None:
        src, kw = self.bind(node, ("dim",))
        dim = kw.get("dim")
        if not isinstance(dim, int):
            raise NotRowWise(f"{node.format_node()}: no constant dimension")
        if name == "unsqueeze":
            d = dim % (_value(src).dim() + 1)
            at = rows.dim + (d <= rows.dim)
        else:
            d = dim % _value(src).dim()
            if d == rows.dim:
                raise NotRowWise(f"{node.format_node()} squeezes the tokens")
            at = rows.dim - (d < rows.dim)
        self.emit(node, name, [self.env[src], dim], {}, dataclasses.replace(rows, dim=at))

    def view(self, node: fx.Node, rows: Rows) -> None:
        src = node.args[0] if node.args else node.kwargs["input"]
        before, after = tuple(_value(src).shape), tuple(_value(node).shape)
        k = len(before) - len(after)
        x = self.env[cast(fx.Node, src)]
        if k == 0 and all(map(_same, before, after)):
            self.env[node], self.rows[node] = x, rows
            self.r.nodes.append(node)
            return
        for a in range(rows.dim + 1):
            b = a + k
            if k < 0 or b < rows.dim or b >= len(before):
                continue
            if all(map(_same, before[:a], after[:a])) and all(map(_same, before[b + 1 :], after[a + 1 :])):
                merged = Rows(a, rows.outer * _static(before[a : rows.dim]), rows.inner * _static(before[rows.dim + 1 : b + 1]))
                self.emit(node, "flatten", [x, a, b], {}, merged)
                return
        raise NotRowWise(f"{node.format_node()}: a view that does not merge the tokens with static dimensions")

    def getitem(self, node: fx.Node, rows: Rows) -> None:
        src, index = node.args
        value = _value(src)
        if not isinstance(value, torch.Tensor):
            raise NotRowWise(f"{node.format_node()}: not an index of a tensor")
        idx = index if isinstance(index, tuple) else (index,)
        if sum(i is Ellipsis for i in idx) > 1 or any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in idx):
            raise NotRowWise(f"{node.format_node()}: an index by tensors")
        consumed = sum(isinstance(i, (int, slice)) for i in idx)
        expanded: list[Any] = []
        for i in idx:
            expanded.extend([slice(None)] * (value.dim() - consumed) if i is Ellipsis else [i])
        dim, out, at = 0, 0, None
        for i in expanded:
            if i is not None and dim == rows.dim:
                if i != slice(None):
                    raise NotRowWise(f"{node.format_node()} indexes the tokens")
                at = out
            dim += i is not None
            out += not isinstance(i, int)
        if at is None:
            at = out + rows.dim - dim
        self.emit(node, operator.getitem, [self.env[cast(fx.Node, src)], index], {}, dataclasses.replace(rows, dim=at))

    def stack(self, node: fx.Node, fn: Callable[..., Any]) -> None:
        items = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(items, (list, tuple)) or not all(i in self.env for i in items) or not isinstance(dim, int):
            raise NotRowWise(f"{node.format_node()}: joins values that are not all the logits'")
        rows = {self.rows[i] for i in items}
        if len(rows) != 1:
            raise NotRowWise(f"{node.format_node()}: joins values whose tokens do not line up")
        (r,) = rows
        d = dim % _value(node).dim()
        if fn is torch.cat and d == r.dim:
            raise NotRowWise(f"{node.format_node()} joins along the tokens")
        at = r.dim + (d <= r.dim) if fn is torch.stack else r.dim
        self.emit(node, fn, [[self.env[i] for i in items], dim], {}, dataclasses.replace(r, dim=at))
