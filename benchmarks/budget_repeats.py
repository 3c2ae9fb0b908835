"""Step time of activation-memory budgets against uniform fp8 at equal peak, repeated.

Runs each row in a fresh process (``torch_patches.bench.run_in_subprocess``: a cold
compile cache of its own), five rounds with the rows alternating, so slow phases of a shared
machine fall on every row alike.  Writes ``{row: [[step_s, peak_bytes, saved_bytes], ...]}``
to the JSON path given and prints each row's median step time.

    python benchmarks/budget_repeats.py results/budget-vs-fp8-repeats-cpu-DATE.json
"""

import json
import statistics
import sys

from torch_patches.bench import Case, run_in_subprocess

ROUNDS = 5

ROWS = {
    # uniform fp8 saves 0.525 of Llama's saved bytes: budget(0.53) is the plan at equal peak
    "llama ours": Case(model="llama", backend="inductor", hook="fp8_rowwise", mode="ours", device="cpu", blocks=4),
    "llama budget 0.53": Case(model="llama", backend="inductor", hook="-", mode="budget", budget=0.53, device="cpu", blocks=4),
    "transformer ours": Case(model="transformer", backend="inductor", hook="fp8_rowwise", mode="ours", device="cpu"),
    "transformer budget 0.3": Case(model="transformer", backend="inductor", hook="-", mode="budget", budget=0.3, device="cpu"),
}


def main(path: str) -> None:
    out: dict[str, list[list[float]]] = {k: [] for k in ROWS}
    for i in range(ROUNDS):
        for name, case in ROWS.items():
            r = run_in_subprocess(case)
            if "error" in r or "skipped" in r:
                raise SystemExit(f"{name}: {r.get('error') or r.get('skipped')}")
            out[name].append([r["step_s"], r["peak_bytes"], r["saved_bytes"]])
            print(i, name, out[name][-1], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for name, runs in out.items():
        steps = [1000 * r[0] for r in runs]
        peak = statistics.median(r[1] for r in runs) / 2**20
        print(f"{name}: median step {statistics.median(steps):.1f} ms {[round(s) for s in steps]}, peak {peak:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1])
