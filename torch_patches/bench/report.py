"""The bench's report: ratios against the no-hooks row, the table, the JSON file."""

from __future__ import annotations

import json
import os
from typing import Any

from torch_patches.bench.case import hook_column


def add_ratios(results: list[dict[str, Any]]) -> None:
    base = {}
    for r in results:
        c = r["case"]
        if c["mode"] == "no-hooks" and "error" not in r and "skipped" not in r:
            base[(c["model"], c["backend"])] = r
    for r in results:
        b = base.get((r["case"]["model"], r["case"]["backend"]))
        if b is None or "error" in r or "skipped" in r:
            continue
        r["peak_ratio"] = r["peak_bytes"] / max(b["peak_bytes"], 1)
        r["time_ratio"] = r["step_s"] / b["step_s"]
        r["time_ratio_min"] = r["step_min_s"] / b["step_min_s"]


def _mib(n: int | None, width: int) -> str:
    return f"{'-':>{width}s}" if n is None else f"{n / 2**20:{width}.2f}"


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'model':12s} {'backend':9s} {'hook':23s} {'mode':13s} {'peak MiB':>9s} {'peak x':>7s} "
        f"{'step ms':>9s} {'time x':>7s} {'min x':>7s} {'frames':>6s} {'kept MiB':>8s} {'compile s':>9s} "
        f"{'saved MiB':>9s} {'plan MiB':>8s} {'floor MiB':>9s}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c = r["case"]
        hook = hook_column(c)
        if "error" in r:
            lines.append(f"{c['model']:12s} {c['backend']:9s} {hook:23s} {c['mode']:13s} ERROR {r['error']}")
            continue
        if "skipped" in r:
            lines.append(f"{c['model']:12s} {c['backend']:9s} {hook:23s} {c['mode']:13s} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{c['model']:12s} {c['backend']:9s} {hook:23s} {c['mode']:13s} "
            f"{r['peak_bytes'] / 2**20:9.1f} {r.get('peak_ratio', float('nan')):7.2f} "
            f"{r['step_s'] * 1e3:9.1f} {r.get('time_ratio', float('nan')):7.2f} "
            f"{r.get('time_ratio_min', float('nan')):7.2f} {r['frames_compiled']:6d} "
            f"{_mib(r.get('kept_bytes'), 8)} "
            f"{r.get('compile_s', float('nan')):9.2f} "
            f"{_mib(r.get('saved_bytes'), 9)} {_mib(r.get('plan_bytes'), 8)} {_mib(r.get('floor_bytes'), 9)}"
        )
    return "\n".join(lines)


def write_json(path: str, common: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """The run's common settings and every row's result, as JSON at ``path`` (its folder made)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"common": common, "results": results}, f, indent=2)
