"""Peak-memory and step-time benchmark of saved-tensor hooks under torch.compile.

Every case runs in its own subprocess (an empty compile cache directory of its own, so
``compile s`` is a cold compile; clean memory accounting),
and all cases of one invocation are reported side by side, as ratios against the
no-hooks row of the same model and backend.

Rows (``mode``):
  no-hooks      the compiled model, no saved-tensor hooks
  eager-hooks   the same hooks as plain Python functions: they run at runtime on the
                compiled graph's saved tensors (eager semantics)
  stock-inline  GraphModule hooks inlined by stock torch (torch_patches not applied)
  ours          GraphModule hooks inlined by torch_patches (placed at use)
  budget        ``--budget F``: torch_patches applied, hooks ``torch_patches.hooks.budget(F)``
                (the activation-memory budget planner; hook column ``budget F``)
  stock-budget  ``--budget F``: torch_patches not applied, no hooks, stock torch's
                ``torch._functorch.config.activation_memory_budget = F`` (min-cut
                rematerialization, which aot_eager and inductor both partition with) set
                around compilation and steps (hook column ``amb F``)

Peak memory: on CUDA ``max_memory_allocated`` above the pre-step base; on CPU the RSS
high-water mark of one step above the pre-step RSS (``/proc/self/clear_refs`` = 5 resets
it; workers run with ``MALLOC_MMAP_THRESHOLD_`` fixed so large tensors are mmap-backed
and freed memory really leaves the RSS).

``kept MiB`` (rows ``ours``): bytes of saved tensors a selective hook left uncompressed
(the lossy hooks' ``numerics_safe`` default: RoPE angles, statistics...), per step, from
the inliner's log. ``--models llama`` is Hugging Face Llama built from a config (hidden
``--dim``, ``--blocks`` layers, 256-token sequences, ``--batch`` tokens per step).

``step ms``: median of ``--steps`` steps; ``peak x`` / ``time x``: against the no-hooks row
of the same model and backend (budget rows included).

``saved MiB``: the bytes the autograd graph holds for backward at the end of the forward of
one (untimed, warm) step, counted exactly, not from the RSS
(:func:`~torch_patches.bench.measure.saved_bytes`): the graph is walked from the output's
``grad_fn`` through ``next_functions``; a compiled function's backward node (an
autograd.Function ctx) gives ``saved_tensors`` and the tensors it keeps as attributes (AOT's
``_tensors_no_vc_check``), any other node its ``_saved_*`` tensors. Each storage counts
once; the model's parameters, buffers and the input are left out. Hooks inlined into a
compiled graph (``ours``, ``stock-inline``, ``budget``) save their packed tensors there, so
the walk sees what is really kept. Runtime hooks (``eager-hooks``) hide their packed values
from the walk (reading a saved tensor would unpack it), so that row counts the tensors in
what ``pack`` returned during that forward instead. Host memory (``cpu_offload``) counts
too.

``plan MiB`` (rows ``budget``): the planner's predicted saved bytes, summed over the
``budget plan (...)`` lines the inliner logs for the compile's graphs. ``floor MiB`` (rows
``budget``): ``peak - (parameter-gradient bytes + plan + largest block working set)``, what
the peak holds beyond the part a budget cannot remove (the gradients) or chose to keep (the
plan) and the one block whose backward runs at a time. The block working set is a formula
over exact counts, not a measured peak: each block (the ``Sequential``'s children, Llama's
decoder layers) is run once eagerly, without hooks, on the input it gets in the model; its
set is the bytes it saves for backward (:func:`~torch_patches.bench.measure.saved_bytes`,
its parameters and its input left out: the plan holds its input) plus the bytes of its
output (the incoming gradient) and of its differentiable input (the outgoing gradient). The
largest over blocks is used. It is an estimate with known errors both ways: the tensors of
that block the plan keeps are counted in both the plan and the set (high: the floor can come
out negative), the gradients of intermediates inside the block are not counted (low). A
floor near zero or below means the peak is explained by those three terms. ``-`` when the
compile logged no plan line.

Modules: ``case`` (a row: :class:`Case`), ``models`` (the models and inputs, shared with the
tests), ``measure`` (byte accounting), ``run`` (the hooks of each mode, running cases in this
process or a subprocess), ``report`` (ratios, the table, the JSON), ``_decisions`` (the
inliner's decisions while compiling: ``kept MiB``, ``plan MiB``), ``convergence`` and
``convergence_report`` (``bench --train``), ``budget_sweep`` (``bench --budget-sweep``:
``budget(F)`` against stock's ``activation_memory_budget`` per fraction, planned beside
measured), ``overhead`` (``bench --overhead``); this module is the command line.
"""

from __future__ import annotations

import json
import sys

from torch_patches.bench.case import BUDGET_MODES, MODES, Case
from torch_patches.bench.measure import block_working_set, saved_bytes, saved_tensors_of, tensor_bytes
from torch_patches.bench.models import blocks_of, build_model, example_input
from torch_patches.bench.report import add_ratios, format_table, write_json
from torch_patches.bench.run import cases_for, make_hooks, run_all, run_case, run_in_subprocess

__all__ = [
    "BUDGET_MODES", "MODES", "Case", "add_ratios", "block_working_set", "blocks_of", "build_model", "cases_for",
    "example_input", "format_table", "main", "make_hooks", "run_all", "run_case", "run_in_subprocess",
    "saved_bytes", "saved_tensors_of", "tensor_bytes",
]


def _fractions(text: str) -> tuple[float, ...]:
    """``--budget``: comma-separated fractions in (0, 1]."""
    import argparse

    try:
        values = tuple(float(v) for v in text.split(",") if v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"budgets are fractions in (0, 1], got {bad}")
    return values


def main(argv: list[str] | None = None) -> int:
    import argparse

    given = sys.argv[1:] if argv is None else argv
    if "--train" in given:
        from torch_patches.bench import convergence

        return convergence.main(argv)
    if "--budget-sweep" in given:
        from torch_patches.bench import budget_sweep

        return budget_sweep.main(given)
    if "--overhead" in given:
        from torch_patches.bench import overhead

        return overhead.main(given)

    parser = argparse.ArgumentParser(prog="python -m torch_patches bench", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--models", default="mlp8", help="comma list: mlp8, transformer, llama (HF config; needs transformers)"
    )
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument(
        "--hooks",
        default="bf16,fp8",
        help="bf16, fp8, torch_patches.hooks names (fp8_rowwise, int8_rowwise, cpu_offload) "
        "or fp8_rowwise+cpu_offload (chained); NAME:all for a lossy library hook without its numerics-safe selection; "
        "bf16_scaled: bf16 with a delayed scale tensor updated after every step (modes ours, eager-hooks)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--budget",
        type=_fractions,
        default=(),
        help="comma list of activation-memory budgets in (0, 1], e.g. 0.3,0.5,0.7: adds a budget row "
        "(torch_patches.hooks.budget(F)) and a stock-budget row (activation_memory_budget=F) per fraction",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-reorder", action="store_true", help="inductor: reorder_for_peak_memory=False")
    parser.add_argument("--small", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--json", default="bench-results/bench.json", help="where to write results")
    args = parser.parse_args(argv)

    if args.worker:
        result = run_case(Case(**json.loads(args.worker)))
        print(json.dumps(result))
        return 0

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        batch, dim = 8192, 4096
    else:
        batch, dim = 2048, 128
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
    cases = cases_for(
        models=args.models.split(","),
        backends=args.backends.split(","),
        hooks=[h for h in args.hooks.split(",") if h],  # --hooks "": no hook rows
        modes=args.modes.split(","),
        budgets=args.budget,
        **common,
    )
    results = run_all(cases)
    table = format_table(results)
    print(f"torch {torch.__version__}, device {device}, batch {common['batch']}, dim {common['dim']}, blocks {args.blocks}")
    print(table)
    write_json(args.json, common, results)
    print(f"results written to {args.json}")
    return 1 if any("error" in r for r in results) else 0
