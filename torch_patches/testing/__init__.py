"""Test harness for torch_patches, in the style of PyTorch's own compiler tests.

``_internal/`` mirrors ``torch/testing/_internal``: each of its modules becomes the upstream
module of the same name (``tools/export_upstream``).  The recording backends and graph
normalisation (:class:`AotEagerAndRecordGraphs`, :class:`InductorAndRecordGraphs`,
:func:`normalize_graph`, :func:`name_primals_by_role`, :func:`hook_nodes`,
:func:`graph_caches_off`) are ``saved_tensors_hooks_graphs``'s; the other
helpers (:func:`peak_bytes`, :func:`cpu_peak_of`, :func:`saved_tensor_records`, :func:`hook_warnings`,
:data:`TORCH_VERSION`, :func:`instantiate_device_type_tests`) and the Dynamo-resetting test
base are ``common_saved_tensors_hooks``'s.  :class:`TestCase` (``case.py``) adds the patch
set: every test runs with torch_patches applied (``apply_patches = False`` for tests of
stock behaviour), or against upstream-form torch.

With the base install (no ``test`` extra) only the recording backends import: torch's test
base needs ``expecttest``; ``python -m torch_patches demo`` needs nothing else.
"""

from __future__ import annotations

from torch_patches._errors import SavedTensorsHookError, SavedTensorsHookWarning
from torch_patches.testing._internal.saved_tensors_hooks_graphs import (
    AotEagerAndRecordGraphs,
    InductorAndRecordGraphs,
    graph_caches_off,
    hook_nodes,
    name_primals_by_role,
    normalize_graph,
)

try:
    from torch_patches.testing._internal.common_saved_tensors_hooks import (
        CPU_RATES,
        CUDA_RATES,
        HAS_CUDA,
        TORCH_VERSION,
        copy_engine_everywhere,
        cpu_peak_of,
        hook_warnings,
        instantiate_device_type_tests,
        peak_bytes,
        saved_tensor_records,
    )
    from torch_patches.testing.case import UPSTREAM_FORM_ENV, TestCase, upstream_form_config_map
except ModuleNotFoundError as e:  # the base install: the recording backends only
    if e.name != "expecttest":
        raise

__all__ = [
    "AotEagerAndRecordGraphs",
    "CPU_RATES",
    "CUDA_RATES",
    "HAS_CUDA",
    "InductorAndRecordGraphs",
    "SavedTensorsHookError",
    "SavedTensorsHookWarning",
    "TORCH_VERSION",
    "TestCase",
    "UPSTREAM_FORM_ENV",
    "copy_engine_everywhere",
    "cpu_peak_of",
    "graph_caches_off",
    "hook_nodes",
    "hook_warnings",
    "instantiate_device_type_tests",
    "name_primals_by_role",
    "normalize_graph",
    "peak_bytes",
    "saved_tensor_records",
    "upstream_form_config_map",
]
