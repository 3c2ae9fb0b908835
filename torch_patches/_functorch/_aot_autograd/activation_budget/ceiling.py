"""The ceiling: a budget's graphs never peak above no budget's, nor above stock's
``activation_memory_budget`` at the same fraction, by Inductor's accounting.

The partition choice (:mod:`.partition_choice`) and the plan (:mod:`.planner`) decide from
predictions; what decides the step's peak is what Inductor runs.  So once the phases have
written the plan into the graphs, the graphs as they will be compiled are priced by
Inductor's own accounting (:mod:`.inductor_accounting`) beside the two partitions a user
could have had instead:

* the default partition without a budget (the graphs the inliner was handed, put back from
  the driver's snapshot), and
* under a fractional budget, the partitioner's own partitions a user could have asked for:
  stock's knapsack at the same fraction (what
  ``torch._functorch.config.activation_memory_budget = F`` compiles), its cheap
  recomputation, and stock's knapsack at each looser fraction of
  ``config.activation_budget_ceiling_fractions``; each where it recomputes no random op
  and reads no input the forward mutates (those compute other gradients).

The budget's graphs stand where their score is at or below the lowest of them, to the
estimate's rounding (:data:`PEAK_TOLERANCE`, :data:`SLACK_BYTES`; the score
of :meth:`~.inductor_accounting.Accounted.score`: the step's peak, or the forward's end for
a graph that is one of several).  Else the plan is withdrawn: the graphs become the lowest,
unchanged by any hook, and the plan's summary, its records and the log say so and by how
much.  So ``budget(F)`` is at or below no budget and stock's knob at ``F`` by construction,
to the accuracy of Inductor's own estimate, and at or below what stock's knob gives at every
looser fraction of the ladder: stock's knapsack is not monotone in the fraction (a tighter
one recomputes more, and its backward may rebuild more at once), and what a looser budget
can take is a floor for a tighter one.  Only where the backend is Inductor
(``config.activation_budget_accounting``); elsewhere nothing is priced and the plan stands,
and so it does beside hooks entered inside the compiled region (withdrawing would drop them).

Compile time only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from torch_patches import _logging as tp_logging, config
from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs, compile_facts
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
from torch_patches._functorch._aot_autograd.utils import graph_outputs, nbytes_of

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
    bound: tuple[int | None, int] = (None, 0),
) -> list[Alternative]:
    """What the budget's graphs are held against (:mod:`.ceiling`): the default partition
    without a budget (``default``: its graphs, over ``modules``' attributes) and, under a
    fractional budget (``offer``), the partitioner's own partitions a looser knob would give
    (:func:`_ladder`), each where it is safe (:func:`.partition_choice.unsafe`) and saves
    another set than those before it; each priced once (the partition choice's prices
    reused) and partitioned again only where its graphs are adopted.  ``bound``: the plan's
    graphs' score (None: not priced) and what the rest of the step holds after the forward
    (:meth:`~.inductor_accounting.Accounted.score`'s ``after``); a partition whose saved
    tensors alone hold more than the lowest score known is not priced (it cannot be the
    lowest)."""
    found = []
    priced = pricing.of("default", *modules, graphs=default, forward_only=forward_only)
    if priced is not None:
        found.append(Alternative("the default partition without a budget", priced, lambda fw, bw: None))
    if offer is None:
        return found
    unbudgeted = _saves(default[0], num_fwd_outputs)
    seen = {unbudgeted}
    for role, fraction, name in _ladder(offer):
        if role in pricing.priced and pricing.priced[role] is None:
            continue  # ruled out by the partition choice, or not priced
        made = partition_choice.partition(offer, fraction, num_fwd_outputs, static_input_indices)
        if isinstance(made, str) or partition_choice.unsafe(*made, default):
            pricing.rule_out(role)
            continue
        saves = _saves(made[0].graph, num_fwd_outputs)
        if saves == unbudgeted and fraction > offer.fraction and role != "cheap":
            # The knapsack recomputes nothing at this fraction (the default fits it, at no
            # recomputation): nor at any looser one.
            break
        if saves in seen:
            continue  # a partition already held against
        seen.add(saves)
        known = [b for b in [bound[0]] + [a.priced.score(forward_only, bound[1]) for a in found] if b is not None]
        at_least = _saved_storage_bytes(made[0].graph, num_fwd_outputs) + (0 if forward_only else bound[1])
        if known and at_least > min(known) + max(PEAK_TOLERANCE * min(known), SLACK_BYTES):
            continue  # its forward's end alone holds more than a graph pair priced already
        theirs = pricing.of(role, *made, forward_only=forward_only)
        if theirs is not None:
            found.append(Alternative(name, theirs, functools.partial(_adopt, offer, fraction, num_fwd_outputs, static_input_indices), True))
    return found


def _ladder(offer: PartitionOffer) -> list[tuple[str, float, str]]:
    """The partitions of the offer's joint graph a budget is held against besides the
    default, as ``(role, fraction, name)``: stock's knapsack at the budget's fraction, the
    partitioner's cheap recomputation, and the knapsack at each fraction of
    ``config.activation_budget_ceiling_fractions`` looser than the budget's.  A looser knob
    is among them because stock's knapsack is not monotone (a tighter fraction recomputes
    more, and its backward can rebuild more at once): what a looser budget could take, a
    tighter one is held to, so ``budget(F)`` peaks no higher than ``budget(F')`` for
    ``F < F'`` of those fractions."""
    f = offer.fraction
    found = [("knapsack", f, f"stock's activation_memory_budget = {f:g}")]
    if offer.cheap_ratio < 1.0:
        found.append(("cheap", offer.cheap_budget, "the partitioner's cheap recomputation"))
    found += [
        (f"knapsack {g:g}", g, f"stock's activation_memory_budget = {g:g} (looser than {f:g})")
        for g in sorted(set(config.activation_budget_ceiling_fractions))
        if f < g < 1.0
    ]
    return found


def _saves(fw_g: fx.Graph, num_fwd_outputs: int) -> frozenset[str]:
    """The names of what a partitioned forward saves (a partition of the same joint graph
    saving the same names is the same partition)."""
    return frozenset(n.name for n in graph_outputs(fw_g)[num_fwd_outputs:] if isinstance(n, fx.Node))


def _saved_storage_bytes(fw_g: fx.Graph, num_fwd_outputs: int) -> int:
    """A floor under what a partitioned forward holds at its end (and so under its score):
    the bytes of the storages of what it saves that are not its inputs, each storage once
    (a saved view and its base are one buffer)."""
    inputs = set(fw_g.find_nodes(op="placeholder"))
    roots = {act_inputs.storage_root(n) for n in graph_outputs(fw_g)[num_fwd_outputs:] if isinstance(n, fx.Node)}
    return sum(nbytes_of(r) for r in roots if r not in inputs)


def _adopt(
    offer: PartitionOffer, fraction: float, num_fwd_outputs: int, static_input_indices: list[int], fw: fx.GraphModule, bw: fx.GraphModule
) -> None:
    """The modules take the partitioner's partition at ``fraction``, made again (the one
    priced may since have been adopted and rewritten by the phases)."""
    made = partition_choice.partition(offer, fraction, num_fwd_outputs, static_input_indices)
    if isinstance(made, str):
        raise RuntimeError(f"the partitioner's partition at {fraction:g} could not be made again: {made}")
    partition_choice.adopt(fw, made[0])
    partition_choice.adopt(bw, made[1])


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
    _withdraw(compiled, why, lowest.name, _saves(fw_module.graph, num_fwd_outputs) if lowest.repartitioned else None)
    log.info("budget plan (%s): %s", plan.scope, words)
    return lowest


def _words(alternatives: list[Alternative], forward_end: bool, after: int) -> str:
    """The default partition's score and the lowest other alternative's, in words."""
    others = [a for a in alternatives if a.repartitioned]
    said = [a for a in alternatives if not a.repartitioned]
    if others:
        said.append(min(others, key=lambda a: a.priced.score(forward_end, after)))
    return " and ".join(f"{a.name}'s {nbytes_in_words(a.priced.score(forward_end, after))}" for a in said)


def _ambient_plan() -> tuple[CompiledSavedTensors | None, int | None]:
    """The records the phases just published for this graph pair and the index of the
    ambient budget's plan among their plans (None where there is none)."""
    found = compile_facts.facts()
    compiled = found.saved_tensors[-1] if found is not None and found.saved_tensors else None
    at = next((i for i, p in enumerate(compiled.plans) if p.scope == "ambient"), None) if compiled is not None else None
    return compiled, at


def _withdraw(compiled: CompiledSavedTensors, why: str, taken: str, saved: frozenset[str] | None) -> None:
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
    after = partition_choice.grad_outputs_bytes(fw_module, inner_meta)
    ours = pricing.of("plan", fw_module, bw_module, forward_only=forward_only)  # first: it bounds what is worth pricing
    bound = None if ours is None else ours.score(forward_only, after)
    graphs = (fw_module, bw_module), snapshot.graphs
    found = alternatives(offer, *graphs, num_fwd_outputs, static_input_indices, pricing, forward_only, (bound, after))
    hold(fw_module, bw_module, pricing, found, snapshot.restore, after, num_fwd_outputs, compiled, at)
