"""The budget's solver on its own (``activation_budget/solver.py``): pure, and the same
plans as the straightforward algorithm it replaces.

:func:`reference_solve` and :func:`reference_fit` are that algorithm (a fresh heap per
point, every point's bytes summed over every storage: quadratic in the storages). The
greedy that :func:`solver.fit` runs carries one heap from point to point and keeps the
bytes per point in a segment tree; on many seeded random instances (ties in price, pins,
transient bytes, options off the hull, refused steps) it must choose exactly what the
reference chooses.  Its work on 1,200 storages is bounded by counting its heap and tree
operations (no timing in unit tests).  The exact programme (:func:`exact.exact_fit`)
(``activation_budget/exact.py``) is checked against the brute force over every
combination, and the greedy against it.
"""

import ast
import dataclasses
import heapq
import itertools
import random
from unittest import mock

from torch._dynamo.test_case import run_tests

from torch_patches._functorch._aot_autograd.activation_budget import exact, solver
from torch_patches.testing import TestCase

Option, Choice, Plan, Span = solver.Option, solver.Choice, solver.Plan, solver.Span
RECOMPUTE = solver.RECOMPUTE


def reference_solve(choices, excess, among=None, allow=None):
    """The greedy over a fresh heap (the algorithm before the incremental one)."""
    heap = []
    movable = set(range(len(choices)) if among is None else among)
    pinned = {j for c in choices if c.chosen.name == RECOMPUTE for j in c.pins}

    def step(i, pos):
        c = choices[i]
        nxt = c.options[pos]
        saved, ms = c.chosen.device_bytes - nxt.device_bytes, nxt.ms - c.chosen.ms
        if nxt.name == RECOMPUTE:
            undone = [j for j in c.pins if j not in pinned]
            saved -= sum(choices[j].nbytes - choices[j].chosen.device_bytes for j in undone if j in movable)
            ms -= sum(choices[j].chosen.ms for j in undone)
        if saved <= 0:
            return None
        return ms / saved, saved

    def push(i):
        if i in pinned or i not in movable:
            return
        c = choices[i]
        pos = c.options.index(c.chosen) + 1
        found = step(i, pos) if pos < len(c.options) else None
        if found is not None:
            heapq.heappush(heap, (found[0], -found[1], i, pos))

    for i in sorted(movable):
        push(i)
    while excess > 0 and heap:
        slope, neg_saved, i, pos = heapq.heappop(heap)
        c = choices[i]
        if i in pinned or c.options.index(c.chosen) + 1 != pos:
            continue
        now = step(i, pos)
        if now is None or (allow is not None and not allow(i, pos)):
            continue
        if (now[0], -now[1]) > (slope, neg_saved):
            heapq.heappush(heap, (now[0], -now[1], i, pos))
            continue
        c.chosen = c.options[pos]
        if c.chosen.name == RECOMPUTE:
            for j in c.pins:
                choices[j].chosen = choices[j].keep
                pinned.add(j)
        excess -= now[1]
        push(i)


def reference_fit(result):
    """Each point from the latest, a fresh :func:`reference_solve` over its storages."""
    points = result.points
    for k in range(len(points) - 1, -1, -1):
        point = points[k]
        excess = result.live(point) - result.slack(point) - result.budget_bytes
        among = [i for i, c in enumerate(result.choices) if c.span.first > point]
        if excess <= 0 or not among:
            continue
        later = points[k:]

        def allow(i, pos, later=later):
            c = result.choices[i]
            if c.options[pos].name != RECOMPUTE:
                return True
            before = [result.live(p) - result.slack(p) for p in later]
            undo = [(c, c.chosen)] + [(result.choices[j], result.choices[j].chosen) for j in c.pins]
            c.chosen = c.options[pos]
            for j in c.pins:
                result.choices[j].chosen = result.choices[j].keep
            after = [result.live(p) - result.slack(p) for p in later]
            for choice, chosen in undo:
                choice.chosen = chosen
            return all(a <= max(b, result.budget_bytes) for a, b in zip(after, before))

        reference_solve(result.choices, excess, among, allow)


def random_plan(seed, n=None, recompute=0.3):
    """A plan of up to 24 storages on a short backward (many storages share a first use),
    sizes and times from small sets (many ties in price), some options off the hull."""
    rng = random.Random(seed)
    n = rng.randrange(1, 25) if n is None else n
    horizon = rng.randrange(1, 12)
    choices = []
    for i in range(n):
        nbytes = rng.choice((0, 100, 200, 400, 800, 1600)) if rng.random() < 0.9 else rng.randrange(0, 5000)
        options = [Option("keep", nbytes, 0.0)]
        for name in rng.sample(("bf16", "int8", "fp8", "offload", "fp8+offload"), rng.randrange(0, 4)):
            options.append(Option(name, rng.choice((0, nbytes // 4, nbytes // 2, nbytes)), rng.choice((0.0, 0.5, 1.0, 2.0))))
        pins = ()
        if i and rng.random() < recompute:
            options.append(Option(RECOMPUTE, 0, rng.choice((0.0, 0.5, 1.0, 3.0))))
            pins = tuple(rng.sample(range(n), rng.randrange(0, min(n, 4))))
            pins = tuple(j for j in pins if j != i)
        if rng.random() < 0.8:  # what the planner gives the solver: the lower hull, keep first
            options = solver._on_hull(Choice(None, "", nbytes, options, options[0])).options
        first = rng.randrange(0, horizon + 1)
        span = Span(first, first + rng.randrange(0, 4))
        transient = rng.choice((0, 0, 100, 1000)) if any(o.name == RECOMPUTE for o in options) else 0
        chosen = options[0]
        if rng.random() < 0.05:  # started part of the way (recompute included)
            chosen = options[rng.randrange(len(options))]
        choices.append(Choice([f"t{i}"], f"t{i}", nbytes, options, chosen, pins=pins, span=span, transient=transient))
    fixed = tuple((Span(f, f + rng.randrange(-1, 3)), rng.choice((100, 500))) for f in rng.sample(range(horizon + 2), rng.randrange(0, 3)))
    result = Plan("t", None, sum(c.nbytes for c in choices), sum(b for _, b in fixed), 0, choices, fixed)
    result.budget_bytes = int(result.peak[0] * rng.choice((0.0, 0.3, 0.5, 0.7, 0.9, 1.0)))
    # A third bound only their forward's end: the backward's points may hold more (a graph
    # of several; a random allowance, the saved bytes without hooks among them). Drawn
    # apart, so that the instances above stay what they were.
    more = random.Random(-1 - seed)
    if more.random() < 1 / 3:
        result.backward_bytes = more.choice((result.baseline_bytes, result.budget_bytes, int(result.peak[0] * more.random())))
    return result


def copied(result):
    return dataclasses.replace(result, choices=[dataclasses.replace(c) for c in result.choices])


class TestSolverMatchesReference(TestCase):
    def test_fit_chooses_what_the_reference_chooses(self):
        # The failing seed in the message; a subtest per seed, and torch's assertEqual (built
        # for tensors), cost more than the fits themselves.
        for seed in range(1500):
            mine, theirs = random_plan(seed), random_plan(seed)
            solver.fit(mine)
            reference_fit(theirs)
            self.assertListEqual([c.chosen for c in mine.choices], [c.chosen for c in theirs.choices], f"seed {seed}")
            self.assertTupleEqual(mine.peak, theirs.peak, f"seed {seed}")

    def test_solve_chooses_what_the_reference_chooses(self):
        for seed in range(1500):
            rng = random.Random(-seed)
            mine, theirs = random_plan(seed), random_plan(seed)
            n = len(mine.choices)
            among = sorted(rng.sample(range(n), rng.randrange(0, n + 1))) if rng.random() < 0.5 else None
            refused = {(rng.randrange(n), rng.randrange(1, 4)) for _ in range(rng.randrange(0, 3))}
            allow = (lambda i, pos, refused=refused: (i, pos) not in refused) if refused else None
            excess = rng.randrange(0, max(1, mine.live(-1)) + 1)
            solver.solve(mine.choices, excess, among, allow)
            reference_solve(theirs.choices, excess, among, allow)
            self.assertListEqual([c.chosen for c in mine.choices], [c.chosen for c in theirs.choices], f"seed {seed}")

    def test_timeline_is_live_at_each_point(self):
        for seed in range(300):
            result = random_plan(seed)
            points, values = result.timeline()
            self.assertEqual(values, [result.live(p) for p in points])
            self.assertEqual(result.peak, max(((result.live(p), p) for p in points), key=lambda bp: (bp[0], -bp[1])))
            bounded = [(result.live(p) - result.slack(p), p) for p in points]
            self.assertEqual(result.bounded, max(bounded, key=lambda bp: (bp[0], -bp[1])))
            self.assertEqual(result.met, all(b <= result.budget_bytes for b, _ in bounded))

    def test_the_model_sizes_match_too(self):
        # Fewer instances, each as large as a 40-layer model's saved storages.
        for seed in range(4):
            mine, theirs = random_plan(seed, n=300), random_plan(seed, n=300)
            solver.fit(mine)
            reference_fit(theirs)
            self.assertEqual([c.chosen for c in mine.choices], [c.chosen for c in theirs.choices])


def large_plan(n, seed=0, recompute=False):
    """``n`` storages over a backward of ``4n`` nodes, keep / bf16 / fp8 (and recompute)."""
    rng = random.Random(seed)
    choices = []
    for i in range(n):
        nbytes = rng.randrange(1000, 100000)
        options = [Option("keep", nbytes, 0.0), Option("bf16", nbytes // 2, nbytes * 1e-5 + 0.01)]
        options.append(Option("fp8", nbytes // 4, nbytes * 2e-5 + 0.015))
        pins = ()
        if recompute and i and rng.random() < 0.3:
            options.append(Option(RECOMPUTE, 0, nbytes * 3e-5 + 0.02))
            pins = tuple(sorted(rng.sample(range(i), min(i, rng.randrange(0, 3)))))
        first = rng.randrange(0, 4 * n)
        span = Span(first, first + rng.randrange(0, 50))
        choice = solver._on_hull(Choice([i], f"t{i}", nbytes, options, options[0], pins=pins, span=span))
        choice.transient = rng.randrange(0, nbytes) if recompute else 0
        choices.append(choice)
    baseline = sum(c.nbytes for c in choices)
    return Plan("t", None, baseline, 0, int(baseline * 0.05), choices)


class TestSolverWork(TestCase):
    def test_fit_of_1200_storages_is_about_linear(self):
        # The reference does a heap of every storage first used after each point and sums
        # every storage at each point: over 1,200 ** 2 steps. The greedy pushes and pops
        # each storage's steps a few times and updates the timeline once per move.
        result = large_plan(1200)
        work = solver.fit(result)
        moves = sum(c.options.index(c.chosen) for c in result.choices)
        self.assertEqual(moves, 2 * 1200)  # unreachable (5%): every storage at fp8
        self.assertLess(work, 10 * 1200)

    def test_refused_recomputes_cost_a_retry_per_point(self):
        # A recompute step refused at one point is tried again at each earlier one (what
        # the reference does too, each try summing every storage at every later point):
        # here that is the work, at a few heap and timeline operations per try.
        result = large_plan(1200, recompute=True)
        tries = []
        greedy_run = solver._Greedy.run

        def counting(greedy, excess, allow=None):
            def counted(i, pos):
                tries.append(i)
                return allow(i, pos)

            return greedy_run(greedy, excess, counted)

        with mock.patch.object(solver._Greedy, "run", counting):
            work = solver.fit(result)
        self.assertLess(work, 4 * len(tries) + 10 * 1200)

    def test_solvers_by_name(self):
        self.assertIs(solver.SOLVERS["greedy"], solver.greedy_fit)
        with self.assertRaises(KeyError):
            solver.fit(large_plan(20), "ilp")


def brute_force(result):
    """The best of every combination of options: (0, ms) when one meets the budget, else
    (1, the lowest peak, its least ms)."""
    best = None
    for combo in itertools.product(*[c.options for c in result.choices]):
        for c, option in zip(result.choices, combo):
            c.chosen = option
        peak, ms = result.bounded[0], result.estimated_ms
        key = (0, ms) if peak <= result.budget_bytes else (1, peak, ms)
        best = key if best is None or key < best else best
    return best


def outcome(result):
    return (0, result.estimated_ms) if result.met else (1, result.bounded[0], result.estimated_ms)


class TestExactSolver(TestCase):
    def test_pure(self):
        # Of torch, only the budget's own package (the solver's data types): no torch, no fx.
        package = solver.__name__.rpartition(".")[0]
        ours = {m for m in imported_modules(exact.__file__) if m.startswith("torch")}
        self.assertTrue(ours and all(m == package or m.startswith(package + ".") for m in ours), ours)

    def test_auto_gives_up_on_the_exact_programme_quickly(self):
        # Random sizes and times give Pareto fronts that grow with every storage: the exact
        # programme stops at EXACT_MAX_STATES partial plans and the greedy fits the plan.
        for n, fraction in ((100, 0.5), (1200, 0.5), (1200, 0.05)):
            with self.subTest(n=n, fraction=fraction):
                auto, greedy = large_plan(n), large_plan(n)
                auto.budget_bytes = greedy.budget_bytes = int(auto.baseline_bytes * fraction)
                work = exact.exact_or_greedy_fit(auto)
                solver.fit(greedy, "greedy")
                self.assertLessEqual(auto.estimated_ms, greedy.estimated_ms + 1e-9)
                self.assertEqual(auto.met, greedy.met)
                self.assertLess(work, 60 * exact.EXACT_MAX_STATES)

    def test_exact_is_the_best_of_every_combination(self):
        # Small plans (up to 7 storages, transient bytes of recomputes that pin nothing,
        # fixed storages, options off the hull): the programme's plan is the brute force's.
        checked = 0
        for seed in range(600):
            result = random_plan(seed, n=random.Random(seed).randrange(1, 8))
            if any(c.pins and c.options[-1].name == RECOMPUTE for c in result.choices):
                continue
            want = brute_force(copied(result))
            exact.exact_fit(result)
            got = outcome(result)
            self.assertEqual(got[:-1], want[:-1], f"seed {seed}")
            self.assertAlmostEqual(got[-1], want[-1], places=9, msg=f"seed {seed}")
            checked += 1
        self.assertGreater(checked, 300)

    def test_greedy_meets_a_budget_exactly_when_the_exact_programme_does(self):
        # Without pins, more bytes saved never raises a point, so both meet a budget exactly
        # when every storage at its fewest bytes does; the greedy's time may be more.
        slower = 0
        for seed in range(600):
            greedy = random_plan(seed, recompute=0)
            greedy.choices = [solver._on_hull(c) for c in greedy.choices]  # what the planner gives
            best = copied(greedy)
            solver.fit(greedy, "greedy")
            exact.exact_fit(best)
            self.assertEqual(greedy.met, best.met, f"seed {seed}")
            if greedy.met:
                self.assertLessEqual(best.estimated_ms, greedy.estimated_ms + 1e-9, f"seed {seed}")
            if not best.met:  # the exact floor is the lowest peak there is
                self.assertLessEqual(best.bounded[0], greedy.bounded[0], f"seed {seed}")
            slower += greedy.met and greedy.estimated_ms > best.estimated_ms + 1e-9
        self.assertGreater(slower, 0)  # the greedy is not exact: why the planner fits exactly

    def test_exact_refuses_pins_and_auto_takes_the_greedy_there(self):
        result = large_plan(30, recompute=True)
        self.assertTrue(any(c.pins for c in result.choices))
        with self.assertRaises(ValueError):
            exact.exact_fit(copied(result))
        auto, greedy = copied(result), copied(result)
        exact.exact_or_greedy_fit(auto)
        solver.fit(greedy, "greedy")
        self.assertEqual([c.chosen for c in auto.choices], [c.chosen for c in greedy.choices])

    def test_unmet_budget_leaves_auto_to_the_greedy(self):
        result = random_plan(3, n=12, recompute=0)
        result.budget_bytes = 0
        before = [c.chosen for c in result.choices]
        with self.assertRaises(LookupError):
            exact.exact_fit(result, floor=False)
        self.assertEqual([c.chosen for c in result.choices], before)


def imported_modules(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    return imported


class TestSolverIsPure(TestCase):
    def test_imports_neither_torch_nor_fx(self):
        self.assertEqual({m for m in imported_modules(solver.__file__) if m.startswith(("torch", "torch_patches"))}, set())

    def test_members_are_opaque(self):
        # Any member list: the solver never looks into it.
        result = large_plan(30)
        for c in result.choices:
            c.members = (object(),)
        solver.fit(result)
        self.assertTrue(result.met or result.peak[0] > result.budget_bytes)


if __name__ == "__main__":
    run_tests()
