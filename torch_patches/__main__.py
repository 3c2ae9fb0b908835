"""Command line: ``python -m torch_patches {status,demo,bench}``."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap


def cmd_status(args: argparse.Namespace) -> int:
    import torch

    import torch_patches

    records = torch_patches.status()
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
        return 0
    print(f"torch {torch.__version__}; supported {'%d.%d' % torch_patches.SUPPORTED_TORCH[0]}"
          f" to {'%d.%d' % torch_patches.SUPPORTED_TORCH[1]}; applied in this process: "
          f"{'yes' if torch_patches.is_applied() else 'no'}")
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
        print(f"\n{len(bad)} patch(es) cannot apply on this torch: "
              + ", ".join(f"{r.name} ({r.problem})" for r in bad))
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import torch
    import torch.fx

    import torch_patches
    from torch_patches.bench.case import Case
    from torch_patches.bench.report import format_table
    from torch_patches.bench.run import _cast_hooks, run_all
    from torch_patches._recorded_graphs import AotEagerAndRecordGraphs, normalize_graph

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_patches.apply()
    print(f"torch {torch.__version__} on {device}; {len(torch_patches.applied_patches())} patches applied\n")

    # 1. A small MLP with GraphModule saved-tensor hooks, graphs printed.
    pack, unpack = _cast_hooks(torch.bfloat16)
    pack_gm, unpack_gm = torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
    ).to(device)
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
        Case(backend=args.backend, mode=mode, **common)  # type: ignore[arg-type]
        for mode in ("no-hooks", "stock-inline", "ours")
    ]
    what = "RSS high-water mark of one step" if device == "cpu" else "max_memory_allocated of one step"
    print(f"\nPeak memory ({what}), 8-block MLP, backend={args.backend}, {args.hook} hooks:")
    results = run_all(cases, progress=False)
    print(textwrap.indent(format_table(results), "  "))
    return 1 if any("error" in r for r in results) else 0


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
    sub.add_parser("bench", help="memory/speed benchmark (see --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        from torch_patches import bench

        return bench.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"status": cmd_status, "demo": cmd_demo}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
