"""Exact recomputation first under an activation-memory budget.

Upstream counterpart: ``choose_saved_values_set`` in ``torch/_functorch/partitioners.py``,
which picks the forward values the min-cut partitioner saves for the backward.  Under
``torch._functorch.config.activation_memory_budget = F`` it first tries its *more
aggressive* min-cut (the default one without its bans on recomputing long fusible chains,
values used far apart and materialised backward values) and returns it when that already
saves at most ``F`` of the default's activation bytes; only then does it run its knapsack,
which may recompute expensive ops.

The budget planner (``torch_patches.hooks.budget(F)``, ``config.activation_memory_budget``)
prefers exact options to lossy ones.  The partitioner's cheap recomputation is the first
exact option: under an ambient budget pair with a fraction ``F`` (and torch's own budget
unset), this patch asks the partitioner for its solution just under a budget of 1 (the more
aggressive min-cut, when that saves anything), and takes it when it saves at most ``F`` of
the default's activation bytes.  The compilation's facts then carry the ratio it reached,
so that the inliner's plan measures the budget against the default partition's bytes and
finds it met, exactly.  Otherwise the default partition is kept and the plan chooses per
saved tensor as before (the knapsack's expensive recomputation is never taken here).  Budget
pairs entered inside a compiled region plan their own scope and leave the partition alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from torch_patches import _logging as tp_logging, config
from torch_patches._functorch._aot_autograd import compile_facts
from torch_patches._functorch._aot_autograd import utils as hook_utils
from torch_patches.hooks.markers import decode


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


def _activation_bytes(values: list[Any], inputs: list[Any]) -> int:
    """Bytes of the saved ``values`` that are not graph inputs (parameters, the batch)."""
    skip = set(inputs)
    total = 0
    for node in values:
        if node not in skip:
            total += hook_utils.nbytes_of(node)
    return total


def _record_stock_pareto(original: Callable[..., Any], joint_graph: Any, node_info: Any) -> None:
    """While a report records: the partitioner's own saved set at each fraction 0.1 to 1.0
    (what ``activation_memory_budget = F`` gives), its activation bytes and the estimated
    time of recomputing what the default partition saves and it does not (from the saved
    set and the inputs), on the compilation's facts."""
    from torch_patches._functorch._aot_autograd.activation_budget.cost_model import Rates, recompute_ms
    from torch_patches._functorch._aot_autograd.activation_budget.planner import PARETO_FRACTIONS

    found = compile_facts.facts()
    if found is None:
        return
    default = original(joint_graph, node_info, memory_budget=1)
    device = next((n.meta["val"].device for n in default if isinstance(n.meta.get("val"), torch.Tensor)), torch.device("cpu"))
    rates = Rates.for_device(device)
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
        found.stock_pareto.append((fraction, _activation_bytes(saved, node_info.inputs), recompute_ms(rebuilt, rates)))


def make_choose_saved_values_set(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``choose_saved_values_set``: under a budget pair, the partitioner's cheap exact
    recomputation when it meets the budget (module docstring)."""

    @functools.wraps(original)
    def choose_saved_values_set(joint_graph: Any, node_info: Any, memory_budget: float = 1) -> list[Any]:
        from torch_patches._functorch._aot_autograd import saved_tensor_records

        if memory_budget == 1 and saved_tensor_records.observed():
            _record_stock_pareto(original, joint_graph, node_info)
        fraction = ambient_budget_fraction() if memory_budget == 1 else None
        if fraction is None:
            return original(joint_graph, node_info, memory_budget=memory_budget)
        default = original(joint_graph, node_info, memory_budget=1)
        cheap = original(joint_graph, node_info, memory_budget=CHEAP_RECOMPUTE_BUDGET)
        full = _activation_bytes(default, node_info.inputs)
        ratio = _activation_bytes(cheap, node_info.inputs) / full if full else 1.0
        artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
        found = compile_facts.facts()
        if found is not None:
            found.partition_cheap_ratio = ratio
        if ratio > fraction:
            artifact.debug(
                "budget %.3g: the partitioner's cheap recomputation saves %.3f of the activation bytes; "
                "the plan starts from the default partition", fraction, ratio,
            )
            return default
        artifact.debug(
            "budget %.3g met by the partitioner's cheap recomputation (exact): it saves %.3f of the "
            "activation bytes", fraction, ratio,
        )
        if found is not None:
            found.partition_budget_ratio = ratio
        return cheap

    return choose_saved_values_set
