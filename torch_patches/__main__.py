"""Command line: ``python -m torch_patches {status,demo,bench,report}``."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from torch_patches import bench


def cmd_status(args: argparse.Namespace) -> int:
    import torch

    import torch_patches

    records = torch_patches.status()
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
        return 0
    low, high = ("{}.{}".format(*v) for v in torch_patches.SUPPORTED_TORCH)
    print(f"torch {torch.__version__}; supported {low} to {high}; applied in this process: {'yes' if torch_patches.is_applied() else 'no'}")
    header = f"{'patch':45s} {'band':9s} {'fingerprint':18s} {'ok':3s} target"
    print(header)
    print("-" * len(header))
    for r in records:
        ok = "yes" if r.fingerprint_ok and r.in_band else "NO"
        print(f"{r.name:45s} {r.band:9s} {r.fingerprint or '-':18s} {ok:3s} {r.target}")
    if args.verbose:
        for r in records:
            print(f"\n{r.name}\n  {r.summary}\n  upstream: {r.upstream}\n  retire when: {r.retire_when}")
            if r.problem:
                print(f"  problem: {r.problem}")
    bad = [r for r in records if not (r.fingerprint_ok and r.in_band)]
    if bad:
        print(f"\n{len(bad)} patch(es) cannot apply on this torch: " + ", ".join(f"{r.name} ({r.problem})" for r in bad))
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import torch
    import torch.fx

    import torch_patches
    from torch_patches.testing._internal.saved_tensors_hooks_graphs import AotEagerAndRecordGraphs, normalize_graph

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_patches.apply()
    print(f"torch {torch.__version__} on {device}; {len(torch_patches.applied_patches())} patches applied\n")

    # 1. A small MLP with GraphModule saved-tensor hooks, graphs printed.
    pack, unpack = bench.cast_hooks(torch.bfloat16)
    pack_gm, unpack_gm = torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(device)
    recorder = AotEagerAndRecordGraphs()
    compiled = torch.compile(model, backend=recorder)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack_gm, unpack_gm):
        compiled(x).sum().backward()
    print("Hooks: pack = x.to(bfloat16), unpack = back to the saved dtype, both fx.GraphModules.")
    print("Nodes the hooks became are marked '# pack(saved)' / '# unpack(saved)':\n")
    print("Forward graph")
    print(textwrap.indent(normalize_graph(recorder.fw_graphs[0]), "  "))
    print("\nBackward graph")
    print(textwrap.indent(normalize_graph(recorder.bw_graphs[0]), "  "))

    # 2. Peak memory of one training step, with and without hooks, each in its own process.
    common = dict(model="mlp8", device=device, hook=args.hook, steps=2)
    if device == "cpu":
        common.update(batch=2048, dim=128)
    else:
        common.update(batch=4096, dim=1024)
    cases = [
        bench.Case(backend=args.backend, mode=mode, **common)  # type: ignore[arg-type]
        for mode in ("no-hooks", "stock-inline", "ours")
    ]
    what = "RSS high-water mark of one step" if device == "cpu" else "max_memory_allocated of one step"
    print(f"\nPeak memory ({what}), 8-block MLP, backend={args.backend}, {args.hook} hooks:")
    results = bench.run_all(cases, progress=False)
    print(textwrap.indent(bench.format_table(results), "  "))
    return 1 if any("error" in r for r in results) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The memory and speed table (:mod:`torch_patches.bench`, ``docs/bench.md``); with
    ``--worker``, one row in this process (each row's fresh process runs that)."""
    if args.worker:
        print(json.dumps(bench.run_case(bench.Case(**json.loads(args.worker)))))
        return 0

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch, dim = (8192, 4096) if device == "cuda" else (2048, 128)
    if args.small:
        batch, dim = 256, 32
    common = dict(
        device=device,
        batch=args.batch or batch,
        dim=args.dim or dim,
        blocks=args.blocks,
        steps=args.steps,
        reorder_for_peak_memory=not args.no_reorder,
    )
    cases = bench.cases_for(
        models=args.models.split(","),
        backends=args.backends.split(","),
        hooks=[h for h in args.hooks.split(",") if h],  # --hooks "": no hook rows
        modes=args.modes.split(","),
        budgets=args.budget,
        **common,
    )
    results = bench.run_all(cases)
    print(f"torch {torch.__version__}, device {device}, batch {common['batch']}, dim {common['dim']}, blocks {args.blocks}")
    print(bench.format_table(results))
    bench.write_json(args.json, common, results)
    print(f"results written to {args.json}")
    return 1 if any("error" in r for r in results) else 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--models", default="mlp8", help="comma list: mlp8, transformer, llama (HF config; needs transformers)")
    p.add_argument("--backends", default="aot_eager,inductor")
    p.add_argument(
        "--hooks",
        default="bf16,fp8",
        help="bf16, fp8, torch_patches.hooks names (fp8_rowwise, int8_rowwise, cpu_offload) "
        "or fp8_rowwise+cpu_offload (chained); NAME:all for a lossy library hook without its numerics-safe selection; "
        "bf16_scaled: bf16 with a delayed scale tensor updated after every step (modes ours, eager-hooks)",
    )
    p.add_argument("--modes", default=",".join(bench.MODES))
    p.add_argument(
        "--budget",
        type=bench.parse_fractions,
        default=(),
        help="comma list of activation-memory budgets in (0, 1], e.g. 0.3,0.5,0.7: adds a budget row "
        "(torch_patches.hooks.budget(F)) and a stock-budget row (activation_memory_budget=F) per fraction",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-reorder", action="store_true", help="inductor: reorder_for_peak_memory=False")
    p.add_argument("--small", action="store_true", help="tiny sizes (CI smoke run)")
    p.add_argument("--json", default="bench-results/bench.json", help="where to write results")


#: The hooks ``report --hooks NAME`` takes: the library's ready-made pairs.
REPORT_HOOKS = ("bf16", "fp8_rowwise", "int8_rowwise", "cpu_offload")


def cmd_report(args: argparse.Namespace) -> int:
    import torch

    import torch_patches
    from torch_patches.testing.models import report_step

    if args.hooks is not None and args.budget is not None:
        raise SystemExit("report: --hooks or --budget, not both")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_patches.apply()
    step = report_step(args.model, device, backend=args.backend)
    hooks = getattr(torch_patches.hooks, args.hooks)() if args.hooks else None
    found = torch_patches.report(step, hooks=hooks, budget=args.budget, snapshot=args.snapshot and device == "cuda")
    print(found.table())
    paths = found.save(args.out, snapshot=args.snapshot and device == "cuda")
    named = sum(1 for r in found.rows if r["module"])
    print(f"\n{len(found.rows)} saved tensors ({named} named by their module); wrote " + ", ".join(sorted(paths.values())))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_patches")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("status", help="the patch table for the installed torch")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    p = sub.add_parser("demo", help="compile a small MLP with hooks; graphs and peak memory")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    p.add_argument("--hook", default="bf16", choices=("bf16", "fp8"))
    p = sub.add_parser(
        "bench",
        help="peak memory and step time of one training step, with hooks and without",
        description=(bench.__doc__ or "").splitlines()[0],
    )
    _bench_arguments(p)
    p = sub.add_parser("report", help="where one training step's activation memory goes, per saved tensor")
    p.add_argument("--model", required=True, choices=("llama", "gpt2", "vit", "mlp8"), help="a built-in model (small, random init)")
    p.add_argument("--hooks", choices=REPORT_HOOKS, help="a ready-made hook pair active around the step")
    p.add_argument("--budget", type=float, help="an activation-memory budget, a fraction of the saved bytes")
    p.add_argument("--out", required=True, help="folder for report.txt, report.csv, timeline.png, pareto.png")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--backend", default="inductor", choices=("aot_eager", "inductor"))
    p.add_argument("--snapshot", action="store_true", help="on CUDA, also the allocator's record of the step")
    args = parser.parse_args(argv)
    return {"status": cmd_status, "demo": cmd_demo, "bench": cmd_bench, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
