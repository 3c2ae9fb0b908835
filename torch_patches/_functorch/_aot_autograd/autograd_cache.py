"""Keep graphs whose saved-tensor hooks fell back to eager out of AOTAutogradCache.

Upstream counterpart: ``AOTAutogradCache.save`` in
``torch/_functorch/_aot_autograd/autograd_cache.py``.  The cache key covers the hooks by
content (``user_cache_hash`` of the installed hook subgraphs, see
``torch_patches/_dynamo/output_graph.py``), but not whether inlining them succeeded: a
graph compiled after an untraceable hook fell back to eager hooks would, on a later hit, be
run as if its hooks were inlined (runtime hooks disabled, no warning).  Such graphs are not
saved; the next process compiles again and warns again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from torch_patches._functorch._aot_autograd import compile_facts

log = logging.getLogger(__name__)


def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``AOTAutogradCache.save``: skip graphs whose hooks fell back to eager."""

    @functools.wraps(original)
    def save(key: str, entry: Any, remote: bool) -> None:
        reasons = compile_facts.not_cacheable_reasons()
        if reasons:
            from torch._dynamo.utils import counters

            counters["aot_autograd"]["autograd_cache_bypass"] += 1
            log.info("not saving AOTAutogradCache entry %s: %s", key, "; ".join(reasons))
            return None
        return original(key, entry, remote)

    return save
