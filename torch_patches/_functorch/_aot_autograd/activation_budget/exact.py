"""The budget's exact solver: the least total time whose bytes fit a :class:`~.solver.Plan`'s
budget at every point, by a dynamic programme over the same nested constraints the greedy
meets (:func:`exact_fit`); and the planner's solver, that programme where it applies and
the greedy elsewhere (:func:`exact_or_greedy_fit`).  Pure: no torch, no fx.

The planner fits with :func:`exact_or_greedy_fit` (``planner.SOLVER``).  On the plans of
the bench's models the greedy met a budget exactly when the programme did, at up to 10%
more estimated time: why the planner fits exactly where it can.
"""

from __future__ import annotations

import bisect
from typing import cast

from torch_patches._functorch._aot_autograd.activation_budget.solver import (
    RECOMPUTE,
    Plan,
    _transient,
    greedy_fit,
)

#: The most partial plans :func:`exact_fit` keeps at one point before it gives up.
EXACT_MAX_STATES = 5_000


def exact_fit(result: Plan, floor: bool = True) -> int:
    """Fit ``result`` exactly: the least total time whose bytes fit its budget at every
    point, or, when nothing fits, the lowest peak (the floor) at the least time.  Returns
    the work done (partial plans made).

    A dynamic programme over the points from the latest to the forward's end.  The bytes at
    point ``k`` are those of the storages in use there at full size (whatever their option)
    plus the stored bytes of the storages first used after ``k`` plus the transient bytes
    of recomputes first used at ``k``; so a partial plan of the storages first used after
    ``k`` is summed up by its stored bytes, and of two partial plans, one with no more
    stored bytes and no more time is as good (no higher peak so far, when looking for the
    floor).  Only those on that Pareto front are kept.  Exact, and exponential at worst: it
    raises ``RuntimeError`` beyond :data:`EXACT_MAX_STATES` partial plans at a point.
    Recompute options that pin other storages couple choices the programme takes one at
    a time, so it refuses them (``ValueError``).  With ``floor=False`` a budget nothing
    meets raises ``LookupError`` (and leaves the choices as they were) instead of looking
    for the floor.  A point's bytes count less its :meth:`Plan.slack` (the peak is of
    those)."""
    choices = result.choices
    if any(c.pins and any(o.name == RECOMPUTE for o in c.options) for c in choices):
        raise ValueError("exact_fit: recompute options that pin other storages are not supported")
    points = result.points
    at = {p: k for k, p in enumerate(points)}
    full = [0] * (len(points) + 1)  # bytes in use at full size, whatever the options, less the slack
    for c in choices:
        lo, hi = at[c.span.first], max(at[c.span.first], bisect.bisect_right(points, c.span.last))
        full[lo] += c.nbytes
        full[hi] -= c.nbytes
    for span, nbytes in result.fixed:
        hi = max(at[span.first], bisect.bisect_right(points, span.last))
        full[0] += nbytes
        full[hi] -= nbytes
    for k in range(1, len(points)):
        full[k] += full[k - 1]
    for k, p in enumerate(points):
        full[k] -= result.slack(p)
    by_first: dict[int, list[int]] = {}
    for i, c in enumerate(choices):
        by_first.setdefault(at[c.span.first], []).append(i)

    def solve_under(budget: float, floor: bool) -> tuple[tuple, int] | None:
        """The least-time full plan never above ``budget`` (``floor``: the lowest-peak
        one), or None; states are (stored, peak, ms, parent, picks)."""
        second = 1 if floor else 2  # what a partial plan is judged by besides its stored bytes
        states: list[tuple] = [(0, 0, 0.0, None, ())]
        work = 0
        for k in range(len(points) - 1, -1, -1):
            combos: list[tuple[int, int, float, tuple]] = [(0, 0, 0.0, ())]  # stored, transient, ms, picks
            for i in by_first.get(k, []):
                c = choices[i]
                combos = [
                    (st + o.device_bytes, tr + _transient(c, o, c.span.first), ms + o.ms, picks + ((i, o),))
                    for st, tr, ms, picks in combos
                    for o in c.options
                ]
            grown = []
            for state in states:
                stored, peak, ms = state[0], state[1], state[2]
                for st, tr, cms, picks in combos:
                    held = full[k] + stored + tr
                    if held <= budget:
                        grown.append((stored + st, max(peak, held), ms + cms, state, picks))
            work += len(grown)
            if len(grown) > EXACT_MAX_STATES * 8:
                raise RuntimeError(f"exact_fit: more than {EXACT_MAX_STATES * 8} partial plans at a point")
            states = _pareto(grown, second)
            if len(states) > EXACT_MAX_STATES:
                raise RuntimeError(f"exact_fit: more than {EXACT_MAX_STATES} partial plans")
            if not states:
                return None
        return min(states, key=lambda s: (s[second], s[3 - second])), work

    found = solve_under(result.budget_bytes, floor=False)
    if found is None and not floor:
        raise LookupError("exact_fit: no plan meets the budget")
    if found is None:  # the floor: the lowest peak, then the least time at it
        # Without a budget a plan is always found, and one meets the lowest peak found.
        (lowest, work) = cast("tuple[tuple, int]", solve_under(float("inf"), floor=True))
        best, more = cast("tuple[tuple, int]", solve_under(lowest[1], floor=False))
        found = (best, work + more)
    best, work = found
    state = best
    while state is not None:
        for i, option in state[4]:
            choices[i].chosen = option
        state = state[3]
    return work


def _pareto(states: list[tuple], second: int) -> list[tuple]:
    """The states no other beats on stored bytes and ``state[second]`` at once."""
    states.sort(key=lambda s: (s[0], s[second], s[3 - second]))
    kept: list[tuple] = []
    for s in states:
        if not kept or s[second] < kept[-1][second]:
            kept.append(s)
    return kept


def exact_or_greedy_fit(result: Plan) -> int:
    """:func:`exact_fit` where it applies (no recompute option pins another storage, at
    most :data:`EXACT_MAX_STATES` partial plans at a point, a budget some plan meets),
    else :func:`greedy_fit`."""
    try:
        return exact_fit(result, floor=False)
    except (ValueError, RuntimeError, LookupError):
        pass  # the choices are untouched until the programme has its plan
    return greedy_fit(result)
