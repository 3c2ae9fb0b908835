"""Which saved tensors a hook pair compresses: a compile-time predicate with context.

A compiled graph's saved tensors are the partitioner's choice, not eager's: it may save an
input of a cheap op and recompute the op in the backward (RoPE angles instead of their
cos/sin, logits instead of the softmax).  A lossy hook on such a tensor can move the
gradient far more than on what eager saves (a bf16 angle of 511 is off by a whole radian).
``select(pack, unpack, where=...)`` attaches a predicate to any hook pair::

    from torch_patches.hooks import bf16, select

    pack, unpack = select(*bf16(), where=lambda t: t.nbytes >= 1 << 20)

While compiling, the inliner calls ``where`` once per saved tensor with a
:class:`SavedTensorInfo` (producer op, dtype, shape, bytes, the backward ops that read it,
through recompute chains): no runtime cost; the predicate's code and what it reads are part
of the hook's identity (guards, caches).  Tensors it rejects are saved as they are.  As
eager hooks the same pair asks the same predicate with what eager knows at pack time
(producer from ``grad_fn``, dtype, shape, bytes; no backward consumers: ``None``).

:func:`numerics_safe` is the default of the ready-made lossy hooks (``bf16``,
``fp8_rowwise``, ``int8_rowwise`` and chains holding them): it keeps tensors whose backward
use amplifies absolute error, normalisation statistics and tensors too small to pay.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx


__all__ = ["SELECT_ATTR", "SavedTensorInfo", "numerics_safe", "select", "unwrap_select"]

#: Attribute on both functions of a :func:`select` pair: ``(pack, unpack, where)``.
SELECT_ATTR = "__torch_patches_select__"


@dataclasses.dataclass(frozen=True)
class SavedTensorInfo:
    """One saved tensor, as a hook's ``where=`` predicate sees it.

    Attributes:
        name: the node in the compiled forward graph (``None`` in eager).
        producer: the op that computed it: ``"aten.mm.default"`` (compiled; ``"getitem:N of
            aten.native_layer_norm.default"`` for output N of a multi-output op), the
            ``grad_fn`` name in eager (``"MmBackward0"``); ``None`` for graph inputs and leaves.
        dtype, shape: the tensor's (symbolic sizes as their hints).
        nbytes: its size in bytes.
        backward_consumers: the ops that read it in the backward, followed through ops that
            only move, reshape, cast or scale it (a recompute chain), in graph order;
            ``None`` in eager, where the backward is not known at pack time.
        is_input: a graph input (compiled) or a leaf (eager).
        scope: ``"ambient"``, an in-region scope's name, or ``"eager"``.
    """

    name: str | None
    producer: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    backward_consumers: tuple[str, ...] | None
    is_input: bool
    scope: str

    @property
    def compiled(self) -> bool:
        return self.name is not None

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "SavedTensorInfo":
        """What eager knows of a tensor at pack time."""
        grad_fn = t.grad_fn
        return SavedTensorInfo(
            name=None,
            producer=None if grad_fn is None else type(grad_fn).__name__,
            dtype=t.dtype,
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
            backward_consumers=None,
            is_input=t.grad_fn is None,
            scope="eager",
        )


class _Kept:
    """A saved tensor the predicate rejected (eager hooks): stored as it is."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def select(
    pack: Callable[[torch.Tensor], Any],
    unpack: Callable[[Any], torch.Tensor],
    where: Callable[[SavedTensorInfo], bool],
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """``(pack, unpack)`` applied only to the saved tensors ``where(info)`` accepts.

    The result is inlineable when ``pack`` and ``unpack`` are (``fx.GraphModule`` or marked
    with :func:`~torch_patches.hooks.inlineable`); the inliner then evaluates ``where`` at
    compile time and traces ``pack``/``unpack`` for the accepted tensors only.  ``where``
    must be a pure function of its argument (and of what it reads, which is keyed like a
    hook's code).  Nested ``select``\\ s combine: both predicates must accept.
    """
    if not callable(where):
        raise TypeError(f"select: where must be callable, got {type(where).__name__}")
    inner = unwrap_select((pack, unpack))
    if inner is not None:
        pack, unpack, outer = inner
        where = functools.partial(_both, outer, where)

    def select_pack(t: torch.Tensor) -> Any:
        return pack(t) if where(SavedTensorInfo.from_tensor(t)) else _Kept(t)

    def select_unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Kept) else unpack(packed)

    from torch_patches.hooks import inlineable, is_inlineable

    parts = (pack, unpack, where)
    for fn in (select_pack, select_unpack):
        setattr(fn, SELECT_ATTR, parts)
    if is_inlineable(pack) and is_inlineable(unpack):
        return inlineable(select_pack, select_unpack)
    return select_pack, select_unpack


def _both(first: Callable[[Any], bool], second: Callable[[Any], bool], info: Any) -> bool:
    return bool(first(info)) and bool(second(info))


def unwrap_select(hooks: Any) -> tuple[Any, Any, Callable[[SavedTensorInfo], bool]] | None:
    """``(pack, unpack, where)`` of a :func:`select` pair, else None."""
    if not hooks:
        return None
    got = getattr(hooks[0], SELECT_ATTR, None)
    if got is None or getattr(hooks[1], SELECT_ATTR, None) is not got:
        return None
    return got


# --------------------------------------------------------------- numerics-safe default

#: Ops whose result moves far when their input moves by an absolute error: periodic
#: (angles), exponential (logits), powers and inverses (statistics, denominators).
AMPLIFYING_OPS = frozenset(
    {
        "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
        "exp", "exp2", "expm1", "pow", "log", "log2", "log10", "log1p", "reciprocal",
        "rsqrt", "sqrt", "_softmax", "softmax", "_log_softmax", "log_softmax", "logsumexp",
        "polar", "special_erfcx", "erfinv",
    }
)
#: ``pow`` by a constant exponent of at most this magnitude only scales relative error
#: (x**2: twice x's); larger ones and tensor exponents amplify it.
_MILD_POW = 2.0
#: Ops whose output is normalisation statistics when it is not output 0.
_NORM_OPS = frozenset(
    {"native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
     "_native_batch_norm_legit_functional", "native_group_norm", "_fused_rms_norm",
     "var_mean", "batch_norm_stats"}
)
#: Producers that are statistics themselves.
_STAT_OPS = frozenset({"rsqrt", "reciprocal", "var", "var_mean", "std", "std_mean"})


def op_base_name(op: str) -> str:
    """``"aten.sin.default"`` -> ``"sin"``; ``"SinBackward0"`` -> ``"sin"``; ``"getitem:1 of
    aten.native_layer_norm.default"`` -> ``"native_layer_norm"``."""
    if op.endswith(")") and "(" in op:  # "aten.pow.Tensor_Scalar(2)"
        op = op[: op.rindex("(")]
    if " of " in op:
        op = op.split(" of ", 1)[1]
    if op.startswith(("aten.", "prims.")):
        return op.split(".")[1]
    if op.endswith(("Backward0", "Backward1")):
        import re

        return re.sub(r"(?<!^)(?=[A-Z])", "_", op[: -len("Backward0")]).lower()
    return op


def numerics_safe(info: SavedTensorInfo) -> bool:
    """The default ``where=`` of the ready-made lossy hooks.

    Rejects (saves as it is) a tensor

    * read in the backward, directly or through a recompute chain, by an op that amplifies
      absolute error (:data:`AMPLIFYING_OPS`: sin/cos of RoPE angles, exp of logits,
      pow/rsqrt/reciprocal of statistics), except ``exp`` of a negative multiple of a
      square (GELU's backward) and ``exp`` read only as ``1 / (1 + exp)`` (a sigmoid:
      SiLU's backward): bounded, so their error stays proportional to the input's;
    * that is normalisation statistics (an output other than the first of a norm op, or
      produced by rsqrt/reciprocal/var/std);
    * too small for row-wise compression to pay (last dimension below 2, 0-d) or smaller
      than ``torch_patches.config.lossy_min_bytes``.

    ``torch_patches.config.lossy_hooks_numerics_safe = False`` accepts every tensor.
    """
    from torch_patches import config

    if not config.lossy_hooks_numerics_safe:
        return True
    if info.nbytes < config.lossy_min_bytes or not info.shape or info.shape[-1] < 2:
        return False
    producer = info.producer
    if producer is not None:
        base = op_base_name(producer)
        if base in _STAT_OPS:
            return False
        if producer.startswith("getitem:") and base in _NORM_OPS and not producer.startswith("getitem:0 "):
            return False
    if info.backward_consumers is not None:
        if any(_amplifies(op) for op in info.backward_consumers):
            return False
    return True


def _amplifies(op: str) -> bool:
    base = op_base_name(op)
    if base == "exp" and op.endswith(tuple(f"({b})" for b in _BOUNDED_EXP)):
        # exp(-c x^2) <= 1, its error at most 2/e times x's relative error; 1/(1+exp(-x))
        # has slope x*s*(1-s) <= 0.28 per unit of x's relative error.
        return False
    if base == "pow" and op.endswith(")") and "(" in op:
        try:
            return abs(float(op[op.rindex("(") + 1 : -1])) > _MILD_POW
        except ValueError:
            return True
    return base in AMPLIFYING_OPS


# ------------------------------------------------------------ compile-time context

#: Ops a recompute chain passes a saved tensor through without changing what it means:
#: views, copies, casts, scaling and concatenation.  The chain is followed through them to
#: the ops that really consume the tensor.
_TRANSPARENT = frozenset(
    {
        "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
        "squeeze", "slice", "select", "clone", "alias", "detach", "_to_copy",
        "convert_element_type", "mul", "div", "add", "sub", "neg", "cat", "unbind",
        "split", "split_with_sizes", "as_strided", "contiguous", "index", "index_select",
        "repeat", "getitem", "stack", "flatten",
    }
)
_MAX_CHAIN = 64


def backward_consumers(bw_input: Any) -> tuple[str, ...]:
    """The ops that read a saved tensor's backward input, through recompute chains."""
    seen: set[Any] = set()
    found: list[str] = []
    stack = [u for u in bw_input.users]
    while stack and len(seen) < _MAX_CHAIN:
        node = stack.pop(0)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        name = _target_name(node)
        if node.target is torch.ops.aten.pow.Tensor_Scalar and isinstance(node.args[1], (int, float)):
            name = f"{name}({node.args[1]})"  # the exponent decides (see numerics_safe)
        elif node.target is torch.ops.aten.exp.default and _negative_square(node.args[0]):
            name = f"{name}({NEGATIVE_SQUARE})"
        elif node.target is torch.ops.aten.exp.default and _logistic(node):
            name = f"{name}({LOGISTIC})"
        found.append(name)
        if op_base_name(name) in _TRANSPARENT:
            stack.extend(node.users)
    return tuple(dict.fromkeys(found))


#: Consumer-name suffix of ``exp(c * x * x)`` with ``c < 0`` (a Gaussian: GELU's backward).
NEGATIVE_SQUARE = "-x^2"
#: Consumer-name suffix of an ``exp`` read only as ``1 / (1 + exp(.))`` (a sigmoid: SiLU's
#: backward as Inductor decomposes it).
LOGISTIC = "logistic"
#: The ``exp`` forms whose output, and its error, are bounded.
_BOUNDED_EXP = (NEGATIVE_SQUARE, LOGISTIC)


def _number(arg: Any) -> float | None:
    return float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


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
    whose exp has an absolute error bounded by a constant times x's relative error."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    aten = torch.ops.aten
    if node.target is aten.neg.default:
        return _square(node.args[0])
    if node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        a, b = node.args[:2]
        if _number(b) is not None:
            return _number(b) < 0 and _square(a)
        is_mul = node.target in (aten.mul.Tensor, aten.mul.Scalar)
        return is_mul and _number(a) is not None and _number(a) < 0 and _square(b)
    return False


def _logistic(exp: Any) -> bool:
    """``exp`` read only through ``1 / (c + exp)`` or ``y / (c + exp)`` with ``c > 0`` (a
    sigmoid, SiLU)."""
    aten = torch.ops.aten
    if not exp.users:
        return False
    for add in exp.users:
        if add.target not in (aten.add.Tensor, aten.add.Scalar):
            return False
        others = [a for a in add.args[:2] if a is not exp]
        if len(others) != 1 or _number(others[0]) is None or _number(others[0]) <= 0:
            return False
        for use in add.users:
            # 1 / (c + exp) or y / (c + exp) (SiLU: x / (1 + exp(-x))): a factor in (0, 1/c)
            # whose error is bounded whatever the exponent's.
            inverse = use.target is aten.reciprocal.default or (
                use.target in (aten.div.Tensor, aten.div.Scalar)
                and use.args[1] is add
                and use.args[0] is not add
            )
            if not inverse:
                return False
    return bool(exp.users)


def _target_name(node: Any) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def producer_of(saved: Any) -> str | None:
    """The op that computed a saved tensor's forward node (None for placeholders)."""
    if saved.op != "call_function":
        return None
    if saved.target is operator.getitem and saved.args and hasattr(saved.args[0], "op"):
        src = saved.args[0]
        return f"getitem:{saved.args[1]} of {_target_name(src)}"
    return _target_name(saved)


def compiled_info(saved: Any, bw_input: Any, scope: str) -> SavedTensorInfo:
    """The :class:`SavedTensorInfo` of a saved tensor of a compiled graph."""
    val = saved.meta["val"]
    shape = tuple(_size_hint(s) for s in val.shape)
    numel = 1
    for s in shape:
        numel *= s
    return SavedTensorInfo(
        name=saved.name,
        producer=producer_of(saved),
        dtype=val.dtype,
        shape=shape,
        nbytes=numel * val.element_size(),
        backward_consumers=backward_consumers(bw_input) if bw_input is not None else (),
        is_input=saved.op == "placeholder",
        scope=scope,
    )


def _size_hint(s: Any) -> int:
    """A symbolic size's example value (its hint); 8192 for one with none (unbacked)."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    hint = getattr(node, "hint", None)
    if isinstance(hint, int):
        return hint
    try:
        return int(node.shape_env.size_hint(node.expr))  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no hint (unbacked size)
        return 8192
