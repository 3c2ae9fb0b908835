"""Saved-tensor hooks for torch.compile.

``inlineable(pack, unpack)`` marks a pair of plain Python functions as pure and traceable:
with torch_patches applied, a compiled graph traces them into its forward (pack) and
backward (unpack) graphs, exactly as it does ``fx.GraphModule`` hooks. Use the pair like any
hooks::

    pack, unpack = torch_patches.hooks.inlineable(pack_fn, unpack_fn)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = compiled_model(x).sum()

The marker is a promise: the functions only compute with tensors (no I/O, no reading tensor
values into Python, no mutation of what they capture). A marked hook that breaks it cannot
be traced: under ``fullgraph=True`` that is an error naming the hook and the reason,
otherwise the graph keeps eager hook semantics with one warning. Outside a compiled region
the functions run as ordinary eager hooks.

Ready-made pairs (``torch_patches.hooks.compress``), all marked inlineable: ``bf16()``,
``fp8_rowwise(dtype)``, ``int8_rowwise()``, ``chain(first, second, ...)`` to compose
pairs (compress, then offload), and ``cpu_offload(pin_memory)``
(``torch_patches.hooks.offload``: moves saved tensors to host memory in the forward and
back in the backward, with the reload issued ahead of its use).  Each documents its error
bound.  ``select(pack, unpack, where=...)`` applies any pair only to the saved tensors a
compile-time predicate accepts (``torch_patches.hooks.select``); the lossy pairs default to
``where=numerics_safe``, the numerics allowlist, to which ``tolerate(op, *args)`` adds entries.  ``budget(memory)`` lets the compiler choose among them per saved
tensor to fit a byte budget (``torch_patches.hooks.budget``).
"""

from __future__ import annotations

from torch_patches.hooks._inlineable import inlineable, is_inlineable
from torch_patches.hooks.budget import budget
from torch_patches.hooks.cache import cache_hash
from torch_patches.hooks.compress import bf16, chain, fp8_rowwise, int8_rowwise
from torch_patches.hooks.markers import SavedTensorInfo
from torch_patches.hooks.offload import cpu_offload
from torch_patches.hooks.select import HookPair, numerics_safe, select, tolerate

__all__ = [
    "HookPair",
    "bf16",
    "budget",
    "cache_hash",
    "chain",
    "cpu_offload",
    "fp8_rowwise",
    "inlineable",
    "int8_rowwise",
    "is_inlineable",
    "numerics_safe",
    "select",
    "SavedTensorInfo",
    "tolerate",
]
