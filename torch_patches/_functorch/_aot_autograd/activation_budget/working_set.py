"""What a compiled graph pair holds besides its saved tensors.

A plan bounds the saved tensors; the step's peak is those plus what the graphs hold at the
same time: in the backward the incoming gradients (tangents, zeros for outputs the caller
dropped included), the gradients it computes and keeps (every parameter's, returned at the
end), and its intermediates; in the forward its intermediates and outputs.  This module
reads them off the graphs (compile time, pure fx):

* :func:`held_bytes`: per node position, the bytes of the graph's own tensors alive right
  after that node runs, storages counted once (views share their base's), the saved tensors
  left out (the plan models them).  A tensor is alive from the node that makes it to the
  last node reading it (or one of its views); an output of the graph to the graph's end, and
  so is an input (a backward's incoming gradients, held by autograd for the call), except
  where autograd hands the compiled backward its gradients in a list the backward empties
  (:func:`dropped_tangents`): then they die at their last use.
  Under Inductor a pointwise op all of whose readers are pointwise ops or reductions is
  fused into them and never materialised (:func:`materialized`): counted as nothing, and
  what it reads stays alive until the kernel it is fused into has run (:func:`kernel_ends`).

The step's peak a plan predicts from them is :mod:`.step_peak`'s.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.utils import is_incoming_gradient, nbytes_of

__all__ = [
    "addmm_add",
    "dropped_tangents",
    "held_bytes",
    "kernel_ends",
    "kernel_inputs",
    "kernels_reading",
    "materialized",
    "pointwise",
    "storage_of",
]


def _tagged(node: fx.Node, *tags: Any) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and any(t in target.tags for t in tags)


def pointwise(node: fx.Node) -> bool:
    """Whether ``node`` is an op torch tags pointwise."""
    return _tagged(node, torch.Tag.pointwise)


#: Ops that are not tagged pointwise but that Inductor lowers as pointwise kernels reading
#: their input at computed indices, so a pointwise op they read is fused into them (the
#: cross-entropy's gather from the log-softmax, never materialised in the forward).
_INDEXED_LOADS = frozenset({torch.ops.aten.gather.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default})


def addmm_add(node: fx.Node) -> bool:
    """An ``add`` of a matmul's output (read by nothing else) and a tensor: Inductor lowers
    the pair as one ``addmm`` (its post-grad pattern), a matmul kernel writing the sum: the
    matmul's own output is never made, and the add is not fused into its readers."""
    if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2:
        return False
    if node.kwargs.get("alpha", 1) != 1:
        return False
    a, b = node.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    for mm, other in ((a, b), (b, a)):
        if mm.op == "call_function" and mm.target is torch.ops.aten.mm.default and len(mm.users) == 1:
            out, inp = mm.meta.get("val"), other.meta.get("val")
            if (
                isinstance(out, torch.Tensor)
                and isinstance(inp, torch.Tensor)
                and inp.dtype == out.dtype
                and inp.shape in (out.shape, out.shape[-1:])
            ):
                return True
    return False


def _fused_into_addmm(node: fx.Node) -> bool:
    """A matmul whose one reader is an add Inductor lowers with it as one ``addmm``."""
    return node.target is torch.ops.aten.mm.default and len(node.users) == 1 and addmm_add(next(iter(node.users)))


def _fuses_pointwise(node: fx.Node) -> bool:
    """Whether Inductor fuses a pointwise op that ``node`` reads into ``node``'s kernel."""
    if addmm_add(node):
        return False
    return _tagged(node, torch.Tag.pointwise, torch.Tag.reduction) or node.target in _INDEXED_LOADS


def _is_view(node: fx.Node) -> bool:
    """A view of another node's storage: a view op, or one result of a view op or of a
    functionalized mutation (``_root``).  One result of any other multi-output op (the
    attention's output, a norm's) is a buffer that op's kernel made."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        made_by = node.args[0]
        return (
            made_by.op != "call_function"
            or getattr(made_by.target, "is_view", False)
            or made_by.target in _FUNCTIONALIZED
            or storage_of(node) is not node
        )
    return act_inputs.storage_root(node) is not node


_FUNCTIONALIZED = tuple(
    op
    for op in (
        getattr(torch.ops.higher_order, "auto_functionalized", None),
        getattr(torch.ops.higher_order, "auto_functionalized_v2", None),
    )
    if op is not None
)


def storage_of(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` reads (``activation_inputs.storage_root``), where a
    functionalized mutation's results (``auto_functionalized``: the op's output, then the
    mutated inputs) are the inputs it mutated: Inductor writes them back in place."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        op, index = node.args[0], node.args[1]
        if op.target in _FUNCTIONALIZED and isinstance(index, int) and index >= 1:
            bases = cast("Sequence[Any] | None", op.kwargs.get("_all_bases"))
            if bases is None:  # v1: the mutated arguments, in the op's schema order
                schema = cast(torch._ops.OpOverload, op.args[0])._schema
                bases = [op.kwargs[a.name] for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            if index - 1 < len(bases) and isinstance(bases[index - 1], fx.Node):
                return storage_of(bases[index - 1])
    return act_inputs.storage_root(node)


def _runs_in_place(node: fx.Node) -> bool:
    """A node that is a kernel of its own but makes no tensor of its own: a functionalized
    mutation (written back in place), or a multi-output op (its results are its getitems)."""
    return node.op == "call_function" and node.target is not operator.getitem and not isinstance(node.meta.get("val"), torch.Tensor)


def materialized(node: fx.Node, packed: bool = False) -> bool:
    """Whether ``node``'s output is a buffer of its own (not a view, not fused away): an op
    that is not pointwise, or a pointwise one read (through views) by something Inductor
    does not fuse it into: not a pointwise op, a reduction or an indexed load (a matmul,
    attention, the graph's output).  ``packed``: as a saved tensor packed into a stored
    form, which the graph returns in its place (so its output reads it in the pack's
    kernel)."""
    if node.op == "placeholder":
        return True
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor) or _is_view(node):
        return False
    if _fused_into_addmm(node):
        return False
    if not pointwise(node) or addmm_add(node):
        return True
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and _is_view(user):
            stack.extend(user.users)
        elif not _fuses_pointwise(user) and not (packed and user.op == "output"):
            return True
    return False


def kernel_ends(graph: fx.Graph, order: list[fx.Node] | None = None) -> list[int]:
    """Per node position (in ``order``, default the graph's), where the kernel computing it
    ends: its own position for a materialised node, else the latest of its readers' (a fused
    op runs inside the kernel of what reads it, and a view is read where its readers run).
    What a fused op reads is alive until that kernel has run: the kernel's output is
    allocated while its inputs still are."""
    nodes = list(graph.nodes) if order is None else order
    pos = {n: i for i, n in enumerate(nodes)}
    out = list(range(len(nodes)))
    for n in reversed(nodes):
        if n.op == "call_function" and not materialized(n) and not _runs_in_place(n) and n.users:
            out[pos[n]] = max(out[pos[u]] if u.op != "output" else len(nodes) - 1 for u in n.users)
    return out


def kernel_inputs(node: fx.Node) -> list[fx.Node]:
    """The storages ``node``'s kernel reads: its inputs' roots, through the pointwise ops
    fused into it."""
    out, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        arg = stack.pop()
        root = storage_of(arg)
        if root in seen:
            continue
        seen.add(root)
        if materialized(root):
            out.append(root)
        elif root.op == "call_function":
            stack.extend(root.all_input_nodes)
    return out


def _reused_input(
    node: fx.Node,
    nbytes: int,
    pos: dict[fx.Node, int],
    free_at: dict[fx.Node, int],
    ends: list[int],
    donated: set[fx.Node],
    readers: dict[fx.Node, set[fx.Node]] | None = None,
) -> fx.Node | None:
    """The input buffer a pointwise kernel writes its output over (Inductor's in-place
    buffers): one of its kernel's inputs of the same bytes, made in the graph (or donated to
    it), freed right after this kernel and not yet taken over; None where there is none (an
    extern kernel, a reduction, or every input lives on).  ``readers``
    (:func:`kernels_reading`), where given: only an input this node's kernel alone reads
    (a fused kernel with two nodes reading the input writes neither over it)."""
    if node.op != "call_function" or not pointwise(node) or addmm_add(node):
        return None
    here = ends[pos[node]] + 1
    for root in kernel_inputs(node):
        if (
            (root.op != "placeholder" or root in donated)
            and free_at.get(root) == here
            and nbytes_of(root) == nbytes
            and (readers is None or readers.get(root) == {node})
        ):
            return root
    return None


def dropped_tangents(bw_g: fx.Graph) -> set[fx.Node]:
    """The incoming gradients of a backward that die at their last use: where autograd
    hands a compiled backward its gradients in a list the backward empties
    (``boxed_grads_call``, torch 2.13 on), the engine keeps none of them: the zeros it makes
    for outputs the caller dropped (HF's logits and cache beside the loss) and the real
    gradients of the outputs the step reads (the logits' gradient a loss compiled apart
    computes, a block's output's under per-block compilation) alike.  A 0-dim gradient (a
    loss's) is left out: it is the engine's seed, and too small to matter."""
    if not hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed"):
        return set()
    tangents = [n for n in bw_g.find_nodes(op="placeholder") if is_incoming_gradient(n)]
    return {n for n in tangents if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0}


def held_bytes(
    graph: fx.Graph,
    excluded: Iterable[fx.Node] = (),
    inputs: bool = True,
    dropped: Iterable[fx.Node] = (),
    order: list[fx.Node] | None = None,
    donated: Iterable[fx.Node] = (),
) -> list[int]:
    """Bytes of ``graph``'s own tensors alive right after each node (see the module);
    ``excluded``: nodes whose storages are not counted (the saved tensors: the plan's; one a
    pointwise kernel writes over an input only that kernel reads takes over the input's
    bytes, which stop counting where it is made); ``inputs``:
    whether the graph's inputs count (a backward's incoming gradients do, to the graph's end:
    autograd passes them to the compiled backward in arguments it holds until the call
    returns; a forward's inputs were held by the caller before the step); ``dropped``:
    inputs that die at their last use instead (:func:`dropped_tangents`); ``order``: the
    order the nodes run in (default the graph's; ``inductor_order.inductor_order``), which the result's
    positions follow; ``donated``: inputs a kernel may write its output over where they die
    in it (saved tensors the compiled backward owns)."""
    nodes = list(graph.nodes) if order is None else order
    pos = {n: i for i, n in enumerate(nodes)}
    skip = {storage_of(n) for n in excluded}
    dropped, donated = set(dropped), set(donated)
    end = len(nodes)
    ends = kernel_ends(graph, order)
    readers = kernels_reading(graph) if any(n.op == "call_function" for n in skip) else {}
    last: dict[fx.Node, int] = {}
    for n in nodes:
        for arg in n.all_input_nodes:
            root = storage_of(arg)
            last[root] = max(last.get(root, -1), end if n.op == "output" else ends[pos[n]])
    diff = [0] * (end + 1)
    free_at: dict[fx.Node, int] = {}
    for n in nodes:
        if n in skip and materialized(n):
            # Not counted here, but it may be written in place of an input that dies in
            # its kernel: that input's bytes become its own from there.  Only an input its
            # kernel alone reads (the thin MLP's forward end keeps a buffer two nodes of one
            # kernel read); the graph's own tensors keep the plain rule, which the
            # backward's measured peaks follow (the stricter one over-predicted them).
            nbytes = nbytes_of(n)
            reused = _reused_input(n, nbytes, pos, free_at, ends, donated, readers)
            if reused is not None:
                diff[free_at.pop(reused)] += nbytes
                diff[pos[n]] -= nbytes
            continue
        if n in skip or not materialized(n) or (n.op == "placeholder" and not inputs):
            continue
        nbytes = nbytes_of(n)
        if nbytes:
            # An input lives to the graph's end: autograd holds a backward's incoming
            # gradients in the arguments of the call until it returns.
            held_to_end = n.op == "placeholder" and n not in dropped
            free_at[n] = end if held_to_end else min(end, max(last.get(n, pos[n]), pos[n]) + 1)
            reused = _reused_input(n, nbytes, pos, free_at, ends, donated)
            if reused is not None:  # written in place of an input that dies in its kernel
                diff[free_at.pop(reused)] += nbytes
            else:
                diff[pos[n]] += nbytes
            diff[free_at[n]] -= nbytes
    out, total = [], 0
    for d in diff[:end]:
        total += d
        out.append(total)
    return out


def kernels_reading(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """Per storage root, the nodes whose kernels read it (a fused reader's kernel is that of
    what reads it; the output node reads what the graph returns)."""
    memo: dict[fx.Node, set[fx.Node]] = {}

    def kernels(u: fx.Node) -> set[fx.Node]:
        if u not in memo:
            if u.op == "output" or materialized(u) or _runs_in_place(u) or u.op != "call_function" or not u.users:
                memo[u] = {u}
            else:
                memo[u] = set().union(*(kernels(w) for w in u.users))
        return memo[u]

    out: dict[fx.Node, set[fx.Node]] = collections.defaultdict(set)
    for n in reversed(list(graph.nodes)):
        for arg in n.all_input_nodes:
            out[storage_of(arg)] |= kernels(n)
    return out
