"""The budget's promise over generated steps: ``budget(F)`` at or below no budget and stock's
``activation_memory_budget = F``, monotone in ``F``, planned within 10% of measured.

Each step comes from ``torch_patches.testing.budget_steps.draw(seed)`` (MLP, SwiGLU and
attention blocks; norms, residuals, gates; an embedding or a float input with or without
grad; four losses; compiled whole or each block apart; static or dynamic shapes) and is
measured in a fresh process of its own, every row beside the others (no budget, then stock's
knob and ``budget(F)`` at each fraction), by the CPU allocator's events or CUDA's allocator::

    python -m benchmarks.budget_promise --seeds 0-299 --json benchmarks/results/budget-promise.json
    python -m benchmarks.budget_promise --seeds 0-19 --small       # the test sizes

Prints one line a step and the counts the issue asks for; a step whose process fails is
counted apart, with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

_CHILD = """
import json, sys, torch, torch_patches
from torch_patches.testing import budget_steps as bs
torch.set_num_threads({threads})
torch_patches.apply()
m = bs.measure(bs.draw({seed}, small={small}), {fractions}, device={device!r})
print("RESULT " + json.dumps(bs.as_json(m)))
"""


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run_step(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    code = _CHILD.format(seed=seed, small=args.small, fractions=tuple(args.fractions), device=args.device, threads=args.threads)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ))
    seconds = time.perf_counter() - start
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT ") :])
            row["seconds"] = round(seconds, 1)
            return row
    return {"seed": seed, "error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"], "seconds": round(seconds, 1)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    within = [abs(r["planned"][k] - r["peaks"][k]) <= 0.1 * r["peaks"][k] for r in ok for k in r["planned"] if k.startswith("budget")]
    return {
        "steps": len(rows),
        "failed": len(rows) - len(ok),
        "above_no_budget": sum(any("above no budget" in v for v in r["violations"]) for r in ok),
        "above_stock": sum(any("above stock" in v for v in r["violations"]) for r in ok),
        "not_monotone": sum(any("above budget(" in v for v in r["violations"]) for r in ok),
        "planned_within_10pct": f"{sum(within)} of {len(within)}",
        "withdrawn_rows": sum(v for r in ok for v in r["withdrawn"].values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-29", help="a range or comma list: 0-299, 3,7,11")
    parser.add_argument("--fractions", type=lambda s: [float(f) for f in s.split(",")], default=[0.5, 0.3, 0.1])
    parser.add_argument("--small", action="store_true", help="the sizes of the fast tests")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per step's process")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a step's process may run")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for seed in _seeds(args.seeds):
        row = run_step(seed, args)
        rows.append(row)
        _write(args, rows)  # after every step: a run cut by its timeout keeps what it measured
        if "error" in row:
            print(f"seed {seed}: FAILED {row['error']}", flush=True)
            continue
        peaks = " ".join(f"{k}={v / 2**20:.1f}" for k, v in row["peaks"].items())
        print(f"{row['describe']}\n  MiB: {peaks}  {row['seconds']} s  {'; '.join(row['violations']) or 'holds'}", flush=True)
    print(json.dumps(summary(rows)))
    return 0


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if args.json:
        result = {"summary": summary(rows), "torch": _torch_version(), "device": args.device, "small": args.small, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
