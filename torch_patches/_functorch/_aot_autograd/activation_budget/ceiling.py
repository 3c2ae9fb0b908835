"""The ceiling: a budget's graphs never peak above no budget's, nor above stock's
``activation_memory_budget`` at the same fraction, by Inductor's accounting.

The partition choice (:mod:`.partition_choice`) and the plan (:mod:`.planner`) decide from
predictions; what decides the step's peak is what Inductor runs.  So once the phases have
written the plan into the graphs, the graphs as they will be compiled are priced by
Inductor's own accounting (:mod:`.inductor_accounting`) beside the two partitions a user
could have had instead:

* the default partition without a budget (the graphs the inliner was handed, put back from
  the driver's snapshot), and
* under a fractional budget, stock's knapsack at the same fraction (what
  ``torch._functorch.config.activation_memory_budget = F`` compiles), where it recomputes
  no random op and reads no input the forward mutates (those compute other gradients).

The budget's graphs stand where their score is at or below the lower of the two, to the
estimate's rounding (:data:`PEAK_TOLERANCE`, :data:`SLACK_BYTES`; the score
of :meth:`~.inductor_accounting.Accounted.score`: the step's peak, or the forward's end for
a graph that is one of several).  Else the plan is withdrawn: the graphs become the lower
of the two, unchanged by any hook, and the plan's summary, its records and the log say so
and by how much.  So ``budget(F)`` is at or below both by construction, to the accuracy of
Inductor's own estimate.  Only where the backend is Inductor
(``config.activation_budget_accounting``); elsewhere nothing is priced and the plan stands, and
so it does beside hooks entered inside the compiled region (withdrawing would drop them).

Compile time only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from torch_patches import _logging as tp_logging
from torch_patches._functorch._aot_autograd import compile_facts
from torch_patches._functorch._aot_autograd.activation_budget import partition_choice
from torch_patches._functorch._aot_autograd.activation_budget.inductor_accounting import Accounted, Pricing, nbytes_in_words
from torch_patches._functorch._aot_autograd.compile_facts import PartitionOffer
from torch_patches._functorch._aot_autograd.saved_tensor_records import (
    RECOMPUTED,
    Bounds,
    CompiledSavedTensors,
    DecidedBy,
    Decision,
)

__all__ = ["Alternative", "alternatives", "hold", "hold_to_ceiling"]

log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch.partitioners"

#: How far above the lower alternative the plan's graphs may score and stand: the estimate's
#: rounding (a stored form's buffer beside its tensor in a kernel), 0.5% or 64 KiB, whichever
#: is more; a plan priced above that is withdrawn.
PEAK_TOLERANCE = 0.005
SLACK_BYTES = 64 << 10


@dataclasses.dataclass
class Alternative:
    """A partition the budget's graphs are held against: its name in words, its graphs
    (made on demand: a knapsack is partitioned again only when it is needed) and its
    price."""

    name: str
    priced: Accounted
    #: Puts its graphs into the modules (after the driver restored the default partition).
    adopt: Callable[[fx.GraphModule, fx.GraphModule], None]
    #: Whether it is another partition than the default (its forward saves other tensors).
    repartitioned: bool = False


def alternatives(
    offer: PartitionOffer | None,
    modules: tuple[fx.GraphModule, fx.GraphModule],
    default: tuple[fx.Graph, fx.Graph],
    num_fwd_outputs: int,
    static_input_indices: list[int],
    pricing: Pricing,
    forward_only: bool = False,
) -> list[Alternative]:
    """What the budget's graphs are held against (:mod:`.ceiling`): the default partition
    without a budget (``default``: its graphs, over ``modules``' attributes) and, under a
    fractional budget (``offer``), stock's knapsack at the fraction where it is safe
    (:func:`.partition_choice.unsafe`); each priced once (the partition choice's prices reused), the
    knapsack partitioned again where its graphs are needed and were not kept.
    ``forward_only``: the budget bounds the forward's end; only forwards are priced."""
    found = []
    priced = pricing.of("default", *modules, graphs=default, forward_only=forward_only)
    if priced is not None:
        found.append(Alternative("the default partition without a budget", priced, lambda fw, bw: None))
    if offer is None:
        return found
    made: dict[str, tuple[fx.GraphModule, fx.GraphModule] | str] = {}

    def knapsack() -> tuple[fx.GraphModule, fx.GraphModule] | str:
        if "k" not in made:
            made["k"] = partition_choice.partition(offer, offer.fraction, num_fwd_outputs, static_input_indices)
        return made["k"]

    if "knapsack" not in pricing.priced:
        k = knapsack()
        if isinstance(k, str) or partition_choice.unsafe(*k, default):
            return found
        pricing.of("knapsack", *k, forward_only=forward_only)
    theirs = pricing.priced.get("knapsack")
    if theirs is None:
        return found

    def adopt(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
        k = knapsack()
        if isinstance(k, str):
            raise RuntimeError(f"the partitioner's knapsack could not be made again: {k}")
        partition_choice.adopt(fw, k[0])
        partition_choice.adopt(bw, k[1])

    found.append(Alternative(f"stock's activation_memory_budget = {offer.fraction:g}", theirs, adopt, repartitioned=True))
    return found


def hold(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    pricing: Pricing,
    alternatives: list[Alternative],
    restore: Callable[[], None],
    after: int,
    num_fwd_outputs: int,
    compiled: CompiledSavedTensors,
    at: int,
) -> Alternative | None:
    """Price the budget's graphs (``fw_module``, ``bw_module``, as the phases wrote them) and
    withdraw the plan where the lower of ``alternatives`` scores less (module docstring):
    ``restore`` puts the default partition back, then the alternative adopts its graphs.
    ``after``: what the rest of the step holds after the forward (the score's);
    ``num_fwd_outputs``: the forward's outputs before its saved tensors; ``compiled``: the
    records the phases published, ``at``: the index of the ambient budget's plan among their
    plans.  Returns the alternative taken, or None where the budget's graphs stand (or
    cannot be priced)."""
    if not alternatives:
        return None
    plan = compiled.plans[at]
    forward_end = plan.bounded_at == Bounds.FORWARD_END
    ours = pricing.of("plan", fw_module, bw_module, forward_only=forward_end)
    if ours is None:
        compiled.plans[at] = dataclasses.replace(
            plan, accounting=f"{pricing.name} could not price the plan's graphs: not held to a ceiling"
        )
        return None
    mine = ours.score(forward_end, after)
    lowest = min(alternatives, key=lambda a: a.priced.score(forward_end, after))
    theirs = lowest.priced.score(forward_end, after)
    what = "its forward's end" if forward_end else "the step's peak"
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    if mine <= theirs + max(PEAK_TOLERANCE * theirs, SLACK_BYTES):
        words = f"priced by {pricing.name}: {what} {nbytes_in_words(mine)}, at or below {_words(alternatives, forward_end, after)}"
        compiled.plans[at] = dataclasses.replace(plan, accounted_peak_bytes=ours.peak, accounted_peak_at=ours.at, accounting=words)
        artifact.debug("budget plan (%s): %s", plan.scope, words)
        return None
    why = f"withdrawn: priced by {pricing.name}, {what} {nbytes_in_words(mine)} is above {lowest.name}'s {nbytes_in_words(theirs)}"
    restore()
    lowest.adopt(fw_module, bw_module)
    words = f"{why}; {lowest.name} runs instead"
    compiled.plans[at] = dataclasses.replace(
        plan,
        accounted_peak_bytes=lowest.priced.peak,
        accounted_peak_at=lowest.priced.at,
        accounting=words,
        preference=f"{plan.preference}; {words}",
        met=plan.met and lowest.priced.forward_end <= plan.budget_bytes,
    )
    _withdraw(compiled, why, lowest.name, saved_names(fw_module, num_fwd_outputs) if lowest.repartitioned else None)
    log.info("budget plan (%s): %s", plan.scope, words)
    return lowest


def _words(alternatives: list[Alternative], forward_end: bool, after: int) -> str:
    return " and ".join(f"{a.name}'s {nbytes_in_words(a.priced.score(forward_end, after))}" for a in alternatives)


def _ambient_plan() -> tuple[CompiledSavedTensors | None, int | None]:
    """The records the phases just published for this graph pair and the index of the
    ambient budget's plan among their plans (None where there is none)."""
    found = compile_facts.facts()
    compiled = found.saved_tensors[-1] if found is not None and found.saved_tensors else None
    at = next((i for i, p in enumerate(compiled.plans) if p.scope == "ambient"), None) if compiled is not None else None
    return compiled, at


def _withdraw(compiled: CompiledSavedTensors, why: str, taken: str, saved: set[str] | None) -> None:
    """The records of a withdrawn plan: every saved tensor as the partition taken has it
    (saved as it is; recomputed by the partitioner where its forward does not save it:
    ``saved``, the names it saves, None for the default partition)."""
    for r in compiled.records:
        if r.decision == Decision.UNHOOKED and r.decided_by not in (DecidedBy.BUDGET, DecidedBy.PARTITIONER):
            continue
        if saved is not None and r.name not in saved:
            r.leave(DecidedBy.PARTITIONER, f"recomputed by {taken} ({why})", RECOMPUTED)
        else:
            r.leave(DecidedBy.BUDGET, why)


def saved_names(fw_module: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """The names of the tensors a partitioned forward saves for its backward."""
    outputs: Any = next(iter(fw_module.graph.find_nodes(op="output"))).args[0]
    return {n.name for n in outputs[num_fwd_outputs:] if isinstance(n, fx.Node)}


def hold_to_ceiling(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    snapshot: Any,
    offer: PartitionOffer | None,
    context: tuple[int, Any, Any, list[int]],
    pricing: Pricing,
) -> None:
    """The inliner driver's call: the budget's graphs as the phases wrote them, held at or
    below the default partition without a budget (the graphs of the driver's ``snapshot``, an
    ``inline_fallback.GraphPairSnapshot``, which puts them back) and stock's knapsack at the
    fraction of ``offer``, priced by ``pricing``.  ``context``: the graph pair's number of
    forward outputs, ``ViewAndMutationMeta``, AOT config and static input indices."""
    num_fwd_outputs, inner_meta, _, static_input_indices = context
    compiled, at = _ambient_plan()
    if compiled is None or at is None:
        return
    plan = compiled.plans[at]
    facts = compile_facts.facts()
    if facts is not None and facts.scopes:  # withdrawing would drop the hooks entered in the region
        compiled.plans[at] = dataclasses.replace(plan, accounting="hooks entered in the region beside it: not held to a ceiling")
        return
    forward_only = plan.bounded_at == Bounds.FORWARD_END
    found = alternatives(offer, (fw_module, bw_module), snapshot.graphs, num_fwd_outputs, static_input_indices, pricing, forward_only)
    after = partition_choice.grad_outputs_bytes(fw_module, inner_meta)
    hold(fw_module, bw_module, pricing, found, snapshot.restore, after, num_fwd_outputs, compiled, at)
