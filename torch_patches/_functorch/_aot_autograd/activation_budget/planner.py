"""The budget's glue: from a compiled graph's saved tensors to a fitted :class:`Plan` per
budget pair (:func:`plan`), and from the plans into the saved tensors' records (each
record's option, hooks or recipe, and each plan's summary, :mod:`.summary`: :func:`apply_plans`).  The facts
of the graph pair every plan reads are built once (:class:`GraphFacts`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Set
from typing import Any

import torch
import torch.fx as fx

from torch_patches import config
from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs, donated_inputs
from torch_patches._functorch._aot_autograd.activation_budget.cost_model import (
    Rates,
    copy_engine,
    graph_compute_ms,
    lossy_tolerance,
    options_for,
    windows,
)
from torch_patches._functorch._aot_autograd.activation_budget.exact import exact_or_greedy_fit
from torch_patches._functorch._aot_autograd.activation_budget.recompute import Recipe, with_recipes
from torch_patches._functorch._aot_autograd.activation_budget.solver import (
    KEEP,
    LOSS,
    RECOMPUTE,
    Choice,
    Option,
    PartitionTerms,
    Plan,
    Span,
    _on_hull,
    _penalized,
    _unpenalized,
    greedy_fit,
)
from torch_patches._functorch._aot_autograd.activation_budget.step_peak import predicted_peak
from torch_patches._functorch._aot_autograd.activation_budget.summary import OFFLOADS, summarize
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair
from torch_patches._functorch._aot_autograd.saved_tensor_records import (
    ALIAS,
    HOOKED,
    RECOMPUTED,
    Bounds,
    BudgetPlanSummary,
    DecidedBy,
    SavedTensorRecord,
    observed as records_observed,
)
from torch_patches._functorch._aot_autograd.utils import nbytes_of
from torch_patches.hooks import chain, cpu_offload, inlineable
from torch_patches.hooks.compress import bf16_pack, bf16_unpack, fp8_rowwise, int8_rowwise

#: What the plans are fitted with: the exact programme where it applies, else the greedy
#: (:mod:`.exact`).  The floor's plan is always the greedy's: it brings every point as low
#: as the options take it.
SOLVER: Callable[[Plan], int] = exact_or_greedy_fit


#: ``config.activation_budget_bounds``'s values.
BOUNDS = ("auto", "every_point", "forward_end")


@dataclasses.dataclass(frozen=True, eq=False)
class GraphFacts:
    """What every budget plan of one forward/backward graph pair reads.

    ``inputs``: the forward's placeholders and their input descriptions (None for an
    activation); ``held``: forward inputs the caller keeps (a recomputation may read
    them); ``bw_inputs``: the backward's placeholder per saved tensor's name;
    ``records``: the saved tensors' records (``saved_tensor_records``), by forward node;
    ``autograd_inputs``: the forward's inputs that autograd produced before the graph
    (``activation_inputs.autograd_inputs``: the graph is one of several of its step)."""

    fw_g: fx.Graph
    bw_g: fx.Graph
    bw_inputs: dict[str, fx.Node]
    inputs: dict[fx.Node, str | None]
    held: set[fx.Node]
    saved_tensors: list[fx.Node]
    records: dict[fx.Node, SavedTensorRecord]
    autograd_inputs: tuple[str, ...] = ()
    #: The partition choice's terms for the ambient budget's plan.
    partition: PartitionTerms = PartitionTerms()

    @functools.cached_property
    def bounds(self) -> tuple[Bounds, str]:
        """Which points a budget bounds in this graph, ``"every_point"`` or ``"forward_end"``
        (``config.activation_budget_bounds``; ``"auto"``: the forward's end where autograd
        produced an input of the graph), and that and why, in words."""
        mode = config.activation_budget_bounds
        if mode not in BOUNDS:
            raise SavedTensorsHookConfigError(f"torch_patches.config.activation_budget_bounds must be one of {BOUNDS}, got {mode!r}")
        if mode == "auto" and self.autograd_inputs:
            mode, why = "forward_end", f"one graph of several in its step (autograd produced its input {', '.join(self.autograd_inputs)})"
        elif mode == "auto":
            mode, why = "every_point", "the graph is its step (no input of it comes from autograd)"
        else:
            why = f"config.activation_budget_bounds = {mode!r}"
        where = "every point" if mode == "every_point" else "the forward's end"
        return Bounds(mode), f"{where}: {why}"

    @functools.cached_property
    def bw_pos(self) -> dict[fx.Node, int]:
        """Each backward node's position (the plans' points)."""
        return {n: i for i, n in enumerate(self.bw_g.nodes)}

    @functools.cached_property
    def point_names(self) -> dict[int, str]:
        return {i: n.name for n, i in self.bw_pos.items()}


@functools.cache
def option_hooks(name: str) -> tuple[Any, Any]:
    """The hook pair of a storage option (one object per option: traces are shared)."""
    if name == "bf16":
        return inlineable(bf16_pack, bf16_unpack)
    if name == "int8":
        return int8_rowwise(where=None)
    if name == "fp8":
        return fp8_rowwise(where=None)
    if name == "offload":
        return cpu_offload()
    if name == "fp8+offload":
        return chain(fp8_rowwise(where=None), cpu_offload())
    raise ValueError(f"unknown storage option {name!r}")


def backward_span(saved: list[fx.Node], bw_inputs: dict[str, fx.Node], bw_pos: dict[fx.Node, int]) -> Span:
    """The :class:`Span` of the storage the ``saved`` tensors read: from the first backward
    node using one of them to the last node using one of them or a view of one (a view
    keeps the storage alive).  Unused: held to the backward's end."""
    end = len(bw_pos)
    first, last = end, -1
    stack = [bw_inputs[s.name] for s in saved if s.name in bw_inputs]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if node.op == "placeholder":
                first = min(first, bw_pos[user])
            last = max(last, bw_pos[user])
            if act_inputs.storage_root(user) is act_inputs.storage_root(node):  # a view of it
                stack.append(user)
    return Span(first, max(last, first))


@dataclasses.dataclass
class Units:
    """What a budget pair's plans are made of (:func:`build_choices`): one :class:`Choice` per
    storage the plan may store otherwise, the bytes and backward spans of those it cannot,
    what the pair saves without hooks, the cost model's rates, and how many graphs ahead the
    reloads of a graph of several start (0: none)."""

    choices: list[Choice]
    groups: dict[fx.Node, list[fx.Node]]
    baseline: int
    fixed: int
    fixed_spans: tuple[tuple[Span, int], ...]
    rates: Rates
    ahead: int


def build_choices(spec: Any, facts: GraphFacts, members: list[fx.Node], plannable: list[fx.Node], aliases: dict[fx.Node, fx.Node]) -> Units:
    """The choices of a budget pair (see :func:`plan`): per storage its options and their
    cost (:mod:`.cost_model`), its backward span."""
    fw_g, bw_g, bw_inputs = facts.fw_g, facts.bw_g, facts.bw_inputs
    groups: dict[fx.Node, list[fx.Node]] = {}
    for s in members:
        root = act_inputs.storage_root(s)
        if not (root.op == "placeholder" and facts.inputs.get(root) is not None):  # an activation
            groups.setdefault(root, []).append(s)
    storage = {root: max([nbytes_of(root), *map(nbytes_of, saved)]) for root, saved in groups.items()}
    plannable_set = set(plannable)
    covered = plannable_set | {a for a, r in aliases.items() if r in plannable_set}
    planned = {root: [s for s in saved if s in plannable_set] for root, saved in groups.items()}
    planned = {root: saved for root, saved in planned.items() if saved and set(groups[root]) <= covered}
    spans = {root: backward_span(saved, bw_inputs, facts.bw_pos) for root, saved in groups.items()}
    nodes = [s for saved in planned.values() for s in saved]
    device = next((s.meta["val"].device for s in nodes), torch.device("cpu"))
    rates = Rates.for_device(device)
    # One graph of several, whose reloads start a graph ahead (offload_prefetch): its
    # copies hide behind the graphs beside it as well.
    ahead = int(config.offload_prefetch_graphs) if facts.autograd_inputs else 0
    if any(o in spec.options for o in OFFLOADS) and any(copy_engine(s.meta["val"].device) for s in nodes):
        hidden = windows(nodes, bw_inputs, fw_g, bw_g, rates, neighbours=ahead > 0)
    else:  # no copy to hide: skip estimating the compute of every node
        hidden = dict.fromkeys(nodes, (0.0, 0.0))
    choices = []
    for root, saved in planned.items():
        per = []
        for s in saved:
            info = facts.records[s].info()
            opts = options_for(s.meta["val"], info.nbytes, spec.options, lossy_tolerance(info), hidden[s], rates)
            per.append({o.name: o for o in opts})
        common = [name for name in per[0] if name != KEEP and all(name in p for p in per)]
        options = [Option(KEEP, storage[root], 0.0)] + [
            Option(
                name,
                *(sum(getattr(p[name], f) for p in per) for f in ("device_bytes", "ms", "copy_bytes", "copy_ms", "exposed_ms")),
            )
            for name in common
        ]
        text = facts.records[saved[0]].describe() + (f" and {len(saved) - 1} more sharing its storage" if len(saved) > 1 else "")
        why = next((w for w in (facts.records[s].tolerance_why for s in saved) if w), "")
        if not any(LOSS.get(o, 3) for o in spec.options):
            why = f"options={'/'.join(spec.options)} has no lossy storage"
        choices.append(Choice(saved, text, storage[root], options, options[0], span=spans[root], why_exact=why))
    fixed = {root: b for root, b in storage.items() if root not in planned}
    return Units(choices, groups, sum(storage.values()), sum(fixed.values()), tuple((spans[r], b) for r, b in fixed.items()), rates, ahead)


def plan(
    pair: HookPair,
    spec: Any,
    facts: GraphFacts,
    members: list[fx.Node],
    plannable: list[fx.Node],
    aliases: dict[fx.Node, fx.Node],
    exact: Set[fx.Node] = frozenset(),
    trial: bool = False,
) -> Plan:
    """The plan for one budget pair: its choices (:func:`build_choices`), the plan chosen
    among those fitted to its budget (:func:`choose`), and the step's peak it predicts with
    the graphs' own tensors (:func:`.step_peak.predicted_peak`).

    ``members``: every saved tensor in the pair's scope; ``plannable``: those the hooks may
    see (dtype policy, filtering mode, unused ones excluded), without ``aliases`` (saved
    tensors that share another's packed tensor). Saved graph inputs that are not activations
    (parameters, leaves) are not counted. The unit of choice is a storage: the saved tensors
    reading it (q, k, v of one projection) are packed together or kept, since keeping one
    keeps all of it. It costs its base tensor's bytes, however small the saved views.
    ``exact``: the forward nodes a recomputation may read (saved tensors no other hook
    packs, inputs the caller keeps); those in this plan are pinned to keep when read.
    ``trial``: no report's pareto (:func:`fit_plans`).
    """
    result = choose(pair, spec, facts, build_choices(spec, facts, members, plannable, aliases), exact, trial)
    bw_saved = [facts.bw_inputs[s.name] for s in facts.saved_tensors if s.name in facts.bw_inputs]
    donated = donated_inputs.donatable(facts.fw_g, facts.bw_g, facts.saved_tensors, facts.bw_inputs, facts.inputs)
    kept = {m for c in result.choices if c.chosen.device_bytes == c.nbytes for m in c.members}
    donated = {n: b for n, b in donated.items() if n in kept}
    result.predicted = predicted_peak(result, facts.fw_g, facts.bw_g, facts.saved_tensors, bw_saved, set(donated))
    result.donated = tuple(donated_inputs.describe(n) for n in donated)
    return result


def choose(pair: HookPair, spec: Any, facts: GraphFacts, units: Units, exact: Set[fx.Node], trial: bool = False) -> Plan:
    """The plan taken among those fitted to the budget: the least lossy one meeting it,
    unless a lossier one is faster by more than ``config.activation_budget_lossy_margin``;
    the floor where none meets it (:func:`_floor_plan`)."""
    choices, baseline = units.choices, units.baseline
    # The partition taken is the partitioner's own recomputation (activation_budget/
    # partition_choice.py): the budget is a fraction of the default partition's bytes (a
    # partition that saves no activation meets any).
    terms = facts.partition if pair.label == "ambient" else PartitionTerms()
    ratio = terms.ratio
    if ratio is None:
        target = spec.target_bytes(baseline)
    else:
        target = spec.target_bytes(round(baseline / ratio)) if ratio else max(baseline, spec.target_bytes(baseline))

    # A graph that is one of several (GraphFacts.bounds): its forward's end is what the
    # budget bounds, the bytes it holds while the rest of the step runs; its backward's
    # points may hold up to what it saves without hooks (only a recomputation's ops could
    # hold more).
    backward_bytes = baseline if facts.bounds[0] == Bounds.FORWARD_END else None
    # Fitted under what the partitioner's knapsack at the fraction holds, where that is less
    # and the knapsack recomputes too slowly (partition_choice._fit_under): at or below the
    # step's peak that activation_memory_budget gives.  Bounding the forward's end only, the
    # backward's points keep the fraction's bound.
    cap, forward_end_only = terms.cap or (None, False)
    capped = cap is not None and cap < target
    if capped:
        if forward_end_only and backward_bytes is None:
            backward_bytes = target
        target = cap

    def run(units_: list[Choice], exact_first: bool = False, budget: int = target, fit: Callable[[Plan], int] = SOLVER) -> Plan:
        on_hull = [_on_hull(_penalized(c) if exact_first else c) for c in units_]
        candidate = Plan(
            pair.label, spec, baseline, units.fixed, budget, on_hull, units.fixed_spans, facts.point_names, backward_bytes, facts.bounds[0]
        )
        if ratio is not None:
            candidate.preference = f"met by the partitioner's recomputation, {ratio:.3f} of its default bytes"
        fit(candidate)
        if exact_first:  # the true times of what was chosen
            candidate.choices = [_unpenalized(c, u) for c, u in zip(candidate.choices, units_)]
            candidate.preference = "least lossy"
        candidate.ahead_bytes = _ahead_bytes(candidate, units.ahead)
        return candidate

    @functools.cache
    def recipes() -> list[Choice] | None:
        """The choices with their recompute options (looked for once, on first need)."""
        if RECOMPUTE not in spec.options:
            return None
        return with_recipes(choices, _sole(choices, units.groups), exact, facts.fw_g, units.rates)

    # While a report records: the plan at every fraction of the saved bytes (its pareto).
    pareto: tuple[tuple[float, int, float, bool], ...] = ()
    if records_observed() and not trial:
        pareto = _pareto(run, [u for u in (choices, recipes()) if u is not None], baseline)

    def done(result: Plan, pareto: tuple[tuple[float, int, float, bool], ...]) -> Plan:
        if capped:
            at = "its forward's end" if forward_end_only else "every point"
            result.preference += f"; {at} fitted under {cap} B, what the partitioner's knapsack at the fraction holds"
        return _with_pareto(result, pareto)

    # The fastest plan: storage options first; recompute (its recipes are only looked for
    # then) where they cannot meet the budget.
    fastest = run(choices)
    recomputable = None
    if not fastest.met:
        recomputable = recipes()
        if recomputable is not None:
            fastest = min([fastest, run(recomputable)], key=lambda p: (not p.met, p.bounded[0] if not p.met else 0))
    if not fastest.met:
        return done(_floor_plan(run, [u for u in (choices, recomputable) if u is not None], target), pareto)
    if not fastest.lossy:
        return done(fastest, pareto)  # nothing lossy to avoid
    # The least lossy plan: exact options (keep, offload, recompute) before bf16 before fp8,
    # each tier at the least time; taken unless the fastest is faster by more than the margin.
    if recomputable is None:
        recomputable = recipes()
    tried = [run(recomputable or choices, exact_first=True)]
    if not tried[0].met and recomputable:
        # A recompute pins what it reads to keep: the greedy, taking cheap recomputes
        # first, can leave the budget out of reach of what it pinned, where the storage
        # options alone (offload, bf16 before fp8) meet it.
        tried.append(run(choices, exact_first=True))
    # The greedy is not exact: the fastest plan may be no lossier (then it is taken).
    least_lossy = min([*tried, fastest], key=lambda p: (not p.met, _loss(p), p.estimated_ms))
    margin = config.activation_budget_lossy_margin * graph_compute_ms(facts.fw_g, facts.bw_g, units.rates)
    if least_lossy.met and (not fastest.met or least_lossy.estimated_ms <= fastest.estimated_ms + margin):
        return done(least_lossy, pareto)
    fastest.preference = f"fastest: the least lossy plan {'misses the budget' if not least_lossy.met else 'is slower by'}" + (
        "" if not least_lossy.met else f" {least_lossy.estimated_ms - fastest.estimated_ms:.3f} ms > margin {margin:.3f} ms"
    )
    return done(fastest, pareto)


def _ahead_bytes(result: Plan, graphs: int) -> int:
    """What the backward of a graph whose plan is ``result`` holds of the next ``graphs``
    graphs' reloads, started ahead while it runs (``offload_prefetch``): as many bytes as
    this graph reloads per graph (a model compiled block by block repeats its blocks), at
    most ``config.offload_prefetch_bytes``."""
    if graphs <= 0:
        return 0
    reloaded = graphs * sum(c.chosen.copy_bytes for c in result.choices if c.chosen.name in OFFLOADS)
    limit = config.offload_prefetch_bytes
    return reloaded if limit is None else min(reloaded, int(limit))


def _loss(result: Plan) -> tuple[int, ...]:
    """How lossy a plan is: the bytes stored at each tier of loss, the lossiest first (so
    that fewer fp8 bytes win, then fewer int8, then fewer bf16)."""
    tiers = [min(LOSS.get(c.chosen.name, 3), 3) for c in result.choices]
    return tuple(sum(c.nbytes for c, t in zip(result.choices, tiers) if t == tier) for tier in (3, 2, 1))


#: The fractions of its saved bytes a report's pareto plans each budget pair at.
PARETO_FRACTIONS = tuple(round(0.1 * k, 1) for k in range(1, 11))


def _pareto(run: Any, unit_sets: list[list[Choice]], baseline: int) -> tuple[tuple[float, int, float, bool], ...]:
    """``(fraction, planned peak bytes, estimated ms, met)`` of the plan at each of
    :data:`PARETO_FRACTIONS` of ``baseline``: the fastest plan meeting it, or the lowest peak
    (compile-time work, done only while a report records).  The peak is of what the budget
    bounds (:attr:`Plan.bounded`: a graph of several, its forward's end)."""
    points = []
    for fraction in PARETO_FRACTIONS:
        plans = [run(units, budget=round(fraction * baseline)) for units in unit_sets]
        best = min(plans, key=lambda p: (not p.met, p.estimated_ms if p.met else p.bounded[0]))
        points.append((fraction, best.bounded[0], best.estimated_ms, best.met))
    return tuple(points)


def _with_pareto(result: Plan, pareto: tuple[tuple[float, int, float, bool], ...]) -> Plan:
    result.pareto = pareto
    return result


def _floor_plan(run: Any, candidates: list[list[Choice]], target: int) -> Plan:
    """The plan when nothing meets ``target``: the floor.  Every point the budget bounds is
    brought as low as the options take it (the greedy against a budget of 0 bytes), with
    and without the recompute options; the one with the lower peak of what the budget
    bounds (then the fewer bytes at the forward's end, then the less time) is taken.  It
    does not depend on the budget, so every budget below the floor plans the same, and a
    tighter budget never plans a higher peak than a looser one."""
    lowest = min(
        (run(units, budget=0, fit=greedy_fit) for units in candidates), key=lambda p: (p.bounded[0], p.predicted_bytes, p.estimated_ms)
    )
    lowest.budget_bytes = target
    lowest.preference = "the floor: no plan meets the budget; every point as low as the options take it"
    return lowest


def _sole(choices: list[Choice], groups: dict[fx.Node, list[fx.Node]]) -> list[bool]:
    """Per choice: its tensor is the one reader of its storage (a recompute frees it)."""
    return [len(groups[act_inputs.storage_root(c.members[0])]) == 1 for c in choices]


def fit_plans(
    candidates: list[SavedTensorRecord], facts: GraphFacts, trial: bool = False
) -> list[tuple[HookPair, Plan, list[SavedTensorRecord], dict[fx.Node, fx.Node]]]:
    """The fitted plan of every budget pair among the ``candidates`` (the records of saved
    tensors with hooks, aliases marked): ``(pair, plan, the pair's packed records, their
    aliases -> root)``.  Nothing is written or warned (:func:`apply_plans` does); a
    ``trial`` (a partition weighed against another, :mod:`.partition_choice`) skips the report's
    pareto."""
    fitted: list[tuple[HookPair, Plan, list[SavedTensorRecord], dict[fx.Node, fx.Node]]] = []
    packed = [r for r in candidates if r.decision in (HOOKED, ALIAS)]
    for pair in dict.fromkeys(r.scope_pair for r in candidates):
        spec = pair.kind.budget
        if spec is None:
            continue
        members = [r.fw_node for r in candidates if r.pair is pair]
        mine = [r for r in packed if r.chosen is pair]
        by_name = {r.name: r.fw_node for r in mine}
        aliases = {r.fw_node: by_name[r.alias_of] for r in mine if r.decision == ALIAS and r.alias_of in by_name}
        plannable = [r.fw_node for r in mine if r.fw_node not in aliases]
        # What a recomputation may read: inputs the caller keeps, and saved tensors that
        # reach the backward exact (no other hooks; this plan pins its own to keep).
        others = {r.node for r in packed if r.chosen is not pair}
        exact = facts.held | {s for s in facts.saved_tensors if s.name in facts.bw_inputs and s not in others}
        fitted.append((pair, plan(pair, spec, facts, members, plannable, aliases, exact, trial=trial), mine, aliases))
    return fitted


def apply_plans(candidates: list[SavedTensorRecord], facts: GraphFacts) -> tuple[dict[fx.Node, Recipe], list[BudgetPlanSummary]]:
    """Plan every budget pair among the ``candidates`` (:func:`fit_plans`): each record a
    plan covers gets its option and that option's hooks, or is kept or recomputed
    (``option``, ``decision``, ``reason``).  Returns the recomputed saved tensors with their
    recipes, and each plan's summary."""
    recomputed: dict[fx.Node, Recipe] = {}
    summaries = []
    for pair, result, mine, aliases in fit_plans(candidates, facts):
        summaries.append(summarize(result, *facts.bounds, partition=facts.partition if pair.label == "ambient" else None))
        chosen = {s: c.chosen.name for c in result.choices for s in c.members}
        recipes = {c.members[0]: c.recipe for c in result.choices if c.chosen.name == RECOMPUTE}
        recomputed |= recipes
        for alias, root in aliases.items():
            chosen[alias] = chosen.get(root, KEEP)
        for r in mine:
            _write(r, chosen.get(r.node), recipes.get(r.node), pair)
    return recomputed, summaries


def _write(record: SavedTensorRecord, option: str | None, recipe: Recipe | None, pair: HookPair) -> None:
    """A plan's option into a saved tensor's record."""
    record.option = option
    if option is None:
        record.leave(DecidedBy.BUDGET, "shares its storage with a saved tensor the budget plan cannot hook")
    elif option == KEEP:
        record.leave(DecidedBy.BUDGET, "kept by the budget plan")
    elif option == RECOMPUTE and recipe is None:  # an alias of a recomputed tensor
        record.leave(DecidedBy.BUDGET, f"aliases {record.alias_of}, which the budget plan recomputes")
    elif option == RECOMPUTE and recipe is not None:
        reads = ", ".join(f.name for f in recipe.frontier)
        record.leave(DecidedBy.BUDGET, f"recomputed by the budget plan: {len(recipe.nodes)} ops from {reads}", RECOMPUTED)
    elif record.decision == ALIAS:  # shares its root's packed form: the root's option
        record.chosen = HookPair(*option_hooks(option), pair.label)
        record.hooks = record.chosen.names
    else:
        record.take(HookPair(*option_hooks(option), pair.label), DecidedBy.BUDGET, f"budget option {option}")
