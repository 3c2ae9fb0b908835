"""``python -m benchmarks.overhead``: what hooks cost per compiled call.

A model compiled block by block (as FSDP2's ``fully_shard`` with per-block ``torch.compile``
and torchtitan do) calls every compiled block's guards and runtime wrapper once per step:
with small blocks, a step is mostly that per-call Python.  This bench measures it side by
side, each row in a fresh process, the rows interleaved over ``--rounds`` rounds (the
median of the rounds' medians is reported, so a drift of the machine hits every row alike).

Shapes (``--shapes``):
  per-block     ``--blocks`` blocks (Linear-GELU-Linear, ``--width`` wide, batch ``--batch``),
                each compiled apart
  graph-breaks  the same blocks in one compiled function, a graph break between blocks
  llama         Hugging Face Llama from a config (4 layers x 64, 2 heads, 2 x 32 tokens),
                each decoder layer compiled apart (needs transformers)

Rows (``--modes``; ``ratio`` is against the row named in brackets, same shape):
  stock         stock torch, no hooks
  stock-pair    stock torch, a bf16 pair as ``fx.GraphModule``\\ s (stock's inlining)
  ours          torch_patches applied, no hooks                        [stock]
  ours-pair     the same GraphModule pair, inlined by torch_patches    [stock-pair]
  ours-bf16     ``torch_patches.hooks.bf16()``, made once              [stock-pair]
  ours-recreated ``hooks.bf16()`` made anew every step                 [stock-pair]
  ours-scaled   a bf16 pair with a delayed scale, a tensor updated in place every step
                (a runtime input of the graphs, fetched at every call)   [stock-pair]
  ours-budget   ``config.activation_memory_budget = 0.5``, no hooks    [stock]

``guard us``: the hooks' guard (``torch_patches._dynamo.guards``), timed alone under the
row's hooks, microseconds per compiled call.  Inductor, one CPU thread (or CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks import worker_env
from torch_patches.testing.models import hf_llama

MODES = ("stock", "stock-pair", "ours", "ours-pair", "ours-bf16", "ours-recreated", "ours-scaled", "ours-budget")
SHAPES = ("per-block", "graph-breaks", "llama")
#: The row each row's ratio is taken against.
REFERENCE = {
    "ours": "stock",
    "ours-budget": "stock",
    "ours-pair": "stock-pair",
    "ours-bf16": "stock-pair",
    "ours-recreated": "stock-pair",
    "ours-scaled": "stock-pair",
}


def _gm_pair() -> tuple[Any, Any]:
    import torch
    import torch.fx

    return (
        torch.fx.symbolic_trace(lambda x: (x.dtype, x.to(torch.bfloat16))),
        torch.fx.symbolic_trace(lambda p: p[1].to(p[0])),
    )


def _blocks(n: int, width: int, device: str) -> list[Any]:
    import torch

    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)).to(device) for _ in range(n)]


def _build(shape: str, args: dict[str, Any]) -> tuple[Any, Any]:
    """(forward of one step taking no argument and returning a scalar, its parameters)."""
    import torch

    device, n, width, batch = args["device"], args["blocks"], args["width"], args["batch"]
    if shape == "llama":
        lm = hf_llama(vocab=256, dim=64, layers=4, heads=2, seq=32).to(device)
        for layer in lm.model.layers:
            layer.compile()
        ids = torch.randint(0, 256, (2, 32), device=device)
        return (lambda: lm(input_ids=ids, labels=ids).loss), lm.parameters()
    blocks = _blocks(n, width, device)
    x = torch.randn(batch, width, device=device, requires_grad=True)
    params = [p for b in blocks for p in b.parameters()]
    if shape == "per-block":
        compiled = [torch.compile(b) for b in blocks]

        def forward() -> Any:
            h = x
            for b in compiled:
                h = b(h)
            return h.sum()

        return forward, params

    # Unrolled: a graph break inside a loop makes Dynamo run the loop's frame eagerly.
    body = "\n    torch._dynamo.graph_break()\n".join(f"    h = blocks[{i}](h)" for i in range(n))
    scope: dict[str, Any] = {"torch": torch, "blocks": blocks}
    exec(f"def run(h):\n{body}\n    return h.sum()\n", scope)  # noqa: S102 - our own code
    run = torch.compile(scope["run"])
    return (lambda: run(x)), params


def _hooks_for(mode: str) -> Any:
    """A function giving the hooks of one step (None: no hooks)."""
    if mode in ("stock-pair", "ours-pair"):
        pair = _gm_pair()
        return lambda: pair
    if mode == "ours-bf16":
        from torch_patches import hooks

        pair = hooks.bf16()
        return lambda: pair
    if mode == "ours-recreated":
        from torch_patches import hooks

        return hooks.bf16
    if mode == "ours-scaled":
        return _scaled_hooks()
    return lambda: None


def _scaled_hooks() -> Any:
    import torch

    from torch_patches.hooks import inlineable

    scale = torch.ones(())

    # Only floating-point tensors are scaled: the eager parts of a model compiled per block
    # (embedding, loss) run these as Python hooks on every saved tensor, indices included.
    def pack(x: Any) -> Any:
        return (x.dtype, (x * scale).to(torch.bfloat16) if x.is_floating_point() else x)

    def unpack(p: Any) -> Any:
        dtype, t = p
        return (t.to(torch.float32) / scale).to(dtype) if dtype.is_floating_point else t

    pair = inlineable(pack, unpack)

    def each_step() -> Any:
        with torch.no_grad():
            scale.mul_(0.999).add_(0.002)
        return pair

    return each_step


def measure(shape: str, mode: str, args: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process: median step ms, and the hooks' guard us per call."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if mode.startswith("ours"):
        import torch_patches

        torch_patches.apply()
        if mode == "ours-budget":
            from torch_patches import config

            config.activation_memory_budget = 0.5
    forward, params = _build(shape, args)
    hooks = _hooks_for(mode)
    params = list(params)

    def step() -> None:
        pair = hooks()
        with torch.autograd.graph.saved_tensors_hooks(*pair) if pair else contextlib.nullcontext():
            loss = forward()
        loss.backward()
        for p in params:
            p.grad = None

    sync = torch.cuda.synchronize if args["device"] == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    times = []
    for _ in range(args["steps"]):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    row: dict[str, Any] = {"shape": shape, "mode": mode, "step_ms": 1e3 * statistics.median(times)}
    if mode.startswith("ours"):
        from torch_patches._dynamo.guards import current_key

        pair = hooks()
        with torch.autograd.graph.saved_tensors_hooks(*pair) if pair else contextlib.nullcontext():
            current_key()
            n = 2000
            start = time.perf_counter()
            for _ in range(n):
                current_key()
            row["guard_us"] = 1e6 * (time.perf_counter() - start) / n
    return row


def _run_worker(shape: str, mode: str, args: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--worker", json.dumps([shape, mode, args])],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=1200,
    )
    if proc.returncode != 0:
        return {"shape": shape, "mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(shapes: list[str], modes: list[str], args: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """Every (shape, mode) row, ``rounds`` times, interleaved; the rows with their ratios."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for shape in shapes:
            for mode in modes:
                row = _run_worker(shape, mode, args)
                print(
                    f"  round {r + 1}/{rounds} {shape:12s} {mode:15s} "
                    + (f"{row['step_ms']:.2f} ms" if "step_ms" in row else row.get("error", "")),
                    file=sys.stderr,
                )
                runs.setdefault((shape, mode), []).append(row)
    rows = []
    for (shape, mode), found in runs.items():
        ok = [r for r in found if "step_ms" in r]
        row: dict[str, Any] = {"shape": shape, "mode": mode}
        if not ok:
            row["error"] = found[0].get("error")
        else:
            row["step_ms"] = statistics.median(r["step_ms"] for r in ok)
            row["rounds_ms"] = [round(r["step_ms"], 3) for r in ok]
            if "guard_us" in ok[0]:
                row["guard_us"] = statistics.median(r["guard_us"] for r in ok)
        rows.append(row)
    by_key = {(r["shape"], r["mode"]): r for r in rows}
    for row in rows:
        ref = by_key.get((row["shape"], REFERENCE.get(row["mode"], "")))
        if ref is not None and "step_ms" in ref and "step_ms" in row:
            row["ratio"] = row["step_ms"] / ref["step_ms"]
            row["against"] = ref["mode"]
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':12s} {'mode':15s} {'step ms':>8s} {'ratio':>14s} {'guard us':>9s}  rounds ms"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:12s} {r['mode']:15s} error: {r['error']}")
            continue
        ratio = f"{r['ratio']:.2f}x {r['against']}" if "ratio" in r else "-"
        guard = f"{r['guard_us']:.1f}" if "guard_us" in r else "-"
        lines.append(f"{r['shape']:12s} {r['mode']:15s} {r['step_ms']:8.2f} {ratio:>14s} {guard:>9s}  {r['rounds_ms']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="per-block,graph-breaks,llama")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--json", default="bench-results/overhead.json")
    args = parser.parse_args(argv)
    if args.worker:
        shape, mode, common = json.loads(args.worker)
        print(json.dumps(measure(shape, mode, common)))
        return 0
    import torch

    shapes = [s for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(shapes) - set(SHAPES)) + sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown shapes or modes: {unknown}")
    if "llama" in shapes:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("llama: transformers is not installed, shape skipped", file=sys.stderr)
            shapes.remove("llama")
    common = dict(
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        blocks=args.blocks,
        width=args.width,
        batch=args.batch,
        steps=args.steps,
    )
    rows = run(shapes, modes, common, args.rounds)
    print(
        f"torch {torch.__version__}, device {common['device']}, {args.blocks} blocks x {args.width} wide, "
        f"batch {args.batch}, median of {args.steps} steps, {args.rounds} rounds"
    )
    print(format_rows(rows))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "config": common, "rows": rows}, f, indent=2)
    print(f"results written to {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
