"""How much error each saved tensor tolerates, read off the backward graph.

The rule is ``torch_patches/hooks/numerics.py``'s allowlist; this module applies it to a
partitioned backward graph.  The backward is linear in its incoming gradients (the
``tangents_*`` placeholders): a node that depends on a tangent computes a gradient, every
other node recomputes a function of saved tensors.  A saved tensor's error therefore does
harm only on its way from the placeholder to the nodes that combine it with a gradient.  The
walk follows that way:

* at each node reading the value (through a view, a cast, a product, a bounded function...)
  the argument it is read as must have an entry, else the tensor stays exact;
* where the value meets a gradient (a node that depends on a tangent) the entry's level is
  what it tolerates there, and the path ends (the result is a gradient, linear in everything
  after); a matmul there tolerates ``"fp8"`` only when its result is a parameter's gradient
  (it reaches the graph's output through data movement and accumulation alone, at an input
  the caller keeps: the sum over tokens averages the error), else ``"int8"``;
* a node whose result is not floating point (a mask) and the graph's output end a path too;
* any other node carries the error on to its result, and the walk follows its users.

The tensor's tolerance is the least level met.  So an attention's query, key and value,
read by its backward kernel next to the incoming gradient, take that kernel's entries; its
log-sum-exp, which has none, stays exact; RoPE angles reach ``cos``/``sin`` (no entry) and
stay exact; a GELU input reaches ``erf`` and ``exp(-x*x/2)``, which carry it on, and meets
the gradient in a product (``"int8"``); a linear layer's input meets it in ``x^T @ dy``
(``"fp8"``).

A few readers are decided from the graph, not from a table entry: ``pow`` by a constant
exponent (in [1, 3] its error stays proportional; roots and inverses amplify it near
zero), and ``exp`` in three bounded forms (``exp(c * x*x)`` with ``c < 0``, GELU's
backward; ``exp`` read only as ``1 / (a + exp(.))`` or ``y / (a + exp(.))`` with
``a > 0``, a sigmoid, SiLU's backward; and ``exp`` of a log-softmax output, a
probability).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches._functorch._aot_autograd.utils import is_incoming_gradient
from torch_patches.hooks import numerics
from torch_patches.hooks.numerics import BF16, EXACT, FP8, INT8

#: The most nodes one saved tensor's walk visits before it gives up (and keeps it exact).
MAX_NODES = 512

#: ``pow`` by a constant exponent in this range keeps an error proportional (x^3's relative
#: error is 3 times x's); below 1 (roots) or negative (inverses) it grows without bound
#: near zero.
POW_RANGE = (1.0, 3.0)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How much error a saved tensor tolerates, and why.

    ``level``: ``"exact"``, ``"bf16"``, ``"int8"`` or ``"fp8"`` (``numerics.LEVELS``);
    ``why``: what limits it (None when nothing does); ``readers``: ``"op[arg]"`` for every
    argument the walk met, in graph order."""

    level: str
    why: str | None
    readers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BackwardFacts:
    """What the walk needs of one backward graph, computed once per graph."""

    #: Nodes that depend on an incoming gradient (a ``tangents_*`` input).
    gradients: set[fx.Node]
    #: Output nodes' argument positions that are gradients of inputs the caller keeps
    #: (parameters, leaves): accumulated, not passed on to earlier layers.
    accumulated: frozenset[int] = frozenset()


def tangent_dependent(bw_g: fx.Graph) -> set[fx.Node]:
    """The backward nodes that depend on an incoming gradient (a ``tangents_*`` input)."""
    out: set[fx.Node] = set()
    for node in bw_g.nodes:
        if is_incoming_gradient(node):
            out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def producer_verdict(saved: fx.Node) -> tuple[str, str] | None:
    """``(level, why)`` when what computed ``saved`` makes it a statistic, else None."""
    if saved.op != "call_function":
        return None
    if saved.target is operator.getitem and isinstance(saved.args[0], fx.Node):
        src = saved.args[0]
        index = saved.args[1]
        name = numerics.base_name(str(src.target))
        if isinstance(index, int) and index > 0 and name not in numerics.DATA_OUTPUTS:
            return EXACT, f"output {index} of {src.target} (statistics)"
        return None
    name = numerics.base_name(str(saved.target))
    if name in numerics.STATISTICS:
        return EXACT, f"produced by {saved.target} (statistics)"
    return None


def verdict(saved: fx.Node, bw_input: fx.Node | None, facts: BackwardFacts | set[fx.Node]) -> Verdict:
    """The :class:`Verdict` of ``saved`` (a forward node) read in the backward as
    ``bw_input``; ``facts``: the backward graph's :class:`BackwardFacts` (or just its
    :func:`tangent_dependent` nodes)."""
    if not isinstance(facts, BackwardFacts):
        facts = BackwardFacts(facts)
    found = producer_verdict(saved)
    if found is not None:
        return Verdict(found[0], found[1], ())
    if bw_input is None:
        return Verdict(EXACT, "not read by the backward", ())
    try:
        table = numerics.entries()
    except ValueError as e:  # a level the allowlist does not know, in config.numerics_allowlist
        raise SavedTensorsHookConfigError(str(e)) from e
    level, why = FP8, None
    readers: list[str] = []
    seen: set[fx.Node] = set()
    todo = [bw_input]
    while todo:
        value = todo.pop()
        for user in value.users:
            if len(seen) >= MAX_NODES:
                return Verdict(EXACT, f"read through more than {MAX_NODES} backward nodes", tuple(readers))
            meets = user.op == "output" or user in facts.gradients
            for arg in _args_reading(user, value):
                got, label = _reader_level(table, user, arg, (saved, bw_input))
                if meets and got == FP8 and numerics.is_matmul(user.target) and not _weight_gradient(user, facts):
                    got, label = INT8, f"{label}(an activation's gradient)"
                readers.append(label)
                if got != EXACT and not meets:
                    continue  # carried on to the result: what it meets decides
                if numerics.rank(got) < numerics.rank(level):
                    level = got
                    why = f"read as {label}" + (" (not on the numerics allowlist)" if got == EXACT else f" (tolerates {got})")
            if user in seen:
                continue
            seen.add(user)
            if meets or _ends_path(user):
                continue
            todo.extend(_continue_from(user))
    return Verdict(level, why, tuple(dict.fromkeys(readers)))


#: Ops a weight gradient may pass through on its way to the graph's output.
_ACCUMULATE = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "clone",
        "contiguous",
        "_to_copy",
        "convert_element_type",
        "add",
        "sum",
        "squeeze",
        "unsqueeze",
        "expand",
        "alias",
    }
)


def _weight_gradient(matmul: fx.Node, facts: BackwardFacts) -> bool:
    """Whether ``matmul``'s result is only accumulated into outputs that are gradients of
    inputs the caller keeps (parameters, leaves)."""
    if not facts.accumulated:
        return False
    todo, seen = [matmul], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                outs = cast("Sequence[Any]", user.args[0])  # the graph's outputs
                positions = [i for i, o in enumerate(outs) if o is node]
                if not positions or not set(positions) <= facts.accumulated:
                    return False
                continue
            if numerics.base_name(str(user.target)) not in _ACCUMULATE:
                return False
            todo.append(user)
    return True


def _ends_path(node: fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    # A mask or an index carries no error on; a node without metadata is followed.
    return bool(tensors) and not any(v.is_floating_point() for v in tensors)


def _continue_from(node: fx.Node) -> list[fx.Node]:
    """Where the walk goes on after ``node`` (normally ``node`` itself: its users read it).
    A bounded ``exp`` form continues from the bounded result, not from the ``exp``."""
    if node.target is torch.ops.aten.exp.default:
        outer = _logistic_results(node)
        if outer is not None:
            return outer
    return [node]


def _args_reading(user: fx.Node, value: fx.Node) -> list[str]:
    """The names of the arguments of ``user`` that are (or hold) ``value``."""
    if user.op == "output":
        return ["output"]
    if user.target is operator.getitem:
        return ["getitem"]
    schema = getattr(user.target, "_schema", None)
    names: list[str] = []
    for i, a in enumerate(user.args):
        if _holds(a, value):
            if schema is not None and i < len(schema.arguments):
                names.append(schema.arguments[i].name)
            else:
                names.append(str(i))
    for k, a in user.kwargs.items():
        if _holds(a, value):
            names.append(k)
    return names or ["?"]


def _holds(arg: Any, value: fx.Node) -> bool:
    if arg is value:
        return True
    if isinstance(arg, (list, tuple)):
        return any(_holds(a, value) for a in arg)
    return False


def _reader_level(table: Any, user: fx.Node, arg: str, origin: tuple[fx.Node, fx.Node]) -> tuple[str, str]:
    """``(level, "op[arg]")`` of one argument of one reader; ``origin``: the saved tensor's
    forward node and backward input."""
    if user.op == "output":
        return FP8, "output"
    if user.target is operator.getitem:
        return FP8, "getitem"
    label = f"{_name(user.target)}[{arg}]"
    aten = torch.ops.aten
    if user.target is aten.pow.Tensor_Scalar:
        exponent = user.args[1] if len(user.args) > 1 else user.kwargs.get("exponent")
        p = _number(exponent)
        ok = p is not None and POW_RANGE[0] <= p <= POW_RANGE[1]
        return (INT8 if ok else EXACT), f"{label}({exponent})"
    if user.target is aten.exp.default:
        form = _bounded_exp(user, origin)
        return (INT8, f"{label}({form})") if form else (EXACT, label)
    level = numerics.lookup(table, user.target, arg)
    return (level if level is not None else EXACT), label


def _name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def _number(arg: Any) -> float | None:
    return float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


# ------------------------------------------------------------------- bounded exp

#: Names of the bounded exp forms (in readers' labels).
NEGATIVE_SQUARE = "-x^2"
LOGISTIC = "logistic"
LOG_PROBABILITY = "log-probability"


def _bounded_exp(exp: fx.Node, origin: tuple[fx.Node, fx.Node]) -> str | None:
    arg = exp.args[0]
    if _negative_square(arg):
        return NEGATIVE_SQUARE
    if _logistic_results(exp) is not None:
        return LOGISTIC
    if _log_probability(arg, origin):
        return LOG_PROBABILITY
    return None


def _square(node: Any) -> bool:
    """``x * x``, ``x ** 2``, or a positive multiple of one."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    aten = torch.ops.aten
    if node.target is aten.mul.Tensor and node.args[0] is node.args[1]:
        return True
    if node.target is aten.pow.Tensor_Scalar and _number(node.args[1]) == 2.0:
        return True
    if node.target in (aten.mul.Tensor, aten.mul.Scalar):
        a, b = node.args[:2]
        c = _number(b) if _number(b) is not None else _number(a)
        return c is not None and c > 0 and _square(a if _number(b) is not None else b)
    return False


def _negative_square(node: Any) -> bool:
    """``-(x * x)``, ``c * x * x`` or ``x * x / c`` with ``c < 0``: a non-positive exponent
    whose exp has an error bounded by a constant times x's relative error (at most 2/e)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    aten = torch.ops.aten
    if node.target is aten.neg.default:
        return _square(node.args[0])
    if node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        a, b = node.args[:2]
        cb, ca = _number(b), _number(a)
        if cb is not None:
            return cb < 0 and _square(a)
        is_mul = node.target in (aten.mul.Tensor, aten.mul.Scalar)
        return is_mul and ca is not None and ca < 0 and _square(b)
    return False


def _logistic_results(exp: fx.Node) -> list[fx.Node] | None:
    """The nodes ``1 / (a + exp)`` / ``y / (a + exp)`` (``a > 0``) when ``exp`` is read only
    through them (a sigmoid: a factor in (0, 1/a) whose error is bounded whatever the
    exponent's), else None."""
    aten = torch.ops.aten
    if not exp.users:
        return None
    out: list[fx.Node] = []
    for add in exp.users:
        if add.target not in (aten.add.Tensor, aten.add.Scalar):
            return None
        others = [a for a in add.args[:2] if a is not exp]
        offset = _number(others[0]) if len(others) == 1 else None
        if offset is None or offset <= 0:
            return None
        if not add.users:
            return None
        for use in add.users:
            inverse = use.target is aten.reciprocal.default or (
                use.target in (aten.div.Tensor, aten.div.Scalar) and use.args[1] is add and use.args[0] is not add
            )
            if not inverse:
                return None
            out.append(use)
    return out


def _log_probability(node: Any, origin: tuple[fx.Node, fx.Node]) -> bool:
    """A log-softmax output, through views: the saved tensor itself when the forward
    computed it with ``_log_softmax``, or a ``_log_softmax`` of the backward.  ``exp`` of it
    is a probability ``p``; an error ``d`` of the log-probability moves it by ``p * d``,
    and ``p * |log p| <= 1/e``."""
    saved, bw_input = origin
    while isinstance(node, fx.Node) and node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    log_softmax = (torch.ops.aten._log_softmax.default, torch.ops.aten.log_softmax.int)
    if node is bw_input:
        return saved.op == "call_function" and saved.target in log_softmax
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in log_softmax


def reader_ops(readers: tuple[str, ...]) -> tuple[str, ...]:
    """The ops of ``readers`` labels, without the argument: ``"aten.pow.Tensor_Scalar(3)"``
    for ``"aten.pow.Tensor_Scalar[self](3)"``."""
    out = []
    for label in readers:
        head, bracket, rest = label.partition("[")
        out.append(head + rest.partition("]")[2] if bracket else label)
    return tuple(dict.fromkeys(out))


__all__ = [
    "BF16",
    "BackwardFacts",
    "EXACT",
    "FP8",
    "INT8",
    "Verdict",
    "producer_verdict",
    "reader_ops",
    "tangent_dependent",
    "verdict",
]
