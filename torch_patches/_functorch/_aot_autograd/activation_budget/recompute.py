"""The budget's recompute option: which forward ops the backward may run again to rebuild a
saved tensor instead of saving it (:class:`Recipe`), what that costs, and the choices that
get a ``recompute`` option (:func:`with_recipes`).

A recipe copies at most :data:`RECOMPUTE_MAX_NODES` forward ops, none random or mutating
nor kept by a selective checkpoint's policy (``MUST_SAVE``), reading saved tensors the backward gets exact (the plan pins them to ``keep``) and inputs
the caller keeps (parameters, buffers, leaves).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Set
from typing import cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.activation_budget.cost_model import Rates, _node_ms
from torch_patches._functorch._aot_autograd.activation_budget.solver import RECOMPUTE, Choice, Option
from torch_patches._functorch._aot_autograd.utils import nbytes_of

#: The most forward ops one saved tensor's recomputation may copy into the backward.
RECOMPUTE_MAX_NODES = 8


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the backward recomputes a saved tensor: ``nodes`` (forward ops, in graph order)
    copied into the backward, reading ``frontier`` (saved tensors kept exact, inputs the
    caller keeps)."""

    nodes: tuple[fx.Node, ...]
    frontier: tuple[fx.Node, ...]


def _recomputable(node: fx.Node) -> bool:
    """A forward op the backward may run again for the same result: a functional ``aten``
    or ``prims`` op (not mutating, not random) returning tensors, or one output of one."""
    if node.op != "call_function" or node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
        return False  # a selective checkpoint's policy keeps it
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], fx.Node)  # its producer is checked on its own
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_bitwise in target.tags or draws_random(node):
        return False
    if target.namespace == "prims" and target.__name__.startswith("inductor_"):
        return False  # Inductor's seeds and random prims carry no nondeterministic tag
    vals = pytree.tree_leaves(node.meta.get("val"))
    return bool(vals) and all(isinstance(v, torch.Tensor) for v in vals)


def draws_random(node: fx.Node) -> bool:
    """A forward op (or one output of one) that draws random numbers: run again, it would
    draw others (attention's kernels carry the random tag and draw nothing without dropout)."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded in target.tags and not _no_dropout(node)


def _no_dropout(node: fx.Node) -> bool:
    """A seeded op that draws nothing: its ``dropout_p`` argument (attention) is 0."""
    schema = cast(torch._ops.OpOverload, node.target)._schema  # a seeded op
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def recompute_recipe(
    saved: fx.Node,
    exact: Set[fx.Node],
    order: dict[fx.Node, int],
    limit: int = RECOMPUTE_MAX_NODES,
) -> Recipe | None:
    """The forward ops between ``saved`` and the nodes in ``exact`` (saved tensors the
    backward reads exactly, inputs the caller keeps), or None: more than ``limit`` ops, or
    one that cannot run again (random, mutating, not a tensor op) on the way."""
    nodes: set[fx.Node] = set()
    frontier: set[fx.Node] = set()
    stack = [saved]
    while stack:
        node = stack.pop()
        if node in nodes or node in frontier:
            continue
        if node is not saved and node in exact:
            frontier.add(node)
            continue
        if len(nodes) >= limit or not _recomputable(node):
            return None
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    return Recipe(tuple(sorted(nodes, key=order.__getitem__)), tuple(sorted(frontier, key=order.__getitem__)))


def recompute_ms(recipe: Recipe, rates: Rates) -> float:
    """The recipe's compute and one kernel per op (views and getitem are free)."""
    ops = [n for n in recipe.nodes if n.target is not operator.getitem and not getattr(n.target, "is_view", False)]
    return sum(_node_ms(n, rates) + rates.kernel_ms for n in ops)


def recipe_transient_bytes(recipe: Recipe, root: fx.Node) -> int:
    """Bytes the recipe's ops allocate besides the storage they rebuild (an upper bound:
    as if all of them were alive at once, right before the storage's first use)."""
    return sum(nbytes_of(n) for n in recipe.nodes if not getattr(n.target, "is_view", False) and act_inputs.storage_root(n) is not root)


def with_recipes(choices: list[Choice], sole: list[bool], exact: Set[fx.Node], fw_g: fx.Graph, rates: Rates) -> list[Choice] | None:
    """``choices`` with a recompute option for each one that has a recipe (``sole``: the
    choice's tensor is the one reader of its storage, so recomputing it frees the storage),
    or None if none has.  The choices' members are saved tensors (fx nodes)."""
    fw_order = {n: i for i, n in enumerate(fw_g.nodes)}
    unit_of = {act_inputs.storage_root(c.members[0]): i for i, c in enumerate(choices)}
    out, found = [], False
    for i, c in enumerate(choices):
        recipe = recompute_recipe(c.members[0], exact, fw_order) if sole[i] else None
        if recipe is None:
            out.append(c)
            continue
        found = True
        units = (unit_of.get(act_inputs.storage_root(f)) for f in recipe.frontier)
        pins = tuple(sorted({u for u in units if u is not None and u != i}))
        root = act_inputs.storage_root(c.members[0])
        out.append(
            dataclasses.replace(
                c,
                options=[*c.options, Option(RECOMPUTE, 0, recompute_ms(recipe, rates))],
                recipe=recipe,
                pins=pins,
                transient=recipe_transient_bytes(recipe, root),
            )
        )
    return out if found else None
