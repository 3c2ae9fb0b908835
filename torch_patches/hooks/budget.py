"""An activation memory budget: the compiler chooses how each saved tensor is stored.

``budget(memory)`` is a saved-tensors hook pair that asks the inliner to *plan*: for every
saved tensor of a compiled graph it chooses keep, bf16, int8 or fp8 row-wise, CPU offload, fp8 +
offload or recompute so that the bytes the graph saves for the backward fit ``memory`` at the least
estimated step time::

    from torch_patches.hooks import budget

    with torch.autograd.graph.saved_tensors_hooks(*budget(0.5)):   # half the saved bytes
        loss = compiled_model(x).sum()
    loss.backward()

or, for every compiled graph that runs without other hooks, in torch's config style::

    torch_patches.config.activation_memory_budget = 0.5

``memory`` is a fraction in (0, 1] of the bytes the graph saves without hooks (its
activations: parameters and other graph inputs that are not activations do not count), or
an ``int`` number of bytes per compiled graph.  Entered inside a compiled region the pair
plans the saved tensors of its own scope (the per-scope form).  Which options are allowed:
``options`` (default :data:`OPTIONS`; offload only for CUDA tensors); lossy options only
for tensors :func:`~torch_patches.hooks.select.numerics_safe` accepts.  The cost model and
the solver are described in the package ``torch_patches/_functorch/_aot_autograd/activation_budget/``
(``cost_model.py``, ``solver.py``, ``recompute.py``; ``planner.py`` applies the plans) and
the README ("Activation memory budget").

The plan is a compile-time decision: the pair's content (``memory``, ``options``) and
torch_patches' config (the bandwidth knobs) are part of the compiled graph's guard and
cache key, so changing the budget recompiles once.  As plain eager hooks (no compiled
graph to plan) the pair keeps every saved tensor as it is and warns once.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings
from typing import Any

import torch


__all__ = ["BUDGET_ATTR", "OPTIONS", "BudgetSpec", "budget", "unwrap_budget"]

#: Attribute on both functions of a :func:`budget` pair: its :class:`BudgetSpec`.
BUDGET_ATTR = "__torch_patches_budget__"

#: Every option a plan may choose besides keeping the tensor: the storage options, least
#: lossy first, then recomputing it in the backward (exact; see activation_budget/recompute.py).
OPTIONS = ("bf16", "int8", "fp8", "offload", "fp8+offload", "recompute")


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
    """What a :func:`budget` pair asks for.

    Attributes:
        memory: a fraction in (0, 1] of the graph's saved bytes without hooks (``float``),
            or bytes per compiled graph (``int``).
        options: the storage options the plan may choose, a subset of :data:`OPTIONS`.
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


def _spec(memory: Any, options: Any) -> BudgetSpec:
    if isinstance(memory, bool) or not isinstance(memory, numbers.Real):
        raise TypeError(f"budget: memory must be a float fraction or an int of bytes, got {type(memory).__name__}")
    if isinstance(memory, numbers.Integral):
        if memory < 0:
            raise ValueError(f"budget: memory in bytes must be >= 0, got {memory}")
        memory = int(memory)
    else:
        memory = float(memory)
        if not 0.0 < memory <= 1.0:
            raise ValueError(
                f"budget: a fraction of the saved bytes must be in (0, 1], got {memory} "
                "(pass an int for bytes)"
            )
    options = OPTIONS if options is None else tuple(options)
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise ValueError(f"budget: unknown options {unknown}; choose from {list(OPTIONS)}")
    # Canonical order: the same set of options is the same budget (guards, caches).
    return BudgetSpec(memory, tuple(o for o in OPTIONS if o in options))


_warned_eager = False


def _warn_eager() -> None:
    global _warned_eager
    if _warned_eager:
        return
    _warned_eager = True
    warnings.warn(
        "torch_patches.hooks.budget plans the saved tensors of compiled graphs (it needs the "
        "whole graph to choose); saved tensors of eager autograd are kept as they are",
        stacklevel=3,
    )


def _tracing(x: torch.Tensor) -> bool:
    # A region entering the pair trial-traces it on fake tensors: not an eager use.
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor) or torch.compiler.is_compiling()


@functools.lru_cache(maxsize=64)
def _pair(spec: BudgetSpec) -> tuple[Any, Any]:
    from torch_patches.hooks import inlineable

    def budget_pack(x: torch.Tensor) -> Any:
        if not _tracing(x):
            _warn_eager()
        return x

    def budget_unpack(packed: Any) -> torch.Tensor:
        return packed

    pack, unpack = inlineable(budget_pack, budget_unpack)
    for fn in (pack, unpack):
        setattr(fn, BUDGET_ATTR, spec)
    return pack, unpack


def budget(memory: float | int, options: Any = None) -> tuple[Any, Any]:
    """Hooks asking the compiler to fit the saved tensors in ``memory`` (see the module).

    ``memory``: a ``float`` fraction in (0, 1] of the bytes the compiled graph saves without
    hooks, or an ``int`` of bytes per compiled graph.  ``options``: the storage options the
    plan may use, from :data:`OPTIONS` (default: all of them).  Equal arguments give the
    same pair (no recompile when it is recreated every step).
    """
    return _pair(_spec(memory, options))


def unwrap_budget(hooks: Any) -> BudgetSpec | None:
    """The :class:`BudgetSpec` of a :func:`budget` pair, else None."""
    if not hooks:
        return None
    spec = getattr(hooks[0], BUDGET_ATTR, None)
    if spec is None or getattr(hooks[1], BUDGET_ATTR, None) is not spec:
        return None
    return spec
