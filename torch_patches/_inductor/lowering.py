"""Inductor lowerings for torch_patches' custom ops.

Upstream counterpart: ``torch/_inductor/lowering.py`` (``register_lowering``,
``fallback_handler``).  ``saved_tensors_hooks::offload`` (``torch_patches.hooks.offload``) is
lowered to Inductor's fallback kernel for it, with every buffer it reads freed without reuse
(``torch_patches._inductor.codegen.wrapper.free_without_reuse``): the device-to-host copy
still reads the buffer after the op returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.lowering import fallback_handler, lowerings, register_lowering

from torch_patches._inductor.codegen.wrapper import free_without_reuse


def register_offload_lowering() -> Callable[..., Any]:
    """Lower ``saved_tensors_hooks::offload`` to Inductor's fallback kernel for it, every
    buffer the kernel reads freed at its last use and never reused; returns the lowering."""
    op = _offload_op()
    fallback = fallback_handler(op, add_to_fallback_set=False)

    def _lower_offload(src: Any, pin_memory: bool) -> Any:
        out = fallback(src, pin_memory)
        for name in _read_buffer_names(out, src):
            free_without_reuse(name)
        return out

    return register_lowering(op, type_promotion_kind=None)(_lower_offload)


def _offload_op() -> torch._ops.OpOverload:
    from torch_patches.hooks import offload as offload_ops  # noqa: F401 - defines the op

    return torch.ops.saved_tensors_hooks.offload.default


def upstream_form() -> None:
    """Inductor frees the buffer a saved tensor's CPU offload reads but never reuses it.

    ``saved_tensors_hooks::offload`` starts a device-to-host copy on a side stream and
    returns before it is done; Inductor plans buffers for one stream, so it would reuse the
    buffer for a later kernel while the copy still reads it.  The op is lowered to its
    fallback kernel, and every buffer that kernel reads is freed without reuse (see
    ``free_without_reuse`` in ``torch/_inductor/codegen/wrapper.py``).
    """
    # The registry effect inductor.offload_lowering (install_inductor_lowering) does this
    # when the patch set is applied.
    register_offload_lowering()


def install_inductor_lowering() -> Callable[[], None]:
    """Make Inductor free the buffer ``offload`` reads without ever reusing it; returns the
    undo.

    A registry effect (``inductor.offload_lowering``, area ``offload``): installed by
    ``torch_patches.apply()``, removed by ``unapply()``.  The lowering is Inductor's
    ordinary fallback kernel for the op (:func:`register_offload_lowering`); every buffer the
    kernel reads is registered with ``free_without_reuse`` (the patch
    ``inductor.free_without_reuse``; see the module docstring: the device-to-host copy
    still reads it after the op returns).  Without ``apply()`` the hooks are Python hooks
    and the op runs eagerly: no lowering is needed.
    """
    op = _offload_op()
    previous = lowerings.get(op)
    ours = register_offload_lowering()

    def undo() -> None:
        if lowerings.get(op) is ours:
            if previous is None:
                del lowerings[op]
            else:
                lowerings[op] = previous

    return undo


def _read_buffer_names(out: Any, src: Any) -> list[str]:
    """Names of the buffers the offload fallback kernel reads (``src``'s, and any copy of
    it the fallback realised)."""
    from torch._inductor import ir

    names: list[str] = []

    def add(node: Any) -> None:
        try:
            name = node.get_name()
        except Exception:  # noqa: BLE001 - constants and unnamed nodes read no buffer
            return
        if name not in names:
            names.append(name)

    add(src)
    # The kernel object: out is TensorBox(StorageBox(MultiOutput | FallbackKernel)).
    node = out
    for _ in range(4):
        if isinstance(node, ir.FallbackKernel):
            for inp in node.inputs:
                add(inp)
            break
        if isinstance(node, ir.MultiOutput):
            node = node.inputs[0] if node.inputs else None
            continue
        node = getattr(node, "data", None)
        if node is None:
            break
    return names
