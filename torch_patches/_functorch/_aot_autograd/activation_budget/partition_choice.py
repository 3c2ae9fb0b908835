"""The partition choice: which partition an ambient fractional budget plans.

The partitioner patch (``torch_patches/_functorch/partitioners.py``) keeps the default
partition and leaves a :class:`~torch_patches._functorch._aot_autograd.compile_facts.PartitionOffer`
on the compilation's facts: the joint graph it ran on, the budget's fraction, the default
partition's activation bytes and what its cheap recomputation saves.  The inliner's driver
takes the offer and calls :func:`choose_partition` before the phases, with the ``trial``
function that fits the budget's plans to a graph pair (``inline_phases.trial_plans``).  Data
flows one way: the offer in, the graphs adopted and :class:`~.solver.PartitionTerms` out
(the ratio the plan measures the budget against, the cap it is fitted under), which the
phases hand the planner through :class:`~.planner.GraphFacts`.

The choice, in order:

* **The cheap recomputation** (the partitioner's more aggressive min-cut, exact), where it
  saves at most the fraction: taken unless its step peaks above the default partition
  without a budget (it can rebuild long chains in the backward beside what it still holds;
  a budget must never raise the step's peak).
* **The knapsack** at the fraction (what ``activation_memory_budget = F`` gives, recomputing
  expensive ops too), weighed against the plan over the default partition (:func:`_better`):
  against the plan's floor, the partition that holds less (:func:`_score`; within the fx
  model's margin, the one meeting the budget, and where Inductor prices the knapsack, the
  floor, which the ceiling prices beside it); against lossy storage, the knapsack when
  its extra compute costs no more than the lossy plan's estimated time plus
  ``config.activation_budget_lossy_margin`` of the graph's compute; against exact storage
  that holds more, the plan fitted under it.  Where the knapsack holds less than the plan but
  recomputes too slowly, the plan is fitted again under what the knapsack holds
  (:func:`_fit_under`) and kept where it reaches it faster by more than the margin; else the
  knapsack is taken.  Never a partition that peaks above the default without a budget, nor
  one that recomputes a random op or reads an input the forward mutates.

Each partition without a plan (the default, the cheap recomputation, the knapsack) is
priced by Inductor's own accounting where Inductor compiles the graph
(:mod:`.inductor_accounting`, through the driver's ``Pricing``), else by the fx model
(:func:`~.step_peak.unplanned_peak`); the prices stay on the choice for the ceiling
(:mod:`.ceiling`), which holds the plan's graphs to the lower of the default and the knapsack.

Compile time only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
from torch import fx

from torch_patches import _logging as tp_logging, config
from torch_patches._functorch._aot_autograd import utils as hook_utils
from torch_patches._functorch._aot_autograd.activation_budget.cost_model import Rates, graph_compute_ms
from torch_patches._functorch._aot_autograd.activation_budget.inductor_accounting import Accounted, Pricing
from torch_patches._functorch._aot_autograd.activation_budget.recompute import draws_random
from torch_patches._functorch._aot_autograd.activation_budget.solver import PartitionTerms, Plan
from torch_patches._functorch._aot_autograd.activation_budget.step_peak import unplanned_peak
from torch_patches._functorch._aot_autograd.compile_facts import PartitionOffer
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair
from torch_patches._functorch._aot_autograd.saved_tensor_records import RECOMPUTED, Bounds, DecidedBy, SavedTensorRecord

log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch.partitioners"

#: How far above the default partition without a budget a partition's predicted score may
#: be and still be taken: the prediction's own rounding, never a real rise.
PEAK_TOLERANCE = 0.005

#: How close two predicted peaks must be for the prediction not to tell them apart (it is
#: within 10% of the measured peak): then the partition that meets the budget is taken.
PREDICTION_MARGIN = 0.10

#: Fits the budget's plans to a graph pair under the given terms: the ambient pair's plans
#: and the saved tensors' records (``inline_phases.trial_plans``, its ``context`` and
#: ``ambient`` bound by :func:`choose_partition`).
Trial = Callable[[fx.GraphModule, fx.GraphModule, PartitionTerms], tuple[list[Plan], list[SavedTensorRecord]]]
#: :data:`Trial` before its keywords are bound (``inline_phases.trial_plans`` as the driver
#: hands it).
UnboundTrial = Callable[..., tuple[list[Plan], list[SavedTensorRecord]]]


@dataclasses.dataclass
class PartitionChoice:
    """What :func:`choose_partition` decided: the terms the phases' plan is fitted under,
    and the records of what the default partition saves and the partition taken recomputes
    (decided ``recomputed`` by the partitioner; empty where the default stands or the cheap
    recomputation was taken)."""

    terms: PartitionTerms
    recomputed: list[SavedTensorRecord] = dataclasses.field(default_factory=list)
    #: The accounting the partitions were priced by, with their prices (the ceiling reads
    #: the default's and the knapsack's).
    pricing: Pricing = dataclasses.field(default_factory=lambda: Pricing(False))


@dataclasses.dataclass(frozen=True)
class _Graphs:
    """The partitioned graph pair the inliner was handed, and what the choice reads of it."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int
    static_input_indices: list[int]
    #: What the rest of the step holds after the forward (:func:`grad_outputs_bytes`).
    after: int
    #: How partitions are priced (:mod:`.inductor_accounting`).
    pricing: Pricing


def choose_partition(
    offer: PartitionOffer | None,
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    context: tuple[int, object, object, list[int]],
    ambient: HookPair | None,
    trial: UnboundTrial,
) -> PartitionChoice:
    """The partition the ambient budget plans (module docstring): ``fw_module`` and
    ``bw_module`` take the graphs of the partition taken, if not the default.  ``context``:
    the driver's (inner forward outputs, ``ViewAndMutationMeta``, AOT config, static input
    indices).  Under a budget the choice carries how partitions are priced
    (:mod:`.inductor_accounting`: Inductor's accounting where Inductor compiles, else the fx
    model) for the ceiling."""
    num_fwd_outputs, inner_meta, _, static_input_indices = context
    budgeted = ambient is not None and ambient.kind.budget is not None
    pricing = Pricing.for_compilation(fw_module, inner_meta, static_input_indices) if budgeted else Pricing(False)
    if offer is None or ambient is None:
        return PartitionChoice(PartitionTerms(), pricing=pricing)
    stands = PartitionChoice(PartitionTerms(cheap_ratio=offer.cheap_ratio), pricing=pricing)
    if getattr(inner_meta, "tokens", None):
        return stands
    if any("rng_state" in n.name for m in (fw_module, bw_module) for n in m.graph.find_nodes(op="placeholder")):
        return stands
    graphs = _Graphs(fw_module, bw_module, num_fwd_outputs, static_input_indices, grad_outputs_bytes(fw_module, inner_meta), pricing)
    if offer.cheap_met and _cheap_holds_no_more(offer, graphs):
        return PartitionChoice(PartitionTerms(cheap_ratio=offer.cheap_ratio, ratio=offer.cheap_ratio), pricing=pricing)
    return _weigh_knapsack(offer, graphs, functools.partial(trial, context=context, ambient=ambient), stands)


def _cheap_holds_no_more(offer: PartitionOffer, graphs: _Graphs) -> bool:
    """Whether the cheap recomputation (redone from the offer) peaks no higher than the
    default partition without a budget; if so the graphs take it."""
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    made = partition(offer, offer.cheap_budget, graphs.num_fwd_outputs, graphs.static_input_indices)
    if isinstance(made, str):
        artifact.debug("budget %.3g: the partitioner's cheap recomputation could not be redone (%s)", offer.fraction, made)
        return False
    none = _unplanned_score(graphs.fw, graphs.bw, graphs, False, "default")
    cheap = _unplanned_score(made[0], made[1], graphs, False, "cheap")
    if cheap > none * (1 + PEAK_TOLERANCE):
        artifact.debug(
            "budget %.3g: the partitioner's cheap recomputation (%.3f of the activation bytes) kept out: its step "
            "peaks at %d B, above the %d B of the default partition without a budget (priced by %s)",
            offer.fraction,
            offer.cheap_ratio,
            cheap,
            none,
            graphs.pricing.name,
        )
        return False
    artifact.debug(
        "budget %.3g met by the partitioner's cheap recomputation (exact): it saves %.3f of the activation bytes "
        "(its step peaks at %d B, the default partition's at %d B, priced by %s)",
        offer.fraction,
        offer.cheap_ratio,
        cheap,
        none,
        graphs.pricing.name,
    )
    adopt(graphs.fw, made[0])
    adopt(graphs.bw, made[1])
    return True


def _weigh_knapsack(offer: PartitionOffer, graphs: _Graphs, trial: Trial, stands: PartitionChoice) -> PartitionChoice:
    """The knapsack at the offer's fraction weighed against the plan over the default
    partition (module docstring)."""
    default_terms = stands.terms
    ours, default_records = trial(graphs.fw, graphs.bw, default_terms)
    if len(ours) != 1:
        return stands
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)
    made = partition(offer, offer.fraction, graphs.num_fwd_outputs, graphs.static_input_indices)
    if isinstance(made, str):
        graphs.pricing.rule_out("knapsack")  # not made again for the ceiling
        log.warning("budget %.3g: the partitioner's knapsack could not be weighed (%s); the plan stands", offer.fraction, made)
        return stands
    fw_k, bw_k = made
    if unsafe(fw_k, bw_k, (graphs.fw.graph, graphs.bw.graph)):
        graphs.pricing.rule_out("knapsack")  # the ceiling holds the plan against it neither
        # Upstream's knapsack recomputes random ops without their RNG state, and ops reading
        # an input the forward mutates, after the mutation (stock's activation_memory_budget
        # then computes other gradients).
        artifact.debug(
            "budget %.3g: the partitioner's knapsack recomputes a random op or from a mutated input; the plan stands", offer.fraction
        )
        return stands
    ratio = _saved_activation_bytes(fw_k, graphs.num_fwd_outputs) / offer.default_bytes
    knapsack_terms = dataclasses.replace(default_terms, ratio=ratio)
    theirs, taken_records = trial(fw_k, bw_k, knapsack_terms)
    extra = _extra_ms((graphs.fw, graphs.bw), (fw_k, bw_k))
    forward_end = ours[0].bounded_at == Bounds.FORWARD_END
    none = _unplanned_score(graphs.fw, graphs.bw, graphs, forward_end, "default")
    accounted = graphs.pricing.of("knapsack", fw_k, bw_k, forward_only=forward_end)
    knap_score = None if accounted is None else accounted.score(forward_end, graphs.after)
    taken, why = _better(ours, theirs, extra, graphs.after, none, knap_score)
    cap = None
    if taken is None:  # exact, holding less, but slower than the lossy plan and its margin
        refit = lambda c: trial(graphs.fw, graphs.bw, dataclasses.replace(default_terms, cap=c))[0]  # noqa: E731
        taken, why, cap = _fit_under(theirs[0], ours[0], why, graphs.after, extra, refit, knap_score)
    artifact.debug(
        "budget %.3g: the partitioner's knapsack (%.3f of the activation bytes) %s (priced by %s)",
        offer.fraction,
        ratio,
        why,
        graphs.pricing.name,
    )
    if not taken:
        return PartitionChoice(dataclasses.replace(default_terms, cap=cap), pricing=graphs.pricing)
    adopt(graphs.fw, fw_k)
    adopt(graphs.bw, bw_k)
    kept = {r.name for r in taken_records}
    why = f"recomputed by the partitioner: its knapsack at {offer.fraction:g} (activation_memory_budget's own) {why}"
    dropped = [r for r in default_records if r.name not in kept and not r.is_input]
    for r in dropped:
        r.leave(DecidedBy.PARTITIONER, why, RECOMPUTED)
    return PartitionChoice(knapsack_terms, dropped, graphs.pricing)


# ------------------------------------------------------------ the partitions, redone and scored


def partition(
    offer: PartitionOffer, fraction: float, num_fwd_outputs: int, static_input_indices: list[int]
) -> tuple[fx.GraphModule, fx.GraphModule] | str:
    """The partitioner's own partition of the offer's joint graph under
    ``activation_memory_budget = fraction``, or why it could not be made."""
    try:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return torch._functorch.partitioners.min_cut_rematerialization_partition(
                offer.joint_module,
                None,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static_input_indices,
            )
    except Exception as e:  # noqa: BLE001 - the default partition stands; said in the log
        return f"{type(e).__name__}: {e}"


def unsafe(fw: fx.GraphModule, bw: fx.GraphModule, default: tuple[fx.Graph, fx.Graph]) -> bool:
    """Whether a partition recomputes a random op, or an op reading an input the forward
    mutates that the default partition (its graphs ``default``) does not read in its
    backward: both give other gradients than the default partition."""
    return any(draws_random(n) for n in bw.graph.nodes) or bool(
        _backward_reads_mutated(fw.graph, bw.graph) - _backward_reads_mutated(*default)
    )


def adopt(dst: fx.GraphModule, src: fx.GraphModule) -> None:
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


def _backward_reads_mutated(fw_g: fx.Graph, bw_g: fx.Graph) -> set[str]:
    """The inputs the forward mutates that the backward takes (by the forward's names)."""
    return hook_utils.mutated_inputs(fw_g) & {n.name for n in bw_g.find_nodes(op="placeholder")}


def grad_outputs_bytes(fw_module: fx.GraphModule, inner_meta: object) -> int:
    """What the rest of the step holds at least after this graph's forward, when the graph
    does not end it: twice the bytes of the outputs that require grad (they and their
    gradients).  A graph returning a scalar that requires grad returns its step's loss: the
    rest of its outputs are the caller's to drop (HF's logits beside the loss), 0."""
    outs = hook_utils.graph_outputs(fw_module.graph)[getattr(inner_meta, "num_mutated_inp_runtime_indices", 0) :]
    grads = [
        node
        for info, node in zip(getattr(inner_meta, "output_info", ()), outs)
        if getattr(info, "requires_grad", False) and isinstance(getattr(node, "meta", {}).get("val"), torch.Tensor)
    ]
    if any(node.meta["val"].dim() == 0 for node in grads):
        return 0
    return sum(2 * hook_utils.nbytes_of(node) for node in grads)


def _saved_activation_bytes(fw_module: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes of the tensors a partitioned forward saves that are not its inputs."""
    saved = [n for n in hook_utils.graph_outputs(fw_module.graph)[num_fwd_outputs:] if isinstance(n, fx.Node)]
    return hook_utils.activation_bytes(saved, fw_module.graph.find_nodes(op="placeholder"))


def _score(plan: Plan, after_bytes: int) -> tuple[int, int]:
    """What a partition's plan is compared by.  Where the budget bounds the forward's end (a
    graph that is one of several) the bytes it holds there, then its predicted peak.  Else
    the step's peak as far as this graph sees it: its own predicted peak, or what it holds
    at its forward's end while the rest of the step reads its outputs (``after_bytes``,
    :func:`grad_outputs_bytes`: a loss after a graph break reads the logits), whichever is
    more; then its own predicted peak."""
    predicted = plan.predicted[0] if plan.predicted else plan.peak[0]
    if plan.bounded_at == Bounds.FORWARD_END:
        return plan.bounded[0], predicted
    return max(predicted, plan.predicted_bytes + after_bytes), predicted


def _knapsack_score(knap: Plan, after: int, accounted: int | None) -> tuple[int, int]:
    """The knapsack's :func:`_score`, its first term Inductor's accounting where given."""
    score = _score(knap, after)
    return score if accounted is None else (accounted, score[1])


def _unplanned_score(fw: fx.GraphModule, bw: fx.GraphModule, graphs: _Graphs, forward_end: bool, role: str) -> int:
    """A partition's score (:func:`_score`) without a plan: its bytes at the forward's end
    where the budget bounds that, else the step's peak as the graph sees it; by Inductor's
    accounting where the graphs price by it (``role``: the partition's, priced once), else
    by the fx model."""
    accounted: Accounted | None = graphs.pricing.of(role, fw, bw, forward_only=forward_end)
    if accounted is not None:
        return accounted.score(forward_end, graphs.after)
    saved = [n for n in hook_utils.graph_outputs(fw.graph)[graphs.num_fwd_outputs :] if isinstance(n, fx.Node)]
    names = {n.name for n in saved}
    bw_saved = [n for n in bw.graph.find_nodes(op="placeholder") if n.name in names]
    peak, at_end, _ = unplanned_peak(fw.graph, bw.graph, saved, bw_saved)
    return at_end if forward_end else max(peak, at_end + graphs.after)


def _extra_ms(default: tuple[fx.GraphModule, fx.GraphModule], knapsack: tuple[fx.GraphModule, fx.GraphModule]) -> tuple[float, float]:
    """The knapsack's partition's estimated compute beyond the default partition's, and
    ``config.activation_budget_lossy_margin`` of the default's, in ms."""
    rates = Rates.for_device(hook_utils.device_of(default[0].graph.nodes))
    base = graph_compute_ms(default[0].graph, default[1].graph, rates)
    return graph_compute_ms(knapsack[0].graph, knapsack[1].graph, rates) - base, config.activation_budget_lossy_margin * base


# ------------------------------------------------------------ the weighing (pure over plans)


def _better(
    ours: list[Plan], theirs: list[Plan], extra: tuple[float, float], after: int, none: int | None = None, knap_score: int | None = None
) -> tuple[bool | None, str]:
    """Whether the knapsack's partition (its plan ``theirs``) is taken over the default's
    (``ours``), and why in words.  Where our plan misses the budget: the lower score
    (:func:`_score`).  Where it meets it with lossy storage: the knapsack when it meets it
    too, exactly, and its recomputation costs at most our plan's estimated time plus
    ``config.activation_budget_lossy_margin`` of the graph's compute (the least lossy plan's
    rule, :func:`~.planner.choose`; ``extra``: :func:`_extra_ms`).  None where it costs more
    than that but holds less than our plan, or where both are exact and it holds less: our
    plan is fitted under it (:func:`_fit_under`).  ``knap_score``: the knapsack's score by
    Inductor's accounting, where it prices (else its plan's prediction)."""
    if len(theirs) != 1 or theirs[0].lossy:
        return False, "kept out: its plan is not exact"
    mine, knap = ours[0], theirs[0]
    scores = _knapsack_score(knap, after, knap_score), _score(mine, after)
    if none is not None and scores[0][0] > none * (1 + PEAK_TOLERANCE):
        return False, f"kept out: it holds {scores[0][0]} B, above the {none} B of the default partition without a budget"
    if not mine.met:
        if scores[0] < scores[1]:
            return True, f"taken over the plan's floor: it holds {scores[0][0]} B against {scores[1][0]} B"
        if knap.met and knap_score is None and scores[0][0] <= scores[1][0] * (1 + PREDICTION_MARGIN):
            # Closer than the prediction can tell: the partition known to hold less, the one
            # meeting the budget (stock's own), is taken.  Where Inductor's accounting prices
            # the knapsack, the floor stays: the ceiling prices its graphs too and takes the
            # lower of the two (a knapsack meeting the fraction can peak above a looser one).
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


def _in_time(mine: Plan, extra: tuple[float, float]) -> tuple[bool, float]:
    """Whether the knapsack's recomputation (``extra``: :func:`_extra_ms`) costs at most our
    lossy plan ``mine``'s estimated time plus the margin, and that allowance in ms."""
    allowed = mine.estimated_ms + extra[1]
    return extra[0] <= allowed, allowed


def _fit_under(
    knap: Plan,
    mine: Plan,
    why: str,
    after: int,
    extra: tuple[float, float],
    refit: Callable[[tuple[int, bool]], list[Plan]],
    knap_score: int | None = None,
) -> tuple[bool, str, tuple[int, bool] | None]:
    """Where the knapsack's partition (its plan ``knap``) holds less than our plan ``mine``
    (:func:`_score`) but recomputes more slowly than its time and margin (``extra``:
    :func:`_extra_ms`): our plan is fitted again under what the knapsack holds (``refit``:
    the trial under a cap, ``(bytes, forward's end only)``: where the score is what the
    forward's end holds while the rest of the step runs, that point's bytes, else every
    point's), so that ``budget(F)`` holds no more than ``activation_memory_budget = F``.
    Returns whether the knapsack is taken, why, and the cap the phases' plan is fitted under
    where it is not: that plan is kept where it reaches the knapsack's score and is still
    estimated faster by more than the margin; else the knapsack is taken."""
    goal = _knapsack_score(knap, after, knap_score)[0]
    cap = None
    for _ in range(3):  # the bytes the budget bounds and the step's peak move together, not 1:1
        held = _score(mine, after)[0]
        if held <= goal:
            break
        at_end = mine.bounded_at == Bounds.FORWARD_END or mine.predicted_bytes + after >= held
        bound = mine.predicted_bytes if at_end and mine.bounded_at != Bounds.FORWARD_END else mine.bounded[0]
        cap = (bound - (held - goal), at_end)
        fitted = refit(cap)
        if len(fitted) != 1 or not fitted[0].met or _score(fitted[0], after)[0] >= held:
            break
        mine = fitted[0]
    held = _score(mine, after)[0]
    if held > goal:
        return True, f"taken: {why}, but it holds {goal} B where the plan's options hold {held} B at least", None
    in_time, allowed = _in_time(mine, extra)
    if in_time:
        return (
            True,
            (
                f"taken: it holds {goal} B; the plan fitted under it (estimated {mine.estimated_ms:.3f} ms) leaves its "
                f"recomputation {extra[0]:.3f} ms <= {allowed:.3f} ms"
            ),
            None,
        )
    return (
        False,
        (
            f"kept out: {why}; the plan is fitted under what it holds instead ({held} B against its {goal} B, "
            f"estimated {mine.estimated_ms:.3f} ms)"
        ),
        cap,
    )
