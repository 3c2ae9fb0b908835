"""The collect phase: the record of each saved tensor before any decision (what it is,
the op and module that made it, its hooks' scope, what the backward does with it: its
readers, the numerics allowlist's verdict, its spans in both graphs).

The inliner's phases (``inline_phases``) make one
:class:`~.saved_tensor_records.SavedTensorRecord` per saved tensor with :func:`collect`;
the budget's summary names modules by :func:`module_path`.  Compile time only.
"""

from __future__ import annotations

import operator
import re
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import saved_numerics, utils as hook_utils
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair
from torch_patches._functorch._aot_autograd.saved_tensor_records import UNHOOKED, DecidedBy, SavedTensorRecord

__all__ = ["collect", "input_module_path", "input_source_name", "module_path", "named_module_path", "producer_of"]


def _target_name(node: fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def producer_of(saved: fx.Node) -> str | None:
    """The op that computed a saved tensor's forward node (None for placeholders)."""
    if saved.op != "call_function":
        return None
    if saved.target is operator.getitem and saved.args and isinstance(saved.args[0], fx.Node):
        return f"getitem:{saved.args[1]} of {_target_name(saved.args[0])}"
    return _target_name(saved)


def module_path(node: fx.Node) -> str:
    """The module whose forward computed ``node`` (Dynamo's ``nn_module_stack``, innermost),
    as ``named_modules()`` of the compiled module names it; ``""`` when none did."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    entry = list(stack.values())[-1]
    return named_module_path(entry[0] if isinstance(entry, tuple) else str(entry))


def named_module_path(source: str) -> str:
    """Dynamo's source of a module (``L['self'].layers[0]._modules['fc']``) as a
    ``named_modules()`` path (``layers.0.fc``): a module the compiled frame holds as a local
    (the compiled module itself, ``L['self']`` or ``L['fn']`` by torch version, or a module
    argument) is the root; a global one keeps its name (``G['model'].fc`` is ``model.fc``)."""
    path = re.sub(r"^L\[['\"][^'\"]+['\"]\]", "", source)
    path = re.sub(r"^G\[['\"]([^'\"]+)['\"]\]", r"\1", path)
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.lstrip(".")


def _span(bw_input: fx.Node | None, bw_order: dict[fx.Node, int]) -> tuple[int, int] | None:
    if bw_input is None or not bw_input.users:
        return None
    positions = [bw_order[u] for u in bw_input.users]
    return min(positions), max(positions)


def input_source_name(placeholder: fx.Node, input_sources: list[Any] | None) -> str:
    """The source Dynamo gave a graph input (``L['hidden_states']``), from
    ``aot_config.aot_autograd_arg_pos_to_source``; ``""`` without one."""
    if not input_sources:
        return ""
    index = getattr(placeholder.meta.get("desc"), "idx", None)
    if index is None:  # primals_<k>: the k-th input
        found = re.fullmatch(r"primals_(\d+)", placeholder.name)
        index = int(found.group(1)) - 1 if found else None
    if index is None or not 0 <= index < len(input_sources) or input_sources[index] is None:
        return ""
    source = input_sources[index]
    return source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", source))


def input_module_path(placeholder: fx.Node, input_sources: list[Any] | None) -> str:
    """The module owning a saved graph input (a parameter or buffer: ``fc1`` for
    ``L['self']._modules['fc1']._parameters['weight']``), from the sources Dynamo gave
    AOTAutograd's inputs (:func:`input_source_name`); ``""`` for other inputs or without
    sources."""
    owner = re.match(r"(.*)\._(?:parameters|buffers)\[['\"][^'\"]+['\"]\]$", input_source_name(placeholder, input_sources))
    return named_module_path(owner.group(1)) if owner else ""


def _module_of(node: fx.Node, input_sources: list[Any] | None) -> str:
    """:func:`module_path`, or for a graph input :func:`input_module_path`.  A view (the
    partitioner's weight transpose, AOTAutograd's detach of a saved output) has the module
    of the tensor it views: its storage is that tensor's."""
    while (
        node.op == "call_function"
        and getattr(node.target, "is_view", False)
        and not node.meta.get("nn_module_stack")
        and node.args
        and isinstance(node.args[0], fx.Node)
    ):
        node = node.args[0]
    if node.op == "placeholder":
        return input_module_path(node, input_sources)
    return module_path(node)


def _fw_span(saved: fx.Node, fw_order: dict[fx.Node, int] | None) -> tuple[int, int] | None:
    if fw_order is None:
        return None
    uses = [fw_order[u] for u in saved.users if u.op != "output"]
    return fw_order[saved], max(uses, default=fw_order[saved])


def collect(
    saved: fx.Node,
    bw_input: fx.Node | None,
    bw_order: dict[fx.Node, int],
    facts: saved_numerics.BackwardFacts | None,
    storage_root: fx.Node,
    pair: HookPair | None,
    fw_order: dict[fx.Node, int] | None = None,
    input_sources: list[Any] | None = None,
) -> SavedTensorRecord:
    """The record of one saved tensor before any decision: what it is, its hooks' scope
    (``pair``, None: no hooks), and what the backward does with it."""
    val = saved.meta["val"]
    shape = tuple(hook_utils.size_hint(s) for s in val.shape)
    # The numerics walk only where hooks may compress (it reads the backward graph).
    found = saved_numerics.verdict(saved, bw_input, cast(saved_numerics.BackwardFacts, facts)) if pair is not None else None
    return SavedTensorRecord(
        name=saved.name,
        producer=producer_of(saved),
        module=_module_of(saved, input_sources),
        dtype=val.dtype,
        shape=shape,
        nbytes=hook_utils.nbytes_of(saved),
        device=val.device.type,
        is_input=saved.op == "placeholder",
        storage_root=storage_root.name,
        scope=None if pair is None else pair.label,
        readers=tuple(found.readers or ()) if found is not None else (),
        tolerance=found.level if found is not None else None,
        tolerance_why=found.why if found is not None else None,
        span=_span(bw_input, bw_order),
        fw_span=_fw_span(saved, fw_order),
        decision=UNHOOKED,
        decided_by=DecidedBy.SCOPE,
        reason=None if pair is not None else "no saved tensors hooks in its scope",
        node=saved,
        bw_input=bw_input,
        pair=pair,
        chosen=pair,
    )
