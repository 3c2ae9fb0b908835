"""Dynamo: ``saved_tensors_hooks(pack, unpack)`` called inside a compiled region.

Upstream counterpart: ``UserDefinedClassVariable.call_function`` in
``torch/_dynamo/variables/user_defined.py``, which builds the object through its skipped
``__init__`` (a graph break). For exactly ``torch.autograd.graph.saved_tensors_hooks`` (not
subclasses such as ``save_on_cpu``, whose hooks are eager-only) we return an in-graph scope
(:class:`torch_patches._dynamo.variables.ctx_manager.SavedTensorsHooksVariable`); every other
class goes to the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def make_call_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``UserDefinedClassVariable.call_function``."""

    @functools.wraps(original)
    def call_function(self: Any, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if self.value is torch.autograd.graph.saved_tensors_hooks:
            from torch_patches._dynamo.variables.ctx_manager import SavedTensorsHooksVariable

            return SavedTensorsHooksVariable.create(tx, args, kwargs)
        return original(self, tx, args, kwargs)

    return call_function
