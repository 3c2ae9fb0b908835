"""Inductor: free, but never reuse, the buffers an op still reads asynchronously.

Two wrappers, two patches: ``codegen_free`` (``inductor.free_without_reuse``: the buffer is
freed with a plain ``del``) and ``can_reuse`` (``inductor.no_inplace_reuse``: no kernel
writes its output into the buffer in place).  Both read the names registered with
:func:`free_without_reuse` during lowering.

Upstream counterpart: ``PythonWrapperCodegen.codegen_free`` in
``torch/_inductor/codegen/wrapper.py``.  Inductor's only way to protect a buffer that is
read after the kernel reading it returned (``V.graph.never_reuse_buffers``) also keeps it
from ever being freed: it stays alive to the end of the graph.  That defeats
``saved_tensors_hooks::offload``, whose device-to-host copy runs on a side stream: its input must
leave the graph right after the op (so the forward's memory drops; ``record_stream`` makes
the caching allocator hold the block until the copy is done), but must never be handed to a
later kernel by Inductor's own buffer reuse (``buf7 = buf3  # reuse``), which the caching
allocator cannot see.  Buffers registered with :func:`free_without_reuse` during lowering
get a plain ``del`` at their last use and are not reuse candidates; every other buffer goes
to the original.

In-place reuse is the other way a later kernel could write the buffer: Inductor realizes
pointwise ops lazily, so an offload of ``mm``'s output is usually *scheduled before* the
fused kernel that reads ``mm``'s output last (``gelu``), and that kernel, as the last
reader, writes its own output into the same buffer (``buf3 = buf0  # reuse`` followed by
``kernel(buf3)``) while the side stream may still be copying it out.  ``can_reuse`` is what
the scheduler asks before such an in-place update; for registered buffers it says no.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: Attribute of the GraphLowering (``V.graph``) holding the names to free without reuse.
FREE_WITHOUT_REUSE_ATTR = "free_without_reuse"


def free_without_reuse(name: str) -> None:
    """During lowering: free buffer ``name`` at its last use, never reuse it."""
    from torch._inductor.virtualized import V

    V.graph.__dict__.setdefault(FREE_WITHOUT_REUSE_ATTR, set()).add(name)


def make_codegen_free(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PythonWrapperCodegen.codegen_free``."""

    @functools.wraps(original)
    def codegen_free(self: Any, buffer: Any) -> Any:
        from torch._inductor.codegen.wrapper import FreeLine
        from torch._inductor.virtualized import V

        name = buffer.get_name()
        if name not in getattr(V.graph, FREE_WITHOUT_REUSE_ATTR, ()):
            return original(self, buffer)
        if name not in self.freed:
            self.freed.add(name)  # freed buffers are never reuse candidates
            self.writeline(FreeLine(self, buffer))
        return None

    return codegen_free


def make_can_reuse(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PythonWrapperCodegen.can_reuse``: registered buffers are never reused, in
    place or otherwise."""

    @functools.wraps(original)
    def can_reuse(self: Any, input_buffer: Any, *args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        if input_buffer.get_name() in getattr(V.graph, FREE_WITHOUT_REUSE_ATTR, ()):
            return False
        return original(self, input_buffer, *args, **kwargs)

    return can_reuse
