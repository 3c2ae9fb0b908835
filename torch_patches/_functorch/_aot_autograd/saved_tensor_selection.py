"""Which saved tensors the inliner's hooks see, and which hooks each takes: the selection
phases over one compilation's saved-tensor records (``saved_tensor_records``).

The inliner's phases (``inline_phases``) call them in order, each a function over the
records:

* scope: the hooks a saved tensor takes, those of the scope the op that saved it ran in
  (:func:`hooks_for_saved`);
* filter: what hooks may not see (upstream's filtering mode, our dtype policy, activations
  the caller holds, tensors the backward does not read; :func:`filtered_by_mode`,
  :func:`output_aliases`, :func:`filter_hookable`);
* select: what a ``select`` pair leaves each tensor (:func:`resolve_select`);
* alias: views of one storage packed once (:func:`mark_aliases`, settled once every phase
  decided by :func:`settle_aliases`), and under ``donated`` mode nothing packed that shares
  an activation input's storage with a tensor left unhooked (:func:`drop_partially_hooked`).

Compile time only.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches import config
from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches._functorch._aot_autograd import (
    activation_inputs as act_inputs,
    graph_surgery,
    hook_scopes,
    hook_tracing,
    saved_tensor_records as records,
    utils as hook_utils,
)
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair

__all__ = [
    "drop_partially_hooked",
    "filter_hookable",
    "filtered_by_mode",
    "hooks_for_saved",
    "mark_aliases",
    "output_aliases",
    "resolve_select",
    "settle_aliases",
]


def hooks_for_saved(
    saved: fx.Node,
    bw_input: fx.Node | None,
    bw_order: dict[fx.Node, int],
    ambient: HookPair | None,
) -> HookPair | None:
    """The hooks a saved tensor takes: those of the scope the op that saved it ran in.

    In-graph scopes (``saved_tensors_hooks`` entered inside the compiled region) are
    recorded on nodes by the Dynamo patch (see ``scope_of`` for the rule); a saved tensor
    outside every in-graph scope takes the hooks active around the compiled call.
    """
    scope = hook_scopes.scope_of(saved, bw_input, bw_order)
    if scope is hook_scopes.NO_SCOPE:
        return ambient
    return scope


def filtered_by_mode(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    saved_tensors: list[fx.Node],
    num_inner_fwd_outputs: int,
    static_input_indices: list[int],
) -> set[fx.Node] | None:
    """Saved tensors upstream's filtering mode allows hooks on (None = all)."""
    from torch._functorch._aot_autograd import graph_compile as gc, utils as aot_utils

    mode = torch._functorch.config.saved_tensors_hooks_filtering_mode
    if mode == "all":
        return None
    if mode == "no_static":
        placeholders = fw_module.graph.find_nodes(op="placeholder")
        static = {placeholders[i] for i in static_input_indices}
        return {n for n in saved_tensors if n not in static}
    if mode != "donated":
        raise SavedTensorsHookConfigError(f"unknown saved_tensors_hooks_filtering_mode {mode!r}")
    # Donated buffers: saved intermediates that alias no graph input or output, so
    # packing them really frees their memory.
    if aot_utils.contain_metadata_mutation_ops(fw_module) or aot_utils.contain_metadata_mutation_ops(bw_module):
        return set()

    def vals(nodes: Any) -> list[Any]:
        return [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]

    fw_outs = hook_utils.graph_outputs(fw_module.graph)
    bw_outs = hook_utils.graph_outputs(bw_module.graph)
    idxs = gc.collect_fw_donated_buffer_idxs(
        vals(fw_module.graph.find_nodes(op="placeholder")),
        vals(fw_outs[:num_inner_fwd_outputs]),
        vals(bw_outs),
        vals(saved_tensors),
    )
    return {saved_tensors[i] for i in idxs}


def output_aliases(
    fw_module: fx.GraphModule, bw_module: fx.GraphModule, saved_tensors: list[fx.Node], num_inner_fwd_outputs: int
) -> set[fx.Node]:
    """Saved tensors ``donated`` mode leaves alone only because they share a storage with an
    output of the forward (the logits and the KV cache a Hugging Face model returns beside its
    loss): packing one frees nothing while the caller holds the output.  A training step keeps
    its loss and drops the rest right after the forward, so a budget plan may store them
    otherwise (upstream's own test of the other aliases, without the forward's outputs)."""
    from torch._functorch._aot_autograd import graph_compile as gc

    def vals(nodes: Any) -> list[Any]:
        return [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]

    ins = vals(fw_module.graph.find_nodes(op="placeholder"))
    outs = vals(hook_utils.graph_outputs(fw_module.graph)[:num_inner_fwd_outputs])
    bw_outs = vals(hook_utils.graph_outputs(bw_module.graph))
    saved = vals(saved_tensors)
    without_outputs = set(gc.collect_fw_donated_buffer_idxs(ins, [], bw_outs, saved))
    donated = set(gc.collect_fw_donated_buffer_idxs(ins, outs, bw_outs, saved))
    return {saved_tensors[i] for i in without_outputs - donated}


def filter_hookable(
    candidates: list[records.SavedTensorRecord],
    allowed: set[fx.Node] | None,
    inputs: dict[fx.Node, str | None],
    output_aliases: Set[fx.Node] = frozenset(),
) -> None:
    """Leave unhooked what the hooks may not see: upstream's filtering mode, our dtype
    policy, and tensors the backward does not use.  A budget pair's plan also sees the saved
    tensors that ``donated`` mode filters only because a forward output shares their storage
    (``output_aliases``)."""
    mode = torch._functorch.config.saved_tensors_hooks_filtering_mode
    for r in candidates:
        saved = r.node
        if allowed is not None and saved not in allowed and saved in output_aliases and r.scope_pair.kind.budget is not None:
            r.aliases_output = True
            if not hook_utils.is_hookable_dtype(r.dtype):
                r.leave(
                    records.DecidedBy.FILTER, f"dtype {r.dtype} (config.hooked_saved_tensor_dtypes={config.hooked_saved_tensor_dtypes!r})"
                )
            else:
                r.take(
                    r.scope_pair,
                    records.DecidedBy.HOOKS,
                    "aliases a forward output: stored otherwise, freed once the caller drops the output",
                )
            continue
        if allowed is not None and saved not in allowed:
            root = act_inputs.storage_root(saved)
            if inputs.get(root) is not None:
                why = f"{'is' if root is saved else 'aliases'} graph input {root.name}: {inputs[root]}"
            else:
                why = f"filtered by saved_tensors_hooks_filtering_mode={mode!r}"
        elif not hook_utils.is_hookable_dtype(r.dtype):
            why = f"dtype {r.dtype} (config.hooked_saved_tensor_dtypes={config.hooked_saved_tensor_dtypes!r})"
        elif r.bw_input is None or not r.bw_input.users:
            why = "unused by the backward"
        else:
            r.take(r.scope_pair, records.DecidedBy.HOOKS)
            continue
        r.leave(records.DecidedBy.FILTER, why)


def resolve_select(candidates: list[records.SavedTensorRecord]) -> None:
    """Resolve ``select`` pairs: the hooks each tensor takes, or why none.

    A :func:`torch_patches.hooks.select` pair asks its ``where`` predicate, once per saved
    tensor at compile time, with the tensor's :class:`SavedTensorInfo`; an accepted tensor
    takes the pair's inner hooks (traced without the eager-mode branching), a rejected one
    the pair's ``otherwise`` hooks (which may select in turn), or none.
    """
    for r in candidates:
        if not r.hooked:
            continue
        pair, how = r.chosen_pair, []
        while (sel := pair.kind.selection) is not None:
            try:
                accepted = bool(sel.where(r.info()))
            except Exception as e:  # noqa: BLE001 - the user's predicate
                raise hook_tracing.hook_error(
                    pair.pack,
                    f"its where= predicate {hook_utils.hook_name(sel.where)} raised {type(e).__name__}: {e}",
                    e,
                    role="pack",
                    pair=pair,
                    saved=r.node,
                ) from e
            where = hook_utils.hook_name(sel.where)
            if accepted:
                how.append(f"accepted by where={where}")
                pair = HookPair(sel.pack, sel.unpack, pair.label)
            elif sel.otherwise is not None:
                how.append(f"rejected by where={where}, otherwise")
                pair = HookPair(sel.otherwise[0], sel.otherwise[1], pair.label)
            else:
                consumers = ", ".join(r.info().backward_consumers or ()) or "none"
                numerics = f"tolerates {r.tolerance}" + (f": {r.tolerance_why}" if r.tolerance_why else "")
                r.leave(records.DecidedBy.SELECT, f"not selected by where={where} ({numerics}; backward consumers: {consumers})")
                break
        else:
            if how:
                r.take(pair, records.DecidedBy.SELECT, "; ".join(how))


def drop_partially_hooked(
    candidates: list[records.SavedTensorRecord], saved_tensors: list[fx.Node], inputs: dict[fx.Node, str | None]
) -> None:
    """``donated`` mode: leave unhooked what shares an activation input's storage with a
    saved tensor left unhooked (packing it would not free the storage)."""
    packed = [r.fw_node for r in candidates if r.decision in (records.HOOKED, records.ALIAS)]
    reasons = act_inputs.partially_hooked(saved_tensors, packed, inputs)
    for r in candidates:
        if r.node in reasons:
            r.leave(records.DecidedBy.FILTER, reasons[r.node])


def mark_aliases(candidates: list[records.SavedTensorRecord]) -> None:
    """A hooked saved tensor that purely aliases (detach, alias) another hooked with the
    same hooks is not packed again: the backward reads the root's unpacked tensor."""
    aliases = graph_surgery.alias_roots({r.fw_node: r.chosen_pair for r in candidates if r.hooked})
    for r in candidates:
        if r.node in aliases:
            r.decision, r.decided_by, r.alias_of = records.ALIAS, records.DecidedBy.ALIAS, aliases[r.node].name


def settle_aliases(candidates: list[records.SavedTensorRecord]) -> dict[fx.Node, fx.Node]:
    """The aliases that still share their root's packed form (alias -> root) once every
    phase decided; an alias whose root is no longer hooked is packed on its own."""
    by_name = {r.name: r for r in candidates}
    out: dict[fx.Node, fx.Node] = {}
    for r in candidates:
        if r.decision != records.ALIAS:
            continue
        root = by_name[cast(str, r.alias_of)]  # an alias names its root
        if root.hooked and root.chosen == r.chosen:
            out[r.fw_node] = root.fw_node
        else:
            r.decision, r.alias_of = records.HOOKED, None
    return out
