"""The report of ``bench --train`` (:mod:`torch_patches.bench.convergence`): each row's
losses summarized over seeds against the compiled run without hooks, the table, the loss
curves."""

from __future__ import annotations

import os
import statistics
from typing import Any


def final_train(losses: list[float]) -> float:
    """The mean of the last tenth of the steps' losses."""
    tail = losses[-max(1, len(losses) // 10) :]
    return statistics.fmean(tail)


def summarize(results: list[dict[str, Any]], reference: str = "compiled") -> list[dict[str, Any]]:
    """Per row: means over seeds, and the eval-loss change against ``reference`` of the
    same seed (mean, min, max), peak and step time as ratios of the reference's."""
    ref = next((r for r in results if r["row"] == reference and "seeds" in r), None)
    rows = []
    for r in results:
        if "seeds" not in r:
            rows.append({"row": r["row"], "error": r.get("error", "no result")})
            continue
        seeds = r["seeds"]
        evals = {s: v["eval"][-1][1] for s, v in seeds.items()}
        entry: dict[str, Any] = {
            "row": r["row"],
            "seeds": len(seeds),
            "train": statistics.fmean(final_train(v["train"]) for v in seeds.values()),
            "eval": statistics.fmean(evals.values()),
            "peak_bytes": statistics.fmean(v["peak_bytes"] for v in seeds.values() if v["peak_bytes"]),
            "step_ms": statistics.fmean(v["step_ms"] for v in seeds.values()),
            "warnings": r.get("warnings", []),
        }
        if ref is not None:
            common = [s for s in evals if s in ref["seeds"]]
            changes = [evals[s] / ref["seeds"][s]["eval"][-1][1] - 1 for s in common]
            if changes:
                entry["change"] = (statistics.fmean(changes), min(changes), max(changes))
            ref_peak = statistics.fmean(v["peak_bytes"] for v in ref["seeds"].values() if v["peak_bytes"])
            ref_ms = statistics.fmean(v["step_ms"] for v in ref["seeds"].values())
            entry["peak_x"] = entry["peak_bytes"] / ref_peak
            entry["time_x"] = entry["step_ms"] / ref_ms
        rows.append(entry)
    return rows


def format_table(cfg: Any, rows: list[dict[str, Any]]) -> str:
    """The table of one model (``cfg``: its ``convergence.TrainConfig``)."""
    head = (f"| {cfg.model} | train loss | eval loss | eval vs compiled (mean [min, max]) "
            f"| peak MiB | peak x | step ms | time x |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:120]} | | | | | | |")
            continue
        change = r.get("change")
        text = "-" if change is None else f"{100 * change[0]:+.2f}% [{100 * change[1]:+.1f}, {100 * change[2]:+.1f}]"
        lines.append(
            f"| {r['row']} | {r['train']:.3f} | {r['eval']:.3f} | {text} | {r['peak_bytes'] / 2**20:.1f} "
            f"| {r.get('peak_x', float('nan')):.2f} | {r['step_ms']:.0f} | {r.get('time_x', float('nan')):.2f} |"
        )
        notes.extend(f"{r['row']}: {w}" for w in r["warnings"])
    return "\n".join(lines + [f"  warning, {n}" for n in notes])


def plot(configs: list[Any], results: list[list[dict[str, Any]]], path: str) -> bool:
    """Loss curves (train, smoothed; eval), mean over seeds, one column per model. False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, len(configs), figsize=(6.5 * len(configs), 8), squeeze=False)
    for col, (cfg, rows) in enumerate(zip(configs, results)):
        for r in rows:
            if "seeds" not in r:
                continue
            runs = list(r["seeds"].values())
            n = min(len(v["train"]) for v in runs)
            train = [statistics.fmean(v["train"][i] for v in runs) for i in range(n)]
            axes[0][col].plot(range(1, n + 1), _smooth(train), label=r["row"], linewidth=1)
            points = min(len(v["eval"]) for v in runs)
            xs = [runs[0]["eval"][i][0] for i in range(points)]
            ys = [statistics.fmean(v["eval"][i][1] for v in runs) for i in range(points)]
            axes[1][col].plot(xs, ys, marker="o", markersize=3, label=r["row"], linewidth=1)
        for row, what in enumerate(("train loss (smoothed)", "eval loss (held-out text)")):
            ax = axes[row][col]
            ax.set_title(f"{cfg.model}: {what}, mean of {len(rows[0].get('seeds', {}))} seeds")
            ax.set_xlabel("step")
            ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def _smooth(values: list[float], alpha: float = 0.05) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out
