"""What activation checkpointing already did to a compiled graph's saved tensors.

``torch.utils.checkpoint`` (reentrant or not; Dynamo traces both as the
``tag_activation_checkpoint`` higher-order op) and selective activation checkpointing
(``create_selective_checkpoint_contexts``) tag the forward ops of a checkpointed region with a
``CheckpointPolicy`` (``node.meta["recompute"]``, the region in ``node.meta["ac_graph_id"]``),
and upstream's partitioner recomputes the tagged ops in the backward, saving what the region
reads and what its policy keeps (``MUST_SAVE``).  By the time the inliner sees the partitioned
graphs, what a checkpoint recomputes is no longer saved; what it saves is a saved tensor like
any other, which the budget plans and the hooks pack.

This module says which is which, for the records (``saved_tensor_records``):

* :func:`role`: a saved tensor's part in a checkpoint: an input its region recomputes from,
  or a tensor the region's policy keeps;
* :func:`recomputed`: the forward tensors a checkpoint recomputes that the backward's
  gradient formulas read (what eager autograd would have saved for them), one per storage.

The budget's own recomputation never recomputes a tensor a policy says ``MUST_SAVE``
(``activation_budget.recompute``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs

#: The policies under which a checkpoint recomputes a tagged op in the backward.
RECOMPUTING = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
#: The policies under which a selective checkpoint keeps the op's output.
SAVING = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def policy_of(node: fx.Node) -> Any:
    """The ``CheckpointPolicy`` a checkpoint tagged ``node`` with (None: not in a region)."""
    return node.meta.get("recompute")


def _region_of(node: fx.Node) -> Any:
    return node.meta.get("ac_graph_id") if policy_of(node) is not None else None


def role(saved: fx.Node) -> str | None:
    """A saved forward tensor's part in activation checkpointing, in words (None: none)."""
    policy = policy_of(saved)
    if policy in SAVING:
        return f"kept by its checkpoint's policy ({policy.name})"
    mine = _region_of(saved)
    regions = {_region_of(u) for u in saved.users if policy_of(u) in RECOMPUTING}
    regions.discard(mine)
    regions.discard(None)
    if regions:
        return "an input of a checkpointed region: the backward recomputes the region from it"
    return None


def recomputed(fw_g: fx.Graph, bw_g: fx.Graph) -> list[tuple[fx.Node, str]]:
    """The forward tensors (nodes of ``fw_g``) that a checkpoint recomputes in ``bw_g`` and
    the backward's gradient formulas read, each storage once (a view's base), with why."""
    fw_nodes = {n.name: n for n in fw_g.nodes if n.op == "call_function"}
    out: dict[fx.Node, str] = {}
    for node in bw_g.nodes:
        policy = policy_of(node)
        if node.op != "call_function" or policy not in RECOMPUTING:
            continue
        if all(policy_of(u) in RECOMPUTING for u in node.users):
            continue  # read only by the recomputation itself
        root = act_inputs.storage_root(node)
        fw_node = fw_nodes.get(root.name)
        if fw_node is None or policy_of(fw_node) not in RECOMPUTING or fw_node in out:
            continue
        if not isinstance(fw_node.meta.get("val"), torch.Tensor):
            continue  # a higher-order op's tuple (nested_compile_region): its items are tensors
        out[fw_node] = f"its checkpointed region recomputes it in the backward ({policy_of(fw_node).name}): never saved"
    return list(out.items())
