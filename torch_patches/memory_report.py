"""``torch_patches.report``: where one step's activation memory goes, saved tensor by saved tensor.

::

    report = torch_patches.report(step, budget=0.5)   # step(): one forward and backward
    print(report.table())                             # grouped by module, with totals
    report.save("memory-report")                      # report.txt, report.csv, timeline.png, pareto.png

``report`` runs ``step()`` once with the hooks (or the budget) active, after
``torch._dynamo.reset()`` so that every graph of the step is compiled, or loaded from
AOTAutogradCache (whose entries carry their records), inside it. Each compiled graph's
saved-tensor records (``saved_tensor_records.SavedTensorRecord``: what the inliner decided
for every tensor its forward saves, and why) become :attr:`MemoryReport.rows`. The pictures
are the planner's model of the step, not a measurement: device bytes of the saved tensors
along the forward and backward node order (``timeline.png``), and each budget fraction's
planned peak and estimated time beside the partitioner's own ``activation_memory_budget``
partition (``pareto.png``). On CUDA, ``save(snapshot=True)`` adds the allocator's own
record of the step, for PyTorch's memory viewer.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import io
import os
import re
from collections.abc import Callable
from typing import Any

__all__ = ["FIELDS", "MemoryReport", "report"]

#: The columns of :attr:`MemoryReport.rows` (and of ``report.csv``).
FIELDS = (
    "graph",
    "module",
    "name",
    "op",
    "shape",
    "dtype",
    "bytes",
    "decision",
    "storage",
    "packed_bytes",
    "device_bytes",
    "why",
)


def _storage(record: Any) -> str:
    """What the tensor was stored as between the forward and the backward."""
    if record.decision == "recomputed":
        return "recomputed"
    if record.decision == "alias":
        return f"alias of {record.alias_of}"
    if record.decision == "unhooked":
        return "kept"
    if record.option is not None:
        return record.option
    # "pack=torch_patches.hooks.compress.bf16_pack, unpack=..." -> "bf16"
    packs = re.findall(r"pack=([\w.<>]+)", record.hooks or "")
    return "+".join(p.rsplit(".", 1)[-1].removesuffix("_pack") for p in packs[:1]) or record.hooks or "hooked"


def _device_bytes(record: Any) -> int:
    """Device bytes it holds between the forward and the backward (its storage's share)."""
    if record.decision in ("recomputed", "alias"):
        return 0
    if record.decision == "hooked":
        return record.packed_bytes if record.packed_bytes is not None else record.nbytes
    return record.nbytes


def _row(graph: int, record: Any) -> dict[str, Any]:
    why = record.reason or ""
    if not why and record.decision == "hooked":
        why = f"{record.decided_by}: {record.hooks}"
    return {
        "graph": graph,
        "module": record.module,
        "name": record.name,
        "op": record.producer or "input",
        "shape": tuple(record.shape),
        "dtype": str(record.dtype).replace("torch.", ""),
        "bytes": record.nbytes,
        "decision": record.decision,
        "storage": _storage(record),
        "packed_bytes": record.packed_bytes,
        "device_bytes": _device_bytes(record),
        "why": why,
    }


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass
class MemoryReport:
    """The saved tensors of one step, what was done with them, and the planner's model.

    Attributes:
        rows: one dict per saved tensor (:data:`FIELDS`): ``graph`` (the compiled graph's
            index in the step), ``module`` (the ``named_modules()`` path of the module whose
            forward computed it, ``""`` outside any submodule), ``name`` (the forward
            graph's node), ``op``, ``shape``, ``dtype``, ``bytes`` (its full size),
            ``decision`` (``hooked``, ``unhooked``, ``recomputed``, ``alias``), ``storage``
            (what it was stored as: ``kept``, a budget option, the hooks' names,
            ``recomputed``), ``packed_bytes`` (its packed form on the device, 0 when
            offloaded), ``device_bytes`` (what it holds on the device between the forward
            and the backward) and ``why``.
        graphs: the compiled graphs' records, in the order the step compiled them.
        hooks: what was active (``"none"``, ``"budget(0.5)"``, the hooks' names).
    """

    rows: list[dict[str, Any]]
    graphs: list[Any]
    hooks: str = "none"
    snapshot: Any = None

    # ------------------------------------------------------------------ tables

    def by_module(self) -> dict[str, dict[str, int]]:
        """Per module (in first-seen order): ``count``, ``bytes``, ``device_bytes``."""
        out: dict[str, dict[str, int]] = {}
        for r in self.rows:
            m = out.setdefault(r["module"], {"count": 0, "bytes": 0, "device_bytes": 0})
            m["count"] += 1
            m["bytes"] += r["bytes"]
            m["device_bytes"] += r["device_bytes"]
        return out

    def table(self) -> str:
        """The rows grouped by module, each group with its totals, then the step's."""
        lines = [f"saved tensors of one step ({len(self.graphs)} graph(s)), hooks: {self.hooks}"]
        header = f"  {'name':<18} {'op':<28} {'shape':<20} {'dtype':<9} {'bytes':>10} {'stored as':<16} {'on device':>10}  why"
        groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in self.rows:
            groups[r["module"]].append(r)
        for module, rows in groups.items():
            total = sum(r["bytes"] for r in rows)
            kept = sum(r["device_bytes"] for r in rows)
            lines.append("")
            lines.append(f"{module or '(outside any submodule)'}: {len(rows)} saved, {_size(total)}, {_size(kept)} on the device")
            lines.append(header)
            for r in rows:
                shape = "x".join(map(str, r["shape"])) or "scalar"
                lines.append(
                    f"  {r['name'][:18]:<18} {r['op'][:28]:<28} {shape[:20]:<20} {r['dtype']:<9} {_size(r['bytes']):>10} "
                    f"{r['storage'][:16]:<16} {_size(r['device_bytes']):>10}  {r['why']}"
                )
        total = sum(r["bytes"] for r in self.rows)
        kept = sum(r["device_bytes"] for r in self.rows)
        lines.append("")
        lines.append(f"total: {len(self.rows)} saved tensors, {_size(total)}; {_size(kept)} on the device between forward and backward")
        plans = [(k, p) for k, g in enumerate(self.graphs) for p in g.plans]
        if plans:
            lines.append("")
            lines.append("budget plans, per graph:")
        for k, p in plans:
            share = (lambda n: f" ({n / p.baseline_bytes:.2f})") if p.baseline_bytes else (lambda n: "")
            met = "met" if p.met else f"not met (floor {_size(p.floor_bytes or 0)}{share(p.floor_bytes or 0)})"
            lines.append(
                f"  graph {k} ({p.scope}, {p.spec}): {_size(p.planned_bytes)}{share(p.planned_bytes)} of "
                f"{_size(p.baseline_bytes)} of activations saved at the forward's end, budget {_size(p.budget_bytes)}"
                f"{share(p.budget_bytes)}, {met}; bounds {p.bounded_at}; est {p.estimated_ms:.3f} ms"
            )
            if p.predicted_peak_bytes is not None:
                lines.append(
                    f"    with the graphs' own tensors the step peaks at {_size(p.predicted_peak_bytes)}, at {p.predicted_peak_at}"
                )
            lines.extend(f"    {head}" for head in p.loss_heads)
            lines.extend(f"    {donated}" for donated in p.donated_inputs)
            if p.copies():
                lines.append(f"    {p.copies()}")
        return "\n".join(lines)

    def csv(self) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=FIELDS)
        writer.writeheader()
        for r in self.rows:
            writer.writerow({**r, "shape": "x".join(map(str, r["shape"]))})
        return out.getvalue()

    # ------------------------------------------------------------------ models

    def timeline(self) -> dict[str, Any]:
        """Device bytes of the saved tensors along the step (the planner's model): the
        forward graphs in compile order, then the backward graphs in reverse.

        Returns ``x`` (node positions), ``without`` (every saved tensor kept at full size
        until its last backward use), ``with`` (as stored: packed after its last forward
        use, unpacked at its first backward use, nothing when recomputed or an alias),
        ``forward_end`` (the x where the backward starts), ``peak`` (index into ``x``), and
        ``at_peak``: the largest tensors alive at the peak, ``(module, name, bytes)``."""
        offsets, x_fw = [], 0
        for g in self.graphs:
            offsets.append(x_fw)
            x_fw += max(g.fw_len, 1)
        bw_offsets, x_bw = {}, x_fw
        for i in reversed(range(len(self.graphs))):
            bw_offsets[i] = x_bw
            x_bw += max(self.graphs[i].bw_len, 1)
        n = x_bw
        without, with_ = [0] * (n + 1), [0] * (n + 1)
        alive: list[list[tuple[int, str, str]]] = [[] for _ in range(n)]

        def add(curve: list[int], start: int, stop: int, nbytes: int) -> None:
            if nbytes and stop > start:
                curve[start] += nbytes
                curve[stop] -= nbytes

        for gi, g in enumerate(self.graphs):
            seen: set[str] = set()
            for r in g.records:
                if r.is_input or r.fw_span is None or r.storage_root in seen:
                    continue  # graph inputs are not activations; a storage counts once
                seen.add(r.storage_root)
                born, last_fw = (offsets[gi] + p for p in r.fw_span)
                bw0 = bw_offsets[gi]
                first_bw, last_bw = (bw0 + r.span[0], bw0 + r.span[1] + 1) if r.span is not None else (bw0, bw0)
                add(without, born, last_bw, r.nbytes)
                stored = _device_bytes(r)
                add(with_, born, last_fw + 1, r.nbytes)
                add(with_, last_fw + 1, first_bw, stored)
                if r.decision != "alias":
                    add(with_, first_bw, last_bw, r.nbytes)
                for k in range(born, min(last_bw, n)):
                    held = r.nbytes if (k <= last_fw or k >= first_bw) else stored
                    if held and r.decision != "alias":
                        alive[k].append((held, r.module, r.name))
        for curve in (without, with_):
            for k in range(1, n + 1):
                curve[k] += curve[k - 1]
        without, with_ = without[:n], with_[:n]
        peak = max(range(n), key=lambda k: with_[k]) if n else 0
        at_peak = sorted(alive[peak], reverse=True)[:4] if n else []
        return {
            "x": list(range(n)),
            "without": without,
            "with": with_,
            "forward_end": x_fw,
            "peak": peak,
            "at_peak": [(m, name, b) for b, m, name in at_peak],
        }

    def pareto(self) -> dict[str, list[tuple[float, int, float]]]:
        """Per budget fraction, summed over the step's graphs: ``ours`` (planned peak bytes,
        estimated ms of the plan; from the budget planner, present when a budget was
        active) and ``stock`` (the saved activation bytes of the partitioner's
        ``activation_memory_budget`` partition and the estimated ms of what it recomputes)."""
        ours: dict[float, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        stock: dict[float, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for g in self.graphs:
            for p in g.plans:
                for fraction, peak, ms, _met in p.pareto:
                    ours[fraction][0] += peak
                    ours[fraction][1] += ms
            for fraction, nbytes, ms in g.stock_pareto:
                stock[fraction][0] += nbytes
                stock[fraction][1] += ms
        return {
            "ours": [(f, int(v[0]), v[1]) for f, v in sorted(ours.items())],
            "stock": [(f, int(v[0]), v[1]) for f, v in sorted(stock.items())],
        }

    # ------------------------------------------------------------------ files

    def save(self, directory: str, *, snapshot: bool = False) -> dict[str, str]:
        """Write ``report.txt``, ``report.csv``, ``timeline.png`` and ``pareto.png`` (and,
        with ``snapshot`` and a CUDA allocator record of the step, ``memory_snapshot.pickle``
        for https://pytorch.org/memory_viz) under ``directory``; returns their paths by name.
        The pictures need matplotlib (``pip install torch_patches[bench]``)."""
        os.makedirs(directory, exist_ok=True)
        paths = {name: os.path.join(directory, name) for name in ("report.txt", "report.csv", "timeline.png", "pareto.png")}
        with open(paths["report.txt"], "w") as f:
            f.write(self.table() + "\n")
        with open(paths["report.csv"], "w", newline="") as f:
            f.write(self.csv())
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise RuntimeError("MemoryReport.save draws with matplotlib: pip install 'torch_patches[bench]'") from e
        _draw_timeline(plt, self.timeline(), self.hooks, paths["timeline.png"])
        _draw_pareto(plt, self.pareto(), self.hooks, paths["pareto.png"])
        if snapshot:
            if self.snapshot is None:
                raise RuntimeError("no allocator record: report(..., snapshot=True) on CUDA records one")
            import pickle

            paths["memory_snapshot.pickle"] = os.path.join(directory, "memory_snapshot.pickle")
            with open(paths["memory_snapshot.pickle"], "wb") as f:
                pickle.dump(self.snapshot, f)
        return paths


def _draw_timeline(plt: Any, t: dict[str, Any], hooks: str, path: str) -> None:
    mib = 2**20
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(t["x"], [b / mib for b in t["without"]], label="without hooks", color="0.6")
    ax.plot(t["x"], [b / mib for b in t["with"]], label=f"with {hooks}", color="C0")
    ax.axvline(t["forward_end"], color="0.8", linestyle="--")
    ax.text(t["forward_end"], ax.get_ylim()[1] * 0.97, " backward", va="top", color="0.5")
    if t["x"]:
        peak = t["peak"]
        ax.plot([peak], [t["with"][peak] / mib], "o", color="C3")
        label = "\n".join(f"{m or '(root)'} {name}: {b / mib:.1f} MiB" for m, name, b in t["at_peak"])
        ax.annotate(
            f"peak {t['with'][peak] / mib:.1f} MiB\n{label}",
            (peak, t["with"][peak] / mib),
            textcoords="offset points",
            xytext=(10, -10),
            va="top",
            fontsize=8,
        )
    ax.set_xlabel("forward nodes, then backward nodes (each graph in order)")
    ax.set_ylabel("saved tensors on the device, MiB (planned)")
    ax.set_title("Saved-tensor memory over the step (the planner's model)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_pareto(plt: Any, p: dict[str, Any], hooks: str, path: str) -> None:
    mib = 2**20
    fig, ax = plt.subplots(figsize=(7, 5))
    for key, label, color in (("ours", "budget(F): planned peak", "C0"), ("stock", "activation_memory_budget = F: saved bytes", "C1")):
        points = p[key]
        if not points:
            continue
        ax.plot([b / mib for _, b, _ in points], [ms for _, _, ms in points], "o-", color=color, label=label)
        for f, b, ms in points:
            ax.annotate(f"{f:g}", (b / mib, ms), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    chosen = hooks[len("budget(") : -1] if hooks.startswith("budget(") else None
    if chosen is not None:
        for f, b, ms in p["ours"]:
            if abs(f - float(chosen)) < 1e-6:
                ax.plot([b / mib], [ms], "s", markersize=11, markerfacecolor="none", color="C3", label=f"chosen: {hooks}")
    if not p["ours"] and not p["stock"]:
        ax.text(0.5, 0.5, "no graph with saved activations", ha="center", transform=ax.transAxes)
    ax.set_xlabel("device MiB (saved tensors)")
    ax.set_ylabel("estimated ms (plan / recomputation)")
    ax.set_title("Budget fractions 0.1-1.0: memory against time (estimates)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _describe(hooks: Any, budget: Any) -> str:
    if budget is not None:
        return f"budget({budget:g})" if isinstance(budget, float) else f"budget({budget})"
    if hooks is None:
        return "none"
    from torch_patches._functorch._aot_autograd.utils import hook_name

    return hook_name(hooks[0]).removesuffix("_pack")


def report(
    step: Callable[[], Any],
    *,
    hooks: tuple[Any, Any] | None = None,
    budget: float | int | None = None,
    snapshot: bool = False,
    reset: bool = True,
) -> MemoryReport:
    """Run ``step()`` (one forward and backward of a compiled model) once and report every
    tensor its compiled graphs save for the backward.

    ``hooks``: a saved-tensor hook pair made active around the step; ``budget``: an
    activation-memory budget (``torch_patches.hooks.budget(budget)``) instead; neither:
    what the step saves as it is (hooks the step enters itself are seen too). ``reset``:
    ``torch._dynamo.reset()`` first, so every graph of the step is compiled, or loaded from
    AOTAutogradCache, inside the report (graphs compiled earlier in this process would
    otherwise run without being seen); the step's functions recompile afterwards. With
    ``snapshot`` on CUDA the allocator's record of the step is kept
    (``MemoryReport.save(snapshot=True)``). Calls ``torch_patches.apply()`` if needed.
    """
    import torch

    from torch_patches._functorch._aot_autograd import saved_tensor_records
    from torch_patches._registry import apply, is_applied
    from torch_patches.hooks import budget as budget_pair

    if hooks is not None and budget is not None:
        raise ValueError("report(): pass hooks= or budget=, not both")
    if not is_applied():
        apply()
    pair = budget_pair(budget) if budget is not None else hooks
    if reset:
        torch._dynamo.reset()
    record = snapshot and torch.cuda.is_available()
    context = torch.autograd.graph.saved_tensors_hooks(*pair) if pair is not None else contextlib.nullcontext()
    if record:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        with saved_tensor_records.recording(report=True) as graphs, context:
            step()
        taken = torch.cuda.memory._snapshot() if record else None
    finally:
        if record:
            torch.cuda.memory._record_memory_history(enabled=None)
    rows = [_row(i, r) for i, g in enumerate(graphs) for r in g.records]
    return MemoryReport(rows, list(graphs), _describe(hooks, budget), taken)
