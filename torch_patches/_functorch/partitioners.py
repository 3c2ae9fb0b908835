"""Exact recomputation first under an activation-memory budget.

Upstream counterpart: ``choose_saved_values_set`` in ``torch/_functorch/partitioners.py``,
which picks the forward values the min-cut partitioner saves for the backward.  Under
``torch._functorch.config.activation_memory_budget = F`` it first tries its *more
aggressive* min-cut (the default one without its bans on recomputing long fusible chains,
values used far apart and materialised backward values) and returns it when that already
saves at most ``F`` of the default's activation bytes; only then does it run its knapsack,
which may recompute expensive ops.

The budget planner (``torch_patches.hooks.budget(F)``, ``config.activation_memory_budget``)
prefers exact options to lossy ones, and the partitioner's own recomputation is the first
exact option: its more aggressive min-cut (asked for at a budget just under 1, the cheap
recomputation) where that saves at most ``F`` of the default's activation bytes, else its
knapsack at ``F``.  Which partition the budget plans is chosen after the partition, where
the plans over each can be weighed.

Under an ambient budget (with torch's own budget unset) this patch keeps the default
partition and leaves an offer on the compilation's facts (``compile_facts.PartitionOffer``):
the joint graph it ran on, the fraction, the default's activation bytes and what the cheap
recomputation saves.  The inliner's driver hands the offer to the partition choice
(``_aot_autograd/activation_budget/partition_choice.py``), which redoes the cheap
recomputation or the knapsack at ``F`` from the joint graph and weighs each against the
plan.  A cheap recomputation or knapsack that would recompute a random op (other random
numbers) or read an input the graph mutates is never taken.  Budget pairs entered inside
a compiled region plan their own scope and leave the partition alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from torch_patches import _logging as tp_logging, config
from torch_patches._functorch._aot_autograd import compile_facts, inline_fallback, saved_tensor_records, utils as hook_utils
from torch_patches._functorch._aot_autograd.activation_budget.cost_model import Rates, recompute_ms
from torch_patches._functorch._aot_autograd.activation_budget.planner import PARETO_FRACTIONS
from torch_patches._functorch._aot_autograd.activation_budget.recompute import draws_random
from torch_patches.hooks.markers import decode

log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch.partitioners"

#: The budget at which the partitioner is asked for its cheap recomputation: below 1, so that
#: it tries its more aggressive min-cut, and so close to 1 that its knapsack, if it runs at
#: all, needs to recompute next to nothing.
CHEAP_RECOMPUTE_BUDGET = 0.999


def ambient_budget_fraction() -> float | None:
    """The fraction of an ambient budget pair (or ``config.activation_memory_budget``) that
    plans this compilation's whole graph, else None (no budget, a budget in bytes, or
    in-region scopes, which plan parts of the graph; or
    ``config.activation_budget_partitioner_recompute`` is off)."""
    if not config.activation_budget_partitioner_recompute:
        return None
    spec = decode(hook_utils.ambient_saved_tensors_hooks()).budget
    if spec is None or not isinstance(spec.memory, float) or spec.memory >= 1.0:
        return None
    found = compile_facts.facts()
    if found is None or found.scopes:
        return None
    return spec.memory


def _recomputes_unsafely(default: list[Any], chosen: list[Any], inputs: list[Any]) -> bool:
    """Whether the backward recomputes, under the saved set ``chosen``, a random op (it would
    draw other numbers) or an op reading an input the graph mutates (it would read the
    mutated value): what the ``default`` set saves (which does neither) and ``chosen`` does
    not is rebuilt from ``chosen`` and the graph's ``inputs``."""
    kept = set(chosen) | set(inputs)
    mutated = hook_utils.mutated_inputs(default[0].graph) if default else set()
    if any(n.name in mutated for n in set(chosen) - set(default)):
        return True  # saved as it is: the backward would read the mutated value
    todo, seen = [n for n in default if n not in kept], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in kept:
            if node.name in mutated:
                return True
            continue
        if draws_random(node):
            return True
        todo.extend(node.all_input_nodes)
    return False


def _record_stock_pareto(original: Callable[..., Any], joint_graph: Any, node_info: Any) -> None:
    """While a report records: the partitioner's own saved set at each fraction 0.1 to 1.0
    (what ``activation_memory_budget = F`` gives), its activation bytes and the estimated
    time of recomputing what the default partition saves and it does not (from the saved
    set and the inputs), on the compilation's facts."""
    found = compile_facts.facts()
    if found is None:
        return
    default = original(joint_graph, node_info, memory_budget=1)
    rates = Rates.for_device(hook_utils.device_of(default))
    found.stock_pareto.clear()
    for fraction in PARETO_FRACTIONS:
        saved = default if fraction == 1 else original(joint_graph, node_info, memory_budget=fraction)
        kept = set(saved) | set(node_info.inputs)
        todo, rebuilt = [n for n in default if n not in kept], set()
        while todo:
            node = todo.pop()
            if node in rebuilt or node in kept or node.op != "call_function":
                continue
            rebuilt.add(node)
            todo.extend(node.all_input_nodes)
        found.stock_pareto.append((fraction, hook_utils.activation_bytes(saved, node_info.inputs), recompute_ms(rebuilt, rates)))


def make_choose_saved_values_set(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``choose_saved_values_set``: under a budget pair, the partitioner's cheap exact
    recomputation when it meets the budget (module docstring); upstream's own choice where
    ours fails with an internal error (``inline_fallback``)."""

    @functools.wraps(original)
    def choose_saved_values_set(joint_graph: Any, node_info: Any, memory_budget: float = 1) -> list[Any]:
        try:
            return _budget_first(original, joint_graph, node_info, memory_budget)
        except Exception as e:  # noqa: BLE001 - ours unless the user's (inline_fallback.is_internal)
            return _upstream_after(e, original, joint_graph, node_info, memory_budget)

    return choose_saved_values_set


def _budget_first(original: Callable[..., Any], joint_graph: Any, node_info: Any, memory_budget: float) -> list[Any]:
    """``choose_saved_values_set`` (``original``) under a budget pair: its cheap exact
    recomputation when that meets the budget (module docstring)."""
    if memory_budget == 1 and saved_tensor_records.observed():
        _record_stock_pareto(original, joint_graph, node_info)
    fraction = ambient_budget_fraction() if memory_budget == 1 else None
    if fraction is None:
        return original(joint_graph, node_info, memory_budget=memory_budget)
    default = original(joint_graph, node_info, memory_budget=1)
    found = compile_facts.facts()
    cheap = original(joint_graph, node_info, memory_budget=CHEAP_RECOMPUTE_BUDGET)
    if _recomputes_unsafely(default, cheap, node_info.inputs):  # other random numbers, mutated inputs
        cheap = default
    full = hook_utils.activation_bytes(default, node_info.inputs)
    ratio = hook_utils.activation_bytes(cheap, node_info.inputs) / full if full else 1.0
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    if found is not None and full:  # the partition choice redoes and weighs (activation_budget.partition_choice)
        found.partition_offer = compile_facts.PartitionOffer(joint_graph.owning_module, fraction, full, ratio, CHEAP_RECOMPUTE_BUDGET)
    if ratio > fraction:
        artifact.debug(
            "budget %.3g: the partitioner's cheap recomputation saves %.3f of the activation bytes; "
            "the plan starts from the default partition",
            fraction,
            ratio,
        )
        return default
    if found is not None and full:  # weighed by its peak against the default by the partition choice
        return default
    artifact.debug(
        "budget %.3g met by the partitioner's cheap recomputation (exact): it saves %.3f of the activation bytes",
        fraction,
        ratio,
    )
    return cheap


def _upstream_after(error: Exception, original: Callable[..., Any], joint_graph: Any, node_info: Any, memory_budget: float) -> list[Any]:
    """Upstream's own choice after an internal ``error`` of :func:`_budget_first` (the
    budget then plans that partition), with one warning; a user's error raises."""
    if not inline_fallback.wants_fallback(error):
        raise error
    inline_fallback.forget_partition_facts()
    inline_fallback.warn_once(
        error,
        "the budget's partition",
        f"failed on {inline_fallback.describe_graph(joint_graph, 'joint')}",
        "The partition is torch's own (as without torch_patches); the budget plans it",
    )
    return original(joint_graph, node_info, memory_budget=memory_budget)
