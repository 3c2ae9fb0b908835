"""Saved tensors that are activations entering the compiled graph as inputs.

Under per-block compilation (FSDP2's ``fully_shard`` + ``torch.compile`` per block), DDP's
bucketed graph splits, or a graph break, the activation a graph starts from is a graph
input, and the graph often saves it (or a view of it, e.g. the ``view`` a 3-d ``linear``
saves for its weight gradient).  Upstream's ``"donated"`` filtering mode hooks only saved
tensors that alias no graph input, so these stay in full precision while eager hooks
compress them: the graph-per-block pattern loses part of what a hook saves.

Packing such an input frees its memory exactly when nothing else keeps the storage: the
input was produced by autograd upstream of the graph (a non-leaf that requires grad; the
caller drops its own reference as the next block runs), it is not a parameter or buffer
(Dynamo's static inputs), the graph does not mutate it, no graph output aliases it, and
every saved tensor that shares its storage is packed too.  Inputs that pass all of this are
hooked under ``"donated"``; the reason any other one is not is logged.  The facts come from
the graph's own metadata (``ViewAndMutationMeta``, upstream's descriptor of each input), so
nothing here guesses at runtime state; leafness is the example input's, which Dynamo guards
for graphs whose hooks are inlined (``_dynamo/output_graph.key_input_leafness``): a call
with the other leafness recompiles.
``torch_patches.config.hook_activation_inputs = False`` restores upstream's rule.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from torch_patches import config
from torch_patches._functorch._aot_autograd.utils import graph_outputs

#: Ops that may return their first argument's storage without being declared views.
_STORAGE_SHARING_OPS = (torch.ops.aten._unsafe_view.default,)

#: ``OutputType`` names whose ``base_idx`` is an input index (the output aliases that input).
_INPUT_ALIAS_OUTPUTS = ("is_input", "alias_of_input")


def storage_root(node: Any) -> Any:
    """The node whose storage ``node`` reads: follows view (and view-like) ops to the base."""
    while (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.args
        and isinstance(node.args[0], fx.Node)
        and (
            getattr(node.target, "is_view", False)
            or node.target in _STORAGE_SHARING_OPS
            # one output of a multi-output view op (q, k, v of a split)
            or (node.target is operator.getitem and getattr(node.args[0].target, "is_view", False))
        )
    ):
        node = node.args[0]
    return node


def described_placeholders(fw_module: fx.GraphModule, inner_meta: Any) -> tuple[list[fx.Node], list[Any]]:
    """The forward's placeholders and AOTAutograd's descriptors of its inputs
    (``ViewAndMutationMeta.input_info``).  They line up one to one only when their numbers
    agree: effect tokens, RNG state or tensor-subclass inner inputs shift the placeholders
    against the descriptors, and then no mapping can be trusted."""
    return fw_module.graph.find_nodes(op="placeholder"), list(getattr(inner_meta, "input_info", None) or ())


def activation_inputs(
    fw_module: fx.GraphModule,
    inner_meta: Any,
    static_input_indices: Iterable[int],
    num_inner_fwd_outputs: int,
) -> dict[fx.Node, str | None]:
    """Forward placeholder -> None if packing it frees its memory, else why it does not."""
    placeholders, infos = described_placeholders(fw_module, inner_meta)
    if not config.hook_activation_inputs:
        return dict.fromkeys(placeholders, "config.hook_activation_inputs is False")
    if len(infos) != len(placeholders):
        why = f"{len(placeholders)} graph inputs for {len(infos)} input descriptors"
        return dict.fromkeys(placeholders, why)
    static = set(static_input_indices)
    aliased_by_output = {
        o.base_idx
        for o in getattr(inner_meta, "output_info", ())
        if getattr(getattr(o, "output_type", None), "name", "") in _INPUT_ALIAS_OUTPUTS
    }
    fw_outs = graph_outputs(fw_module.graph)[:num_inner_fwd_outputs]
    aliased_by_output |= {
        placeholders.index(r) for r in (storage_root(n) for n in fw_outs) if isinstance(r, fx.Node) and r.op == "placeholder"
    }
    out: dict[fx.Node, str | None] = {}
    for i, (ph, info) in enumerate(zip(placeholders, infos)):
        if i in static:
            out[ph] = "a parameter or buffer (static input)"
        elif not info.requires_grad:
            out[ph] = "does not require grad (data the caller keeps)"
        elif info.is_leaf:
            out[ph] = "a leaf the caller keeps"
        elif info.mutates_data or info.mutates_metadata:
            out[ph] = "mutated by the graph"
        elif i in aliased_by_output:
            out[ph] = "aliased by a graph output"
        else:
            out[ph] = None
    return out


def autograd_inputs(fw_module: fx.GraphModule, inner_meta: Any, static_input_indices: Iterable[int]) -> list[fx.Node]:
    """The forward's placeholders that autograd produced before the graph: non-leaf
    inputs that require grad, not parameters or buffers.  A graph with one is one
    of several graphs of its step (per-block compilation, a graph break): other graphs'
    saved tensors are held beside its own.  Leafness is the example input's, guarded (see
    the module).  Empty when the placeholders cannot be mapped to input descriptors."""
    placeholders, infos = described_placeholders(fw_module, inner_meta)
    if len(infos) != len(placeholders):
        return []
    static = set(static_input_indices)
    return [ph for i, (ph, info) in enumerate(zip(placeholders, infos)) if i not in static and info.requires_grad and not info.is_leaf]


def held_by_caller(fw_module: fx.GraphModule, inner_meta: Any, static_input_indices: Iterable[int]) -> set[fx.Node]:
    """Forward placeholders the caller keeps alive through the backward and the graph does
    not mutate: parameters and buffers (static inputs), inputs that do not require grad,
    and leaves.  The backward may read them exactly at no memory cost (a budget plan's
    recomputation).  Empty when the placeholders cannot be mapped to input descriptors."""
    placeholders, infos = described_placeholders(fw_module, inner_meta)
    if len(infos) != len(placeholders):
        return set()
    static = set(static_input_indices)
    return {
        ph
        for i, (ph, info) in enumerate(zip(placeholders, infos))
        if (i in static or not info.requires_grad or info.is_leaf)
        and not (info.mutates_data or info.mutates_metadata)
        and isinstance(ph.meta.get("val"), torch.Tensor)
    }


def partially_hooked(
    saved_tensors: Iterable[fx.Node],
    hooked: Iterable[fx.Node],
    inputs: dict[fx.Node, str | None],
) -> dict[fx.Node, str]:
    """Saved tensors sharing an activation input's storage with one left unhooked.

    Packing some of them would add packed copies while the unhooked one keeps the input's
    whole storage alive; they are left unhooked, with the reason returned here.
    """
    hooked = set(hooked)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for s in saved_tensors:
        root = storage_root(s)
        if inputs.get(root, "") is None:
            groups.setdefault(root, []).append(s)
    out: dict[fx.Node, str] = {}
    for root, members in groups.items():
        kept = [m.name for m in members if m not in hooked]
        if kept and len(kept) < len(members):
            why = f"shares graph input {root.name}'s storage with {', '.join(kept)}, which stays unhooked: packing would not free it"
            out |= {m: why for m in members if m in hooked}
    return out
