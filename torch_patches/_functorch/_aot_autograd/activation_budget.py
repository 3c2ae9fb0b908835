"""Plan how each saved tensor is stored to fit an activation memory budget.

Used by the inliner (``graph_compile._inline``) for saved tensors whose hooks are a
:func:`torch_patches.hooks.budget` pair.  The partitioner has chosen what the graph saves
(and what it recomputes: ``torch._functorch.config.activation_memory_budget`` runs first
and this plan covers what it left saved); this module chooses, per saved tensor, one of

* ``keep``: saved as it is;
* ``bf16``: ``torch_patches.hooks.bf16`` (float32/float64 only);
* ``fp8``: ``torch_patches.hooks.fp8_rowwise`` (e4m3fn, one float32 scale per row);
* ``offload``: ``torch_patches.hooks.cpu_offload`` (CUDA tensors only);
* ``fp8+offload``: both, chained;
* ``recompute``: not saved; the backward recomputes it with the forward's own ops from
  tensors the graph saves anyway (kept exact: the plan pins them to ``keep``) and inputs
  the caller keeps (parameters, buffers, leaves).  At most :data:`RECOMPUTE_MAX_NODES`
  ops, none random or mutating; exact, so offered whatever ``numerics_safe`` says;
  only to a saved tensor that is the one reader of its storage,

so that the bytes the saved tensors hold on their device fit the budget at every point from
the forward's end through the backward, at the least estimated time.  A saved storage is
held in its stored form until its first backward use and at full size from there to its
last (:class:`Span`), so the backward's first uses are where it can peak; bounding only the
forward's end would let a plan be "met" while the backward rebuilds a tensor beside
everything not used yet.  Lossy options are offered only for tensors
:func:`~torch_patches.hooks.select.numerics_safe` accepts.

Cost model (every figure from the graph's metadata and config knobs, no measurement, so the
plan is a pure function of the graph, the budget and the config, all of which key the
compiled graph):

* device bytes at the end of the forward: keep ``n*s`` (``n`` elements of ``s`` bytes),
  bf16 ``2n``, fp8 ``n + 4r`` (``r`` rows), offload 0, fp8+offload 0;
* time: memory traffic over ``activation_budget_memory_bandwidth`` plus a fixed cost per
  kernel (``activation_budget_kernel_overhead_us``).  bf16 moves ``2ns + 4n`` bytes (pack
  and unpack) in 2 kernels; fp8 ``3ns + 2n + 8r`` (an amax pass, the quantisation, the
  dequantisation) in 3.  Offload copies ``ns`` bytes each way at
  ``activation_budget_host_bandwidth``; only the part of each copy that the compute
  around it cannot cover counts: the device-to-host copy overlaps the forward compute after
  the tensor's last forward use, the host-to-device copy the compute of the
  ``reload_prefetch_distance`` backward nodes before its first use.  Compute per node is
  ``max(flops / activation_budget_flops, bytes / memory bandwidth)`` with flops from
  ``torch.utils.flop_counter``'s formulas.  Recompute costs the compute of its ops (views
  are free) plus a kernel each.

Solver: the multiple-choice knapsack's greedy over each tensor's lower convex hull of
(bytes, time): starting from keep everywhere, repeatedly take the step that saves bytes at
the least time per byte (ties: more bytes first, then graph order) until the saved bytes fit
the budget (:func:`solve`).  The constraint at a point of the backward is a knapsack over
the storages first used after it, so the constraints nest; :func:`fit` meets them from the
last point to the forward's end.  Deterministic.  Recompute couples tensors: taking it pins
the saved tensors it reads to ``keep`` (undoing what they saved), so its step is re-priced
when it comes up (a lazy greedy) and dropped when it would no longer save bytes; its ops
allocate bytes besides the tensor they rebuild, counted at its first use, and a step that
would raise a point over the budget is refused.  Recompute is the fallback: the greedy runs
with the storage options only, and only when that cannot meet the budget again with
recompute too.  If neither run meets it, the one with the lower peak is taken and a warning
says where the backward holds too much.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from torch_patches import config
from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair


KEEP = "keep"
RECOMPUTE = "recompute"

#: The most forward ops one saved tensor's recomputation may copy into the backward.
RECOMPUTE_MAX_NODES = 8


@dataclasses.dataclass(frozen=True)
class Rates:
    """The machine the cost model assumes (config knobs, or defaults per device type)."""

    memory_bytes_per_ms: float
    host_bytes_per_ms: float
    flops_per_ms: float
    kernel_ms: float

    @staticmethod
    def for_device(device: torch.device) -> "Rates":
        cuda = device.type == "cuda"

        def knob(value: float | None, cpu: float, gpu: float) -> float:
            return float(value if value is not None else (gpu if cuda else cpu))

        host = config.activation_budget_host_bandwidth
        if host is None:
            # torch's offload bandwidth knob (torch >= 2.12; its default, 50 GB/s, before).
            host = getattr(torch._functorch.config, "activation_offload_cpu_gpu_bw", 50.0)
        return Rates(
            memory_bytes_per_ms=knob(config.activation_budget_memory_bandwidth, 20.0, 2000.0) * 1e6,
            host_bytes_per_ms=float(host) * 1e6,
            flops_per_ms=knob(config.activation_budget_flops, 0.2, 400.0) * 1e9,
            kernel_ms=knob(config.activation_budget_kernel_overhead_us, 2.0, 5.0) * 1e-3,
        )


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    device_bytes: int
    ms: float


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the backward recomputes a saved tensor: ``nodes`` (forward ops, in graph order)
    copied into the backward, reading ``frontier`` (saved tensors kept exact, inputs the
    caller keeps)."""

    nodes: tuple[fx.Node, ...]
    frontier: tuple[fx.Node, ...]


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
    q, k and v of one projection are three): all of them take it, or the storage stays."""

    saved: list[fx.Node]
    describe: str
    nbytes: int
    options: list[Option]  # lower convex hull: keep first, unless a free option beats it
    chosen: Option
    recipe: Recipe | None = None  # with a "recompute" option
    pins: tuple[int, ...] = ()  # choices that must stay "keep" if this one recomputes
    span: Span = dataclasses.field(default_factory=lambda: Span(0, 0))
    transient: int = 0  # bytes the recipe's other ops allocate while it runs

    @property
    def keep(self) -> Option:
        return Option(KEEP, self.nbytes, 0.0)

    def live(self, point: int) -> int:
        """Device bytes of the storage when the backward reaches ``point``."""
        extra = self.transient if self.chosen.name == RECOMPUTE and point == self.span.first else 0
        return self.span.live(point, self.chosen.device_bytes, self.nbytes) + extra


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

    @property
    def peak(self) -> tuple[int, int]:
        """(bytes, point) of the most the saved storages hold from the forward's end on
        (the earliest point of that many bytes)."""
        nbytes, neg_point = max((self.live(p), -p) for p in self.points)
        return nbytes, -neg_point

    #: Why this plan was taken among those meeting the budget (for the log).
    preference: str = "least lossy"

    @property
    def estimated_ms(self) -> float:
        return sum(c.chosen.ms for c in self.choices)

    @property
    def met(self) -> bool:
        return self.peak[0] <= self.budget_bytes

    def describe_point(self, point: int) -> str:
        return "the forward's end" if point < 0 else f"backward node {self.point_names.get(point, point)}"


# ------------------------------------------------------------------------- options


@functools.cache
def option_hooks(name: str) -> tuple[Any, Any]:
    """The hook pair of a storage option (one object per option: traces are shared)."""
    from torch_patches.hooks import chain, cpu_offload, inlineable
    from torch_patches.hooks.compress import bf16_pack, bf16_unpack, fp8_rowwise, int8_rowwise

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


def options_for(
    val: torch.Tensor, nbytes: int, allowed: tuple[str, ...], tolerance: str, window: tuple[float, float], rates: Rates
) -> list[Option]:
    """Every allowed option for one saved tensor with its bytes and time (keep first).
    ``tolerance``: the lossiest storage the numerics allowlist accepts for it."""
    from torch_patches import _numerics

    from torch_patches._functorch._aot_autograd.utils import size_hint as _size_hint

    s = val.element_size()
    n = nbytes // max(s, 1)
    rows = n // max(_size_hint(val.shape[-1]), 1) if val.dim() else 1  # symbolic: its hint
    out = [Option(KEEP, nbytes, 0.0)]
    if not val.is_floating_point() or n == 0:
        return out
    bw, k = rates.memory_bytes_per_ms, rates.kernel_ms
    fp8_bytes = n + 4 * rows
    fp8_ms = (3 * n * s + 2 * n + 8 * rows) / bw + 3 * k
    cuda = val.device.type == "cuda"

    def exposed(copy_bytes: int) -> float:
        one_way = copy_bytes / rates.host_bytes_per_ms
        fw_window, bw_window = window
        return max(0.0, one_way - fw_window) + max(0.0, one_way - bw_window) + 2 * k

    bf16_ok = _numerics.tolerates(tolerance, _numerics.BF16)
    int8_ok = _numerics.tolerates(tolerance, _numerics.INT8)
    fp8_ok = _numerics.tolerates(tolerance, _numerics.FP8)
    if bf16_ok and "bf16" in allowed and s > 2:
        out.append(Option("bf16", 2 * n, (2 * n * s + 4 * n) / bw + 2 * k))
    if int8_ok and "int8" in allowed and s > 1:
        out.append(Option("int8", fp8_bytes, fp8_ms))  # the same passes, rounding to integers
    if fp8_ok and "fp8" in allowed and s > 1:
        out.append(Option("fp8", fp8_bytes, fp8_ms))
    if cuda and "offload" in allowed:
        out.append(Option("offload", 0, exposed(nbytes)))
    if cuda and fp8_ok and "fp8+offload" in allowed and s > 1:
        out.append(Option("fp8+offload", 0, fp8_ms + exposed(fp8_bytes)))
    return out


def lossy_tolerance(info: Any) -> str:
    """The lossiest storage ``numerics_safe`` accepts for a saved tensor (the allowlist's
    tolerance, and the size rule): one of ``_numerics.LEVELS``."""
    from torch_patches import _numerics
    from torch_patches.hooks.select import numerics_safe

    for level in reversed(_numerics.LEVELS[1:]):
        if numerics_safe(info, level):
            return level
    return _numerics.EXACT


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


def solve(
    choices: list[Choice],
    excess: int,
    among: list[int] | None = None,
    allow: Any = None,
) -> None:
    """Move choices along their hulls until ``excess`` bytes are saved (greedy by ms per
    byte; ties: more bytes, then order).  Only the choices ``among`` move (default: all);
    ``allow(i, pos)`` may refuse a step.  A recompute step also pins its ``pins`` to keep
    (only the undone savings of pins ``among`` count against it): it is re-priced with that
    cost when popped and pushed back if it got dearer."""
    heap: list[tuple[float, int, int, int]] = []
    movable = set(range(len(choices)) if among is None else among)
    pinned = {j for c in choices if c.chosen.name == RECOMPUTE for j in c.pins}

    def step(i: int, pos: int) -> tuple[float, int] | None:
        """(ms per byte, bytes saved) of moving choice i to options[pos], pins included."""
        c = choices[i]
        nxt = c.options[pos]
        saved, ms = c.chosen.device_bytes - nxt.device_bytes, nxt.ms - c.chosen.ms
        if nxt.name == RECOMPUTE:
            # What the tensors it reads saved (by compression, or their own recompute) is undone.
            undone = [j for j in c.pins if j not in pinned]
            saved -= sum(choices[j].nbytes - choices[j].chosen.device_bytes for j in undone if j in movable)
            ms -= sum(choices[j].chosen.ms for j in undone)
        if saved <= 0:
            return None
        return ms / saved, saved

    def push(i: int) -> None:
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
            continue  # stale: pinned, or moved since
        now = step(i, pos)
        if now is None or (allow is not None and not allow(i, pos)):
            continue
        if (now[0], -now[1]) > (slope, neg_saved):  # dearer since it was pushed
            heapq.heappush(heap, (now[0], -now[1], i, pos))
            continue
        c.chosen = c.options[pos]
        if c.chosen.name == RECOMPUTE:
            for j in c.pins:
                choices[j].chosen = choices[j].keep
                pinned.add(j)
        excess -= now[1]
        push(i)


def fit(result: Plan) -> None:
    """Move ``result``'s choices until the saved storages fit its budget at every point of
    the backward, or as close as the options allow.

    At a point ``p`` the bytes are those of the storages used at or before ``p`` and still
    needed (at full size: nothing stored differently shrinks them) plus the stored form of
    the storages first used after ``p``.  So the constraint at ``p`` is a knapsack over the
    storages first used after ``p``, and the constraints nest: what a later point's
    storages save counts at every earlier point too.  The points are met from the latest to
    the earliest, each by :func:`solve` over its own storages; the last is the forward's
    end, where every storage is in its stored form.  A recompute step is refused where the
    ops it copies (and the storages it pins to keep) would raise a point already met above
    the budget, or one above the budget already any higher."""
    points = result.points
    for k in range(len(points) - 1, -1, -1):
        point = points[k]
        excess = result.live(point) - result.budget_bytes
        among = [i for i, c in enumerate(result.choices) if c.span.first > point]
        if excess <= 0 or not among:
            continue
        later = points[k:]

        def allow(i: int, pos: int, later: list[int] = later) -> bool:
            c = result.choices[i]
            if c.options[pos].name != RECOMPUTE:
                return True
            before = [result.live(p) for p in later]
            undo = [(c, c.chosen)] + [(result.choices[j], result.choices[j].chosen) for j in c.pins]
            c.chosen = c.options[pos]
            for j in c.pins:
                result.choices[j].chosen = result.choices[j].keep
            after = [result.live(p) for p in later]
            for choice, chosen in undo:
                choice.chosen = chosen
            return all(a <= max(b, result.budget_bytes) for a, b in zip(after, before))

        solve(result.choices, excess, among, allow)


# ---------------------------------------------------------------- compute windows


def _hinted(value: Any) -> Any:
    """``value`` with every symbolic size replaced by its hint: a meta tensor for a tensor.

    The estimates must never touch a symbolic expression: evaluating one (``float()``, a
    comparison) installs a guard on the graph's shapes, and a dynamic-shape graph would
    recompile at every new size."""
    from torch_patches._functorch._aot_autograd.utils import size_hint as _size_hint

    if isinstance(value, torch.Tensor):
        return torch.empty([_size_hint(d) for d in value.shape], dtype=value.dtype, device="meta")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _size_hint(value)
    return value


def _node_ms(node: fx.Node, rates: Rates) -> float:
    if node.op != "call_function":
        return 0.0
    vals = [_hinted(a.meta.get("val")) for a in node.all_input_nodes]
    out = pytree.tree_map(_hinted, node.meta.get("val"))
    moved = sum(v.numel() * v.element_size() for v in pytree.tree_leaves((vals, out)) if isinstance(v, torch.Tensor))
    return max(_flops(node) / rates.flops_per_ms, moved / rates.memory_bytes_per_ms)


def _flops(node: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs))
    args, kwargs = pytree.tree_map(_hinted, (args, kwargs))
    try:
        return float(formula(*args, **kwargs, out_val=pytree.tree_map(_hinted, node.meta.get("val"))))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments: no estimate
        return 0.0


def windows(
    saved: list[fx.Node], bw_inputs: dict[str, fx.Node], fw_g: fx.Graph, bw_g: fx.Graph, rates: Rates
) -> dict[fx.Node, tuple[float, float]]:
    """Per saved tensor: the forward compute after its last use, and the compute of the
    ``reload_prefetch_distance`` backward nodes before its first use (what hides a copy)."""
    fw_nodes, bw_nodes = list(fw_g.nodes), list(bw_g.nodes)
    fw_ms = [_node_ms(n, rates) for n in fw_nodes]
    bw_ms = [_node_ms(n, rates) for n in bw_nodes]
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    bw_pos = {n: i for i, n in enumerate(bw_nodes)}
    suffix = [0.0] * (len(fw_nodes) + 1)
    for i in range(len(fw_nodes) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + fw_ms[i]
    distance = max(config.unpack_prefetch_distance, config.reload_prefetch_distance)
    out = {}
    for s in saved:
        uses = [fw_pos[u] for u in s.users if u.op != "output"]
        last = max(uses, default=fw_pos[s])
        bw_in = bw_inputs.get(s.name)
        first = min((bw_pos[u] for u in bw_in.users), default=len(bw_nodes)) if bw_in is not None else len(bw_nodes)
        out[s] = (suffix[last + 1], sum(bw_ms[max(0, first - distance) : first]))
    return out


# --------------------------------------------------------------------- recompute


def _recomputable(node: fx.Node) -> bool:
    """A forward op the backward may run again for the same result: a functional ``aten``
    or ``prims`` op (not mutating, not random) returning tensors, or one output of one."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], fx.Node)  # its producer is checked on its own
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if target._schema.is_mutable or any(
        t in target.tags for t in (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)
    ):
        return False
    if target.namespace == "prims" and target.__name__.startswith("inductor_"):
        return False  # Inductor's seeds and random prims carry no nondeterministic tag
    vals = pytree.tree_leaves(node.meta.get("val"))
    return bool(vals) and all(isinstance(v, torch.Tensor) for v in vals)


def recompute_recipe(
    saved: fx.Node,
    exact: set[fx.Node],
    order: dict[fx.Node, int],
    limit: int = RECOMPUTE_MAX_NODES,
) -> Recipe | None:
    """The forward ops between ``saved`` and the nodes in ``exact`` (saved tensors the
    backward reads exactly, inputs the caller keeps), or None: more than ``limit`` ops, or
    one that cannot run again (random, mutating, not a tensor op) on the way."""
    nodes: set[fx.Node] = set()
    frontier: set[fx.Node] = set()
    stack = [saved]
    while stack:
        node = stack.pop()
        if node in nodes or node in frontier:
            continue
        if node is not saved and node in exact:
            frontier.add(node)
            continue
        if len(nodes) >= limit or not _recomputable(node):
            return None
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    return Recipe(tuple(sorted(nodes, key=order.__getitem__)), tuple(sorted(frontier, key=order.__getitem__)))


def recompute_ms(recipe: Recipe, rates: Rates) -> float:
    """The recipe's compute and one kernel per op (views and getitem are free)."""
    ops = [n for n in recipe.nodes if n.target is not operator.getitem and not getattr(n.target, "is_view", False)]
    return sum(_node_ms(n, rates) + rates.kernel_ms for n in ops)


# ------------------------------------------------------------------------- driver


def _nbytes(node: fx.Node) -> int:
    from torch_patches._functorch._aot_autograd.utils import nbytes_of

    return nbytes_of(node)


def plan(
    pair: HookPair,
    spec: Any,
    members: list[fx.Node],
    plannable: list[fx.Node],
    aliases: dict[fx.Node, fx.Node],
    inputs: dict[fx.Node, str | None],
    bw_inputs: dict[str, fx.Node],
    fw_g: fx.Graph,
    bw_g: fx.Graph,
    record_of: Any,
    exact: set[fx.Node] = frozenset(),
) -> Plan:
    """The plan for one budget pair.

    ``members``: every saved tensor in the pair's scope; ``plannable``: those the hooks may
    see (dtype policy, filtering mode, unused ones excluded), without ``aliases`` (saved
    tensors that share another's packed tensor). Saved graph inputs that are not activations
    (parameters, leaves) are not counted. The unit of choice is a storage: the saved tensors
    reading it (q, k, v of one projection) are packed together or kept, since keeping one
    keeps all of it. It costs its base tensor's bytes, however small the saved views.
    ``exact``: the forward nodes a recomputation may read (saved tensors no other hook
    packs, inputs the caller keeps); those in this plan are pinned to keep when read.
    """
    groups: dict[fx.Node, list[fx.Node]] = {}
    for s in members:
        root = act_inputs.storage_root(s)
        if not (root.op == "placeholder" and inputs.get(root) is not None):  # an activation
            groups.setdefault(root, []).append(s)
    storage = {root: max([_nbytes(root), *map(_nbytes, saved)]) for root, saved in groups.items()}
    baseline = sum(storage.values())
    plannable_set = set(plannable)
    covered = plannable_set | {a for a, r in aliases.items() if r in plannable_set}
    planned = {root: [s for s in saved if s in plannable_set] for root, saved in groups.items()}
    planned = {root: saved for root, saved in planned.items() if saved and set(groups[root]) <= covered}
    fixed = sum(b for root, b in storage.items() if root not in planned)
    bw_pos = {n: i for i, n in enumerate(bw_g.nodes)}
    spans = {root: backward_span(saved, bw_inputs, bw_pos) for root, saved in groups.items()}
    nodes = [s for saved in planned.values() for s in saved]
    device = next((s.meta["val"].device for s in nodes), torch.device("cpu"))
    rates = Rates.for_device(device)
    offload = any(o in spec.options for o in ("offload", "fp8+offload"))
    if offload and any(s.meta["val"].device.type == "cuda" for s in nodes):
        hidden = windows(nodes, bw_inputs, fw_g, bw_g, rates)
    else:  # no copy to hide: skip estimating the compute of every node
        hidden = dict.fromkeys(nodes, (0.0, 0.0))
    choices = []
    for root, saved in planned.items():
        per = []
        for s in saved:
            info = record_of(s).info()
            opts = options_for(s.meta["val"], info.nbytes, spec.options, lossy_tolerance(info), hidden[s], rates)
            per.append({o.name: o for o in opts})
        common = [name for name in per[0] if name != KEEP and all(name in p for p in per)]
        options = [Option(KEEP, storage[root], 0.0)] + [
            Option(name, sum(p[name].device_bytes for p in per), sum(p[name].ms for p in per)) for name in common
        ]
        text = record_of(saved[0]).describe() + (f" and {len(saved) - 1} more sharing its storage" if len(saved) > 1 else "")
        choices.append(Choice(saved, text, storage[root], options, options[0], span=spans[root]))
    fixed_spans = tuple((spans[root], b) for root, b in storage.items() if root not in planned)
    names = {i: n.name for n, i in bw_pos.items()}

    # The partitioner's cheap recomputation met an ambient budget (torch_patches/_functorch/
    # partitioners.py): the budget is a fraction of the default partition's bytes.
    from torch_patches import _compile_facts

    found = _compile_facts.facts()
    ratio = found.partition_budget_ratio if found is not None and pair.label == "ambient" else None
    target = spec.target_bytes(baseline if not ratio else round(baseline / ratio))

    def run(units: list[Choice], exact_first: bool = False) -> Plan:
        on_hull = [_on_hull(_penalized(c) if exact_first else c) for c in units]
        candidate = Plan(pair.label, spec, baseline, fixed, target, on_hull, fixed_spans, names)
        if ratio:
            candidate.preference = f"met by the partitioner's recomputation, {ratio:.3f} of its default bytes"
        fit(candidate)
        if exact_first:  # the true times of what was chosen
            candidate.choices = [_unpenalized(c, u) for c, u in zip(candidate.choices, units)]
            candidate.preference = "least lossy"
        return candidate

    # The fastest plan: storage options first; recompute (its recipes are only looked for
    # then) where they cannot meet the budget.
    fastest = run(choices)
    recomputable = None
    if not fastest.met and RECOMPUTE in spec.options:
        recomputable = with_recipes(choices, _sole(choices, groups), exact, fw_g, rates)
        if recomputable is not None:
            fastest = min([fastest, run(recomputable)], key=lambda p: (not p.met, p.peak[0] if not p.met else 0))
    if all(c.chosen.name == KEEP for c in fastest.choices) or not any(_lossy(c.chosen) for c in fastest.choices):
        return fastest  # nothing lossy to avoid
    # The least lossy plan: exact options (keep, offload, recompute) before bf16 before fp8,
    # each tier at the least time; taken unless the fastest is faster by more than the margin.
    if recomputable is None and RECOMPUTE in spec.options:
        recomputable = with_recipes(choices, _sole(choices, groups), exact, fw_g, rates)
    least_lossy = run(recomputable or choices, exact_first=True)
    margin = config.activation_budget_lossy_margin * graph_compute_ms(fw_g, bw_g, rates)
    if least_lossy.met and (not fastest.met or least_lossy.estimated_ms <= fastest.estimated_ms + margin):
        return least_lossy
    fastest.preference = (
        f"fastest: the least lossy plan {'misses the budget' if not least_lossy.met else 'is slower by'}"
        + ("" if not least_lossy.met else f" {least_lossy.estimated_ms - fastest.estimated_ms:.3f} ms > margin {margin:.3f} ms")
    )
    return fastest


#: How lossy each option is: exact (keep, offload, recompute), bf16, int8, fp8 (the
#: numerics levels' order).
LOSS = {KEEP: 0, "offload": 0, RECOMPUTE: 0, "bf16": 1, "int8": 2, "fp8": 3, "fp8+offload": 3}
#: Time added per tier of loss in the least-lossy run: larger than any plan's time, so that
#: the greedy takes every exact step before a bf16 one and every bf16 step before an fp8 one
#: (per byte saved).
_LOSS_PENALTY_MS = 1e6


def _lossy(option: Option) -> bool:
    return LOSS.get(option.name, 3) > 0


def _penalized(choice: Choice) -> Choice:
    options = [dataclasses.replace(o, ms=o.ms + LOSS.get(o.name, 3) * _LOSS_PENALTY_MS) for o in choice.options]
    return dataclasses.replace(choice, options=options, chosen=options[0])


def _unpenalized(choice: Choice, original: Choice) -> Choice:
    by_name = {o.name: o for o in original.options}
    return dataclasses.replace(choice, options=[by_name[o.name] for o in choice.options], chosen=by_name[choice.chosen.name])


def _sole(choices: list[Choice], groups: dict[fx.Node, list[fx.Node]]) -> list[bool]:
    """Per choice: its tensor is the one reader of its storage (a recompute frees it)."""
    return [len(groups[act_inputs.storage_root(c.saved[0])]) == 1 for c in choices]


def graph_compute_ms(fw_g: fx.Graph, bw_g: fx.Graph, rates: Rates) -> float:
    """The cost model's time of the forward and backward graphs' compute."""
    return sum(_node_ms(n, rates) for g in (fw_g, bw_g) for n in g.nodes)


def with_recipes(
    choices: list[Choice], sole: list[bool], exact: set[fx.Node], fw_g: fx.Graph, rates: Rates
) -> list[Choice] | None:
    """``choices`` with a recompute option for each one that has a recipe (``sole``: the
    choice's tensor is the one reader of its storage, so recomputing it frees the storage),
    or None if none has."""
    fw_order = {n: i for i, n in enumerate(fw_g.nodes)}
    unit_of = {act_inputs.storage_root(c.saved[0]): i for i, c in enumerate(choices)}
    out, found = [], False
    for i, c in enumerate(choices):
        recipe = recompute_recipe(c.saved[0], exact, fw_order) if sole[i] else None
        if recipe is None:
            out.append(c)
            continue
        found = True
        units = (unit_of.get(act_inputs.storage_root(f)) for f in recipe.frontier)
        pins = tuple(sorted({u for u in units if u is not None and u != i}))
        root = act_inputs.storage_root(c.saved[0])
        out.append(
            dataclasses.replace(
                c,
                options=[*c.options, Option(RECOMPUTE, 0, recompute_ms(recipe, rates))],
                recipe=recipe,
                pins=pins,
                transient=recipe_transient_bytes(recipe, root),
            )
        )
    return out if found else None


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


def recipe_transient_bytes(recipe: Recipe, root: fx.Node) -> int:
    """Bytes the recipe's ops allocate besides the storage they rebuild (an upper bound:
    as if all of them were alive at once, right before the storage's first use)."""
    return sum(
        _nbytes(n)
        for n in recipe.nodes
        if not getattr(n.target, "is_view", False) and act_inputs.storage_root(n) is not root
    )


def _on_hull(choice: Choice) -> Choice:
    """``choice`` (its options all listed, keep first) over the lower hull of its options,
    at the hull's first option."""
    hull = lower_hull(choice.options)
    if hull[0].name == RECOMPUTE:  # free to recompute (views only): still a step, pins and all
        hull.insert(0, choice.options[0])
    return dataclasses.replace(choice, options=hull, chosen=hull[0])


def summarize(result: Plan) -> Any:
    """The plan's :class:`~saved_tensor_records.BudgetPlanSummary`; warns when the plan
    does not meet its budget (where the backward holds too much)."""
    from torch_patches import _compile_facts
    from torch_patches._functorch._aot_autograd.saved_tensor_records import BudgetPlanSummary, PlannedStorage

    peak, point = result.peak
    found = _compile_facts.facts() if result.label == "ambient" else None
    cheap = found.partition_cheap_ratio if found is not None else None
    units = tuple(
        PlannedStorage(
            tuple(n.name for n in c.saved),
            c.chosen.name,
            c.chosen.device_bytes,
            c.chosen.ms,
            tuple(f.name for f in c.recipe.frontier) if c.chosen.name == RECOMPUTE and c.recipe is not None else (),
        )
        for c in result.choices
    )
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
        partitioner_met=None if cheap is None else found.partition_budget_ratio is not None,
    )
    if not result.met:
        in_use = sorted(
            (c for c in result.choices if c.span.first <= point <= c.span.last), key=lambda c: -c.nbytes
        )
        exact = sorted(
            (c for c in result.choices if len(c.options) == 1 and point < c.span.first), key=lambda c: -c.nbytes
        )
        warnings.warn(
            f"torch_patches: activation memory {result.spec.describe()} of {result.budget_bytes} B "
            f"cannot be met in scope {result.label!r}: the smallest plan found holds {peak} B of saved "
            f"tensors at {result.describe_point(point)}. Of those, {sum(c.nbytes for c in in_use)} B "
            f"are in use there at full size ({_names(in_use)}), "
            f"{sum(s.live(point, n, n) for s, n in result.fixed)} B cannot be hooked (integer tensors, "
            f"graph inputs), and {sum(c.nbytes for c in exact)} B have no allowed option ({_names(exact)}: "
            "numerics_safe keeps them exact, offload needs CUDA, recompute needs a short chain "
            "of ops from tensors kept exact). Saving as much as possible; "
            "torch._functorch.config.activation_memory_budget can recompute more",
            stacklevel=2,
        )
    return summary


def _names(choices: list[Choice]) -> str:
    return (", ".join(c.saved[0].name for c in choices[:3]) + (", ..." if len(choices) > 3 else "")) or "none"


def apply_plans(
    candidates: list[Any],
    saved_tensors: list[fx.Node],
    inputs: dict[fx.Node, str | None],
    held: set[fx.Node],
    bw_inputs: dict[str, fx.Node],
    fw_g: fx.Graph,
    bw_g: fx.Graph,
) -> tuple[dict[fx.Node, Recipe], list[Any]]:
    """Plan every budget pair among the ``candidates`` (records of saved tensors with
    hooks): each record the plan covers gets its option and the hooks of that option, or
    is kept or recomputed (``SavedTensorRecord.option``, ``decision``, ``reason``).
    Returns the recomputed saved tensors with their recipes and each plan's summary.
    ``held``: forward inputs the caller keeps (a recomputation may read them)."""
    from torch_patches._functorch._aot_autograd.graph_surgery import alias_roots
    from torch_patches._functorch._aot_autograd.saved_tensor_records import RECOMPUTED

    record_of = {r.node: r for r in candidates}.__getitem__
    hookable = {r.node: r.chosen for r in candidates if r.hooked}
    recomputed: dict[fx.Node, Recipe] = {}
    summaries = []
    for pair in dict.fromkeys(r.pair for r in candidates):
        spec = pair.kind.budget
        if spec is None:
            continue
        members = [r.node for r in candidates if r.pair is pair]
        mine = {s: p for s, p in hookable.items() if p is pair}
        aliases = alias_roots(mine)
        plannable = [s for s in mine if s not in aliases]
        # What a recomputation may read: inputs the caller keeps, and saved tensors that
        # reach the backward exact (no other hooks; this plan pins its own to keep).
        exact = held | {
            s for s in saved_tensors if s.name in bw_inputs and hookable.get(s, pair) is pair
        }
        result = plan(pair, spec, members, plannable, aliases, inputs, bw_inputs, fw_g, bw_g, record_of, exact)
        summaries.append(summarize(result))
        chosen = {s: c.chosen.name for c in result.choices for s in c.saved}
        recipes = {c.saved[0]: c.recipe for c in result.choices if c.chosen.name == RECOMPUTE}
        recomputed |= recipes
        for alias, root in aliases.items():
            chosen[alias] = chosen.get(root, KEEP)
        for s in mine:
            record = record_of(s)
            option = chosen.get(s)
            record.option = option
            if option is None:
                record.leave("budget", "shares its storage with a saved tensor the budget plan cannot hook")
            elif option == KEEP:
                record.leave("budget", "kept by the budget plan")
            elif option == RECOMPUTE and s not in recipes:  # an alias of a recomputed tensor
                record.leave("budget", f"aliases {aliases[s].name}, which the budget plan recomputes")
            elif option == RECOMPUTE:
                recipe = recipes[s]
                reads = ", ".join(f.name for f in recipe.frontier)
                record.leave("budget", f"recomputed by the budget plan: {len(recipe.nodes)} ops from {reads}", RECOMPUTED)
            else:
                record.take(HookPair(*option_hooks(option), pair.label), "budget", f"budget option {option}")
    return recomputed, summaries
