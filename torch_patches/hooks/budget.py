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
an ``int`` number of bytes per compiled graph.  In a graph that is its whole step the
budget bounds every point of the backward; in a graph that is one of several (an input of
it produced by autograd: each block compiled on its own, a graph break) it bounds what the
graph holds at its forward's end, while the other graphs run
(``torch_patches.config.activation_budget_bounds``).  Entered inside a compiled region the
pair plans the saved tensors of its own scope (the per-scope form).  Which options are allowed:
``options`` (default :data:`OPTIONS`; offload only for CUDA tensors); lossy options only
for tensors :func:`~torch_patches.hooks.select.numerics_safe` accepts.  The cost model,
the solver, recompute recipes and the glue are the package
``torch_patches/_functorch/_aot_autograd/activation_budget/`` (README, "Activation memory
budget").  The pair itself is a marker (``torch_patches.hooks.markers.budget_pair``): identity
functions carrying the :class:`BudgetSpec` the compiler reads.

The plan is a compile-time decision: the pair's content (``memory``, ``options``) and
torch_patches' config (the bandwidth knobs) are part of the compiled graph's guard and
cache key, so changing the budget recompiles once.  As plain eager hooks (no compiled
graph to plan) the pair keeps every saved tensor as it is and warns once.
"""

from __future__ import annotations

from typing import Any

from torch_patches.hooks.markers import BUDGET_ATTR, BUDGET_OPTIONS as OPTIONS, BudgetSpec, budget_pair, budget_spec, decode

__all__ = ["BUDGET_ATTR", "OPTIONS", "BudgetSpec", "budget", "unwrap_budget"]


def budget(memory: float | int, options: Any = None) -> tuple[Any, Any]:
    """Hooks asking the compiler to fit the saved tensors in ``memory`` (see the module).

    ``memory``: a ``float`` fraction in (0, 1] of the bytes the compiled graph saves without
    hooks, or an ``int`` of bytes per compiled graph.  ``options``: the storage options the
    plan may use, from :data:`OPTIONS` (default: all of them).  Equal arguments give the
    same pair (no recompile when it is recreated every step).
    """
    return budget_pair(budget_spec(memory, options))


def unwrap_budget(hooks: Any) -> BudgetSpec | None:
    """The :class:`BudgetSpec` of a :func:`budget` pair, else None."""
    return decode(hooks).budget
