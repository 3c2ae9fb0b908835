"""The budget's solver: which option each saved storage takes so that the bytes held fit the
budget at every point from the forward's end through the backward, at the least time.

Pure: no torch, no fx.  A :class:`Choice` stands for opaque ``members`` (the planner's saved
tensors) and is priced by its :class:`Option` list; a :class:`Plan` holds the choices, the
storages no option applies to, and the names of the backward's points (for messages).

Solvers are looked up in :data:`SOLVERS` by name (``fit`` takes ``"greedy"``):

* ``"greedy"`` (:func:`greedy_fit`): the multiple-choice knapsack's greedy over each
  choice's lower convex hull of (bytes, time), from the latest point of the backward to
  the forward's end (the constraints nest), with recompute steps re-priced lazily.

The exact programme, and the planner's fit (it where it applies, else the greedy), are in
:mod:`.exact`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

KEEP = "keep"
RECOMPUTE = "recompute"

#: How lossy each option is: exact (keep, offload, recompute), bf16, int8, fp8 (the
#: numerics levels' order).  Unknown names count as the lossiest.
LOSS = {KEEP: 0, "offload": 0, RECOMPUTE: 0, "bf16": 1, "int8": 2, "fp8": 3, "fp8+offload": 3}
#: Time added per tier of loss in the least-lossy run: larger than any plan's time, so that
#: the greedy takes every exact step before a bf16 one and every bf16 step before an fp8 one
#: (per byte saved).
_LOSS_PENALTY_MS = 1e6


@dataclasses.dataclass(frozen=True)
class PartitionTerms:
    """What the partition choice (:mod:`.partition_choice`) tells an ambient budget's plan
    about the partition it plans."""

    #: What the partitioner's cheap recomputation saves, of the default partition's
    #: activation bytes (reported with the plan's summary); None where nothing was offered.
    cheap_ratio: float | None = None
    #: Where the partition taken is the partitioner's own recomputation (cheap or knapsack):
    #: what it saves of the default's bytes.  The budget is a fraction of the default's.
    ratio: float | None = None
    #: ``(bytes, forward's end only)``: the bound the plan is fitted under besides the
    #: fraction's, where the partitioner's knapsack holds less than the plan but recomputes
    #: too slowly (never above ``activation_memory_budget = F``).
    cap: tuple[int, bool] | None = None


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    device_bytes: int
    ms: float
    #: An offload's: the bytes it copies each way, the copies' time on the copy link (out
    #: and back), and the part of it no compute hides (counted in ``ms``).
    copy_bytes: int = 0
    copy_ms: float = 0.0
    exposed_ms: float = 0.0


@dataclasses.dataclass(frozen=True)
class Span:
    """Where the backward uses a saved storage: positions (in the backward graph's node
    order) of its first and its last use, views of it included.  Until ``first`` it is
    held in its stored form, from ``first`` to ``last`` at full size (unpacked or
    recomputed right before ``first``), and after ``last`` it is freed.  Position ``-1`` is
    the end of the forward, before the backward runs anything."""

    first: int
    last: int

    def live(self, point: int, stored: int, full: int) -> int:
        if point < self.first:
            return stored
        return full if point <= self.last else 0


@dataclasses.dataclass
class Choice:
    """The option chosen for the saved tensors sharing one storage (most often one tensor;
    q, k and v of one projection are three): all of them take it, or the storage stays.
    ``members`` are the planner's (the solver never looks into them)."""

    members: Sequence[Any]
    describe: str
    nbytes: int
    options: list[Option]  # lower convex hull: keep first, unless a free option beats it
    chosen: Option
    recipe: Any = None  # with a "recompute" option: how the planner rebuilds the tensor
    pins: tuple[int, ...] = ()  # choices that must stay "keep" if this one recomputes
    span: Span = dataclasses.field(default_factory=lambda: Span(0, 0))
    transient: int = 0  # bytes the recipe's other ops allocate while it runs
    why_exact: str = ""  # what keeps lossy options from it (for messages)

    @property
    def keep(self) -> Option:
        return Option(KEEP, self.nbytes, 0.0)

    def live(self, point: int) -> int:
        """Device bytes of the storage when the backward reaches ``point``."""
        return self.span.live(point, self.chosen.device_bytes, self.nbytes) + _transient(self, self.chosen, point)


def _highest(points: list[int], values: list[int]) -> tuple[int, int]:
    """(value, point) of the largest value, at the earliest point holding it."""
    value, neg_point = max((v, -p) for p, v in zip(points, values))
    return value, -neg_point


def _transient(choice: Choice, option: Option, point: int) -> int:
    return choice.transient if option.name == RECOMPUTE and point == choice.span.first else 0


@dataclasses.dataclass
class Plan:
    """One budget pair's plan over the saved tensors of its scope in one graph."""

    label: str
    spec: Any
    baseline_bytes: int  # what the scope saves without hooks (unique storages)
    fixed_bytes: int  # saved bytes the plan cannot store otherwise
    budget_bytes: int
    choices: list[Choice]
    fixed: tuple[tuple[Span, int], ...] = ()  # the storages of fixed_bytes, where used
    point_names: dict[int, str] = dataclasses.field(default_factory=dict)  # for messages
    #: The most the backward's points may hold when that is more than the budget (a graph
    #: that is one of several graphs of a step: the budget bounds its forward's end); None:
    #: the budget bounds every point.
    backward_bytes: int | None = None
    #: Which points the budget bounds (``GraphFacts.bounds``, a ``saved_tensor_records.Bounds``;
    #: this module imports no torch): ``"forward_end"`` where the graph is one of several of
    #: its step, else ``"every_point"``.
    bounded_at: str = "every_point"
    #: Bytes the backward's points hold besides the plan's own storages: the reloads of the
    #: graphs autograd runs next, started ahead while this graph's backward runs (set once
    #: the plan is fitted; the backward's points may hold them on top of their bound).
    ahead_bytes: int = 0
    #: The step's peak the plan predicts with what the graphs hold besides the saved
    #: tensors, and where (set by the planner once the plan is taken).
    predicted: tuple[int, str] | None = None
    #: Saved graph inputs the plan keeps and the backward writes their gradients over where
    #: the caller dropped them (``donated_inputs``), each in words (set with ``predicted``).
    donated: tuple[str, ...] = ()
    #: While a report records: ``(fraction, peak bytes, ms, met)`` of the plan at fractions
    #: of the saved bytes (set by the planner).
    pareto: tuple[tuple[float, int, float, bool], ...] = ()

    @property
    def predicted_bytes(self) -> int:
        """Device bytes saved at the end of the forward."""
        return self.live(-1)

    def live(self, point: int) -> int:
        """Device bytes of the saved storages when the backward reaches ``point``."""
        return sum(c.live(point) for c in self.choices) + sum(s.live(point, n, n) for s, n in self.fixed)

    @property
    def points(self) -> list[int]:
        """Where the saved bytes can peak: the forward's end and each first use (the only
        points where a storage grows)."""
        return sorted({-1, *(c.span.first for c in self.choices), *(s.first for s, _ in self.fixed)})

    def timeline(self) -> tuple[list[int], list[int]]:
        """:attr:`points` and :meth:`live` at each of them, in one pass over the storages."""
        points = self.points
        at = {p: k for k, p in enumerate(points)}
        diff = [0] * (len(points) + 1)

        def held(lo: int, hi: int, nbytes: int) -> None:
            diff[lo] += nbytes
            diff[hi] -= nbytes

        for c in self.choices:
            first = at[c.span.first]
            held(0, first, c.chosen.device_bytes)
            held(first, max(first, bisect.bisect_right(points, c.span.last)), c.nbytes)
            held(first, first + 1, _transient(c, c.chosen, c.span.first))
        for span, nbytes in self.fixed:
            first = at[span.first]
            held(0, max(first, bisect.bisect_right(points, span.last)), nbytes)
        values, total = [], 0
        for p, d in zip(points, diff):
            total += d
            values.append(total + (self.ahead_bytes if p >= 0 else 0))
        return points, values

    @property
    def peak(self) -> tuple[int, int]:
        """(bytes, point) of the most the saved storages hold from the forward's end on
        (the earliest point of that many bytes)."""
        return _highest(*self.timeline())

    def slack(self, point: int) -> int:
        """How many bytes more than the budget ``point`` may hold: 0 at the forward's end;
        at the backward's points what :attr:`backward_bytes` allows more, and the reloads
        started ahead (:attr:`ahead_bytes`)."""
        if point < 0:
            return 0
        if self.backward_bytes is None:
            return self.ahead_bytes
        return max(0, self.backward_bytes - self.budget_bytes) + self.ahead_bytes

    def bounded_timeline(self) -> tuple[list[int], list[int]]:
        """:meth:`timeline` less each point's :meth:`slack`: what the budget bounds."""
        points, values = self.timeline()
        return points, [v - self.slack(p) for p, v in zip(points, values)]

    @property
    def bounded(self) -> tuple[int, int]:
        """(bytes, point) of the most :meth:`bounded_timeline` holds (the earliest point of
        it): :attr:`peak` where the budget bounds every point."""
        return _highest(*self.bounded_timeline())

    #: Why this plan was taken among those meeting the budget (for the log).
    preference: str = "least lossy"

    @property
    def estimated_ms(self) -> float:
        return sum(c.chosen.ms for c in self.choices)

    @property
    def lossy(self) -> bool:
        """Whether any storage is stored lossily (bf16, int8, fp8)."""
        return any(_lossy(c.chosen) for c in self.choices)

    @property
    def met(self) -> bool:
        return self.bounded[0] <= self.budget_bytes

    def describe_point(self, point: int) -> str:
        return "the forward's end" if point < 0 else f"backward node {self.point_names.get(point, point)}"


# ---------------------------------------------------------------------------- hulls


def lower_hull(options: list[Option]) -> list[Option]:
    """The options worth stepping through, from the most bytes (keep) to the fewest, each
    step costing more time per byte saved than the one before: options another beats on
    both bytes and time, and those above the convex hull, are dropped."""
    frontier: list[Option] = []
    for o in sorted(options, key=lambda o: (o.device_bytes, o.ms, LOSS.get(o.name, len(LOSS)), o.name)):
        if not frontier or o.ms < frontier[-1].ms:  # fewer-byte options are all slower
            frontier.append(o)
    hull: list[Option] = []
    for o in reversed(frontier):  # bytes decreasing, time increasing
        while len(hull) >= 2 and _slope(hull[-2], hull[-1]) >= _slope(hull[-1], o):
            hull.pop()
        hull.append(o)
    return hull


def _slope(a: Option, b: Option) -> float:
    saved = a.device_bytes - b.device_bytes
    return (b.ms - a.ms) / saved if saved > 0 else float("inf")


def _on_hull(choice: Choice) -> Choice:
    """``choice`` (its options all listed, keep first) over the lower hull of its options,
    at the hull's first option."""
    hull = lower_hull(choice.options)
    if hull[0].name == RECOMPUTE:  # free to recompute (views only): still a step, pins and all
        hull.insert(0, choice.options[0])
    return dataclasses.replace(choice, options=hull, chosen=hull[0])


def _lossy(option: Option) -> bool:
    return LOSS.get(option.name, 3) > 0


def _penalized(choice: Choice) -> Choice:
    """``choice`` with each option's time raised by its tier of loss (exact first)."""
    options = [dataclasses.replace(o, ms=o.ms + LOSS.get(o.name, 3) * _LOSS_PENALTY_MS) for o in choice.options]
    return dataclasses.replace(choice, options=options, chosen=options[0])


def _unpenalized(choice: Choice, original: Choice) -> Choice:
    """``choice`` (a :func:`_penalized` one, solved) with the true times of ``original``."""
    by_name = {o.name: o for o in original.options}
    return dataclasses.replace(choice, options=[by_name[o.name] for o in choice.options], chosen=by_name[choice.chosen.name])


# --------------------------------------------------------------------------- greedy


class _Greedy:
    """The greedy of :func:`solve`, kept from one round to the next.

    A round moves the ``movable`` choices along their options until ``excess`` bytes are
    saved.  Between rounds choices may only become movable, so the heap is kept: at a
    round's start it holds what a fresh heap would (one entry per movable, unpinned choice
    with a step left, priced now), because only the entries whose price may have changed
    are priced again (``dirty``: choices that became movable, were released from a pin, or
    were dropped in the last round, and recomputes whose pins changed).  ``token``
    invalidates an entry priced again.  ``pinned`` is, at a round's start, the choices some
    recomputing choice reads (``count``), and it only grows during a round."""

    def __init__(self, choices: list[Choice], on_change: Callable[[int, Option, Option], None] | None = None):
        self.choices = choices
        self.on_change = on_change
        self.movable: set[int] = set()
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.token = [0] * len(choices)
        self.count = [0] * len(choices)
        self.pinners: list[list[int]] = [[] for _ in choices]
        for i, c in enumerate(choices):
            for j in c.pins:
                self.pinners[j].append(i)
                self.count[j] += c.chosen.name == RECOMPUTE
        self.pinned = {j for j, n in enumerate(self.count) if n}
        self.released: set[int] = set()
        self.dirty: set[int] = set()
        self.steps = 0  # heap operations, for tests bounding the work

    def add(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i not in self.movable:
                self.movable.add(i)
                self.dirty.add(i)
                self._touch(i)

    def _touch(self, j: int) -> None:
        """``j`` changed (its option, pinned, movable): the recomputes reading it re-price."""
        self.dirty.update(self.pinners[j])

    def _set(self, i: int, option: Option) -> None:
        c = self.choices[i]
        old = c.chosen
        if old.name == RECOMPUTE:
            for j in c.pins:
                self.count[j] -= 1
                if not self.count[j]:
                    self.released.add(j)
        c.chosen = option
        if option.name == RECOMPUTE:
            for j in c.pins:
                self.count[j] += 1
        self._touch(i)
        if self.on_change is not None:
            self.on_change(i, old, option)

    def step(self, i: int, pos: int) -> tuple[float, int] | None:
        """(ms per byte, bytes saved) of moving choice i to options[pos], pins included."""
        c = self.choices[i]
        nxt = c.options[pos]
        saved, ms = c.chosen.device_bytes - nxt.device_bytes, nxt.ms - c.chosen.ms
        if nxt.name == RECOMPUTE:
            # What the tensors it reads saved (by compression, or their own recompute) is undone.
            undone = [j for j in c.pins if j not in self.pinned]
            saved -= sum(self.choices[j].nbytes - self.choices[j].chosen.device_bytes for j in undone if j in self.movable)
            ms -= sum(self.choices[j].chosen.ms for j in undone)
        if saved <= 0:
            return None
        return ms / saved, saved

    def push(self, i: int) -> None:
        self.token[i] += 1  # what was pushed before is priced again (or dropped) here
        if i in self.pinned or i not in self.movable:
            return
        c = self.choices[i]
        pos = c.options.index(c.chosen) + 1
        found = self.step(i, pos) if pos < len(c.options) else None
        if found is not None:
            self.steps += 1
            heapq.heappush(self.heap, (found[0], -found[1], i, pos, self.token[i]))

    def run(self, excess: int, allow: Callable[[int, int], bool] | None = None) -> int:
        """One round: save ``excess`` bytes (greedy by ms per byte; ties: more bytes, then
        order); ``allow(i, pos)`` may refuse a step.  Returns what is left of ``excess``."""
        for j in self.released:
            if not self.count[j] and j in self.pinned:
                self.pinned.discard(j)
                self.dirty.add(j)
                self._touch(j)
        self.released.clear()
        dirty, self.dirty = self.dirty, set()
        for i in dirty:
            self.push(i)
        choices = self.choices
        while excess > 0 and self.heap:
            self.steps += 1
            slope, neg_saved, i, pos, token = heapq.heappop(self.heap)
            c = choices[i]
            if token != self.token[i] or i in self.pinned or c.options.index(c.chosen) + 1 != pos:
                continue  # stale: priced again, pinned, or moved since
            now = self.step(i, pos)
            if now is None or (allow is not None and not allow(i, pos)):
                self.dirty.add(i)  # not this round; priced afresh in the next
                continue
            if (now[0], -now[1]) > (slope, neg_saved):  # dearer since it was pushed
                self.token[i] += 1
                self.steps += 1
                heapq.heappush(self.heap, (now[0], -now[1], i, pos, self.token[i]))
                continue
            option = c.options[pos]
            self._set(i, option)
            if option.name == RECOMPUTE:
                for j in c.pins:
                    self._set(j, choices[j].keep)
                    self.pinned.add(j)
                    self._touch(j)
            excess -= now[1]
            self.push(i)
        return excess


def solve(
    choices: list[Choice],
    excess: int,
    among: Iterable[int] | None = None,
    allow: Callable[[int, int], bool] | None = None,
) -> None:
    """Move choices along their hulls until ``excess`` bytes are saved (greedy by ms per
    byte; ties: more bytes, then order).  Only the choices ``among`` move (default: all);
    ``allow(i, pos)`` may refuse a step.  A recompute step also pins its ``pins`` to keep
    (only the undone savings of pins ``among`` count against it): it is re-priced with that
    cost when popped and pushed back if it got dearer."""
    greedy = _Greedy(choices)
    greedy.add(range(len(choices)) if among is None else among)
    greedy.run(excess, allow)


class _Timeline:
    """Bytes held at each point (by index in :attr:`Plan.points`), kept as choices move:
    range add and range max in O(log points) (a segment tree with pending adds)."""

    def __init__(self, values: list[int]):
        size = 1
        while size < len(values):
            size *= 2
        self.size, self.height = size, size.bit_length() - 1
        self.top: list[float] = [float("-inf")] * (2 * size)  # max below a node, its own adds in
        self.pending = [0] * size  # adds not yet passed to a node's children
        self.top[size : size + len(values)] = values
        for k in range(size - 1, 0, -1):
            self.top[k] = max(self.top[2 * k], self.top[2 * k + 1])
        self.steps = 0

    def _apply(self, k: int, value: int) -> None:
        self.top[k] += value
        if k < self.size:
            self.pending[k] += value

    def _rebuild(self, k: int) -> None:
        while k > 1:
            k >>= 1
            self.top[k] = max(self.top[2 * k], self.top[2 * k + 1]) + self.pending[k]

    def _push_down(self, k: int) -> None:
        for s in range(self.height, 0, -1):
            i = k >> s
            if self.pending[i]:
                self._apply(2 * i, self.pending[i])
                self._apply(2 * i + 1, self.pending[i])
                self.pending[i] = 0

    def add(self, lo: int, hi: int, value: int) -> None:
        """Add ``value`` at the points ``lo`` to ``hi - 1``."""
        if lo >= hi or not value:
            return
        self.steps += 1
        lo, hi = lo + self.size, hi + self.size
        lo0, hi0 = lo, hi
        while lo < hi:
            if lo & 1:
                self._apply(lo, value)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, value)
            lo, hi = lo >> 1, hi >> 1
        self._rebuild(lo0)
        self._rebuild(hi0 - 1)

    def max(self, lo: int, hi: int) -> float:
        """The most held at the points ``lo`` to ``hi - 1``."""
        self.steps += 1
        lo, hi = lo + self.size, hi + self.size
        self._push_down(lo)
        self._push_down(hi - 1)
        out = float("-inf")
        while lo < hi:
            if lo & 1:
                out = max(out, self.top[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                out = max(out, self.top[hi])
            lo, hi = lo >> 1, hi >> 1
        return out


def greedy_fit(result: Plan) -> int:
    """Move ``result``'s choices until the saved storages fit its budget at every point of
    the backward, or as close as the options allow.  Returns the work done (heap and
    timeline operations, for tests bounding it): O((storages + moves) log storages), and
    a few operations more for each try of a recompute step (one refused at a point is
    tried again at each earlier point its price comes up at).

    At a point ``p`` the bytes are those of the storages used at or before ``p`` and still
    needed (at full size: nothing stored differently shrinks them) plus the stored form of
    the storages first used after ``p``.  So the constraint at ``p`` is a knapsack over the
    storages first used after ``p``, and the constraints nest: what a later point's
    storages save counts at every earlier point too.  The points are met from the latest to
    the earliest, each by a round of :func:`solve`'s greedy over its own storages (one
    greedy whose heap carries over, the storages of each earlier point added to it); the
    last is the forward's end, where every storage is in its stored form.  A recompute step
    is refused where the ops it copies (and the storages it pins to keep) would raise a
    point already met above the budget, or one above the budget already any higher.  A
    point's bytes count less its :meth:`Plan.slack` throughout."""
    choices, budget = result.choices, result.budget_bytes
    points, values = result.bounded_timeline()
    at = {p: k for k, p in enumerate(points)}
    first = [at[c.span.first] for c in choices]
    timeline = _Timeline(values)

    def moved(i: int, old: Option, new: Option) -> None:
        c = choices[i]
        timeline.add(0, first[i], new.device_bytes - old.device_bytes)
        point = c.span.first
        timeline.add(first[i], first[i] + 1, _transient(c, new, point) - _transient(c, old, point))

    greedy = _Greedy(choices, moved)
    by_first: dict[int, list[int]] = {}
    for i, k in enumerate(first):
        by_first.setdefault(k, []).append(i)

    def allow(i: int, pos: int, k: int) -> bool:
        """No point from ``k`` on ends above the budget, or above where it was, for
        recomputing choice i (and keeping what it pins)."""
        c = choices[i]
        if c.options[pos].name != RECOMPUTE:
            return True
        after = {i: c.options[pos]}
        after.update((j, choices[j].keep) for j in c.pins)
        changes = [(0, 0)]  # (index, change of the held bytes from there on)
        for j, option in after.items():
            cj, fj = choices[j], first[j]
            stored = option.device_bytes - cj.chosen.device_bytes
            transient = _transient(cj, option, cj.span.first) - _transient(cj, cj.chosen, cj.span.first)
            changes += [(0, stored), (fj, transient - stored), (fj + 1, -transient)]
        changes.sort()
        delta = 0
        for n, (index, change) in enumerate(changes):
            delta += change
            end = changes[n + 1][0] if n + 1 < len(changes) else len(points)
            lo = max(index, k)
            if delta > 0 and lo < end and timeline.max(lo, end) + delta > budget:
                return False
        return True

    for k in range(len(points) - 1, -1, -1):
        greedy.add(by_first.get(k + 1, ()))  # the storages first used after points[k]
        excess = timeline.max(k, k + 1) - budget
        if excess <= 0 or not greedy.movable:
            continue
        greedy.run(int(excess), functools.partial(allow, k=k))
    return greedy.steps + timeline.steps


#: The solvers a plan may be fitted with, by name.
SOLVERS: dict[str, Callable[[Plan], int]] = {"greedy": greedy_fit}


def fit(result: Plan, solver: str = "greedy") -> int:
    """Fit ``result`` to its budget with :data:`SOLVERS` ``[solver]``; returns its work."""
    return SOLVERS[solver](result)
