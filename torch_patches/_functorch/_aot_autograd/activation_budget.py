"""Plan how each saved tensor is stored to fit an activation memory budget.

Used by the inliner (``graph_compile._inline``) for saved tensors whose hooks are a
:func:`torch_patches.hooks.budget` pair.  The partitioner has chosen what the graph saves
(and what it recomputes: ``torch._functorch.config.activation_memory_budget`` runs first
and this plan covers what it left saved); this module chooses, per saved tensor, one of

* ``keep``: saved as it is;
* ``bf16``: ``torch_patches.hooks.bf16`` (float32/float64 only);
* ``fp8``: ``torch_patches.hooks.fp8_rowwise`` (e4m3fn, one float32 scale per row);
* ``offload``: ``torch_patches.hooks.cpu_offload`` (CUDA tensors only);
* ``fp8+offload``: both, chained,

so that the bytes the graph keeps on its device for the backward fit the budget at the
least estimated time.  Lossy options are offered only for tensors
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
  ``torch.utils.flop_counter``'s formulas.

Solver: the multiple-choice knapsack's greedy over each tensor's lower convex hull of
(bytes, time): starting from keep everywhere, repeatedly take the step that saves bytes at
the least time per byte (ties: more bytes first, then graph order) until the saved bytes fit
the budget.  Deterministic.  If every tensor at its smallest option still exceeds the
budget, that is the plan and a warning says by how much.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from torch_patches import config
from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair


KEEP = "keep"


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


@dataclasses.dataclass
class Choice:
    """The option chosen for the saved tensors sharing one storage (most often one tensor;
    q, k and v of one projection are three): all of them take it, or the storage stays."""

    saved: list[fx.Node]
    describe: str
    nbytes: int
    options: list[Option]  # lower convex hull: keep first, unless a free option beats it
    chosen: Option


@dataclasses.dataclass
class Plan:
    """One budget pair's plan over the saved tensors of its scope in one graph."""

    label: str
    spec: Any
    baseline_bytes: int  # what the scope saves without hooks (unique storages)
    fixed_bytes: int  # saved bytes the plan cannot store otherwise
    budget_bytes: int
    choices: list[Choice]

    @property
    def predicted_bytes(self) -> int:
        return self.fixed_bytes + sum(c.chosen.device_bytes for c in self.choices)

    @property
    def estimated_ms(self) -> float:
        return sum(c.chosen.ms for c in self.choices)

    @property
    def met(self) -> bool:
        return self.predicted_bytes <= self.budget_bytes


# ------------------------------------------------------------------------- options


@functools.cache
def option_hooks(name: str) -> tuple[Any, Any]:
    """The hook pair of a storage option (one object per option: traces are shared)."""
    from torch_patches.hooks import chain, cpu_offload, inlineable
    from torch_patches.hooks.compress import bf16_pack, bf16_unpack, fp8_rowwise

    if name == "bf16":
        return inlineable(bf16_pack, bf16_unpack)
    if name == "fp8":
        return fp8_rowwise(where=None)
    if name == "offload":
        return cpu_offload()
    if name == "fp8+offload":
        return chain(fp8_rowwise(where=None), cpu_offload())
    raise ValueError(f"unknown storage option {name!r}")


def options_for(
    val: torch.Tensor, nbytes: int, allowed: tuple[str, ...], lossy_ok: bool, window: tuple[float, float], rates: Rates
) -> list[Option]:
    """Every allowed option for one saved tensor with its bytes and time (keep first)."""
    from torch_patches.hooks.select import _size_hint

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

    if lossy_ok and "bf16" in allowed and s > 2:
        out.append(Option("bf16", 2 * n, (2 * n * s + 4 * n) / bw + 2 * k))
    if lossy_ok and "fp8" in allowed and s > 1:
        out.append(Option("fp8", fp8_bytes, fp8_ms))
    if cuda and "offload" in allowed:
        out.append(Option("offload", 0, exposed(nbytes)))
    if cuda and lossy_ok and "fp8+offload" in allowed and s > 1:
        out.append(Option("fp8+offload", 0, fp8_ms + exposed(fp8_bytes)))
    return out


def lower_hull(options: list[Option]) -> list[Option]:
    """The options worth stepping through, from the most bytes (keep) to the fewest, each
    step costing more time per byte saved than the one before: options another beats on
    both bytes and time, and those above the convex hull, are dropped."""
    frontier: list[Option] = []
    for o in sorted(options, key=lambda o: (o.device_bytes, o.ms, o.name)):
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


def solve(choices: list[Choice], excess: int) -> None:
    """Move choices along their hulls until ``excess`` bytes are saved (greedy by ms per
    byte; ties: more bytes, then order)."""
    heap: list[tuple[float, int, int, int]] = []

    def push(i: int) -> None:
        c = choices[i]
        pos = c.options.index(c.chosen)
        if pos + 1 < len(c.options):
            nxt = c.options[pos + 1]
            heapq.heappush(heap, (_slope(c.chosen, nxt), -(c.chosen.device_bytes - nxt.device_bytes), i, pos + 1))

    for i in range(len(choices)):
        push(i)
    while excess > 0 and heap:
        _, neg_saved, i, pos = heapq.heappop(heap)
        choices[i].chosen = choices[i].options[pos]
        excess += neg_saved
        push(i)


# ---------------------------------------------------------------- compute windows


def _node_ms(node: fx.Node, rates: Rates) -> float:
    if node.op != "call_function":
        return 0.0
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    out = node.meta.get("val")
    moved = sum(
        v.numel() * v.element_size()
        for v in pytree.tree_leaves((vals, out))
        if isinstance(v, torch.Tensor) and not isinstance(v.numel(), torch.SymInt)
    )
    return max(_flops(node) / rates.flops_per_ms, moved / rates.memory_bytes_per_ms)


def _flops(node: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs))
    try:
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read symbolic shapes: no estimate
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


# ------------------------------------------------------------------------- driver


def _nbytes(node: fx.Node) -> int:
    from torch_patches.hooks.select import compiled_info

    val = node.meta.get("val")
    return compiled_info(node, None, "").nbytes if isinstance(val, torch.Tensor) else 0


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
    describe: Any,
) -> Plan:
    """The plan for one budget pair.

    ``members``: every saved tensor in the pair's scope; ``plannable``: those the hooks may
    see (dtype policy, filtering mode, unused ones excluded), without ``aliases`` (saved
    tensors that share another's packed tensor). Saved graph inputs that are not activations
    (parameters, leaves) are not counted. The unit of choice is a storage: the saved tensors
    reading it (q, k, v of one projection) are packed together or kept, since keeping one
    keeps all of it. It costs its base tensor's bytes, however small the saved views.
    """
    from torch_patches.hooks.select import compiled_info, numerics_safe

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
    nodes = [s for saved in planned.values() for s in saved]
    device = next((s.meta["val"].device for s in nodes), torch.device("cpu"))
    rates = Rates.for_device(device)
    offload = any(o in spec.options for o in ("offload", "fp8+offload"))
    if offload and any(s.meta["val"].device.type == "cuda" for s in nodes):
        spans = windows(nodes, bw_inputs, fw_g, bw_g, rates)
    else:  # no copy to hide: skip estimating the compute of every node
        spans = dict.fromkeys(nodes, (0.0, 0.0))
    choices = []
    for root, saved in planned.items():
        per = []
        for s in saved:
            info = compiled_info(s, bw_inputs.get(s.name), pair.label)
            opts = options_for(s.meta["val"], info.nbytes, spec.options, numerics_safe(info), spans[s], rates)
            per.append({o.name: o for o in opts})
        common = [name for name in per[0] if name != KEEP and all(name in p for p in per)]
        options = [Option(KEEP, storage[root], 0.0)] + [
            Option(name, sum(p[name].device_bytes for p in per), sum(p[name].ms for p in per)) for name in common
        ]
        hull = lower_hull(options)
        text = describe(saved[0]) + (f" and {len(saved) - 1} more sharing its storage" if len(saved) > 1 else "")
        choices.append(Choice(saved, text, storage[root], hull, hull[0]))
    result = Plan(pair.label, spec, baseline, fixed, spec.target_bytes(baseline), choices)
    solve(choices, result.predicted_bytes - result.budget_bytes)
    return result


def log_plan(result: Plan, artifact: logging.Logger) -> None:
    """The plan, per saved tensor and in total (``TORCH_LOGS="torch_patches"``)."""
    for c in result.choices:
        artifact.debug(
            "budget plan (%s): saved %s -> %s, %d B on device, est %.3f ms",
            result.label, c.describe, c.chosen.name, c.chosen.device_bytes, c.chosen.ms,
        )
    artifact.debug(
        "budget plan (%s): %d B planned of %d B saved, budget %d B; est %.3f ms; %s",
        result.label, result.predicted_bytes, result.baseline_bytes, result.budget_bytes,
        result.estimated_ms, "met" if result.met else "NOT met",
    )
    if not result.met:
        floor = result.fixed_bytes + sum(c.options[-1].device_bytes for c in result.choices)
        exact = sorted((c for c in result.choices if len(c.options) == 1), key=lambda c: -c.nbytes)
        names = ", ".join(c.saved[0].name for c in exact[:3]) + (", ..." if len(exact) > 3 else "")
        warnings.warn(
            f"torch_patches: activation memory {result.spec.describe()} of {result.budget_bytes} B "
            f"cannot be met in scope {result.label!r}: the smallest plan keeps {floor} B. "
            f"{result.fixed_bytes} B of it cannot be hooked (integer tensors, graph inputs), "
            f"{sum(c.nbytes for c in exact)} B have no allowed option ({names or 'none'}: "
            "numerics_safe keeps them exact and offload needs CUDA). Saving as much as "
            "possible; torch._functorch.config.activation_memory_budget can recompute more",
            stacklevel=2,
        )


def apply_plans(
    hookable: dict[fx.Node, HookPair],
    candidates: list[tuple[fx.Node, HookPair]],
    inputs: dict[fx.Node, str | None],
    bw_inputs: dict[str, fx.Node],
    fw_g: fx.Graph,
    bw_g: fx.Graph,
    artifact: logging.Logger,
    describe: Any,
) -> dict[fx.Node, HookPair]:
    """``hookable`` with every budget pair replaced by its plan's option per saved tensor
    (saved tensors the plan keeps are dropped)."""
    from torch_patches._functorch._aot_autograd.graph_surgery import alias_roots
    from torch_patches.hooks.budget import unwrap_budget

    out = dict(hookable)
    for pair in dict.fromkeys(p for _, p in candidates):
        spec = unwrap_budget((pair.pack, pair.unpack))
        if spec is None:
            continue
        members = [s for s, p in candidates if p is pair]
        mine = {s: p for s, p in hookable.items() if p is pair}
        aliases = alias_roots(mine)
        plannable = [s for s in mine if s not in aliases]
        result = plan(pair, spec, members, plannable, aliases, inputs, bw_inputs, fw_g, bw_g, describe)
        log_plan(result, artifact)
        chosen = {s: c.chosen.name for c in result.choices for s in c.saved}
        for alias, root in aliases.items():
            chosen[alias] = chosen.get(root, KEEP)
        for s in mine:
            if chosen.get(s, KEEP) == KEEP:
                why = "kept by the budget plan" if s in chosen else (
                    "shares its storage with a saved tensor the budget plan cannot hook"
                )
                artifact.debug("saved %s left unhooked: %s", describe(s), why)
                del out[s]
            else:
                out[s] = HookPair(*option_hooks(chosen[s]), pair.label)
    return out
