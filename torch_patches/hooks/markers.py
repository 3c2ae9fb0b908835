"""What kind of saved-tensors hook pair the compiler is given: the markers and their decoding.

The bottom of the line between the compiler (``torch_patches/_dynamo``, ``_functorch``) and
the hooks library (``torch_patches/hooks``): the library marks the functions it returns, the
compiler decodes a pair once (:func:`decode`) into a :class:`PairKind` whose fields it reads.
Neither side imports the other for this; this module imports neither.

Kinds (a pair may be several: a ``select`` pair of inlineable functions is both):

* *inlineable*: both functions are ``fx.GraphModule``\\ s or plain functions marked with
  :func:`mark_inlineable` (``torch_patches.hooks.inlineable``): the compiler traces them;
* *select*: ``(pack, unpack, where, otherwise)``: applied only to the saved tensors a
  compile-time predicate accepts (``torch_patches.hooks.select``);
* *budget*: a :class:`BudgetSpec`: the compiler plans each saved tensor's storage
  (``torch_patches.hooks.budget``).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from torch_patches._errors import SavedTensorsHookWarning
from torch_patches.hooks import numerics

__all__ = [
    "BUDGET_ATTR",
    "BUDGET_OPTIONS",
    "CACHE_HASH_ATTR",
    "INLINEABLE_ATTR",
    "OTHERWISE_ATTR",
    "SELECT_ATTR",
    "BudgetSpec",
    "PairKind",
    "Selection",
    "budget_pair",
    "budget_spec",
    "decode",
    "is_inlineable_hook",
    "mark_inlineable",
    "pair_is_inlineable",
    "SavedTensorInfo",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Attribute set on a plain function by ``torch_patches.hooks.inlineable``.
INLINEABLE_ATTR = "__saved_tensors_hook_inlineable__"
#: Attribute on both functions of a ``select`` pair: ``(pack, unpack, where)``.
SELECT_ATTR = "__saved_tensors_hook_select__"
#: Attribute on both functions of a ``select`` pair: its ``otherwise`` pair, or None.
OTHERWISE_ATTR = "__saved_tensors_hook_select_otherwise__"
#: Attribute on both functions of a ``budget`` pair: its :class:`BudgetSpec`.
BUDGET_ATTR = "__saved_tensors_hook_budget__"
#: Attribute ``torch_patches.hooks.cache_hash`` sets on an ``fx.wrap`` leaf function.
CACHE_HASH_ATTR = "__saved_tensors_hook_user_cache_hash__"

#: Every option a budget plan may choose besides keeping the tensor: the storage options,
#: least lossy first, then recomputing it in the backward (exact).
BUDGET_OPTIONS = ("bf16", "int8", "fp8", "offload", "fp8+offload", "recompute")


# ------------------------------------------------------------------------ inlineable


def mark_inlineable(fn: F) -> F:
    """Mark one function as a traceable saved-tensors hook (a thin wrapper where the object
    takes no attributes, as builtins)."""
    if not callable(fn):
        raise TypeError(f"saved tensors hooks must be callable, got {type(fn).__name__}")
    try:
        setattr(fn, INLINEABLE_ATTR, True)
        return fn
    except AttributeError:

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        setattr(wrapper, INLINEABLE_ATTR, True)
        return wrapper  # type: ignore[return-value]


def is_inlineable_hook(fn: Any) -> bool:
    """True for ``fx.GraphModule``\\ s and functions marked with :func:`mark_inlineable`."""
    return isinstance(fn, torch.fx.GraphModule) or (callable(fn) and getattr(fn, INLINEABLE_ATTR, False) is True)


def pair_is_inlineable(hooks: Any) -> bool:
    """Both functions of a pair are inlineable (upstream's predicate, widened to marked
    functions)."""
    if not hooks:
        return False
    pack, unpack = hooks
    return is_inlineable_hook(pack) and is_inlineable_hook(unpack)


# ------------------------------------------------------------------------ budget


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
    """What a budget pair asks for.

    Attributes:
        memory: a fraction in (0, 1] of the graph's saved bytes without hooks (``float``),
            or bytes per compiled graph (``int``).
        options: the storage options the plan may choose, a subset of :data:`BUDGET_OPTIONS`.
    """

    memory: float | int
    options: tuple[str, ...]

    def target_bytes(self, baseline: int) -> int:
        """The budget in bytes for a graph that saves ``baseline`` bytes without hooks."""
        if isinstance(self.memory, float):
            return int(self.memory * baseline)
        return int(self.memory)

    def describe(self) -> str:
        memory = f"{self.memory:g} of the saved bytes" if isinstance(self.memory, float) else f"{self.memory} B"
        return f"budget({memory}, options={'/'.join(self.options)})"


def budget_spec(memory: Any, options: Any = None) -> BudgetSpec:
    """The canonical :class:`BudgetSpec` of ``budget(memory, options)``; bad arguments raise."""
    if isinstance(memory, bool) or not isinstance(memory, numbers.Real):
        raise TypeError(f"budget: memory must be a float fraction or an int of bytes, got {type(memory).__name__}")
    if isinstance(memory, numbers.Integral):
        if memory < 0:
            raise ValueError(f"budget: memory in bytes must be >= 0, got {memory}")
        memory = int(memory)
    else:
        memory = float(memory)
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"budget: a fraction of the saved bytes must be in (0, 1], got {memory} (pass an int for bytes)")
    options = BUDGET_OPTIONS if options is None else tuple(options)
    unknown = [o for o in options if o not in BUDGET_OPTIONS]
    if unknown:
        raise ValueError(f"budget: unknown options {unknown}; choose from {list(BUDGET_OPTIONS)}")
    # Canonical order: the same set of options is the same budget (guards, caches).
    return BudgetSpec(memory, tuple(o for o in BUDGET_OPTIONS if o in options))


_warned_eager_budget = False


def _warn_eager_budget() -> None:
    global _warned_eager_budget
    if _warned_eager_budget:
        return
    _warned_eager_budget = True
    warnings.warn(
        "torch_patches.hooks.budget plans the saved tensors of compiled graphs (it needs the "
        "whole graph to choose); saved tensors of eager autograd are kept as they are",
        SavedTensorsHookWarning,
        stacklevel=3,
    )


def _tracing(x: torch.Tensor) -> bool:
    # A region entering the pair trial-traces it on fake tensors: not an eager use.
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor) or torch.compiler.is_compiling()


@functools.lru_cache(maxsize=64)
def budget_pair(spec: BudgetSpec) -> tuple[Any, Any]:
    """The pair standing for ``spec``: identity functions (eager keeps every tensor, and
    warns once) marked inlineable and with the spec.  One pair per spec, so a budget
    recreated every step is the same pair."""

    def budget_pack(x: torch.Tensor) -> Any:
        if not _tracing(x):
            _warn_eager_budget()
        return x

    def budget_unpack(packed: Any) -> torch.Tensor:
        return packed

    pack, unpack = mark_inlineable(budget_pack), mark_inlineable(budget_unpack)
    for fn in (pack, unpack):
        setattr(fn, BUDGET_ATTR, spec)
    return pack, unpack


# ------------------------------------------------------------------------ select


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
        backward_consumers: the ops that read it in the backward, up to where its error meets
            a gradient (through views, casts and the recomputation of what it feeds), in
            graph order; ``None`` in eager, where the backward is not known at pack time.
        is_input: a graph input (compiled) or a leaf (eager).
        scope: ``"ambient"``, an in-region scope's name, or ``"eager"``.
        tolerance: the lossiest storage the numerics allowlist accepts for it: ``"exact"``,
            ``"bf16"``, ``"int8"`` or ``"fp8"``; see ``torch_patches/hooks/numerics.py``.
        why: what limits ``tolerance`` (the reader and argument, or the producer), or None.
        readers: ``"op[argument]"`` for every argument it is read as on the way to a
            gradient (compiled); ``None`` in eager.
    """

    name: str | None
    producer: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    backward_consumers: tuple[str, ...] | None
    is_input: bool
    scope: str
    tolerance: str = "fp8"  # the lossiest level (numerics.FP8)
    why: str | None = None
    readers: tuple[str, ...] | None = None

    @property
    def compiled(self) -> bool:
        return self.name is not None

    @staticmethod
    def from_tensor(t: torch.Tensor) -> SavedTensorInfo:
        """What eager knows of a tensor at pack time (its producer, not its readers)."""
        grad_fn = t.grad_fn
        tolerance, why = numerics.eager_verdict(t)
        return SavedTensorInfo(
            name=None,
            producer=None if grad_fn is None else type(grad_fn).__name__,
            dtype=t.dtype,
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
            backward_consumers=None,
            is_input=t.grad_fn is None,
            scope="eager",
            tolerance=tolerance,
            why=why,
        )


# ------------------------------------------------------------------------ decoding


@dataclasses.dataclass(frozen=True)
class Selection:
    """A ``select`` pair's parts: the inner pair, its predicate, its ``otherwise`` pair."""

    pack: Callable[..., Any]
    unpack: Callable[..., Any]
    where: Callable[[Any], bool]
    otherwise: tuple[Callable[..., Any], Callable[..., Any]] | None


@dataclasses.dataclass(frozen=True)
class PairKind:
    """What a pair is, decoded once: the fields the compiler reads."""

    inlineable: bool
    selection: Selection | None = None
    budget: BudgetSpec | None = None


def _shared(hooks: Any, attr: str) -> Any:
    got = getattr(hooks[0], attr, None)
    if got is None or getattr(hooks[1], attr, None) is not got:
        return None
    return got


def decode(hooks: Any) -> PairKind:
    """The :class:`PairKind` of a ``(pack, unpack)`` pair (None or empty: not inlineable)."""
    if not hooks:
        return PairKind(False)
    selection = None
    parts = _shared(hooks, SELECT_ATTR)
    if parts is not None:
        pack, unpack, where = parts  # select()'s inner pair and predicate
        selection = Selection(pack, unpack, where, otherwise=getattr(hooks[0], OTHERWISE_ATTR, None))
    return PairKind(pair_is_inlineable(hooks), selection, _shared(hooks, BUDGET_ATTR))
