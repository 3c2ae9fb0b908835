"""Facts one compilation's stages hand each other, carried on its ``TracingContext``.

Dynamo's tracing, AOTAutograd's inliner, the runtime-wrapper factory and the
AOTAutogradCache save of one compilation all run inside one ``torch._guards.TracingContext``
(restored around a lazily compiled backward), upstream's own carrier of per-compilation
state (``fw_metadata``, output strides, the DDP optimizer's context...).  What torch_patches'
stages must tell each other lives in one typed record on it, reached only through
:func:`facts`; nothing per-compilation lives in module globals, so two compilations (two
threads, or a recompile) can never read each other's facts.

Without a TracingContext (AOTAutograd called directly, not through Dynamo) there is no
carrier: :func:`facts` returns None, and the stages fall back to what they can decide alone
(the inliner raises instead of falling back to eager hooks, see ``graph_compile``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class CompileFacts:
    #: In-graph saved-tensors-hooks scopes Dynamo traced, by scope key -> ``HookPair``
    #: (read by the inliner through ``hook_scopes.scope_of``).
    scopes: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: (guard key of the ambient hooks, whether the inliner inlined them) for the graph
    #: compiled last in this context (read by the runtime-wrapper factory).
    hooks_inlined: tuple[Any, bool] | None = None
    #: Why this compilation must not be saved to AOTAutogradCache (hooks fell back to eager
    #: hooks, or keyed only in this process); read by the cache-save patch.
    not_cacheable: list[str] = dataclasses.field(default_factory=list)
    #: Under an ambient budget, the fraction of the default partition's activation bytes the
    #: partitioner's cheap recomputation saves, when it met the budget (set by the
    #: partitioner patch, read by the budget plan: the budget is a fraction of the default's).
    partition_budget_ratio: float | None = None
    #: Under an ambient fractional budget, the fraction the partitioner's cheap recomputation
    #: saves whether or not it met the budget (reported with the plan's summary).
    partition_cheap_ratio: float | None = None
    #: While a report records: the partitioner's saved set at each activation_memory_budget
    #: fraction, ``(fraction, saved activation bytes, estimated recomputation ms)`` (set by
    #: the partitioner patch, copied onto the records by the inliner).
    stock_pareto: list[Any] = dataclasses.field(default_factory=list)
    #: What the inliner decided, per compiled graph pair of this context
    #: (``saved_tensor_records.CompiledSavedTensors``, in compile order).
    saved_tensors: list[Any] = dataclasses.field(default_factory=list)
    #: Tensors inlined hooks read that Dynamo made graph inputs: (the pair's label -
    #: ``"ambient"`` or an in-region scope's -, ``hook_inputs.LiftedTensor``, the Dynamo
    #: graph's placeholder), read by the inliner.
    hook_inputs: list[Any] = dataclasses.field(default_factory=list)


_ATTR = "_saved_tensors_hooks_facts"


def facts(tracing_context: Any = None) -> CompileFacts | None:
    """The facts of ``tracing_context`` (default: the current one), created on first use."""
    if tracing_context is None:
        from torch._guards import TracingContext

        tracing_context = TracingContext.try_get()
        if tracing_context is None:
            return None
    found = vars(tracing_context).get(_ATTR)
    if found is None:
        found = CompileFacts()
        setattr(tracing_context, _ATTR, found)
    return found
