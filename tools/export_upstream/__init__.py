"""Export every torch_patches patch as upstream PyTorch code.

    python -m tools.export_upstream export --out DIR [--stack REPO] [--torch-root ROOT]
    python -m tools.export_upstream verify [--torch-root ROOT] [TEST ...]

``export`` writes one git-format-patch file per commit (``NN-<name>.patch``, in stack
order, each against the sources as the previous ones leave them): each patch's commit,
preceded by one commit per new upstream module it adds (``split_new_modules``; with the
upstream test file made from ours, ``_tests.py``);
``SUMMARY.md`` (every commit, its size, why one is large), ``summary.json`` and
``config-map.json`` (our config knobs -> their upstream names).  The exported text speaks
upstream's names (``_names.py``).
``--stack REPO`` also commits the stack, one commit per file, into a git repository
(created with a base commit of the pristine files if needed; a pytorch checkout is used
as it is), ready for ``ghstack submit``.  Nothing is pushed.

``verify`` applies the stack to an overlay of the installed torch and runs our golden
tests against it without ``torch_patches.apply()`` (see ``test/test_export_upstream.py``).

How the upstream form is generated: :mod:`tools.export_upstream._generate` (the driver),
one patch's :mod:`~tools.export_upstream._job` composed of a workspace and a placer
(:mod:`~tools.export_upstream._place`), an emitter (:mod:`~tools.export_upstream._emit`) and
the files' rendering (:mod:`~tools.export_upstream._render`), over :mod:`~tools.export_upstream._trees`
(torch's sources and ours, where each module goes) and :mod:`~tools.export_upstream._model`
(the records); commit messages, patch files, the stack and overlays in
:mod:`~tools.export_upstream._write`, git in :mod:`~tools.export_upstream._git`.
"""

from tools.export_upstream._generate import Exporter, split_new_modules
from tools.export_upstream._git import check_applies
from tools.export_upstream._model import CONFIG_HOME, KNOB_NAMES, PatchExport, knob_upstream_name, stack_order
from tools.export_upstream._pysrc import ExportError
from tools.export_upstream._write import (
    apply_to_overlay,
    knob_map,
    make_overlay,
    make_stack,
    run_export,
    write_out,
)

__all__ = [
    "CONFIG_HOME",
    "ExportError",
    "Exporter",
    "KNOB_NAMES",
    "PatchExport",
    "apply_to_overlay",
    "split_new_modules",
    "check_applies",
    "knob_map",
    "knob_upstream_name",
    "make_overlay",
    "make_stack",
    "run_export",
    "stack_order",
    "write_out",
]
