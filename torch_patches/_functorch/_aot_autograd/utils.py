"""Which saved-tensor hooks can be inlined, how they are named, and their content keys.

Upstream counterpart: ``torch/_functorch/_aot_autograd/utils.py``
(``top_saved_tensors_hooks``, ``saved_tensors_hooks_are_inlineable``).  Upstream
accepts only ``fx.GraphModule`` pairs and tells hooks apart by ``id()``.  We also accept
plain functions the user marked as inlineable (``torch_patches.hooks.inlineable``), and
key hooks by *content*, so an identical hook recreated every step is the same hook
(guards, caches) while a hook whose code or captured constants changed is not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, cast

import torch

from torch_patches import config
from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches.hooks.markers import budget_pair, budget_spec, pair_is_inlineable


def saved_tensors_hooks_are_inlineable(hooks: Any) -> TypeGuard[tuple[Callable[..., Any], Callable[..., Any]]]:
    """Replacement for upstream's predicate: GraphModules or marked functions, both."""
    return pair_is_inlineable(hooks)


def describe_tensor(dtype: torch.dtype, shape: Any, device: torch.device) -> str:
    """``float32[4, 8] on cpu``: a tensor in errors and logs."""
    return f"{str(dtype).replace('torch.', '')}{list(shape)} on {device.type}"


def describe_value(val: Any) -> str:
    """A tensor as :func:`describe_tensor` writes it; anything else by its type's name."""
    if isinstance(val, torch.Tensor):
        return describe_tensor(val.dtype, val.shape, val.device)
    return type(val).__name__


def size_hint(s: Any) -> int:
    """A symbolic size's example value (its hint); 8192 for one with none (unbacked)."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    hint = getattr(node, "hint", None)
    if isinstance(hint, int):
        return hint
    try:
        return int(node.shape_env.size_hint(node.expr))  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no hint (unbacked size)
        return 8192


def hinted_nbytes(val: Any) -> int:
    """Bytes of a tensor ``val`` (symbolic sizes as their hints); 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()


def nbytes_of(node: torch.fx.Node) -> int:
    """Bytes of a graph node's tensor value (symbolic sizes as their hints); 0 for others."""
    return hinted_nbytes(node.meta.get("val"))


def activation_bytes(values: list[Any], inputs: list[Any]) -> int:
    """Bytes of the saved ``values`` that are not among the graph's ``inputs`` (what a
    partition saves of the activations)."""
    skip = set(inputs)
    return sum(nbytes_of(node) for node in values if node not in skip)


def mutated_inputs(graph: torch.fx.Graph) -> set[str]:
    """The names of the graph's inputs it mutates (functionalized: ``copy_`` into them)."""
    return {
        n.args[0].name for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default) if n.args[0].op == "placeholder"
    }


def device_of(nodes: Any) -> torch.device:
    """The device of the first tensor among ``nodes``' values (the CPU if none)."""
    return next((n.meta["val"].device for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)), torch.device("cpu"))


def graph_outputs(graph: torch.fx.Graph) -> Sequence[Any]:
    """What an AOTAutograd graph returns: its output node's values (a tuple or list)."""
    return cast("Sequence[Any]", graph.output_node().args[0])


def is_incoming_gradient(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a backward graph's incoming gradient (AOTAutograd's
    ``tangents_*`` placeholders)."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def incoming_gradients_boxed() -> bool:
    """Whether autograd hands a compiled backward its incoming gradients in a list the
    backward empties (``BackwardCFunction.apply_boxed``, torch 2.13 on): then each dies after
    its last reader in the backward; before, autograd holds them until the call returns."""
    return hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed")


def hook_name(fn: Any) -> str:
    """A human name for a hook, for errors and logs."""
    if isinstance(fn, torch.fx.GraphModule):
        return f"GraphModule {type(fn).__name__!r}"
    if isinstance(fn, functools.partial):
        bound = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{hook_name(fn.func)}({', '.join(bound)})"
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qual}"


# ===================================================================== per compiled call
# What runs at every call of a compiled graph (ARCHITECTURE.md, "What runs per compiled
# call"): lookups against what compiling recorded, never a walk, an input search or a trace
# (test_hook_guards.TestPerCallPath counts them).


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost saved-tensors hooks pair active right now, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def ambient_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The hooks compiled graphs plan with around the compiled call: the innermost pair
    active right now, else the ``torch_patches.config.activation_memory_budget`` pair
    (``torch_patches.hooks.budget``), else None.

    The budget pair stands for the config knob everywhere ambient hooks are read (the
    frame's guard, the cache-key subgraphs, the inliner, the runtime wrapper), so a budget
    set in config is keyed exactly as the same pair entered by hand.
    """
    hooks = top_saved_tensors_hooks()
    if hooks is not None:
        return hooks
    budget = _config_budget()
    if budget is None:
        return None
    try:
        return _config_budget_pair(budget)
    except (TypeError, ValueError) as e:
        raise type(e)(f"torch_patches.config.activation_memory_budget: {e}") from None


_budget_memo: list[Any] = [None, None]


def _config_budget() -> Any:
    """``config.activation_memory_budget``, read at every compiled call (the guard): read
    again only when a knob was set (the config module's hash object is then a new one;
    a config module's attribute read costs several of these)."""
    h = config.get_hash()
    if _budget_memo[0] is not h:
        _budget_memo[:] = [h, config.activation_memory_budget]
    return _budget_memo[1]


@functools.lru_cache(maxsize=16, typed=True)
def _config_budget_pair(memory: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    # Asked at every compiled call (the guard): one lookup per value of the knob.
    return budget_pair(budget_spec(memory))


def is_hookable_dtype(dtype: torch.dtype) -> bool:
    """Whether user hooks see saved tensors of ``dtype`` (``config.hooked_saved_tensor_dtypes``).

    "float" (default): floating point and complex only; masks and indices the partitioner
    saves are kept as they are. "all": every dtype, as eager autograd would pass them.
    """
    policy = config.hooked_saved_tensor_dtypes
    if policy == "all":
        return True
    if policy != "float":
        raise SavedTensorsHookConfigError(f"torch_patches.config.hooked_saved_tensor_dtypes must be 'float' or 'all', got {policy!r}")
    return dtype.is_floating_point or dtype.is_complex
