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

The facts one stage writes and another reads through a question (was the ambient pair
inlined, may this compilation be cached) are asked here (:func:`record_inlined`,
:func:`inlined`, :func:`mark_not_cacheable`, :func:`not_cacheable_reasons`), so a reader
imports this module, not the stage that wrote the fact.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PartitionOffer:
    """What a partition under an ambient fractional budget can be redone from, and what the
    partitioner's cheap recomputation saves: data the partitioner patch hands the partition
    choice (``activation_budget/partition_choice.py``)."""

    #: The joint graph the partitioner ran on.
    joint_module: torch.fx.GraphModule
    #: The budget's fraction (``activation_memory_budget`` the knapsack is redone at).
    fraction: float
    #: The default partition's activation bytes (the budget's 1).
    default_bytes: int
    #: What the partitioner's cheap recomputation saves, of ``default_bytes`` (1.0 where it
    #: recomputes a random op or from a mutated input: never offered).
    cheap_ratio: float
    #: The budget the cheap recomputation is asked for at (just under 1).
    cheap_budget: float

    @property
    def cheap_met(self) -> bool:
        """Whether the cheap recomputation saves at most the fraction."""
        return self.cheap_ratio <= self.fraction


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
    #: Under an ambient fractional budget: what the partitioner patch offers the partition
    #: choice (set by ``_functorch/partitioners.py``, taken by the inliner's driver:
    #: :func:`take_partition_offer`).
    partition_offer: PartitionOffer | None = None
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
    #: Loss heads the budget computes in chunks (``loss_head.rewrite_loss_heads``, run on
    #: Dynamo's graph): ``(description, chunks, tokens, vocabulary)``, read by the plan's
    #: summary and the report.
    loss_heads: list[Any] = dataclasses.field(default_factory=list)


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


# ------------------------------------------------------------------------ accessors


def record_inlined(guard_key: Any, inlined: bool) -> None:
    """The compilation in progress inlined the ambient hooks whose guard key is
    ``guard_key`` (``inlined``) or fell back to eager hooks (read by the runtime-wrapper
    factory of the same compilation, so a graph whose hooks fell back keeps them enabled at
    runtime)."""
    found = facts()
    if found is not None:
        found.hooks_inlined = (guard_key, inlined)


def inlined(guard_key: Any) -> bool | None:
    """Whether the compilation in progress inlined the ambient hooks, if they still have
    ``guard_key`` (None: it did not try, e.g. a cache hit, or the ambient hooks changed
    since)."""
    found = facts()
    if found is None or found.hooks_inlined is None:
        return None
    key, decision = found.hooks_inlined
    return decision if key == guard_key else None


def mark_not_cacheable(reason: str) -> bool:
    """The compilation in progress must not be saved to AOTAutogradCache.

    Recorded on the compilation's facts (read by the AOTAutogradCache save patch, also when
    the entry is saved at the first backward on autograd's thread, under the restored
    context). False when there is no compilation context to carry it.
    """
    found = facts()
    if found is None:
        return False
    log.info("not cacheable: %s", reason)
    found.not_cacheable.append(reason)
    return True


def take_partition_offer() -> PartitionOffer | None:
    """What the partitioner patch offered for the compilation in progress, cleared from the
    facts: None if nothing."""
    found = facts()
    if found is None:
        return None
    offer, found.partition_offer = found.partition_offer, None
    return offer


def not_cacheable_reasons() -> list[str]:
    """Why the compilation in progress must not be saved to AOTAutogradCache (empty: it may)."""
    found = facts()
    return list(found.not_cacheable) if found is not None else []
