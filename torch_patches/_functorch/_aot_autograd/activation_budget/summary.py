"""A budget plan's summary: what the plan chose per storage, whether it met its budget, and
where it did not, its floor and what holds it there (in words, for the warning, the log and
``report()``).  Reads a fitted :class:`~.solver.Plan`; the planner (:mod:`.planner`) calls
:func:`summarize` once per plan."""

from __future__ import annotations

import warnings

from torch_patches._errors import SavedTensorsHookWarning
from torch_patches._functorch._aot_autograd import compile_facts
from torch_patches._functorch._aot_autograd.activation_budget.solver import RECOMPUTE, Choice, PartitionTerms, Plan
from torch_patches._functorch._aot_autograd.saved_tensor_collect import module_path
from torch_patches._functorch._aot_autograd.saved_tensor_records import Bounds, BudgetPlanSummary, PlannedStorage

#: The storage options that offload (their copies run on the copy link).
OFFLOADS = ("offload", "fp8+offload")


def summarize(
    result: Plan, bounded_at: Bounds = Bounds.EVERY_POINT, bounds_why: str = "", partition: PartitionTerms | None = None
) -> BudgetPlanSummary:
    """The plan's summary (each storage's option); warns when the plan does not meet its
    budget, naming its floor and what holds it there.  ``bounded_at``, ``bounds_why``:
    which points the budget bounds, and that and why in words (:attr:`GraphFacts.bounds`);
    ``partition``: the partition choice's terms (:class:`~.planner.PartitionTerms`) for the
    ambient budget's plan."""
    peak, point = result.peak
    floor, first = result.bounded
    found = compile_facts.facts() if result.label == "ambient" else None
    cheap = partition.cheap_ratio if partition is not None else None
    units = tuple(
        PlannedStorage(
            tuple(n.name for n in c.members),
            c.chosen.name,
            c.chosen.device_bytes,
            c.chosen.ms,
            tuple(f.name for f in c.recipe.frontier) if c.chosen.name == RECOMPUTE and c.recipe is not None else (),
            tuple(o.name for o in c.options),
            c.chosen.copy_bytes,
        )
        for c in result.choices
    )
    at = _last_peak(result)
    holders = () if result.met else _floor_holders(result, at)
    offloaded = [c for c in result.choices if c.chosen.name in OFFLOADS]
    summary = BudgetPlanSummary(
        scope=result.label,
        spec=result.spec.describe(),
        planned_bytes=result.predicted_bytes,
        baseline_bytes=result.baseline_bytes,
        budget_bytes=result.budget_bytes,
        peak_bytes=peak,
        peak_at=result.describe_point(point),
        met=result.met,
        preference=result.preference,
        estimated_ms=result.estimated_ms,
        units=units,
        partitioner_ratio=cheap,
        partitioner_met=None if cheap is None or partition is None else partition.ratio is not None,
        pareto=result.pareto,
        floor_bytes=None if result.met else floor,
        floor_holders=tuple(text for _, text in holders),
        bounds=bounds_why,
        bounded_at=bounded_at,
        predicted_peak_bytes=result.predicted[0] if result.predicted else None,
        predicted_peak_at=result.predicted[1] if result.predicted else "",
        copy_ms=sum(c.chosen.copy_ms for c in offloaded),
        copy_exposed_ms=sum(c.chosen.exposed_ms for c in offloaded),
        ahead_bytes=result.ahead_bytes,
        loss_heads=tuple(found.loss_heads) if found is not None else (),
        donated_inputs=result.donated,
    )
    if not result.met:
        share = f" ({floor / result.baseline_bytes:.2f} of the saved bytes)" if result.baseline_bytes else ""
        since = "" if at == first else f" (and from {result.describe_point(first)} on)"
        bounded = "" if result.backward_bytes is None else f" (the budget bounds {bounds_why})"
        warnings.warn(
            f"torch_patches: activation memory {result.spec.describe()} of {result.budget_bytes} B "
            f"cannot be met in scope {result.label!r}: its floor, the least the allowed options hold, "
            f"is {floor} B{share}, held at {result.describe_point(at)}{since}{bounded}. What holds it there: "
            f"{'; '.join(text for _, text in holders) or 'nothing'}. Planned at the floor (every point as low "
            "as the options take it); torch._functorch.config.activation_memory_budget can recompute more",
            SavedTensorsHookWarning,
            stacklevel=2,
        )
    return summary


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _named(choice: Choice) -> str:
    """A storage's first saved tensor, with the module that computed it."""
    node = choice.members[0]
    module = module_path(node)
    return f"{node.name} ({module})" if module else node.name


def _last_peak(result: Plan) -> int:
    """The latest point holding the peak of what the budget bounds (where the most storages
    are already at full size: what no stored form can lower)."""
    points, values = result.bounded_timeline()
    top = max(values)
    return max(p for p, v in zip(points, values) if v == top)


def _floor_holders(result: Plan, point: int, most: int = 3) -> list[tuple[int, str]]:
    """What ``result`` holds at ``point``, largest first, as ``(bytes, words)``: the
    storages in use there at full size, those stored exact (and why), those at their fewest
    bytes (per option), those a smaller form would not help, and what cannot be hooked.  At
    most ``most`` storages are named per kind."""
    in_use, kept_exact, other = [], [], []
    smallest: dict[str, list[Choice]] = {}
    for c in result.choices:
        if c.span.first <= point <= c.span.last:
            in_use.append(c)
        elif point < c.span.first and c.live(point):
            if len(c.options) == 1:
                kept_exact.append(c)
            elif c.chosen is c.options[-1] or c.chosen.device_bytes == min(o.device_bytes for o in c.options):
                smallest.setdefault(c.chosen.name, []).append(c)
            else:
                other.append(c)
    out: list[tuple[int, str]] = []

    def named(kind: list[Choice], words: str) -> None:
        kind = sorted(kind, key=lambda c: -c.live(point))
        total = sum(c.live(point) for c in kind)
        if not total:
            return
        names = ", ".join(f"{_named(c)} {_size(c.live(point))}" for c in kind[:most])
        more = f" and {len(kind) - most} more" if len(kind) > most else ""
        out.append((total, f"{_size(total)} {words}: {names}{more}"))

    named(in_use, "in use there at full size")
    kept_exact.sort(key=lambda c: -c.live(point))
    for c in kept_exact[:most]:
        why = f" ({c.why_exact})" if c.why_exact else ""
        out.append((c.live(point), f"{_named(c)} {_size(c.live(point))} kept exact{why}"))
    named(kept_exact[most:], "kept exact in other storages")
    for option, kind in smallest.items():
        total = sum(c.live(point) for c in kind)
        out.append((total, f"{_size(total)} already {option}, their fewest bytes ({len(kind)} storages)"))
    named(other, "stored where fewer bytes would raise another point")
    fixed = sum(span.live(point, n, n) for span, n in result.fixed)
    if fixed:
        out.append((fixed, f"{_size(fixed)} that cannot be hooked (integer tensors, graph inputs)"))
    return sorted(out, key=lambda t: -t[0])
