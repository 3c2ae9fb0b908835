"""Inductor: free, but never reuse, the buffers an op still reads asynchronously.

Upstream counterpart: ``PythonWrapperCodegen.codegen_free`` in
``torch/_inductor/codegen/wrapper.py``.  Inductor's only way to protect a buffer that is
read after the kernel reading it returned (``V.graph.never_reuse_buffers``) also keeps it
from ever being freed: it stays alive to the end of the graph.  That defeats
``torch_patches::offload``, whose device-to-host copy runs on a side stream: its input must
leave the graph right after the op (so the forward's memory drops; ``record_stream`` makes
the caching allocator hold the block until the copy is done), but must never be handed to a
later kernel by Inductor's own buffer reuse (``buf7 = buf3  # reuse``), which the caching
allocator cannot see.  Buffers registered with :func:`free_without_reuse` during lowering
get a plain ``del`` at their last use and are not reuse candidates; every other buffer goes
to the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: Attribute of the GraphLowering (``V.graph``) holding the names to free without reuse.
FREE_WITHOUT_REUSE_ATTR = "torch_patches_free_without_reuse"


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
