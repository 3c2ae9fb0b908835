"""Inline saved-tensor hooks into the AOT forward and backward graphs, placed at use.

Upstream counterpart: ``maybe_inline_graph_saved_tensors_hooks`` in
``torch/_functorch/_aot_autograd/graph_compile.py`` (PR #150032).  Upstream retraces pack
into the forward *epilogue* and unpack into the backward *prologue*; every full-size
saved tensor then stays alive to the end of the forward and every unpacked tensor is
materialised at the start of the backward, so nothing is saved unless the backend
reorders.  This is a fresh implementation with the same calling convention:

* each pack is placed right after its saved tensor's last forward use, and each unpack
  right before the saved tensor's first backward use (``config.unpack_prefetch_distance``
  nodes earlier, for reloads that should overlap compute);
* hooks are traced per saved tensor, functionalized, with the backend's decompositions,
  so they may read dtype/shape, return tuples, symints and constants;
* which saved tensors hooks see: upstream's filtering mode (donated / no_static / all)
  and our dtype policy (``config.hooked_saved_tensor_dtypes``: floating point only by
  default, so masks and indices are never handed to an activation hook);
* what unpack returns is checked against the saved tensor (dtype, shape, device; strides
  are restored in-graph when they differ);
* all hooks are traced before either graph is touched: a hook that cannot be traced
  leaves the graphs as they were and either raises (fullgraph, or
  ``config.untraceable_hook="error"``) or falls back to eager hooks with one warning.

This module is the patched entry point and the driver: it runs the phases (filter, select,
plan, place, rewrite: ``inline_phases``, functions over one record per saved tensor,
``saved_tensor_records``), falls back to eager hooks when a hook cannot be traced, and says
what the compilation decided for the runtime wrapper and the cache.  Tracing and the hook
contract live in ``hook_tracing``, the graph rewrite in ``graph_surgery``, graph inputs in
``activation_inputs``, subclass packed forms in ``packed_subclasses``.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from torch_patches import config
from torch_patches._errors import SavedTensorsHookError, SavedTensorsHookWarning
from torch_patches._functorch._aot_autograd import (
    activation_inputs as act_inputs,
    compile_facts,
    hook_identity as hook_keys,
    hook_tracing,
    inline_fallback,
    inline_phases,
    saved_tensor_records as records,
    utils as hook_utils,
)
from torch_patches._functorch._aot_autograd.activation_budget import ceiling, partition_choice
from torch_patches._functorch._aot_autograd.graph_surgery import HOOK_META  # noqa: F401 - public
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair, trial_trace  # noqa: F401 - public

if TYPE_CHECKING:
    from torch._functorch._aot_autograd.schemas import AOTConfig, ViewAndMutationMeta

log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch._aot_autograd.graph_compile"


# --------------------------------------------------------------- compile decisions


def _record_decision(inlined: bool) -> None:
    key = hook_keys.hooks_guard_key(hook_utils.ambient_saved_tensors_hooks())
    compile_facts.record_inlined(key, inlined)


_warned: set[Any] = set()
_warned_objects: weakref.WeakSet[Any] = weakref.WeakSet()  # a hook that mutates itself


def warn_untraceable_once(error: SavedTensorsHookError, consequence: str) -> None:
    """Warn that a hook could not be inlined: once per hook in a process.

    "One hook" is one identity (``hook_identity``): a hook recreated every step warns once,
    two different hooks with the same name warn once each. A hook entered inside a region is
    reported when Dynamo enters it; the block then runs eagerly and its graph sees the same
    hook as ambient: one warning covers both.
    """
    key = (error.hook, getattr(error, "identity", None))
    fn = getattr(error, "hook_object", None)
    if key in _warned or (fn is not None and fn in _warned_objects):
        return
    _warned.add(key)
    if fn is not None:
        try:
            _warned_objects.add(fn)
        except TypeError:
            pass
    warnings.warn(
        f"torch_patches: {error}. {consequence}. Compile with fullgraph=True to make this an error.",
        SavedTensorsHookWarning,
        stacklevel=3,
    )


# ------------------------------------------------------------------- scope lookup


def _ambient_pair() -> HookPair | None:
    hooks = hook_utils.ambient_saved_tensors_hooks()
    if not hook_utils.saved_tensors_hooks_are_inlineable(hooks):
        return None
    return HookPair(hooks[0], hooks[1], "ambient")


# ------------------------------------------------------------------------ driver


def maybe_inline_graph_saved_tensors_hooks(
    fw_module: torch.fx.GraphModule,
    bw_module: torch.fx.GraphModule,
    num_inner_fwd_outputs: int,
    inner_meta: ViewAndMutationMeta,
    aot_config: AOTConfig,
    static_input_indices: list[int],
) -> None:
    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return
    found = compile_facts.facts()
    if found is not None:
        found.hooks_inlined = None
    ambient = _ambient_pair()
    # The modules as handed over, put back if our own code fails on them (inline_fallback).
    snapshot = inline_fallback.snapshot(fw_module, bw_module, inner_meta, ambient, found)
    try:
        # The partition the ambient budget plans (activation_budget.partition_choice): the
        # default, or the partitioner's cheap recomputation or knapsack redone from its offer;
        # the modules take its graphs.
        offer = compile_facts.take_partition_offer()
        context = (num_inner_fwd_outputs, inner_meta, aot_config, static_input_indices)
        choice = partition_choice.choose_partition(offer, fw_module, bw_module, context, ambient, inline_phases.trial_plans)
        held = act_inputs.held_by_caller(fw_module, inner_meta, static_input_indices)  # of the partition taken
        inline_phases.inline(fw_module, bw_module, *context, ambient, held, choice.recomputed, choice.terms)
        if choice.pricing.enabled and snapshot is not None:
            ceiling.hold_to_ceiling(fw_module, bw_module, snapshot, offer, context, choice.pricing)
    except SavedTensorsHookError as e:
        in_graph_scope = getattr(e, "scope", "ambient") != "ambient"
        if (
            ambient is None
            or in_graph_scope  # trial-traced when entered; no eager hooks to fall back to
            or hook_tracing.dynamo_fullgraph()
            or config.untraceable_hook == "error"
            # No compilation context (AOTAutograd without Dynamo) to tell the runtime
            # wrapper that the hooks stay eager: raise rather than run without them.
            or compile_facts.facts() is None
        ):
            raise
        warn_untraceable_once(
            e,
            "Falling back to eager saved-tensors hooks for this graph (results stay correct; memory is saved only as eager hooks save it)",
        )
        log.debug("eager fallback for hooks %s", ambient.names, exc_info=True)
        _record_decision(inlined=False)
        compile_facts.mark_not_cacheable(f"saved tensors hooks {ambient.names} fell back to eager hooks")
        records.publish(records.CompiledSavedTensors([], fallback=str(e)))
        return
    except Exception as e:  # noqa: BLE001 - ours unless the user's (inline_fallback.is_internal)
        if not inline_fallback.wants_fallback(e):
            raise
        inline_fallback.fall_back(e, inline_fallback.hooks_in_words(ambient, found), fw_module, snapshot)
        if ambient is not None:  # as Python hooks; a budget's keep every tensor: none run
            _record_decision(inlined=ambient.kind.budget is not None)
        return
    if ambient is not None:
        _record_decision(inlined=True)
