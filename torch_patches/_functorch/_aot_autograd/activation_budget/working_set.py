"""What a compiled graph pair holds besides its saved tensors, and the step's peak a plan
predicts from it.

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
  the zeros autograd makes for outputs the caller dropped where it hands the compiled
  backward its gradients in a list the backward empties (:func:`dropped_tangents`).
  Under Inductor a pointwise op all of whose readers are pointwise ops or reductions is
  fused into them and never materialised (:func:`materialized`): counted as nothing, and
  what it reads stays alive until the kernel it is fused into has run (:func:`kernel_ends`).
* :func:`predicted_peak`: the most a fitted plan's saved storages and the graphs' own
  tensors hold at once, forward and backward, with where.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.utils import is_incoming_gradient, nbytes_of


__all__ = ["dropped_tangents", "held_bytes", "kernel_ends", "materialized", "predicted_peak"]


def _tagged(node: fx.Node, *tags: Any) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and any(t in target.tags for t in tags)


def _pointwise(node: fx.Node) -> bool:
    return _tagged(node, torch.Tag.pointwise)


#: Ops that are not tagged pointwise but that Inductor lowers as pointwise kernels reading
#: their input at computed indices, so a pointwise op they read is fused into them (the
#: cross-entropy's gather from the log-softmax, never materialised in the forward).
_INDEXED_LOADS = frozenset({torch.ops.aten.gather.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default})


def _fuses_pointwise(node: fx.Node) -> bool:
    """Whether Inductor fuses a pointwise op that ``node`` reads into ``node``'s kernel."""
    return _tagged(node, torch.Tag.pointwise, torch.Tag.reduction) or node.target in _INDEXED_LOADS


def _is_view(node: fx.Node) -> bool:
    return act_inputs.storage_root(node) is not node or node.target is operator.getitem


def materialized(node: fx.Node) -> bool:
    """Whether ``node``'s output is a buffer of its own (not a view, not fused away): an op
    that is not pointwise, or a pointwise one read (through views) by something Inductor
    does not fuse it into: not a pointwise op, a reduction or an indexed load (a matmul,
    attention, the graph's output)."""
    if node.op == "placeholder":
        return True
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor) or _is_view(node):
        return False
    if not _pointwise(node):
        return True
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and _is_view(user):
            stack.extend(user.users)
        elif not _fuses_pointwise(user):
            return True
    return False


def kernel_ends(graph: fx.Graph) -> list[int]:
    """Per node position, where the kernel computing it ends: its own position for a
    materialised node, else the latest of its readers' (a fused op runs inside the kernel of
    what reads it, and a view is read where its readers run).  What a fused op reads is alive
    until that kernel has run: the kernel's output is allocated while its inputs still are."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = list(range(len(nodes)))
    for n in reversed(nodes):
        if n.op == "call_function" and not materialized(n) and n.users:
            out[pos[n]] = max(out[pos[u]] if u.op != "output" else len(nodes) - 1 for u in n.users)
    return out


def dropped_tangents(bw_g: fx.Graph) -> set[fx.Node]:
    """The incoming gradients of a backward that are most likely zeros autograd makes for
    outputs the caller dropped, and that die at their last use: where autograd hands a
    compiled backward its gradients in a list the backward empties (``boxed_grads_call``,
    torch 2.13 on), those zeros are held by nothing else (a real gradient stays in the
    engine's buffer for the call).  Which outputs the caller drops is known at runtime
    only; a forward returning a scalar that requires grad (a 0-dim incoming gradient) returns
    its step's loss, and its other outputs are taken as dropped (HF's logits and cache beside
    the loss)."""
    if not hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed"):
        return set()
    tangents = [n for n in bw_g.find_nodes(op="placeholder") if is_incoming_gradient(n)]
    vals = [n.meta.get("val") for n in tangents]
    if not any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vals):
        return set()
    return {n for n, v in zip(tangents, vals) if isinstance(v, torch.Tensor) and v.dim() > 0}


def held_bytes(graph: fx.Graph, excluded: Iterable[fx.Node] = (), inputs: bool = True, dropped: Iterable[fx.Node] = ()) -> list[int]:
    """Bytes of ``graph``'s own tensors alive right after each node (see the module);
    ``excluded``: nodes whose storages are not counted (the saved tensors); ``inputs``:
    whether the graph's inputs count (a backward's incoming gradients do, to the graph's end:
    autograd passes them to the compiled backward in arguments it holds until the call
    returns; a forward's inputs were held by the caller before the step); ``dropped``:
    inputs that die at their last use instead (:func:`dropped_tangents`)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    skip = {act_inputs.storage_root(n) for n in excluded}
    dropped = set(dropped)
    end = len(nodes)
    ends = kernel_ends(graph)
    last: dict[fx.Node, int] = {}
    for n in nodes:
        for arg in n.all_input_nodes:
            root = act_inputs.storage_root(arg)
            last[root] = max(last.get(root, -1), end if n.op == "output" else ends[pos[n]])
    diff = [0] * (end + 1)
    for n in nodes:
        if n in skip or not materialized(n) or (n.op == "placeholder" and not inputs):
            continue
        nbytes = nbytes_of(n)
        if nbytes:
            diff[pos[n]] += nbytes
            # An input lives to the graph's end: autograd holds a backward's incoming
            # gradients in the arguments of the call until it returns.
            held_to_end = n.op == "placeholder" and n not in dropped
            diff[end if held_to_end else min(end, max(last.get(n, pos[n]), pos[n]) + 1)] -= nbytes
    out, total = [], 0
    for d in diff[:end]:
        total += d
        out.append(total)
    return out


def predicted_peak(plan: Any, fw_g: fx.Graph, bw_g: fx.Graph, saved: list[fx.Node], bw_saved: list[fx.Node]) -> tuple[int, str]:
    """The most ``plan``'s saved storages and the graphs' own tensors hold at once, and
    where (in words).  ``saved``: the forward's saved tensors, ``bw_saved``: their backward
    inputs.  In the forward a planned storage is full until its last forward use and in its
    stored form after; a storage the plan cannot store otherwise is full from where it is
    made.  In the backward each storage is as the plan's timeline has it."""
    fw_nodes, bw_nodes = list(fw_g.nodes), list(bw_g.nodes)
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    fw_held = held_bytes(fw_g, saved, inputs=False)
    bw_held = held_bytes(bw_g, bw_saved, dropped=dropped_tangents(bw_g))
    bw_ends = kernel_ends(bw_g)
    diff = [0] * (len(fw_nodes) + 1)
    planned = set()
    for c in plan.choices:
        roots = {act_inputs.storage_root(m) for m in c.members}
        planned |= roots
        born = min(fw_pos[r] for r in roots)
        used = max([fw_pos[u] for m in c.members for u in m.users if u.op != "output"] + [born])
        diff[born] += c.nbytes
        diff[used + 1] += c.chosen.device_bytes - c.nbytes
    for root in {act_inputs.storage_root(s) for s in saved} - planned:
        if root.op != "placeholder":  # graph inputs are held by the caller before the step
            diff[fw_pos[root]] += nbytes_of(root)
    best, where, total = -1, "", 0
    for i, d in enumerate(diff[: len(fw_nodes)]):
        total += d
        if total + fw_held[i] > best:
            best, where = total + fw_held[i], f"forward node {fw_nodes[i].name}"
    diff = [0] * (len(bw_nodes) + 1)
    # A storage the forward makes and returns once, as a saved tensor, reaches the backward
    # donated; one it also returns as an output (or a view of it), saves twice, or takes as
    # an input (an activation another graph made), does not.
    returned = collections.Counter(
        act_inputs.storage_root(a) for a in fw_nodes[-1].args[0] if isinstance(a, fx.Node)
    ) if fw_nodes and fw_nodes[-1].op == "output" else collections.Counter()

    def freed(last: int, nbytes: int = 0) -> int:
        """After the kernel of its last reader; for a donated storage (``nbytes`` given)
        whose last reader's kernel is a pointwise one with an output of its bytes, at it:
        Inductor writes the output in place of the dying input."""
        if last >= len(bw_nodes):
            return len(bw_nodes)
        kernel = bw_ends[last]
        node = bw_nodes[kernel]
        if nbytes and _pointwise(node) and materialized(node) and nbytes_of(node) == nbytes:
            return kernel
        return min(len(bw_nodes), kernel + 1)

    for c in plan.choices:
        diff[0] += c.chosen.device_bytes
        diff[c.span.first] += c.nbytes - c.chosen.device_bytes
        donated = all(returned[act_inputs.storage_root(m)] == 1 and act_inputs.storage_root(m).op != "placeholder" for m in c.members)
        diff[freed(c.span.last, c.nbytes if donated else 0)] -= c.nbytes
    for span, nbytes in plan.fixed:
        diff[0] += nbytes
        diff[freed(span.last)] -= nbytes
    total = plan.ahead_bytes
    for i, d in enumerate(diff[: len(bw_nodes)]):
        total += d
        if total + bw_held[i] > best:
            best, where = total + bw_held[i], f"backward node {bw_nodes[i].name}"
    return best, where
