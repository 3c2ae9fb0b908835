"""Rewriting the AOT forward and backward graphs around saved tensors' traced hooks.

Each pack graph is copied in right after its saved tensor's last forward use, each unpack
graph right before the saved tensor's first backward use (or at the graph boundaries, with
``config.hook_placement="boundary"``), and the saved outputs / backward inputs are rewired
in AOTAutograd's calling convention.  Nothing here decides *whether* to hook (the inliner in
``graph_compile`` does) or traces anything (``hook_tracing``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import is_sym_node

from torch_patches import config
from torch_patches._functorch._aot_autograd import utils as hook_utils
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair, Traced

#: node.meta key on every node we insert: {"role": "pack"|"unpack", "saved": name, "hook": label}
HOOK_META = "saved_tensors_hook"


@dataclasses.dataclass
class SavedPlan:
    saved: fx.Node  # forward output node saved for backward
    pair: HookPair
    pack: Traced
    unpack: Traced
    restride: bool
    record: Any = None  # its saved_tensor_records.SavedTensorRecord: told where pack and unpack went
    #: The graphs' nodes for the tensors the hooks read as runtime inputs (the traces'
    #: trailing placeholders, in order): forward placeholders, and their backward inputs.
    fw_inputs: tuple[fx.Node, ...] = ()
    bw_inputs: tuple[fx.Node, ...] = ()


def _unique(graphs: tuple[fx.Graph, ...], candidate: str) -> str:
    names: set[str] = set()
    for g in graphs:
        names.update(n.name for n in g.nodes)
    if candidate not in names:
        return candidate
    for i in itertools.count():
        c = f"{candidate}_{i}"
        if c not in names:
            return c
    raise AssertionError("unreachable")


def _copy_into(
    graph: fx.Graph,
    owner: fx.GraphModule,
    src: fx.GraphModule,
    env: dict[fx.Node, Any],
    names: dict[fx.Node, str],
    tag: dict[str, str],
    only: set[fx.Node] | None = None,
) -> list[fx.Node]:
    """Copy ``src``'s body (no placeholders/output; only the nodes in ``only``, when
    given, and those not copied yet) at the graph's insert point."""
    new_nodes = []
    for node in src.graph.nodes:
        if node.op in ("placeholder", "output") or node in env:
            continue
        if only is not None and node not in only:
            continue
        target = node.target
        if node.op == "get_attr":
            # Constants the hook created (make_fx lifts them onto its module).
            value = getattr(src, str(node.target))
            target = _unique((graph,), "_saved_tensors_hook_constant")
            while hasattr(owner, target):
                target += "_"
            setattr(owner, target, value)
        new = graph.create_node(
            node.op,
            target,
            fx.map_arg(node.args, lambda n: env[n]),
            fx.map_arg(node.kwargs, lambda n: env[n]),
            name=names.get(node),
            type_expr=node.type,
        )
        new.meta = copy.copy(node.meta)
        new.meta[HOOK_META] = dict(tag)
        env[node] = new
        new_nodes.append(new)
        if node.op == "get_attr" and isinstance(getattr(owner, target), torch.Tensor):
            # Read the constant through lift_fresh, as AOTAutograd does for constants it
            # traces: fake-tensor propagation of the graph (Inductor re-runs it) accepts a
            # real tensor only there. lift_fresh returns its input (no copy; Inductor: a
            # nop). 0-d constants take lift_fresh_copy: Inductor inlines them as a scalar,
            # which only a computation (the copy, fused into its reader) can consume.
            value = getattr(owner, target)
            lift = torch.ops.aten.lift_fresh_copy if value.dim() == 0 else torch.ops.aten.lift_fresh
            lifted = graph.call_function(lift.default, (new,))
            lifted.meta = {"val": _fake_constant(value, env), HOOK_META: dict(tag)}
            env[node] = lifted
            new_nodes.append(lifted)
    return new_nodes


def _fake_constant(value: torch.Tensor, env: dict[fx.Node, Any]) -> Any:
    """A fake of ``value`` in the fake mode of the graph being edited, for node meta."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    for known in env.values():
        mode = maybe_get_fake_mode(known.meta.get("val")) if isinstance(known, fx.Node) else None
        if mode is not None:
            return mode.from_tensor(value, static_shapes=True)
    return None


def _mutates(user: fx.Node, arg: fx.Node) -> bool:
    target = user.target
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
            if value is arg:
                return True
    return False


def _forward_anchor(saved: fx.Node, order: dict[fx.Node, int], placement: str) -> fx.Node:
    """The node after which saved's pack goes."""
    graph = saved.graph
    output = graph.output_node()
    if placement == "boundary":
        return output.prev
    last_placeholder = graph.find_nodes(op="placeholder")[-1]
    users = [u for u in saved.users if u is not output]
    mutations = sorted((u for u in users if _mutates(u, saved)), key=order.__getitem__)
    if mutations:
        # Pack the value the backward expects: before anything overwrites it.
        anchor = mutations[0].prev
    elif users:
        anchor = max(users, key=order.__getitem__)
    else:
        anchor = saved
    if order.get(anchor, 0) < order[last_placeholder]:
        anchor = last_placeholder
    return anchor


def _backward_insert_before(bw_input: fx.Node, order: dict[fx.Node, int], placement: str, prefetch: int) -> fx.Node:
    """The node before which bw_input's unpack goes."""
    graph = bw_input.graph
    last_placeholder = graph.find_nodes(op="placeholder")[-1]
    if placement == "boundary" or not bw_input.users:
        return last_placeholder.next
    node = min(bw_input.users, key=order.__getitem__)
    for _ in range(max(prefetch, 0)):
        if node.prev is last_placeholder or node.prev.op == "placeholder":
            break
        node = node.prev
    return node


#: Ops whose output is the input itself (same storage, sizes, strides) under another name.
_PURE_ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def alias_roots(hookable: dict[fx.Node, HookPair]) -> dict[fx.Node, fx.Node]:
    """saved tensor -> the hooked saved tensor it purely aliases (same hooks), if any.

    The partitioner often saves both ``x`` and ``detach(x)`` (one backward formula reads the
    input, another the result). Packing each would store two compressed copies of one
    tensor; eager autograd would also call pack twice, but the hooks are pure by contract,
    so one packed copy serves both.
    """
    roots = {}
    for saved, pair in hookable.items():
        root = saved
        while root.op == "call_function" and root.target in _PURE_ALIAS_OPS:
            root = cast(fx.Node, root.args[0])  # an alias's tensor
        if root is not saved and hookable.get(root) == pair:
            roots[saved] = root
    return roots


def merge_aliases(
    fw_module: fx.GraphModule,
    bw_inputs: dict[str, fx.Node],
    num_inner_fwd_outputs: int,
    aliases: dict[fx.Node, fx.Node],
) -> None:
    """Save each alias's root only: the backward reads the root where it read the alias."""
    if not aliases:
        return
    fw_g = fw_module.graph
    fw_out = fw_g.output_node()
    outs = list(hook_utils.graph_outputs(fw_g))
    keep = [i < num_inner_fwd_outputs or not (isinstance(n, fx.Node) and n in aliases) for i, n in enumerate(outs)]
    fw_out.args = (tuple(n for n, k in zip(outs, keep) if k),)
    desc = fw_out.meta.get("desc")
    if isinstance(desc, (list, tuple)) and len(desc) == len(outs):
        fw_out.meta["desc"] = [d for d, k in zip(desc, keep) if k]
    for alias, root in aliases.items():
        bw_alias = bw_inputs.pop(alias.name)
        bw_alias.replace_all_uses_with(bw_inputs[root.name])
        bw_alias.graph.erase_node(bw_alias)
        if not alias.users:
            fw_g.erase_node(alias)


def insert_pack(
    plan: SavedPlan,
    fw_module: fx.GraphModule,
    bw_g: fx.Graph,
    order: dict[fx.Node, int],
    placement: str,
    tail: dict[fx.Node, fx.Node],
) -> list[Any]:
    """Insert saved's pack after its last forward use; return the packed leaves."""
    fw_g = fw_module.graph
    saved = plan.saved
    gm = plan.pack.gm
    placeholder, *lifted = gm.graph.find_nodes(op="placeholder")
    if len(lifted) != plan.pack.num_inputs or len(lifted) != len(plan.fw_inputs):
        raise AssertionError(f"pack graph takes {len(lifted)} hook inputs for {len(plan.fw_inputs)} graph inputs")
    out_nodes = [x for x in pytree.tree_leaves(plan.pack.out_args) if isinstance(x, fx.Node)]
    names = {}
    for i, n in enumerate(out_nodes):
        if n is not placeholder and n not in names:
            suffix = "" if len(out_nodes) == 1 else f"_{i}"
            names[n] = _unique((fw_g, bw_g), f"{saved.name}_packed{suffix}")
    anchor = _forward_anchor(saved, order, placement)
    if plan.record is not None:
        plan.record.pack_after = anchor.name
    env: dict[fx.Node, Any] = {placeholder: saved, **dict(zip(lifted, plan.fw_inputs))}
    tag = {"role": "pack", "saved": saved.name, "hook": plan.pair.label}
    with fw_g.inserting_before(tail.get(anchor, anchor).next):
        new_nodes = _copy_into(fw_g, fw_module, gm, env, names, tag)
    if new_nodes:
        tail[anchor] = new_nodes[-1]
    leaves = [env[x] if isinstance(x, fx.Node) else x for x in pytree.tree_leaves(plan.pack.out_args)]
    if saved.meta.get("saved_tensor_with_no_vc_check", False):
        for leaf in leaves:
            if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor):
                leaf.meta["saved_tensor_with_no_vc_check"] = True
    return leaves


def reload_starts(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``saved_tensors_hooks::reload_start`` calls of an unpack graph (none for every
    hook but ``cpu_offload`` and chains ending in it)."""
    ns = getattr(torch.ops, "saved_tensors_hooks", None)
    op = getattr(ns, "reload_start", None) if ns is not None else None
    if op is None:  # torch_patches.hooks.offload never imported: no graph can call it
        return []
    targets = (op, op.default)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _reload_start_closure(gm: fx.GraphModule) -> set[fx.Node]:
    """:func:`reload_starts` and the nodes they depend on.

    Placeholders excluded: they become backward inputs, placed at the top anyway.  Empty
    when the graph starts no reload.
    """
    found: set[fx.Node] = set()
    stack = reload_starts(gm)
    while stack:
        node = stack.pop()
        if node in found or node.op == "placeholder":
            continue
        found.add(node)
        stack.extend(node.all_input_nodes)
    return found


def insert_unpack(
    plan: SavedPlan,
    bw_module: fx.GraphModule,
    fw_g: fx.Graph,
    bw_input: fx.Node,
    leaves: list[Any],
    order: dict[fx.Node, int],
    placement: str,
) -> dict[fx.Node, fx.Node]:
    """Insert saved's unpack before its first backward use.

    Returns forward packed leaf -> the backward input that receives it.
    """
    bw_g = bw_module.graph
    gm = plan.unpack.gm
    placeholders = gm.graph.find_nodes(op="placeholder")
    if plan.unpack.num_inputs:
        lifted = placeholders[len(placeholders) - plan.unpack.num_inputs :]
        placeholders = placeholders[: len(placeholders) - plan.unpack.num_inputs]
        if len(lifted) != len(plan.bw_inputs):
            raise AssertionError(f"unpack graph takes {len(lifted)} hook inputs for {len(plan.bw_inputs)} graph inputs")
    else:
        lifted = []
    if len(placeholders) != len(leaves):
        raise AssertionError(f"unpack graph takes {len(placeholders)} inputs for {len(leaves)} packed leaves")
    env: dict[fx.Node, Any] = dict(zip(lifted, plan.bw_inputs))
    new_inputs: dict[fx.Node, fx.Node] = {}
    users_before = list(bw_input.users)
    for ph, leaf in zip(placeholders, leaves):
        if not isinstance(leaf, fx.Node):
            env[ph] = leaf  # constants (dtype, python numbers) are baked in
            continue
        if leaf is plan.saved:
            env[ph] = bw_input
            new_inputs[leaf] = bw_input
            continue
        if leaf in new_inputs:  # one symbol in several places (a subclass's sizes)
            env[ph] = new_inputs[leaf]
            continue
        with bw_g.inserting_before(bw_input):
            new = bw_g.placeholder(leaf.name)  # same name as the forward output
        new.meta = {k: v for k, v in leaf.meta.items() if k in ("val", "tensor_meta")}
        if "desc" in bw_input.meta:
            new.meta["desc"] = bw_input.meta["desc"]
        env[ph] = new
        new_inputs[leaf] = new
    before = _backward_insert_before(bw_input, order, placement, config.unpack_prefetch_distance)
    tag = {"role": "unpack", "saved": plan.saved.name, "hook": plan.pair.label}
    out_arg = gm.graph.output_node().args[0]
    (out_node,) = pytree.tree_leaves(out_arg)
    names = {out_node: _unique((fw_g, bw_g), f"{plan.saved.name}_unpacked")}
    early = _reload_start_closure(gm)
    if early:
        # Split reload (cpu_offload): the host-to-device copies start ahead of the use, so
        # they overlap the backward compute in between; the rest (reload_wait onwards)
        # goes right before the use as usual.
        # (unpack_prefetch_distance moves the whole unpack of other hooks; here it moves
        # only the copy's start: waiting early would gain nothing.)
        distance = max(config.unpack_prefetch_distance, config.reload_prefetch_distance)
        early_before = _backward_insert_before(bw_input, order, placement, distance)
        before = _backward_insert_before(bw_input, order, placement, 0)
        with bw_g.inserting_before(early_before):
            _copy_into(bw_g, bw_module, gm, env, names, tag, only=early)
    if plan.record is not None:
        plan.record.unpack_before = before.name
    with bw_g.inserting_before(before):
        _copy_into(bw_g, bw_module, gm, env, names, tag)
        result = env[out_node]
        if plan.restride:
            result = _restride(bw_g, result, plan.saved.meta["val"], tag)
    for user in users_before:
        user.replace_input_with(bw_input, result)
    if not bw_input.users:
        bw_g.erase_node(bw_input)
    return new_inputs


def _restride(bw_g: fx.Graph, result: fx.Node, val: torch.Tensor, tag: dict[str, Any]) -> fx.Node:
    """``result`` (unpack's output) in the saved tensor's strides (``val``'s).  Static strides:
    copied into an ``empty_strided`` of them.  Symbolic ones (``dynamic=True``) cannot be
    spelled in the backward, whose symbols are bound only through its inputs: a dense saved
    tensor's strides follow from its sizes and stride order, so the result is permuted to
    that order, made contiguous and permuted back, every size read off the graph's tensors."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    def add(op: Any, args: tuple[Any, ...], meta: torch.Tensor, kwargs: dict[str, Any] | None = None) -> fx.Node:
        node = bw_g.call_function(op, args, kwargs or {})
        node.meta["val"], node.meta[HOOK_META] = meta, dict(tag)
        return node

    if not free_symbols((*val.shape, *val.stride())):
        empty = add(
            torch.ops.aten.empty_strided.default,
            (list(val.shape), list(val.stride())),
            val.new_empty_strided(val.shape, val.stride()),
            {"dtype": val.dtype, "device": val.device},
        )
        return add(torch.ops.aten.copy.default, (empty, result), empty.meta["val"])
    hint = hook_utils.size_hint
    order = sorted(range(val.dim()), key=lambda d: (-hint(val.stride()[d]), -hint(val.shape[d])))
    back = sorted(range(val.dim()), key=order.__getitem__)
    contiguous = val.permute(order).contiguous()
    permuted = add(torch.ops.aten.permute.default, (result, order), val.permute(order))
    dense = add(torch.ops.aten.clone.default, (permuted,), contiguous, {"memory_format": torch.contiguous_format})
    return add(torch.ops.aten.permute.default, (dense, back), contiguous.permute(back))


def insert_recompute(
    saved: fx.Node,
    nodes: tuple[fx.Node, ...],
    frontier: tuple[fx.Node, ...],
    label: str,
    bw_module: fx.GraphModule,
    bw_inputs: dict[str, fx.Node],
    order: dict[fx.Node, int],
    extra_inputs: dict[fx.Node, fx.Node],
) -> list[fx.Node]:
    """Recompute ``saved`` in the backward: copy the forward ``nodes`` right before its first
    backward use, reading ``frontier`` (saved tensors through their backward inputs, other
    forward nodes through new backward inputs, shared via ``extra_inputs``).  Returns the
    forward nodes the graph must now save for it (``rewire_saved``'s packed leaves)."""
    bw_g = bw_module.graph
    bw_input = bw_inputs[saved.name]
    env: dict[fx.Node, Any] = {}
    leaves = []
    for node in frontier:
        if node.name in bw_inputs:
            env[node] = bw_inputs[node.name]
            continue
        if node not in extra_inputs:
            with bw_g.inserting_before(bw_input):
                new = bw_g.placeholder(node.name)  # same name as the forward output
            new.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
            extra_inputs[node] = new
        env[node] = extra_inputs[node]
        leaves.append(node)
    tag = {"role": "recompute", "saved": saved.name, "hook": label}
    names = {saved: _unique((saved.graph, bw_g), f"{saved.name}_recomputed")}
    with bw_g.inserting_before(_backward_insert_before(bw_input, order, "use", 0)):
        for node in nodes:
            new = bw_g.create_node(
                node.op,
                node.target,
                fx.map_arg(node.args, env.__getitem__),
                fx.map_arg(node.kwargs, env.__getitem__),
                name=names.get(node) or _unique((saved.graph, bw_g), node.name),
                type_expr=node.type,
            )
            new.meta = copy.copy(node.meta)
            new.meta[HOOK_META] = dict(tag)
            env[node] = new
    bw_input.replace_all_uses_with(env[saved])
    bw_g.erase_node(bw_input)
    return leaves


def drop_dead_recomputed(fw_g: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the forward ``nodes`` (pure ops of every recipe; recipes may share ops) that
    nothing reads once no longer saved, users before what they read."""
    wanted = set(nodes)
    for node in reversed([n for n in fw_g.nodes if n in wanted]):
        if not node.users:
            fw_g.erase_node(node)


def saved_backward_inputs(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_inner_fwd_outputs: int) -> dict[str, fx.Node]:
    """The backward's input for each forward output saved for it, by the forward node's name.

    AOTAutograd hands saved values over by position, not by name: the forward returns
    (inner outputs, saved values, symints), the backward takes (symints, saved values,
    incoming gradients...).  A name is no guide: the partitioner's RNG functionalization
    saves ``getitem_4`` (the state ``run_and_save_rng_state`` returned, under activation
    checkpointing's recomputed dropout) as the backward's ``rng_state_output_0``.  Each pair
    is checked (both symbolic, or both tensors of one dtype and rank); a graph pair that
    breaks the convention raises :class:`SavedOutputsMismatch`."""
    saved = list(hook_utils.graph_outputs(fw_module.graph))[num_inner_fwd_outputs:]
    n_syms = 0
    while n_syms < len(saved) and isinstance(saved[-1 - n_syms], fx.Node) and is_sym_node(saved[-1 - n_syms]):
        n_syms += 1
    ordered = saved[len(saved) - n_syms :] + saved[: len(saved) - n_syms]
    placeholders = bw_module.graph.find_nodes(op="placeholder")
    if len(placeholders) < len(ordered):
        raise SavedOutputsMismatch(f"{len(ordered)} saved forward outputs for {len(placeholders)} backward inputs")
    out: dict[str, fx.Node] = {}
    for fw_node, bw_node in zip(ordered, placeholders):
        if not isinstance(fw_node, fx.Node):
            raise SavedOutputsMismatch(f"saved forward output {fw_node!r} is not a graph node")
        if hook_utils.is_incoming_gradient(bw_node) or not _same_kind(fw_node.meta.get("val"), bw_node.meta.get("val")):
            raise SavedOutputsMismatch(f"saved forward output {fw_node.name} does not match backward input {bw_node.name}")
        out[fw_node.name] = bw_node
    return out


class SavedOutputsMismatch(AssertionError):
    """The forward's saved outputs and the backward's inputs break AOTAutograd's convention."""


def _same_kind(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.dim() == b.dim()
    return type(a) is type(b)


def rewire_saved(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_inner_fwd_outputs: int,
    packed_leaves: dict[fx.Node, list[Any]],
    bw_input_of: dict[fx.Node, fx.Node],
    bw_inputs: dict[str, fx.Node],
    extra_saved: list[fx.Node] = (),  # type: ignore[assignment]
) -> None:
    """Replace hooked saved tensors by their packed leaves in the fw outputs/bw inputs;
    ``extra_saved``: forward nodes the backward reads besides (the hooks' graph inputs,
    ``bw_input_of`` gives their backward inputs); ``bw_inputs``: the backward input of each
    saved forward output left as it was (:func:`saved_backward_inputs`).

    Calling convention kept: forward outputs are (inner outputs, tensors saved with
    version-counter check, tensors saved without, opaque objects, symints); backward
    inputs start with (symints, tensors with check, tensors without, opaque objects).
    """
    fw_out = fw_module.graph.output_node()
    outs = list(hook_utils.graph_outputs(fw_module.graph))
    inner, saved = outs[:num_inner_fwd_outputs], outs[num_inner_fwd_outputs:]
    t_vc: list[fx.Node] = []
    t_novc: list[fx.Node] = []
    opaque: list[Any] = []
    syms: list[fx.Node] = []
    new_syms: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        if is_sym_node(node):
            syms.append(node)
        elif isinstance(node.meta.get("val"), torch.Tensor):
            (t_novc if node.meta.get("saved_tensor_with_no_vc_check", False) else t_vc).append(node)
        else:
            opaque.append(node)

    seen: set[fx.Node] = set()
    for node in saved:
        if node in packed_leaves:
            for leaf in packed_leaves[node]:
                if not isinstance(leaf, fx.Node) or leaf in seen:
                    continue  # constants are baked in; a leaf repeated is saved once
                seen.add(leaf)
                if is_sym_node(leaf):
                    new_syms.append(leaf)
                else:
                    place(leaf)
        else:
            place(node)
    for node in extra_saved:
        if node not in seen:
            seen.add(node)
            place(node)
    new_saved = t_vc + t_novc + opaque + syms + new_syms
    desc = fw_out.meta.get("desc")
    fw_out.args = (tuple(inner + new_saved),)
    if isinstance(desc, (list, tuple)) and len(desc) == len(outs):
        fw_out.meta["desc"] = list(desc[:num_inner_fwd_outputs]) + _saved_descs(len(new_saved), len(t_vc), len(t_novc))

    # Backward inputs in the same order, by name; everything else keeps its place.
    bw_g = bw_module.graph
    order = [syms + new_syms, t_vc, t_novc, opaque]
    wanted = [bw_input_of.get(n) or bw_inputs.get(n.name) for group in order for n in group]
    if None in wanted or len(wanted) != len(new_saved):
        raise SavedOutputsMismatch("backward inputs do not match the saved forward outputs")
    wanted_set = set(wanted)
    rest = [n for n in bw_g.find_nodes(op="placeholder") if n not in wanted_set]
    cursor: fx.Node | None = None
    for node in wanted + rest:
        if cursor is None:
            first = next(iter(bw_g.nodes))
            if first is not node:
                first.prepend(node)
        else:
            cursor.append(node)
        cursor = node


def _saved_descs(n_saved: int, n_vc: int, n_novc: int) -> list[Any]:
    """Output descriptors for the rebuilt saved section."""
    from torch._functorch._aot_autograd.descriptors import (
        SavedForBackwardsAOTOutput,
        SavedForBackwardsNoVcCheckAOTOutput,
    )

    return [SavedForBackwardsNoVcCheckAOTOutput(i) if n_vc <= i < n_vc + n_novc else SavedForBackwardsAOTOutput(i) for i in range(n_saved)]
