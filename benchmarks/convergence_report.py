"""The report of ``python -m benchmarks.convergence`` (:mod:`benchmarks.convergence`): each row's
losses summarized over seeds against the compiled run without hooks, the table, the loss
curves."""

from __future__ import annotations

import math
import os
import statistics
from typing import Any


def final_train(losses: list[float]) -> float:
    """The mean of the last tenth of the steps' losses."""
    tail = losses[-max(1, len(losses) // 10) :]
    return statistics.fmean(tail)


def _mean_peak(seeds: dict[str, Any]) -> float | None:
    """The seeds' mean peak, of those measured (a run that diverged before its measured
    step has none); None without any."""
    peaks = [v["peak_bytes"] for v in seeds.values() if v["peak_bytes"]]
    return statistics.fmean(peaks) if peaks else None


def summarize(results: list[dict[str, Any]], reference: str = "compiled") -> list[dict[str, Any]]:
    """Per row: means over seeds, and the eval-loss change against ``reference`` of the
    same seed (mean, min, max; infinite for a seed whose training diverged: a non-finite
    loss stopped it), peak and step time as ratios of the reference's (no peak where no
    seed reached its measured step)."""
    ref = next((r for r in results if r["row"] == reference and "seeds" in r), None)
    rows = []
    for r in results:
        if "seeds" not in r:
            rows.append({"row": r["row"], "error": r.get("error", "no result")})
            continue
        seeds = r["seeds"]
        diverged = {s for s, v in seeds.items() if v.get("diverged_at") is not None}
        evals = {s: math.inf if s in diverged else v["eval"][-1][1] for s, v in seeds.items()}
        entry: dict[str, Any] = {
            "row": r["row"],
            "seeds": len(seeds),
            "train": statistics.fmean(final_train(v["train"]) for v in seeds.values()),
            "eval": statistics.fmean(evals.values()),
            "peak_bytes": _mean_peak(seeds),
            "step_ms": statistics.fmean(v["step_ms"] for v in seeds.values()),
            "warnings": r.get("warnings", []),
            "diverged": sorted(diverged),
        }
        if ref is not None:
            common = [s for s in evals if s in ref["seeds"]]
            changes = [evals[s] / ref["seeds"][s]["eval"][-1][1] - 1 for s in common]
            if changes:
                entry["change"] = (statistics.fmean(changes), min(changes), max(changes))
            ref_peak = _mean_peak(ref["seeds"])
            ref_ms = statistics.fmean(v["step_ms"] for v in ref["seeds"].values())
            if entry["peak_bytes"] is not None and ref_peak:
                entry["peak_x"] = entry["peak_bytes"] / ref_peak
            entry["time_x"] = entry["step_ms"] / ref_ms
        rows.append(entry)
    return rows


def format_table(cfg: Any, rows: list[dict[str, Any]]) -> str:
    """The table of one model (``cfg``: its ``convergence.TrainConfig``)."""
    head = f"| {cfg.model} | train loss | eval loss | eval vs compiled (mean [min, max]) | peak MiB | peak x | step ms | time x |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:120]} | | | | | | |")
            continue
        change = r.get("change")
        text = "-" if change is None else f"{100 * change[0]:+.2f}% [{100 * change[1]:+.1f}, {100 * change[2]:+.1f}]"
        if r.get("diverged"):
            text += f" (diverged: seed {', '.join(r['diverged'])})"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        lines.append(
            f"| {r['row']} | {r['train']:.3f} | {r['eval']:.3f} | {text} | {peak} "
            f"| {r.get('peak_x', float('nan')):.2f} | {r['step_ms']:.0f} | {r.get('time_x', float('nan')):.2f} |"
        )
        notes.extend(f"{r['row']}: {w}" for w in r["warnings"])
    return "\n".join(lines + [f"  warning, {n}" for n in notes])


def eval_differences(rows: list[dict[str, Any]], reference: str = "compiled") -> dict[str, dict[str, list[float]]]:
    """Per row (but ``reference``): its eval loss against the reference's, in percent, at
    each eval step, seed by seed (the same seed's batches and initialisation): ``steps``,
    ``mean``, ``low`` and ``high`` (the seeds' spread)."""
    ref = next((r for r in rows if r["row"] == reference and "seeds" in r), None)
    if ref is None:
        return {}
    out = {}
    for r in rows:
        if r is ref or "seeds" not in r:
            continue
        seeds = [s for s in r["seeds"] if s in ref["seeds"]]
        if not seeds:
            continue
        points = min(min(len(r["seeds"][s]["eval"]), len(ref["seeds"][s]["eval"])) for s in seeds)
        curve: dict[str, list[float]] = {"steps": [], "mean": [], "low": [], "high": []}
        for i in range(points):
            diffs = [100 * (r["seeds"][s]["eval"][i][1] - ref["seeds"][s]["eval"][i][1]) / ref["seeds"][s]["eval"][i][1] for s in seeds]
            curve["steps"].append(ref["seeds"][seeds[0]]["eval"][i][0])
            curve["mean"].append(statistics.fmean(diffs))
            curve["low"].append(min(diffs))
            curve["high"].append(max(diffs))
        out[r["row"]] = curve
    return out


def plot(configs: list[Any], results: list[list[dict[str, Any]]], path: str, reference: str = "compiled") -> bool:
    """One column per model: each row's eval loss against ``reference``'s over the steps (in
    percent, mean over seeds, the seeds' spread as a band), and below it the reference's own
    eval loss. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, len(configs), figsize=(6.5 * len(configs), 7), squeeze=False, gridspec_kw={"height_ratios": [2.2, 1]})
    for col, (cfg, rows) in enumerate(zip(configs, results)):
        top, bottom = axes[0][col], axes[1][col]
        seeds = len(next((r for r in rows if "seeds" in r), {}).get("seeds", {}))
        top.axhline(0.0, color="0.3", linewidth=1, label=reference)
        for k, (name, c) in enumerate(eval_differences(rows, reference).items()):
            color = f"C{k}"
            top.plot(c["steps"], c["mean"], marker="o", markersize=3, linewidth=1.2, color=color, label=name)
            top.fill_between(c["steps"], c["low"], c["high"], color=color, alpha=0.18, linewidth=0)
        top.set_title(f"{cfg.model}: eval loss against {reference}, mean of {seeds} seeds (band: their spread)", fontsize=10)
        top.set_ylabel("eval loss change, %")
        top.grid(alpha=0.3)
        top.legend(fontsize=7)
        ref = next((r for r in rows if r["row"] == reference and "seeds" in r), None)
        if ref is not None:
            runs = list(ref["seeds"].values())
            points = min(len(v["eval"]) for v in runs)
            xs = [runs[0]["eval"][i][0] for i in range(points)]
            bottom.plot(xs, [statistics.fmean(v["eval"][i][1] for v in runs) for i in range(points)], color="0.3", marker="o", markersize=3)
        bottom.set_title(f"{reference}: eval loss (held-out text)", fontsize=9)
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return True
