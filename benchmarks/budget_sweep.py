"""Budget sweep: ``torch_patches.hooks.budget(F)`` against stock ``activation_memory_budget = F``
over a range of fractions, planned beside measured.

``python -m benchmarks.budget_sweep`` builds the causal language models of
:mod:`benchmarks.convergence` (Hugging Face Llama, GPT-2 and the other families of
``torch_patches.testing.models.LANGUAGE_MODELS`` from configs, random init; ``--lora R`` a PEFT
LoRA fine-tune of rank R; the text is bytes, ``--vocab`` widens the embedding, the head and
the logits: a comma list is a sweep per vocabulary, the axis where the loss head becomes the
step's peak; ``--loss`` the loss on the logits, a comma list a sweep per loss:
``torch_patches.testing.models.LOSSES``, cross-entropy, label smoothing, a z-loss, DPO, GRPO,
a KL to a teacher's logits; ``--lengths`` the batches' lengths, ``fixed`` or ``pad``, as a
pad-to-longest collator makes them: 512, 448, 384, 320 tokens in turn at ``--seq 512``, each
length's peak in a table of its own) and runs, each in a
subprocess of its own (its own compile cache): the compiled model without hooks, and per
fraction F a ``budget:F`` row (torch_patches applied) and an ``amb:F`` row (stock torch,
torch_patches not applied).  Each row trains ``--steps`` steps (the first compiles) and
measures one warm step's peak: on CPU the allocator's own account (the profiler's
allocation events summed in time order, :func:`torch_patches.testing.peak_bytes`), on CUDA
``max_memory_allocated``.  The RSS is no measure of one step on CPU: the allocator keeps
freed pages resident, so a step's RSS rises by whatever its peak exceeds the last step's
leftovers (on the issue's Llama, no hooks: 362 MB allocated at the peak, 100 MB of RSS
growth; rows move by tens of MB from run to run).

The table, per model and fraction: the plan's peak (the most the saved tensors hold at any
point of the backward, or, in a graph that is one of several such as a decoder layer
compiled on its own (``--compile-per layer``), at its forward's end: what the budget
bounds; summed over the compiled graphs) as a fraction of what they save
without hooks, whether every graph's plan met its budget (or in how many graphs), or the
floor it stopped at (the largest holders, from the plan's summary); the step's peak the
plans predict (while a graph's backward runs, the graphs called before it hold their saved
bytes: :func:`planned_step_peak`); the measured peak and the median step time of ``budget(F)`` and
of stock; peaks and times as ratios against the row without hooks.  Below it: whether the
measured peak of ``budget(F)`` never rises as F falls, the fractions where it is above
stock's by more than ``--tolerance``, and those where the planned peak is more than 10% off
the measured one.

Where the device has a copy engine (CUDA), the rows ``offload`` (``cpu_offload()``) and
``fp8+offload`` (``chain(fp8_rowwise(), cpu_offload())``) run too, measured the same way
and listed under the table: what an exact (or fp8) offload of every saved tensor costs
beside what the budget plans (``--no-offload-rows`` leaves them out).  With ``--by-hand``,
the row ``chunked_by_hand`` too: the loss written by hand in 8 chunks of tokens under
``checkpoint``, stock compile, no hooks (what torchtune and Liger users write): the peak a
chunked head is held to, listed under the table.

Defaults are the sizes of the budget's acceptance check: 4 layers, hidden 512, 8 heads,
sequences of 512, batch 4, vocabulary 8,192, Inductor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from benchmarks.convergence import LENGTHS, OFFLOAD_ROWS, TrainConfig, run_in_subprocess
from torch_patches._functorch._aot_autograd.activation_budget.cost_model import copy_engine
from torch_patches.testing.models import CALLS, LOSSES

DEFAULT_FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


def _seed(row: dict[str, Any]) -> dict[str, Any] | None:
    """A row's first seed's results (the sweep runs one), or None where the row failed."""
    return next(iter((row.get("seeds") or {}).values()), None) if "error" not in row else None


def _step(row: dict[str, Any]) -> tuple[int | None, float | None]:
    seed = _seed(row)
    return (seed["peak_bytes"], seed["step_ms"]) if seed else (None, None)


def call_order(plans: list[dict[str, Any]], layers: int | None) -> list[int]:
    """The order in which a step's forward calls the plans' graphs (plans are in compile
    order, the forward's): each once, but where each decoder layer is compiled on its own
    (``layers`` given) the graphs of the first frame compiled (the layers', recompiles
    included) make the first ``layers`` calls: one graph for all of them, or one each (a
    layer that recompiles), the last one repeated where there are fewer."""
    if not layers or not plans:
        return list(range(len(plans)))
    frame = lambda p: (p.get("compile_id") or "").split("/")[0]  # noqa: E731
    of_layers = [i for i, p in enumerate(plans) if frame(p) == frame(plans[0])]
    calls = (of_layers + [of_layers[-1]] * layers)[:layers]
    return calls + [i for i in range(len(plans)) if i not in of_layers]


def planned_step_peak(plans: list[dict[str, Any]], order: list[int]) -> int | None:
    """The step's peak the plans predict, the graphs called in ``order``: while one graph's
    backward runs (they run in reverse), the graphs called before it hold their saved bytes
    at their forward's end and those called after it are done; so the most of, over the
    calls, what the calls before hold plus the call's predicted peak (its saved tensors with
    its gradients, intermediates and outputs, forward and backward)."""
    if not plans or any(p.get("predicted_peak_bytes") is None for p in plans):
        return None
    best = held = 0
    for i in order:
        best = max(best, held + plans[i]["predicted_peak_bytes"])
        held += plans[i]["planned_bytes"]
    return best


def plan_of(row: dict[str, Any], layers: int | None = None) -> dict[str, Any] | None:
    """The plans of a ``budget:F`` row summed over its graphs: planned peak and saved bytes,
    met (all graphs), the floors' holders, and the step's peak they predict
    (:func:`planned_step_peak`; ``layers``: the model is compiled per decoder layer)."""
    plans = row.get("plans") or []
    if not plans:
        return None
    return {
        "step_peak_bytes": planned_step_peak(plans, call_order(plans, layers)),
        # What the budget bounds: a graph of several, its forward's end (bounds).
        "peak_bytes": sum(p["planned_bytes"] if p.get("bounded_at") == "forward_end" else p["peak_bytes"] for p in plans),
        # What the graphs save without hooks or budget: where the partitioner's cheap
        # recomputation met the budget, the plan's baseline is what it left saved.
        "baseline_bytes": sum(
            p["baseline_bytes"] / p["partitioner_ratio"] if p.get("partitioner_met") else p["baseline_bytes"] for p in plans
        ),
        "met": all(p["met"] for p in plans),
        "graphs_met": (sum(p["met"] for p in plans), len(plans)),
        "holders": [h for p in plans for h in p["floor_holders"][:2]],
    }


def summarize(results: dict[str, dict[str, Any]], fractions: list[float], tolerance: float, layers: int | None = None) -> dict[str, Any]:
    """Per fraction: plan, the step peak it predicts, measured peaks and times as ratios to
    the row without hooks; then monotonicity, the fractions above stock (beyond
    ``tolerance``) and those whose planned peak is more than 10% off the measured one
    (``layers``: compiled per decoder layer, see :func:`call_order`)."""
    base_peak, base_ms = _step(results["compiled"])
    base_first = _first(results["compiled"])
    base_lengths = _by_length(results["compiled"])
    lines = []
    for f in fractions:
        ours, stock = results[f"budget:{f:g}"], results[f"amb:{f:g}"]
        (op, oms), (sp, sms) = _step(ours), _step(stock)
        plan = plan_of(ours, layers)
        planned = plan["step_peak_bytes"] if plan else None
        lines.append(
            {
                "planned_peak_bytes": planned,
                "planned_peak": _ratio(planned, base_peak),
                "planned_off": abs(planned - op) / op if planned is not None and op else None,
                "fraction": f,
                "plan_peak": plan["peak_bytes"] / plan["baseline_bytes"] if plan and plan["baseline_bytes"] else None,
                "plan_met": plan["met"] if plan else None,
                "graphs_met": plan["graphs_met"] if plan else None,
                "floor": plan["holders"] if plan and not plan["met"] else [],
                "ours_peak_bytes": op,
                "stock_peak_bytes": sp,
                "ours_peak": op / base_peak if op is not None and base_peak else None,
                "stock_peak": sp / base_peak if sp is not None and base_peak else None,
                "ours_time": oms / base_ms if oms is not None and base_ms else None,
                "stock_time": sms / base_ms if sms is not None and base_ms else None,
                # The first step (compile and run) against no hooks' first step.
                "ours_first": _ratio(_first(ours), base_first),
                "stock_first": _ratio(_first(stock), base_first),
                # Each length's peak against no hooks' at that length (pad-to-longest runs).
                "by_length": {
                    n: {"ours": _ratio(_by_length(ours).get(n), b), "stock": _ratio(_by_length(stock).get(n), b)}
                    for n, b in base_lengths.items()
                },
                "errors": [r["error"] for r in (ours, stock) if "error" in r],
            }
        )
    measured = [(line["fraction"], line["ours_peak_bytes"]) for line in lines if line["ours_peak_bytes"] is not None]
    rises = [(a, b) for (a, pa), (b, pb) in zip(measured, measured[1:]) if pa > pb]  # lower F, higher peak
    above = [
        line["fraction"]
        for line in lines
        if None not in (line["ours_peak_bytes"], line["stock_peak_bytes"])
        and line["ours_peak_bytes"] > (1 + tolerance) * line["stock_peak_bytes"]
    ]
    offload = [
        {"row": name, "peak": _ratio(_step(row)[0], base_peak), "time": _ratio(_step(row)[1], base_ms), "error": row.get("error")}
        for name, row in results.items()
        if name in OFFLOAD_ROWS
    ]
    off = [line["fraction"] for line in lines if line["planned_off"] is not None and line["planned_off"] > PLANNED_TOLERANCE]
    by_hand = results.get("chunked_by_hand")
    return {
        "by_hand": None
        if by_hand is None
        else {"peak": _ratio(_step(by_hand)[0], base_peak), "time": _ratio(_step(by_hand)[1], base_ms), "error": by_hand.get("error")},
        "base_peak_bytes": base_peak,
        "base_step_ms": base_ms,
        "base_first_step_s": base_first,
        "lines": lines,
        "rises": rises,
        "above_stock": above,
        "planned_off": off,
        "offload": offload,
    }


def _by_length(row: dict[str, Any]) -> dict[str, int]:
    """A row's warm peak at each length of its batches (one for fixed lengths), where
    recorded."""
    seed = _seed(row)
    return dict(seed.get("peaks_by_length") or {}) if seed else {}


def _first(row: dict[str, Any]) -> float | None:
    """A row's first step in seconds (its compile and run), where recorded."""
    seed = _seed(row)
    return seed.get("first_step_s") if seed else None


#: How far a planned step peak may be from the measured one.
PLANNED_TOLERANCE = 0.1


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any], tolerance: float) -> str:
    out = [
        "| F | plan peak / saved | plan | planned peak x | `budget(F)` peak x | stock peak x | `budget(F)` time x | stock time x "
        "| `budget(F)` first step x | stock first step x |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for line in summary["lines"]:
        plan = "-" if line["plan_met"] is None else ("met" if line["plan_met"] else "floor")
        met, graphs = line["graphs_met"] or (0, 0)
        if graphs > 1 and 0 < met < graphs:
            plan = f"met in {met} of {graphs} graphs"
        out.append(
            f"| {line['fraction']:g} | {_x(line['plan_peak'])} | {plan} | {_x(line.get('planned_peak'))} | {_x(line['ours_peak'])} | "
            f"{_x(line['stock_peak'])} | {_x(line['ours_time'])} | {_x(line['stock_time'])} | {_x(line.get('ours_first'))} | "
            f"{_x(line.get('stock_first'))} |"
        )
    lengths = sorted({n for line in summary["lines"] for n in line.get("by_length", {})}, key=int, reverse=True)
    if len(lengths) > 1:  # batches of several lengths: each length's peak x its own no hooks'
        out.append("\n| F | " + " | ".join(f"`budget(F)` / stock x at {n}" for n in lengths) + " |")
        out.append("|---:|" + "---:|" * len(lengths))
        for line in summary["lines"]:
            cells = [f"{_x(line['by_length'].get(n, {}).get('ours'))} / {_x(line['by_length'].get(n, {}).get('stock'))}" for n in lengths]
            out.append(f"| {line['fraction']:g} | " + " | ".join(cells) + " |")
    base = summary["base_peak_bytes"]
    out.append(f"\n(no hooks: {base / 2**20:.1f} MiB peak, {summary['base_step_ms']:.0f} ms a step)" if base else "")
    rises = summary["rises"]
    out.append(
        "budget(F) measured peak: "
        + ("never rises as F falls" if not rises else "rises from F=" + ", ".join(f"{a:g} to F={b:g}" for a, b in rises))
        + "; "
        + (
            f"at or below stock's + {tolerance:.0%} at every F"
            if not summary["above_stock"]
            else "above stock's + {:.0%} at F = {}".format(tolerance, ", ".join(f"{f:g}" for f in summary["above_stock"]))
        )
    )
    off = summary.get("planned_off")
    if off is not None:
        out.append(
            f"planned peak within {PLANNED_TOLERANCE:.0%} of the measured one at every F"
            if not off
            else "planned peak more than {:.0%} off the measured one at F = {}".format(PLANNED_TOLERANCE, ", ".join(f"{f:g}" for f in off))
        )
    floors = {tuple(line["floor"]) for line in summary["lines"] if line["floor"]}
    for floor in floors:
        out.append("floor held by: " + "; ".join(floor))
    for line in summary["lines"]:
        for error in line["errors"]:
            out.append(f"F={line['fraction']:g}: error: {error}")
    by_hand = summary.get("by_hand")
    if by_hand:
        out.append(
            "the loss chunked by hand under checkpoint, stock compile: "
            + (f"error: {by_hand['error']}" if by_hand["error"] else f"peak x {_x(by_hand['peak'])}, time x {_x(by_hand['time'])}")
        )
    for row in summary.get("offload", ()):
        out.append(
            f"{row['row']}: " + (f"error: {row['error']}" if row["error"] else f"peak x {_x(row['peak'])}, time x {_x(row['time'])}")
        )
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", default="8192", help="vocabulary sizes, a comma list (a sweep per size)")
    parser.add_argument("--steps", type=int, default=6, help="steps per row (the first compiles; >= 4)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=0.02, help="how far above stock's peak counts as above")
    parser.add_argument(
        "--compile-per",
        choices=("model", "layer"),
        default="model",
        help="one torch.compile of the model, or of each decoder layer (as FSDP2 / torchtitan)",
    )
    parser.add_argument(
        "--bounds",
        choices=("auto", "every_point", "forward_end"),
        default="auto",
        help="torch_patches.config.activation_budget_bounds for the budget rows",
    )
    parser.add_argument(
        "--call",
        choices=CALLS,
        default="bench",
        help="bench: the loss inside what is compiled, KV cache off; hf_default: as HF Trainer "
        "calls the model (labels=, KV cache at its default), the HF model compiled; torchtitan: "
        "the model returns its logits and the loss is compiled apart",
    )
    parser.add_argument(
        "--loss",
        default="ce",
        help=f"the losses on the logits, a comma list (a sweep per loss): {', '.join(LOSSES)} (models.LOSSES)",
    )
    parser.add_argument(
        "--lengths",
        default="fixed",
        help="the batches' lengths, a comma list (a sweep per kind): fixed, or pad (as a pad-to-longest collator: "
        "seq x 1, 7/8, 3/4, 5/8 in turn; --steps at least 6)",
    )
    parser.add_argument("--lora", type=int, default=0, help="a PEFT LoRA fine-tune of this rank (every linear but the head; 0: none)")
    parser.add_argument(
        "--by-hand",
        action="store_true",
        help="also the row with the loss chunked by hand under checkpoint, stock compile (chunked_by_hand)",
    )
    parser.add_argument(
        "--no-offload-rows",
        dest="offload_rows",
        action="store_false",
        help="leave out the offload rows a device with a copy engine otherwise adds",
    )
    parser.add_argument("--json", default="bench-results/budget-sweep.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    import torch

    fractions = sorted({float(f) for f in args.fractions.split(",") if f})
    if not fractions or not all(0 < f <= 1 for f in fractions):
        parser.error("--fractions: a comma list of fractions in (0, 1]")
    if args.steps < 4:
        parser.error("--steps: at least 4 (the first compiles, the third is measured, the rest timed)")
    vocabs = [int(v) for v in args.vocab.split(",") if v]
    losses = [x for x in args.loss.split(",") if x]
    if not losses or any(x not in LOSSES for x in losses):
        parser.error(f"--loss: a comma list of {', '.join(LOSSES)}")
    kinds = [x for x in args.lengths.split(",") if x]
    if not kinds or any(x not in LENGTHS for x in kinds):
        parser.error(f"--lengths: a comma list of {', '.join(LENGTHS)}")
    if "pad" in kinds and args.steps < 6:
        parser.error("--steps: at least 6 with --lengths pad (every length compiles, then each is measured, the rest timed)")
    out = {"torch": torch.__version__, "fractions": fractions, "vocabs": vocabs, "losses": losses, "lengths": kinds, "sweeps": {}}
    for vocab, loss, lengths in [(v, x, n) for v in vocabs for x in losses for n in kinds]:
        sizes = dict(
            layers=args.layers,
            dim=args.dim,
            heads=args.heads,
            seq=args.seq,
            batch=args.batch,
            vocab=vocab,
            steps=args.steps,
            eval_every=args.steps,
            eval_batches=1,
            backend=args.backend,
            device=args.device,
            compile_per=args.compile_per,
            budget_bounds=args.bounds,
            call=args.call,
            lora=args.lora,
            loss=loss,
            lengths=lengths,
        )
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers x {args.dim}, "
            f"vocab {vocab}, batch {args.batch} x {args.seq}; backend {args.backend}, device {args.device}; "
            f"compiled per {args.compile_per}, budget bounds {args.bounds}, call {args.call}, loss {loss}, lengths {lengths}"
            + (f", LoRA rank {args.lora}" if args.lora else ""),
            flush=True,
        )
        key = "/".join([str(vocab)] + [loss] * (loss != "ce") + [lengths] * (lengths != "fixed"))
        sweep = out["sweeps"][key] = {"sizes": sizes, "models": {}}
        for model in [m for m in args.models.split(",") if m]:
            cfg = TrainConfig(model=model, **sizes)
            rows = ["compiled"] + [f"{kind}:{f:g}" for f in reversed(fractions) for kind in ("budget", "amb")]
            rows += ["chunked_by_hand"] if args.by_hand else []
            if args.offload_rows and copy_engine(torch.device(args.device)):
                rows += list(OFFLOAD_ROWS)
            results = {}
            for row in rows:
                start = time.time()
                results[row] = run_in_subprocess(cfg, row, [0])
                peak, ms = _step(results[row])
                measured = f"peak {peak / 2**20:.0f} MiB, {ms:.1f} ms a step" if peak is not None else "error"
                print(f"  {model} {row}: {measured} ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
            summary = summarize(results, fractions, args.tolerance, args.layers if args.compile_per == "layer" else None)
            sweep["models"][model] = {"config": dataclasses.asdict(cfg), "rows": results, "summary": summary}
            print(f"\n{model} (vocab {vocab}, loss {loss}, lengths {lengths}):\n{format_table(summary, args.tolerance)}", flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nresults written to {args.json}")
    failed = any(line["errors"] for sweep in out["sweeps"].values() for m in sweep["models"].values() for line in m["summary"]["lines"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
