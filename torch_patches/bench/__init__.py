"""Peak memory and step time of one training step under torch.compile, with saved-tensor hooks and without.

``python -m torch_patches bench`` runs each row in a fresh process and reports the rows side
by side, as ratios against the row without hooks of the same model and backend. Rows
(``mode``): ``no-hooks``, ``eager-hooks`` (the hooks as Python functions run on the compiled
graph's saved tensors), ``stock-inline`` (GraphModule hooks inlined by stock torch), ``ours``
(the same, inlined by torch_patches), and with ``--budget F`` ``budget``
(``torch_patches.hooks.budget(F)``) and ``stock-budget`` (stock's
``activation_memory_budget = F``). What each row and column measures, and how:
``docs/bench.md``.

Modules: ``case`` (a row), ``measure`` (byte accounting), ``run`` (the hooks of each mode;
a row in this process or in a fresh one), ``report`` (ratios, the table, the JSON),
``decisions`` (the inliner's decisions while compiling). The models are
:mod:`torch_patches.testing.models` (shared with the tests); the command line is ``bench``
in ``torch_patches/__main__.py``.
"""

from __future__ import annotations

import argparse

from torch_patches.bench.case import BUDGET_MODES, MODES, Case
from torch_patches.bench.measure import block_working_set, saved_bytes, saved_tensors_of, tensor_bytes
from torch_patches.bench.report import add_ratios, format_table, write_json
from torch_patches.bench.run import cases_for, cast_hooks, make_hooks, run_all, run_case, run_in_subprocess

__all__ = [
    "BUDGET_MODES",
    "MODES",
    "Case",
    "add_ratios",
    "block_working_set",
    "cases_for",
    "cast_hooks",
    "format_table",
    "make_hooks",
    "parse_fractions",
    "run_all",
    "run_case",
    "run_in_subprocess",
    "saved_bytes",
    "saved_tensors_of",
    "tensor_bytes",
    "write_json",
]


def parse_fractions(text: str) -> tuple[float, ...]:
    """``--budget``: comma-separated fractions in (0, 1]."""
    try:
        values = tuple(float(v) for v in text.split(",") if v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"budgets are fractions in (0, 1], got {bad}")
    return values
