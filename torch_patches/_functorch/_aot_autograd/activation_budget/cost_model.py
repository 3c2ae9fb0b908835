"""The budget's cost model: the bytes and time of each storage option of a saved tensor,
and the compute time of graph nodes, from the graphs' metadata and config knobs (no
measurement).  Reads fx graphs; the :class:`Option` it prices (and ``LOSS``, how lossy each
option is) are the solver's data types, defined in :mod:`.solver` and exported here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from torch_patches import config
from torch_patches._functorch._aot_autograd.activation_budget.solver import KEEP, LOSS, RECOMPUTE, Option
from torch_patches._functorch._aot_autograd.utils import hinted_nbytes, nbytes_of, size_hint
from torch_patches.hooks import numerics
from torch_patches.hooks.select import numerics_safe

__all__ = [
    "KEEP",
    "LOSS",
    "RECOMPUTE",
    "Option",
    "Rates",
    "copy_engine",
    "copy_ms",
    "graph_compute_ms",
    "lossy_tolerance",
    "options_for",
    "windows",
]


@dataclasses.dataclass(frozen=True)
class Rates:
    """The machine the cost model assumes (config knobs, or defaults per device type)."""

    memory_bytes_per_ms: float
    host_bytes_per_ms: float
    flops_per_ms: float
    kernel_ms: float

    @staticmethod
    def for_device(device: torch.device) -> Rates:
        defaults = DEFAULT_RATES["cuda" if device.type == "cuda" else "cpu"]

        def knob(name: str) -> float:
            value = getattr(config, name)
            return float(value if value is not None else defaults[name])

        host = config.activation_budget_host_bandwidth
        if host is None:
            # torch's offload bandwidth knob (torch >= 2.12; its default, 50 GB/s, before).
            host = getattr(torch._functorch.config, "activation_offload_cpu_gpu_bw", 50.0)
        return Rates(
            memory_bytes_per_ms=knob("activation_budget_memory_bandwidth") * 1e6,
            host_bytes_per_ms=float(host) * 1e6,
            flops_per_ms=knob("activation_budget_flops") * 1e9,
            kernel_ms=knob("activation_budget_kernel_overhead_us") * 1e-3,
        )


#: The machine :meth:`Rates.for_device` assumes where a knob is unset, per device type, by
#: config knob: memory bandwidth (GB/s), compute (TFLOP/s), a kernel's launch (us).
DEFAULT_RATES: dict[str, dict[str, float]] = {
    "cpu": {"activation_budget_memory_bandwidth": 20.0, "activation_budget_flops": 0.2, "activation_budget_kernel_overhead_us": 2.0},
    "cuda": {"activation_budget_memory_bandwidth": 2000.0, "activation_budget_flops": 400.0, "activation_budget_kernel_overhead_us": 5.0},
}


# ------------------------------------------------------------------------- options


def copy_engine(device: torch.device) -> bool:
    """Whether offloading from ``device`` frees device memory with copies that can run
    beside the compute (CUDA: a copy stream to pinned host memory).  Elsewhere offload is a
    plain copy to the same memory, never a storage option."""
    return device.type == "cuda"


def options_for(
    val: torch.Tensor, nbytes: int, allowed: tuple[str, ...], tolerance: str, window: tuple[float, float], rates: Rates
) -> list[Option]:
    """Every allowed option for one saved tensor with its bytes and time (keep first).
    ``tolerance``: the lossiest storage the numerics allowlist accepts for it."""
    s = val.element_size()
    n = nbytes // max(s, 1)
    rows = n // max(size_hint(val.shape[-1]), 1) if val.dim() else 1  # symbolic: its hint
    out = [Option(KEEP, nbytes, 0.0)]
    if not val.is_floating_point() or n == 0:
        return out
    bw, k = rates.memory_bytes_per_ms, rates.kernel_ms
    fp8_bytes = n + 4 * rows
    fp8_ms = (3 * n * s + 2 * n + 8 * rows) / bw + 3 * k
    cuda = copy_engine(val.device)

    def offloaded(name: str, copy_bytes: int, compute_ms: float = 0.0) -> Option:
        link, exposed = copy_ms(copy_bytes, window, rates)
        return Option(name, 0, compute_ms + exposed + 2 * k, copy_bytes, link, exposed)

    bf16_ok = numerics.tolerates(tolerance, numerics.BF16)
    int8_ok = numerics.tolerates(tolerance, numerics.INT8)
    fp8_ok = numerics.tolerates(tolerance, numerics.FP8)
    if bf16_ok and "bf16" in allowed and s > 2:
        out.append(Option("bf16", 2 * n, (2 * n * s + 4 * n) / bw + 2 * k))
    if int8_ok and "int8" in allowed and s > 1:
        out.append(Option("int8", fp8_bytes, fp8_ms))  # the same passes, rounding to integers
    if fp8_ok and "fp8" in allowed and s > 1:
        out.append(Option("fp8", fp8_bytes, fp8_ms))
    if cuda and "offload" in allowed:
        out.append(offloaded("offload", nbytes))
    if cuda and fp8_ok and "fp8+offload" in allowed and s > 1:
        out.append(offloaded("fp8+offload", fp8_bytes, fp8_ms))
    return out


def lossy_tolerance(info: Any) -> str:
    """The lossiest storage ``numerics_safe`` accepts for a saved tensor (the allowlist's
    tolerance, and the size rule): one of ``numerics.LEVELS``."""
    for level in reversed(numerics.LEVELS[1:]):
        if numerics_safe(info, level):
            return level
    return numerics.EXACT


# ------------------------------------------------------------------ compute per node


def _hinted(value: Any) -> Any:
    """``value`` with every symbolic size replaced by its hint: a meta tensor for a tensor.

    The estimates must never touch a symbolic expression: evaluating one (``float()``, a
    comparison) installs a guard on the graph's shapes, and a dynamic-shape graph would
    recompile at every new size."""
    if isinstance(value, torch.Tensor):
        return torch.empty([size_hint(d) for d in value.shape], dtype=value.dtype, device="meta")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size_hint(value)
    return value


def _node_ms(node: fx.Node, rates: Rates) -> float:
    """The node's compute: ``max(flops / flops rate, bytes moved / memory bandwidth)``."""
    if node.op != "call_function":
        return 0.0
    vals = [a.meta.get("val") for a in node.all_input_nodes]  # (a tuple: max's)
    moved = sum(hinted_nbytes(v) for v in pytree.tree_leaves((vals, node.meta.get("val"))))
    return max(_flops(node) / rates.flops_per_ms, moved / rates.memory_bytes_per_ms)


def _flops(node: fx.Node) -> float:
    """``torch.utils.flop_counter``'s formula for the node's op, at the sizes' hints (0
    without one)."""
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


def recompute_ms(nodes: Any, rates: Rates) -> float:
    """Estimated time to run the forward ``nodes`` again (a recomputation's cost)."""
    return sum(_node_ms(n, rates) for n in nodes)


def graph_compute_ms(fw_g: fx.Graph, bw_g: fx.Graph, rates: Rates) -> float:
    """The cost model's time of the forward and backward graphs' compute."""
    return sum(_node_ms(n, rates) for g in (fw_g, bw_g) for n in g.nodes)


# ----------------------------------------------------------------- offload overlap


def copy_ms(copy_bytes: int, window: tuple[float, float], rates: Rates) -> tuple[float, float]:
    """An offload's copies of ``copy_bytes``, out and back: ``(time on the link, the part
    of it the compute ``window`` (forward, backward) does not cover)``."""
    one_way = copy_bytes / rates.host_bytes_per_ms
    fw_window, bw_window = window
    return 2 * one_way, max(0.0, one_way - fw_window) + max(0.0, one_way - bw_window)


def windows(
    saved: list[fx.Node],
    bw_inputs: dict[str, fx.Node],
    fw_g: fx.Graph,
    bw_g: fx.Graph,
    rates: Rates,
    neighbours: bool = False,
) -> dict[fx.Node, tuple[float, float]]:
    """Per saved tensor, the compute that hides its offload's copies, (forward, backward).

    A graph that is its step: the forward compute after the tensor's last use, and the
    compute of the ``reload_prefetch_distance`` backward nodes before its first use.

    With ``neighbours`` (a graph that is one of several of its step, whose reloads start a
    graph ahead: ``config.offload_prefetch_graphs``, ``offload_prefetch.py``) the copies
    run behind the graphs beside it too: the forward's copies go on while the next graph's
    forward runs, its reloads while the backward of the graph autograd runs before it.
    Those graphs are taken to cost what this one costs (a model compiled block by block
    repeats its blocks), and in the steady state of such a step one copy link carries each
    graph's copies in the time of one graph's forward (and backward): each tensor gets the
    share of this graph's forward and backward compute that its bytes are of the bytes in
    ``saved``, so that offloading all of them hides ``max(0, copy time - compute)`` and no
    more (the windows inside the graph would count the same link twice)."""
    fw_nodes, bw_nodes = list(fw_g.nodes), list(bw_g.nodes)
    fw_ms = [_node_ms(n, rates) for n in fw_nodes]
    bw_ms = [_node_ms(n, rates) for n in bw_nodes]
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    bw_pos = {n: i for i, n in enumerate(bw_nodes)}
    suffix = [0.0] * (len(fw_nodes) + 1)
    for i in range(len(fw_nodes) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + fw_ms[i]
    distance = max(config.unpack_prefetch_distance, config.reload_prefetch_distance)
    total = sum(map(nbytes_of, saved)) if neighbours else 0
    fw_total, bw_total = suffix[0], sum(bw_ms)
    out = {}
    for s in saved:
        uses = [fw_pos[u] for u in s.users if u.op != "output"]
        last = max(uses, default=fw_pos[s])
        bw_in = bw_inputs.get(s.name)
        first = min((bw_pos[u] for u in bw_in.users), default=len(bw_nodes)) if bw_in is not None else len(bw_nodes)
        if total:
            share = nbytes_of(s) / total
            out[s] = (share * fw_total, share * bw_total)
        else:
            out[s] = (suffix[last + 1], sum(bw_ms[max(0, first - distance) : first]))
    return out
