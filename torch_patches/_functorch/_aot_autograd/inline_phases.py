"""The inliner's phases over one compilation's saved tensors, placed at use.

``graph_compile.maybe_inline_graph_saved_tensors_hooks`` (the patched entry point) calls
:func:`inline` with the partitioned forward and backward graphs.  Its spine is one record
per saved tensor (``saved_tensor_records``, made by ``saved_tensor_collect``); each phase is
a function over the records:

* filter: which saved tensors hooks may see (upstream's filtering mode, our dtype policy,
  activations held by the caller: ``saved_tensor_selection``);
* select: what a ``select`` pair leaves each one (``saved_tensor_selection``), the numerics
  allowlist's verdict, the budget's plan;
* alias: views of one storage packed once (``saved_tensor_selection``);
* place and rewrite: every hook traced before either graph is touched (``hook_tracing``),
  then each pack put right after its saved tensor's last forward use and each unpack right
  before its first backward use (``graph_surgery``), the hooks' lifted inputs mapped to the
  forward's placeholders;
* donate: under a budget, saved activation inputs handed to the backward that computes
  their gradients, to write them over (``donated_inputs``).

The records are what the compilation reports (the debug log,
``torch_patches.testing.saved_tensor_records()``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._logging._internal import trace_log

from torch_patches import _logging as tp_logging, config
from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches._functorch._aot_autograd import (
    activation_budget,
    activation_inputs as act_inputs,
    checkpointed,
    compile_facts,
    donated_inputs,
    graph_surgery,
    hook_tracing,
    offload_prefetch,
    saved_numerics,
    saved_tensor_collect as collect,
    saved_tensor_records as records,
    saved_tensor_selection as selection,
    utils as hook_utils,
)
from torch_patches._functorch._aot_autograd.activation_budget.solver import PartitionTerms, Plan
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair

#: The inliner logs as the entry point it serves.
UPSTREAM_MODULE = "torch._functorch._aot_autograd.graph_compile"


def stock_pareto() -> tuple[tuple[float, int, float], ...]:
    """The partitioner's pareto of this compilation (only while a report records)."""
    found = compile_facts.facts()
    return tuple(found.stock_pareto) if found is not None else ()


def _backward_facts(fw_module: fx.GraphModule, bw_module: fx.GraphModule, held: set[fx.Node]) -> Any:
    """The backward's gradient-dependent nodes, and which of its outputs are gradients of
    inputs the caller keeps (parameters, leaves): AOTAutograd returns one gradient per
    forward input, in order; when their numbers differ no position is trusted."""
    placeholders = fw_module.graph.find_nodes(op="placeholder")
    outs = hook_utils.graph_outputs(bw_module.graph)
    accumulated = frozenset(i for i, ph in enumerate(placeholders) if ph in held) if len(outs) == len(placeholders) else frozenset()
    return saved_numerics.BackwardFacts(saved_numerics.tangent_dependent(bw_module.graph), accumulated)


@dataclasses.dataclass
class _GraphPair:
    """The forward and backward graphs being inlined, with what every phase reads of them."""

    fw_module: fx.GraphModule
    bw_module: fx.GraphModule
    num_inner_fwd_outputs: int
    inner_meta: Any
    aot_config: Any
    static_input_indices: list[int]
    held: set[fx.Node]  # forward inputs the caller keeps alive (``activation_inputs``)
    #: The partition choice's terms for the ambient budget's plan.
    partition: PartitionTerms | None = None

    def __post_init__(self) -> None:
        fw_outs = list(hook_utils.graph_outputs(self.fw_module.graph))
        self.saved_tensors = [
            n for n in fw_outs[self.num_inner_fwd_outputs :] if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
        ]
        # The backward input of each saved tensor, by its forward name (by position:
        # AOTAutograd's convention; the names may differ).
        self.bw_inputs = graph_surgery.saved_backward_inputs(self.fw_module, self.bw_module, self.num_inner_fwd_outputs)
        self.sources = getattr(self.aot_config, "aot_autograd_arg_pos_to_source", None)
        self.artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)


def inline(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_inner_fwd_outputs: int,
    inner_meta: Any,
    aot_config: Any,
    static_input_indices: list[int],
    ambient: HookPair | None,
    held: set[fx.Node],
    recomputed_by_partitioner: Sequence[records.SavedTensorRecord] = (),
    partition: PartitionTerms | None = None,
) -> None:
    """Run the phases over the graph pair's saved tensors and rewrite both graphs; publish
    the records.  ``ambient``: the pair active around the compiled call (None: only in-graph
    scopes); ``held``: forward inputs the caller keeps alive (``activation_inputs``);
    ``recomputed_by_partitioner``: records of what the default partition saves and the one
    taken recomputes (published with the others, for the log and ``report()``);
    ``partition``: the partition choice's terms for the ambient budget's plan
    (``activation_budget.partition_choice``).  Every
    hook is traced before either graph changes: a :class:`SavedTensorsHookError` leaves them
    as they were (the driver decides whether to fall back).

    The phases: :func:`_collect` (a record per saved tensor), :func:`_decide` (filter,
    select, alias, plan: each record's decision), :func:`_trace` (every hook traced) and
    :func:`_rewrite` (the packs and unpacks placed, both graphs rewired)."""
    graphs = _GraphPair(fw_module, bw_module, num_inner_fwd_outputs, inner_meta, aot_config, static_input_indices, held, partition)
    compiled = _collect(graphs, ambient)
    if compiled is None:
        return
    candidates = [r for r in compiled.records if r.pair is not None]
    recomputed, aliases = _decide(graphs, candidates, compiled)
    plans = _trace(graphs, candidates)
    if plans or recomputed:
        _rewrite(graphs, plans, candidates, recomputed, aliases)
    if any(r.scope_pair.kind.budget is not None for r in candidates):
        _donate(graphs)
    compiled.records.extend(recomputed_by_partitioner)
    records.log_records(compiled, graphs.artifact)
    records.publish(compiled)
    if plans or recomputed:
        _log_inlined(graphs)


def _collect(graphs: _GraphPair, ambient: HookPair | None, publish: bool = True) -> records.CompiledSavedTensors | None:
    """Phase collect: one record per saved tensor, with its scope's hooks (None: no saved
    tensor has hooks; the records were published for an observer, if any, and ``publish``)."""
    bw_g = graphs.bw_module.graph
    bw_order = {n: i for i, n in enumerate(bw_g.nodes)}
    fw_order = {n: i for i, n in enumerate(graphs.fw_module.graph.nodes)}
    fw_len, bw_len = len(fw_order), len(bw_order)
    bw_inputs, sources = graphs.bw_inputs, graphs.sources
    scoped = [(n, selection.hooks_for_saved(n, bw_inputs.get(n.name), bw_order, ambient)) for n in graphs.saved_tensors]
    if all(pair is None for _, pair in scoped):
        if publish and records.observed():  # a report: what a graph without hooks saves
            records.publish(
                records.CompiledSavedTensors(
                    _checkpointed(
                        [
                            collect.collect(n, bw_inputs.get(n.name), bw_order, None, act_inputs.storage_root(n), None, fw_order, sources)
                            for n in graphs.saved_tensors
                        ],
                        graphs,
                        bw_order,
                        fw_order,
                    ),
                    stock_pareto=stock_pareto(),
                    fw_len=fw_len,
                    bw_len=bw_len,
                )
            )
        return None
    facts = _backward_facts(graphs.fw_module, graphs.bw_module, graphs.held)
    all_records = [
        collect.collect(n, bw_inputs.get(n.name), bw_order, facts, act_inputs.storage_root(n), pair, fw_order, sources)
        for n, pair in scoped
    ]
    return records.CompiledSavedTensors(
        _checkpointed(all_records, graphs, bw_order, fw_order), stock_pareto=stock_pareto(), fw_len=fw_len, bw_len=bw_len
    )


def _checkpointed(
    saved: list[records.SavedTensorRecord], graphs: _GraphPair, bw_order: dict[fx.Node, int], fw_order: dict[fx.Node, int]
) -> list[records.SavedTensorRecord]:
    """The saved tensors' records with their part in activation checkpointing
    (``checkpointed.role``), and after them a record of each tensor a checkpoint recomputes
    instead (decided ``recomputed`` by ``"checkpoint"``; no phase sees these)."""
    for r in saved:
        r.checkpoint = checkpointed.role(r.fw_node)
    extra = []
    for node, why in checkpointed.recomputed(graphs.fw_module.graph, graphs.bw_module.graph):
        r = collect.collect(node, None, bw_order, None, act_inputs.storage_root(node), None, fw_order, graphs.sources)
        r.leave(records.DecidedBy.CHECKPOINT, why, records.RECOMPUTED)
        r.node = None  # not a saved tensor of this graph pair: no phase reads it
        extra.append(r)
    return saved + extra


def _prepare(
    graphs: _GraphPair, candidates: list[records.SavedTensorRecord]
) -> tuple[activation_budget.GraphFacts, set[fx.Node] | None, dict[fx.Node, str | None]]:
    """Phases filter, select and alias: what each candidate's hooks may see and take (a pair
    that cannot be keyed raises first, before any decision).  Returns the facts the budget's
    plans read, and upstream's filtering mode's allowed set and the forward's inputs."""
    fw_module, saved_tensors = graphs.fw_module, graphs.saved_tensors
    allowed = selection.filtered_by_mode(
        fw_module, graphs.bw_module, saved_tensors, graphs.num_inner_fwd_outputs, graphs.static_input_indices
    )
    inputs = act_inputs.activation_inputs(fw_module, graphs.inner_meta, graphs.static_input_indices, graphs.num_inner_fwd_outputs)
    if allowed is not None:  # "donated": also the activations packing frees (see module)
        allowed |= {s for s in saved_tensors if inputs.get(act_inputs.storage_root(s), "") is None}
    for pair in dict.fromkeys(r.scope_pair for r in candidates):
        hook_tracing.check_keyable(pair)
    budgeted = any(r.scope_pair.kind.budget is not None for r in candidates)
    output_aliases = (
        selection.output_aliases(fw_module, graphs.bw_module, saved_tensors, graphs.num_inner_fwd_outputs)
        if allowed is not None and budgeted
        else set()
    )
    selection.filter_hookable(candidates, allowed, inputs, output_aliases)
    selection.resolve_select(candidates)
    selection.mark_aliases(candidates)
    facts = activation_budget.GraphFacts(
        fw_module.graph,
        graphs.bw_module.graph,
        graphs.bw_inputs,
        inputs,
        graphs.held,
        saved_tensors,
        {r.fw_node: r for r in candidates},
        tuple(
            collect.input_source_name(ph, graphs.sources) or ph.name
            for ph in act_inputs.autograd_inputs(fw_module, graphs.inner_meta, graphs.static_input_indices)
        ),
        graphs.partition or PartitionTerms(),
    )
    return facts, allowed, inputs


def _decide(
    graphs: _GraphPair, candidates: list[records.SavedTensorRecord], compiled: records.CompiledSavedTensors
) -> tuple[dict[fx.Node, Any], dict[fx.Node, fx.Node]]:
    """Phases filter, select, alias (:func:`_prepare`) and plan: each candidate's decision.
    Returns the tensors the budget recomputes (their recipes) and the aliases packed with
    their root."""
    facts, allowed, inputs = _prepare(graphs, candidates)
    # Budget pairs (torch_patches.hooks.budget, config.activation_memory_budget): each saved
    # tensor in their scope takes the storage option its plan chose, or is kept.
    recomputed, compiled.plans = activation_budget.apply_plans(candidates, facts)
    if allowed is not None:
        selection.drop_partially_hooked(candidates, graphs.saved_tensors, inputs)
    return recomputed, selection.settle_aliases(candidates)


def trial_plans(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    partition: PartitionTerms,
    *,
    context: tuple[int, Any, Any, list[int]],
    ambient: HookPair,
) -> tuple[list[Plan], list[records.SavedTensorRecord]]:
    """The budget plans the phases would fit to this graph pair for the ``ambient`` pair
    under the partition choice's terms, with the step's peak each predicts, and the saved
    tensors' records; nothing traced, written, published or warned (the partition choice's
    trial: ``activation_budget.partition_choice``).  ``context``: the graph pair's number of
    forward outputs, ``ViewAndMutationMeta``, AOT config and static input indices."""
    num_inner_fwd_outputs, inner_meta, aot_config, static_input_indices = context
    held = act_inputs.held_by_caller(fw_module, inner_meta, static_input_indices)
    graphs = _GraphPair(fw_module, bw_module, num_inner_fwd_outputs, inner_meta, aot_config, static_input_indices, held, partition)
    compiled = _collect(graphs, ambient, publish=False)
    if compiled is None:
        return [], []
    candidates = [r for r in compiled.records if r.pair is not None]
    facts, _, _ = _prepare(graphs, candidates)
    fitted = activation_budget.fit_plans(candidates, facts, trial=True)
    saved = [r for r in compiled.records if r.decided_by != records.DecidedBy.CHECKPOINT]  # not checkpointed.recomputed's
    return [result for pair, result, _, _ in fitted if pair.label == ambient.label], saved


def _trace(graphs: _GraphPair, candidates: list[records.SavedTensorRecord]) -> list[graph_surgery.SavedPlan]:
    """Phase trace: every hooked tensor's pack and unpack traced (nothing modified yet),
    checked against the saved tensor, and planned for the rewrite."""
    bw_g = graphs.bw_module.graph
    # Tensors the hooks read, runtime inputs of the graphs (_dynamo/symbolic_convert.py for
    # the ambient hooks, _dynamo/region_scopes.py for in-region scopes), by pair label.
    lifted = _hook_inputs(graphs.fw_module, graphs.inner_meta, [r.chosen_pair for r in candidates if r.hooked])
    # One trace per hook and saved-tensor metadata: a 12-block model saves the same shapes
    # in every block, and tracing is most of the inliner's compile time.
    traces: dict[Any, tuple[hook_tracing.Traced, hook_tracing.Traced]] = {}
    plans: list[graph_surgery.SavedPlan] = []
    for r in candidates:
        if not r.hooked:
            continue
        saved, pair = r.fw_node, r.chosen_pair
        val = saved.meta["val"]
        key = hook_tracing.trace_key(pair, val)
        if key in traces:
            pack, unpack = traces[key]
        else:
            context = hook_tracing.HookContext(_fw_graph=saved.graph, _bw_graph=bw_g, _node=saved)
            pack, unpack = hook_tracing.trace_pair(
                pair, val, aot_config=graphs.aot_config, saved=saved, context=context, inputs=lifted.get(pair.label, ((), ()))[0]
            )
            if not context.read:  # the traces do not depend on which saved tensor this is
                traces[key] = (pack, unpack)
        if pack.layout is not None:
            r.reason = f"packed as {pack.layout.describe()}, flattened between the graphs"
        r.packed_bytes = _device_bytes(pack.out_vals, val.device)
        out = unpack.out_vals
        if isinstance(out, (tuple, list)) and len(out) == 1:
            out = out[0]
        restride = hook_tracing.check_unpacked(out, val, pair, saved)
        plans.append(graph_surgery.SavedPlan(saved, pair, pack, unpack, restride, r, lifted.get(pair.label, ((), ()))[1]))
    # The host tensors the backward reloads (cpu_offload): their graph's backward node starts
    # them ahead, from the graph autograd runs before it (offload_prefetch).
    reloads = [cast(fx.Node, n.args[0]) for p in plans for n in graph_surgery.reload_starts(p.unpack.gm)]
    offload_prefetch.mark(graphs.inner_meta, len(reloads), sum(map(hook_utils.nbytes_of, reloads)))
    return plans


def _rewrite(
    graphs: _GraphPair,
    plans: list[graph_surgery.SavedPlan],
    candidates: list[records.SavedTensorRecord],
    recomputed: dict[fx.Node, Any],
    aliases: dict[fx.Node, fx.Node],
) -> None:
    """Phase rewrite: each pack after its tensor's last forward use, each unpack (or
    recomputation) before its first backward use, and the saved outputs and backward inputs
    rewired in AOTAutograd's calling convention."""
    fw_module, bw_module, bw_inputs = graphs.fw_module, graphs.bw_module, graphs.bw_inputs
    fw_g, bw_g = fw_module.graph, bw_module.graph
    placement = config.hook_placement
    if placement not in ("use", "boundary"):
        raise SavedTensorsHookConfigError(f"torch_patches.config.hook_placement must be 'use' or 'boundary', got {placement!r}")
    # The artifact's text is the graphs' readable code, printed as it is collected: only
    # where a structured trace is written (as ``trace_structured`` decides: a handler on
    # its logger), decided once for the graphs before and after.
    structured: list[str] | None = [] if trace_log.handlers else None
    _log_graphs(fw_module, bw_module, graphs.aot_config, "pre", structured)
    graph_surgery.merge_aliases(fw_module, bw_inputs, graphs.num_inner_fwd_outputs, aliases)
    fw_order = {n: i for i, n in enumerate(fw_g.nodes)}
    bw_order = {n: i for i, n in enumerate(bw_g.nodes)}
    packed_leaves: dict[fx.Node, list[Any]] = {}
    fw_tail: dict[fx.Node, fx.Node] = {}  # anchor -> last node inserted after it
    for plan in plans:
        packed_leaves[plan.saved] = graph_surgery.insert_pack(plan, fw_module, bw_g, fw_order, placement, fw_tail)
    bw_input_of: dict[fx.Node, fx.Node] = {}
    lifted_fw = tuple(dict.fromkeys(n for p in plans for n in p.fw_inputs))
    lifted_bw = _backward_inputs(bw_g, lifted_fw) if any(p.unpack.num_inputs for p in plans) else ()
    for plan in plans:
        plan.bw_inputs = tuple(lifted_bw[lifted_fw.index(n)] for n in plan.fw_inputs)
        bw_input_of |= graph_surgery.insert_unpack(
            plan,
            bw_module,
            fw_g,
            bw_inputs[plan.saved.name],
            packed_leaves[plan.saved],
            bw_order,
            placement,
        )
    extra_inputs: dict[fx.Node, fx.Node] = {}
    for r in candidates:
        if r.node in recomputed:
            recipe = recomputed[r.node]
            packed_leaves[r.node] = graph_surgery.insert_recompute(
                r.node, recipe.nodes, recipe.frontier, r.scope_pair.label, bw_module, bw_inputs, bw_order, extra_inputs
            )
    bw_input_of |= extra_inputs
    read_back = []  # hook inputs the backward reads (unpack): saved for it
    for fw_node, bw_node in zip(lifted_fw, lifted_bw):
        if bw_node.users:
            bw_input_of[fw_node] = bw_node
            read_back.append(fw_node)
        else:
            bw_g.erase_node(bw_node)
    graph_surgery.rewire_saved(fw_module, bw_module, graphs.num_inner_fwd_outputs, packed_leaves, bw_input_of, bw_inputs, read_back)
    graph_surgery.drop_dead_recomputed(fw_g, [n for recipe in recomputed.values() for n in recipe.nodes])
    fw_g.lint()
    bw_g.lint()
    fw_module.recompile()
    bw_module.recompile()
    _log_graphs(fw_module, bw_module, graphs.aot_config, "post", structured)


def _donate(graphs: _GraphPair) -> None:
    """Phase donate (after the rewrite, on the graphs as they now are): the saved activation
    inputs the backward may write their gradients over (``donated_inputs``)."""
    fw_module, bw_module, num = graphs.fw_module, graphs.bw_module, graphs.num_inner_fwd_outputs
    saved = [n for n in hook_utils.graph_outputs(fw_module.graph)[num:] if isinstance(n, fx.Node)]
    inputs = act_inputs.activation_inputs(fw_module, graphs.inner_meta, graphs.static_input_indices, num)
    bw_inputs = graph_surgery.saved_backward_inputs(fw_module, bw_module, num)
    donated = donated_inputs.donatable(fw_module.graph, bw_module.graph, saved, bw_inputs, inputs)
    if donated:
        names = ", ".join(n.name for n in donated)
        graphs.artifact.info(
            "saved inputs handed to the backward that computes their gradients (written over where the caller dropped them): %s", names
        )
        donated_inputs.donate(fw_module, bw_module, num, donated)


def _log_inlined(graphs: _GraphPair) -> None:
    if graphs.artifact.isEnabledFor(logging.DEBUG):
        graphs.artifact.debug("forward graph with inlined hooks:\n%s", graphs.fw_module.print_readable(False))
        graphs.artifact.debug("backward graph with inlined hooks:\n%s", graphs.bw_module.print_readable(False))


def _hook_inputs(
    fw_module: fx.GraphModule, inner_meta: Any, pairs: list[HookPair]
) -> dict[str, tuple[tuple[torch.Tensor, ...], tuple[fx.Node, ...]]]:
    """For each of ``pairs`` (by label) whose hooks read tensors Dynamo made graph inputs
    (``CompileFacts.hook_inputs``): those tensors, and the forward's placeholder for each.

    Dynamo's graph inputs are the forward's, one to one, when AOTAutograd's input
    descriptors number the placeholders; where they do not (tensor-subclass inputs, effect
    tokens) no input can be matched, and the hooks fall back to eager hooks rather than
    compute with the value seen while compiling."""
    found = compile_facts.facts()
    by_label = {p.label: p for p in pairs}
    lifted = [e for e in (found.hook_inputs if found is not None else ()) if e[0] in by_label]
    if not lifted:
        return {}
    placeholders, infos = act_inputs.described_placeholders(fw_module, inner_meta)
    out: dict[str, tuple[tuple[torch.Tensor, ...], tuple[fx.Node, ...]]] = {}
    for label, t, dynamo_node in lifted:
        pair = by_label[label]
        dynamo_inputs = dynamo_node.graph.find_nodes(op="placeholder")
        if dynamo_node not in dynamo_inputs or not len(dynamo_inputs) == len(placeholders) == len(infos):
            raise hook_tracing.hook_error(
                pair.pack if t.role == "pack" else pair.unpack,
                f"{t.describe()} (a tensor it reads) cannot be matched to the forward graph's "
                f"inputs ({len(placeholders)} placeholders for {len(dynamo_inputs)} Dynamo inputs)",
                role=t.role,
                pair=pair,
                saved=None,
            )
        tensors, nodes = out.get(label, ((), ()))
        node = placeholders[dynamo_inputs.index(dynamo_node)]
        if node not in nodes:
            out[label] = ((*tensors, t.tensor), (*nodes, node))
    return out


def _backward_inputs(bw_g: fx.Graph, fw_nodes: tuple[fx.Node, ...]) -> tuple[fx.Node, ...]:
    """A backward input for each hook input the forward saves for it (same name)."""
    first = next(n for n in bw_g.nodes if n.op != "placeholder")
    out = []
    with bw_g.inserting_before(first):
        for fw_node in fw_nodes:
            node = bw_g.placeholder(fw_node.name)
            node.meta = {k: v for k, v in fw_node.meta.items() if k in ("val", "tensor_meta")}
            out.append(node)
    return tuple(out)


def _device_bytes(packed: Any, device: torch.device) -> int:
    """Bytes of the packed form's tensors on ``device`` (an offloaded copy holds none)."""
    total = 0
    for leaf in pytree.tree_leaves(packed):
        if isinstance(leaf, torch.Tensor) and leaf.device == device:
            total += hook_utils.size_hint(leaf.numel()) * leaf.element_size()
    return total


def _log_graphs(fw_module: fx.GraphModule, bw_module: fx.GraphModule, aot_config: Any, when: str, out: list[str] | None) -> None:
    """Upstream's logs of the graphs before (``when="pre"``) and after inlining.

    As upstream's inliner: ``aot_graphs`` log lines and, after inlining, one structured-trace
    artifact ``aot_saved_tensors_hooks_graphs`` (tlparse) holding the four graphs. Upstream's
    ``maybe_log_graph`` decides (``aot_config.enable_log``) and formats. ``out`` collects the
    artifact's text; ``None`` where no structured trace is written.
    """
    from torch._functorch._aot_autograd import graph_compile as gc

    log_graph = getattr(gc, "maybe_log_graph", None)
    if log_graph is None or aot_config is None or not getattr(aot_config, "enable_log", False):
        return
    label = "pre saved_tensors_hooks inlining" if when == "pre" else "after saved_tensors_hooks inlining"
    for gm, which in ((fw_module, "forward"), (bw_module, "backward")):
        prefix = f"aot_{which}_graph_{when}_saved_tensors_hooks"
        log_graph(gm, f"{which.capitalize()} graph {label}", aot_config, lambda p=prefix: p, out)
    if out is not None and when != "pre":
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "aot_saved_tensors_hooks_graphs", "encoding": "string"},
            payload_fn=lambda: "\n".join(out),
        )
