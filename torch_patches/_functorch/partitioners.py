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
saved tensor.

Where that plan cannot meet the budget either (its floor: the stored forms and the plan's
own recomputation hold more than ``F``), or meets it only with lossy storage, the
partitioner's knapsack at ``F`` (what ``activation_memory_budget = F`` gives, recomputing
expensive ops too) is weighed against it (:func:`weigh_knapsack`): the inliner's driver takes
the :class:`PartitionRetry` this patch left on the compilation's facts, which redoes the
partition at ``F`` from the joint graph and fits the plan to it (met, by the ratio as above: nothing stored otherwise on top).
Against a floor, the partition whose plan holds less is taken (:func:`_score`: the bytes at
the forward's end first where the graph is one of several of its step, each of them holding
its saved bytes while the others run; else the step's peak as the graph sees it).  Against
lossy storage, the knapsack is taken when its extra compute costs no more than the lossy
plan's estimated time plus ``config.activation_budget_lossy_margin`` of the graph's compute:
exact first, as the plan's own choice between its plans.  Where it costs more but holds less
than the lossy plan, ``budget(F)`` would peak above ``activation_memory_budget = F``: the
plan is fitted again under what the knapsack holds (:func:`_fit_under`,
``CompileFacts.budget_cap``) and kept where it reaches it faster by more than the margin;
else the knapsack is taken.  Budget pairs entered inside a
compiled region plan their own scope and leave the partition alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from torch_patches import _logging as tp_logging, config
from torch_patches._functorch._aot_autograd import compile_facts, inline_fallback
from torch_patches._functorch._aot_autograd.activation_budget.recompute import draws_random
from torch_patches._functorch._aot_autograd import utils as hook_utils
from torch_patches._functorch._aot_autograd.activation_budget.working_set import unplanned_peak
from torch_patches.hooks.markers import decode


log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch.partitioners"

#: The budget at which the partitioner is asked for its cheap recomputation: below 1, so that
#: it tries its more aggressive min-cut, and so close to 1 that its knapsack, if it runs at
#: all, needs to recompute next to nothing.
CHEAP_RECOMPUTE_BUDGET = 0.999

#: How far above the default partition without a budget a partition's predicted score may
#: be and still be taken: the prediction's own rounding, never a real rise.
PEAK_TOLERANCE = 0.005

#: How close two predicted peaks must be for the prediction not to tell them apart (it is
#: within 10% of the measured peak): then the partition that meets the budget is taken.
PREDICTION_MARGIN = 0.10


@dataclasses.dataclass
class PartitionRetry:
    """What a partition can be redone from at ``fraction``: the joint graph the partitioner
    ran on, and the default partition's activation bytes (the budget's 1).  Left on the
    compilation's facts; the inliner's driver takes it and calls :meth:`weigh` before the
    phases."""

    joint_module: Any
    fraction: float
    default_bytes: int
    #: Where the partitioner's cheap recomputation saves at most the fraction: what it saves
    #: (of the default's bytes); the driver takes it only where it peaks no higher than the
    #: default partition without a budget (:func:`weigh_knapsack`).
    cheap_ratio: float | None = None

    def weigh(self, *graphs: Any) -> list[Any] | None:
        """:func:`weigh_knapsack` of the partitioned graphs the inliner was handed."""
        return weigh_knapsack(self, *graphs)


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


def _mutated_inputs(graph: Any) -> set[str]:
    """The names of the graph's inputs it mutates (functionalized: ``copy_`` into them)."""
    return {
        n.args[0].name
        for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
        if n.args[0].op == "placeholder"
    }


def _recomputes_unsafely(default: list[Any], chosen: list[Any], inputs: list[Any]) -> bool:
    """Whether the backward recomputes, under the saved set ``chosen``, a random op (it would
    draw other numbers) or an op reading an input the graph mutates (it would read the
    mutated value): what the ``default`` set saves (which does neither) and ``chosen`` does
    not is rebuilt from ``chosen`` and the graph's ``inputs``."""
    kept = set(chosen) | set(inputs)
    mutated = _mutated_inputs(default[0].graph) if default else set()
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


def _backward_reads_mutated(fw_module: Any, bw_module: Any) -> set[str]:
    """The inputs the forward mutates that the backward takes (by the forward's names)."""
    return _mutated_inputs(fw_module.graph) & {n.name for n in bw_module.graph.find_nodes(op="placeholder")}


def _device(nodes: Any) -> torch.device:
    """The device of the first tensor among ``nodes``' values (the CPU if none)."""
    return next((n.meta["val"].device for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)), torch.device("cpu"))


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
    rates = Rates.for_device(_device(default))
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
    from torch_patches._functorch._aot_autograd import saved_tensor_records

    if memory_budget == 1 and saved_tensor_records.observed():
        _record_stock_pareto(original, joint_graph, node_info)
    fraction = ambient_budget_fraction() if memory_budget == 1 else None
    if fraction is None:
        return original(joint_graph, node_info, memory_budget=memory_budget)
    default = original(joint_graph, node_info, memory_budget=1)
    found = compile_facts.facts()
    if found is not None:
        found.budget_cap = None
    cheap = original(joint_graph, node_info, memory_budget=CHEAP_RECOMPUTE_BUDGET)
    if _recomputes_unsafely(default, cheap, node_info.inputs):  # other random numbers, mutated inputs
        cheap = default
    full = _activation_bytes(default, node_info.inputs)
    ratio = _activation_bytes(cheap, node_info.inputs) / full if full else 1.0
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    if found is not None:
        found.partition_cheap_ratio = ratio
    if found is not None and full:
        found.partition_retry = PartitionRetry(
            joint_graph.owning_module, fraction, full, cheap_ratio=ratio if ratio <= fraction else None
        )
    if ratio > fraction:
        artifact.debug(
            "budget %.3g: the partitioner's cheap recomputation saves %.3f of the activation bytes; "
            "the plan starts from the default partition", fraction, ratio,
        )
        return default
    if found is not None and full:  # weighed by its peak against the default (weigh_knapsack)
        return default
    artifact.debug(
        "budget %.3g met by the partitioner's cheap recomputation (exact): it saves %.3f of the "
        "activation bytes", fraction, ratio,
    )
    return cheap


def _upstream_after(error: Exception, original: Callable[..., Any], joint_graph: Any, node_info: Any, memory_budget: float) -> list[Any]:
    """Upstream's own choice after an internal ``error`` of :func:`_budget_first` (the
    budget then plans that partition), with one warning; a user's error raises."""
    if not inline_fallback.wants_fallback(error):
        raise error
    inline_fallback.forget_partition_facts()
    inline_fallback.warn_once(
        error, "the budget's partition", f"failed on {inline_fallback.describe_graph(joint_graph, 'joint')}",
        "The partition is torch's own (as without torch_patches); the budget plans it",
    )
    return original(joint_graph, node_info, memory_budget=memory_budget)


# ------------------------------------------------------------ the knapsack, weighed


def _score(plan: Any, after_bytes: int) -> tuple[int, int]:
    """What a partition's plan is compared by.  Where the budget bounds the forward's end (a
    graph that is one of several) the bytes it holds there, then its predicted peak.  Else
    the step's peak as far as this graph sees it: its own predicted peak, or what it holds
    at its forward's end while the rest of the step reads its outputs (``after_bytes``,
    :func:`_grad_outputs_bytes`: a loss after a graph break reads the logits), whichever is
    more; then its own predicted peak."""
    predicted = plan.predicted[0] if plan.predicted else plan.peak[0]
    if plan.bounded_at == "forward_end":
        return plan.bounded[0], predicted
    return max(predicted, plan.predicted_bytes + after_bytes), predicted


def _grad_outputs_bytes(fw_module: Any, inner_meta: Any) -> int:
    """What the rest of the step holds at least after this graph's forward, when the graph
    does not end it: twice the bytes of the outputs that require grad (they and their
    gradients).  A graph returning a scalar that requires grad returns its step's loss: the
    rest of its outputs are the caller's to drop (HF's logits beside the loss), 0."""
    outs = fw_module.graph.output_node().args[0][getattr(inner_meta, "num_mutated_inp_runtime_indices", 0):]
    grads = [
        node
        for info, node in zip(inner_meta.output_info, outs)
        if getattr(info, "requires_grad", False) and isinstance(getattr(node, "meta", {}).get("val"), torch.Tensor)
    ]
    if any(node.meta["val"].dim() == 0 for node in grads):
        return 0
    return sum(2 * hook_utils.nbytes_of(node) for node in grads)


def _saved_activation_bytes(fw_module: Any, num_fwd_outputs: int) -> int:
    """Bytes of the tensors a partitioned forward saves that are not its inputs."""
    saved = [n for n in fw_module.graph.output_node().args[0][num_fwd_outputs:] if isinstance(n, torch.fx.Node)]
    return _activation_bytes(saved, fw_module.graph.find_nodes(op="placeholder"))


def _adopt(dst: Any, src: Any) -> None:
    """``dst`` (a partitioned graph module the caller holds) takes ``src``'s graph and the
    attributes that graph reads."""
    dst.graph = src.graph
    for node in src.graph.find_nodes(op="get_attr"):
        *path, name = node.target.split(".")
        here, there = src, dst
        for part in path:
            here = getattr(here, part)
            if not hasattr(there, part):
                setattr(there, part, torch.nn.Module())
            there = getattr(there, part)
        setattr(there, name, getattr(here, name))
    dst.meta.update(src.meta)


def _repartition(retry: PartitionRetry, fraction: float, num_fwd_outputs: int, static_input_indices: list[int]) -> tuple[Any, Any] | str:
    """The partitioner's own partition of ``retry``'s joint graph under
    ``activation_memory_budget = fraction``, or why it could not be made."""
    try:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return torch._functorch.partitioners.min_cut_rematerialization_partition(
                retry.joint_module, None, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_input_indices
            )
    except Exception as e:  # noqa: BLE001 - the default partition stands; said in the log
        return f"{type(e).__name__}: {e}"


def _unplanned_score(fw: Any, bw: Any, num_fwd_outputs: int, after: int, forward_end: bool) -> int:
    """A partition's score (:func:`_score`) without a plan: its bytes at the forward's end
    where the budget bounds that, else the step's peak as the graph sees it."""
    saved = [n for n in fw.graph.output_node().args[0][num_fwd_outputs:] if isinstance(n, torch.fx.Node)]
    names = {n.name for n in saved}
    bw_saved = [n for n in bw.graph.find_nodes(op="placeholder") if n.name in names]
    peak, at_end, _ = unplanned_peak(fw.graph, bw.graph, saved, bw_saved)
    return at_end if forward_end else max(peak, at_end + after)


def _weigh_cheap(retry: PartitionRetry, fw_module: Any, bw_module: Any, num_fwd_outputs: int, inner_meta: Any, static_input_indices: list[int]) -> bool:
    """Where the partitioner's cheap recomputation met the budget: take it (``fw_module``
    and ``bw_module`` take its graphs) unless it peaks above the default partition without a
    budget (the aggressive min-cut can rebuild long chains in the backward beside what it
    still holds: a budget must never raise the step's peak)."""
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    made = _repartition(retry, CHEAP_RECOMPUTE_BUDGET, num_fwd_outputs, static_input_indices)
    if isinstance(made, str):
        artifact.debug("budget %.3g: the partitioner's cheap recomputation could not be redone (%s)", retry.fraction, made)
        return False
    after = _grad_outputs_bytes(fw_module, inner_meta)
    none = _unplanned_score(fw_module, bw_module, num_fwd_outputs, after, False)
    cheap = _unplanned_score(made[0], made[1], num_fwd_outputs, after, False)
    if cheap > none * (1 + PEAK_TOLERANCE):
        artifact.debug(
            "budget %.3g: the partitioner's cheap recomputation (%.3f of the activation bytes) kept out: its step "
            "peaks at %d B, above the %d B of the default partition without a budget", retry.fraction, retry.cheap_ratio, cheap, none,
        )
        return False
    artifact.debug(
        "budget %.3g met by the partitioner's cheap recomputation (exact): it saves %.3f of the activation bytes "
        "(its step peaks at %d B, the default partition's at %d B)", retry.fraction, retry.cheap_ratio, cheap, none,
    )
    compile_facts.facts().partition_budget_ratio = retry.cheap_ratio
    _adopt(fw_module, made[0])
    _adopt(bw_module, made[1])
    return True


def weigh_knapsack(
    retry: PartitionRetry,
    fw_module: Any,
    bw_module: Any,
    num_fwd_outputs: int,
    inner_meta: Any,
    aot_config: Any,
    static_input_indices: list[int],
    ambient: Any,
) -> list[Any] | None:
    """Where the partitioner's cheap recomputation met the budget, take it unless it peaks
    above no budget (:func:`_weigh_cheap`).  Else, where the ambient budget's plan over the
    default partition sits at its floor, or meets the budget with lossy storage, redo the
    partition (from ``retry``) with the partitioner's knapsack at the budget's fraction and
    keep it (``fw_module`` and ``bw_module`` take its graphs) where it is better (module
    docstring) and peaks no higher than the default partition without a budget.  Returns
    None where the default partition stands, else the records of what the default partition
    saves and the one taken recomputes (``saved_tensor_records``, decided ``recomputed`` by
    the partitioner; none for the cheap recomputation).  Compile time only."""
    from torch_patches._functorch._aot_autograd import inline_phases, saved_tensor_records as records

    if ambient is None or getattr(inner_meta, "tokens", None):
        return None
    if any("rng_state" in n.name for m in (fw_module, bw_module) for n in m.graph.find_nodes(op="placeholder")):
        return None
    if retry.cheap_ratio is not None and _weigh_cheap(retry, fw_module, bw_module, num_fwd_outputs, inner_meta, static_input_indices):
        return []
    args = (num_fwd_outputs, inner_meta, aot_config, static_input_indices, ambient)
    ours, default_records = inline_phases.trial_plans(fw_module, bw_module, *args)
    if len(ours) != 1:
        return None
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    made = _repartition(retry, retry.fraction, num_fwd_outputs, static_input_indices)
    if isinstance(made, str):
        log.warning("budget %.3g: the partitioner's knapsack could not be weighed (%s); the plan stands", retry.fraction, made)
        return None
    fw_k, bw_k = made
    if any(draws_random(n) for n in bw_k.graph.nodes) or (
        _backward_reads_mutated(fw_k, bw_k) - _backward_reads_mutated(fw_module, bw_module)
    ):
        # Upstream's knapsack recomputes random ops without their RNG state, and ops reading
        # an input the forward mutates, after the mutation (stock's activation_memory_budget
        # then computes other gradients).
        artifact.debug("budget %.3g: the partitioner's knapsack recomputes a random op or from a mutated input; the plan stands", retry.fraction)
        return None
    ratio = _saved_activation_bytes(fw_k, num_fwd_outputs) / retry.default_bytes
    found = compile_facts.facts()
    found.partition_budget_ratio = ratio
    theirs, taken_records = inline_phases.trial_plans(fw_k, bw_k, *args)
    after, extra = _grad_outputs_bytes(fw_module, inner_meta), _extra_ms((fw_module, bw_module), (fw_k, bw_k))
    none = _unplanned_score(fw_module, bw_module, num_fwd_outputs, after, ours[0].bounded_at == "forward_end")
    taken, why = _better(ours, theirs, extra, after, none)
    if taken is None:  # exact, holding less, but slower than the lossy plan and its margin
        found.partition_budget_ratio = None
        refit = lambda: inline_phases.trial_plans(fw_module, bw_module, *args)[0]  # noqa: E731
        taken, why = _fit_under(theirs[0], ours[0], why, after, extra, refit)
    artifact.debug("budget %.3g: the partitioner's knapsack (%.3f of the activation bytes) %s", retry.fraction, ratio, why)
    if not taken:
        found.partition_budget_ratio = None
        return None
    found.partition_budget_ratio, found.budget_cap = ratio, None
    _adopt(fw_module, fw_k)
    _adopt(bw_module, bw_k)
    kept = {r.name for r in taken_records}
    why = f"recomputed by the partitioner: its knapsack at {retry.fraction:g} (activation_memory_budget's own) {why}"
    dropped = [r for r in default_records if r.name not in kept and not r.is_input]
    for r in dropped:
        r.leave("partitioner", why, records.RECOMPUTED)
    return dropped


def _better(ours: list[Any], theirs: list[Any], extra: tuple[float, float], after: int, none: int | None = None) -> tuple[bool | None, str]:
    """Whether the knapsack's partition (its plan ``theirs``) is taken over the default's
    (``ours``), and why in words.  Where our plan misses the budget: the lower score
    (:func:`_score`).  Where it meets it with lossy storage: the knapsack when it meets it
    too, exactly, and its recomputation costs at most our plan's estimated time plus
    ``config.activation_budget_lossy_margin`` of the graph's compute (the least lossy plan's
    rule, :func:`~torch_patches._functorch._aot_autograd.activation_budget.planner.choose`;
    ``extra``: :func:`_extra_ms`).  None where it costs more than that but holds less than
    our plan, or where both are exact and it holds less: ``weigh_knapsack`` fits our plan
    under it (:func:`_fit_under`)."""
    if len(theirs) != 1 or theirs[0].lossy:
        return False, "kept out: its plan is not exact"
    mine, knap = ours[0], theirs[0]
    scores = _score(knap, after), _score(mine, after)
    if none is not None and scores[0][0] > none * (1 + PEAK_TOLERANCE):
        return False, f"kept out: it holds {scores[0][0]} B, above the {none} B of the default partition without a budget"
    if not mine.met:
        if scores[0] < scores[1]:
            return True, f"taken over the plan's floor: it holds {scores[0][0]} B against {scores[1][0]} B"
        if knap.met and scores[0][0] <= scores[1][0] * (1 + PREDICTION_MARGIN):
            # Closer than the prediction can tell: the partition known to hold less, the one
            # meeting the budget (stock's own), is taken.
            return True, (
                f"taken over the plan's floor: it meets the budget the floor misses, and holds {scores[0][0]} B "
                f"against {scores[1][0]} B, closer than the prediction's {PREDICTION_MARGIN:.0%}"
            )
        return False, f"kept out: it holds {scores[0][0]} B against the plan's floor's {scores[1][0]} B"
    if not knap.met:
        return False, "kept out: it misses the budget the plan meets"
    if not mine.lossy:  # both exact: never above stock, the plan fitted under it where it holds less
        if scores[0][0] < scores[1][0] * (1 - PEAK_TOLERANCE):
            return None, f"it holds {scores[0][0]} B where the plan's exact storage holds {scores[1][0]} B"
        return False, f"kept out: it holds {scores[0][0]} B, no less than the plan's exact storage ({scores[1][0]} B)"
    in_time, allowed = _in_time(mine, extra)
    if in_time:
        return True, (
            f"taken over the plan's lossy storage: exact, recomputing for {extra[0]:.3f} ms <= {allowed:.3f} ms; "
            f"it holds {scores[0][0]} B against the plan's {scores[1][0]} B" + ("" if none is None else f" and {none} B without a budget")
        )
    why = f"its recomputation {extra[0]:.3f} ms > {allowed:.3f} ms, the lossy plan's time and margin"
    if scores[0][0] < scores[1][0]:
        return None, why
    return False, f"kept out: {why}"


def _extra_ms(default: tuple[Any, Any], knapsack: tuple[Any, Any]) -> tuple[float, float]:
    """The knapsack's partition's estimated compute beyond the default partition's, and
    ``config.activation_budget_lossy_margin`` of the default's, in ms."""
    from torch_patches._functorch._aot_autograd.activation_budget.cost_model import Rates, graph_compute_ms

    rates = Rates.for_device(_device(default[0].graph.nodes))
    base = graph_compute_ms(default[0].graph, default[1].graph, rates)
    return graph_compute_ms(knapsack[0].graph, knapsack[1].graph, rates) - base, config.activation_budget_lossy_margin * base


def _in_time(mine: Any, extra: tuple[float, float]) -> tuple[bool, float]:
    """Whether the knapsack's recomputation (``extra``: :func:`_extra_ms`) costs at most our
    lossy plan ``mine``'s estimated time plus the margin, and that allowance in ms."""
    allowed = mine.estimated_ms + extra[1]
    return extra[0] <= allowed, allowed


def _fit_under(
    knap: Any, mine: Any, why: str, after: int, extra: tuple[float, float], refit: Callable[[], list[Any]]
) -> tuple[bool, str]:
    """Where the knapsack's partition (its plan ``knap``) holds less than our lossy plan
    ``mine`` (:func:`_score`) but recomputes more slowly than its time and margin
    (``extra``: :func:`_extra_ms`): our plan is fitted again under what the knapsack holds
    (``refit``: the trial under ``CompileFacts.budget_cap``; where the score is what the
    forward's end holds while the rest of the step runs, that point's bytes, else every
    point's), so that ``budget(F)`` holds no more than ``activation_memory_budget = F``.
    That plan is kept, its cap left on the facts for the phases' fit, where it reaches the
    knapsack's score and is still estimated faster by more than the margin; else the
    knapsack is taken."""
    found = compile_facts.facts()
    goal = _score(knap, after)[0]
    for _ in range(3):  # the bytes the budget bounds and the step's peak move together, not 1:1
        held = _score(mine, after)[0]
        if held <= goal:
            break
        at_end = mine.bounded_at == "forward_end" or mine.predicted_bytes + after >= held
        bound = mine.predicted_bytes if at_end and mine.bounded_at != "forward_end" else mine.bounded[0]
        found.budget_cap = (bound - (held - goal), at_end)
        fitted = refit()
        if len(fitted) != 1 or not fitted[0].met or _score(fitted[0], after)[0] >= held:
            break
        mine = fitted[0]
    held = _score(mine, after)[0]
    if held > goal:
        found.budget_cap = None
        return True, f"taken: {why}, but it holds {goal} B where the plan's options hold {held} B at least"
    in_time, allowed = _in_time(mine, extra)
    if in_time:
        found.budget_cap = None
        return True, (
            f"taken: it holds {goal} B; the plan fitted under it (estimated {mine.estimated_ms:.3f} ms) leaves its "
            f"recomputation {extra[0]:.3f} ms <= {allowed:.3f} ms"
        )
    return False, (
        f"kept out: {why}; the plan is fitted under what it holds instead ({held} B against its {goal} B, "
        f"estimated {mine.estimated_ms:.3f} ms)"
    )
