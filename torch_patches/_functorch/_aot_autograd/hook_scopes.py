"""Which in-graph saved-tensors-hooks scope a saved tensor belongs to.

Dynamo (``torch_patches/_dynamo/variables/ctx_manager.py``) annotates every op traced inside
a ``saved_tensors_hooks`` scope entered in a compiled region with the scope's key
(``node.meta["custom"][SCOPE_KEY]``) and registers the scope's hooks on the compilation's
facts; the inliner (``torch_patches/_functorch/_aot_autograd/graph_compile.py``) asks
:func:`scope_of` for each saved tensor.  Shared by both stages, so neither imports the other.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from torch_patches._functorch._aot_autograd import compile_facts

#: ``node.meta["custom"]`` key naming the in-graph hooks scope a node was created in.
SCOPE_KEY = "saved_tensors_hooks_scope"

NO_SCOPE: Any = object()


def _key(node: fx.Node) -> str | None:
    return (node.meta.get("custom") or {}).get(SCOPE_KEY)


def scope_of(saved: fx.Node, bw_input: fx.Node | None, bw_order: dict[fx.Node, int]) -> Any:
    """The in-graph hooks (a ``HookPair``) a saved tensor takes, or ``NO_SCOPE``.

    Eager packs a saved tensor with the hooks active when the op that *saved* it ran. In
    the AOT backward, the nodes that read a saved tensor are that op's gradient formula
    (or, for a tensor the partitioner chose to save, the recomputation that reads it),
    and they carry the forward op's ``custom`` metadata: their scopes are the scopes of
    the ops that saved the tensor. When ops in different scopes saved the same tensor
    (eager packs it once per op), the compiled graph saves it once, with the hooks of
    the scope it was computed in if an op there saved it, else with those of the op
    whose backward reads it first. A tensor no backward node reads is not hooked.
    """
    readers = [u for u in (bw_input.users if bw_input is not None else ()) if u.op != "output"]
    if not readers:
        return NO_SCOPE
    keys = {_key(r) for r in readers}
    key = _key(saved)
    if key not in keys:
        key = _key(min(readers, key=bw_order.__getitem__))
    if key is None:
        return NO_SCOPE
    found = compile_facts.facts()
    pair = found.scopes.get(key) if found is not None else None
    if pair is None:
        raise AssertionError(
            f"saved tensor {saved.name!r} was traced in saved tensors hooks scope {key!r}, "
            "which is no longer registered (compiled outside the Dynamo compilation that "
            "traced it?)"
        )
    return pair
