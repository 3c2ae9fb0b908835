"""The inliner's fallback from its own errors: the graphs stock torch would run.

The inliner's driver (``graph_compile.maybe_inline_graph_saved_tensors_hooks``) rewrites the
partitioned forward and backward modules in place: the partitioner patch's retry may move
another partition into them, the phases insert packs, unpacks and recomputations and rewire
both graphs' saved values.  Where any of that raises an error that is not the user's (a
``KeyError`` on a graph shape we did not foresee, an assertion of ours or of torch's on the
way), nothing half-rewritten may run, and the user's step must not end on our error:

* :class:`GraphPairSnapshot` copies both graphs (and what else the phases touch on the
  modules) before anything runs, and puts them back;
* :func:`fall_back` then says what happened, once per hook pair and error site, in a
  :class:`~torch_patches._errors.SavedTensorsHookWarning` naming the hooks or the budget,
  the graph and the reason; records it on the compilation's records (``fallback``) and marks
  the compilation not cacheable (AOTAutogradCache never keeps a graph we gave up on).

The graphs then are the partition the inliner was handed, and the ambient hooks run as stock
runs them: as Python hooks, around the compiled graph (a budget pair's eager hooks keep every
tensor, so its graph simply runs without them).  Hooks entered inside the compiled region have
no eager form at this point (stock graph-breaks around them): their saved tensors are kept as
they are.

A user's error is never turned into a fallback (:func:`is_internal`): a hook that breaks its
contract or cannot be traced (``SavedTensorsHookError``, with its own fallback in the driver),
a config knob with a value it does not accept (``SavedTensorsHookConfigError``).
``config.internal_error_fallback = False`` raises the error itself (to debug it).
"""

from __future__ import annotations

import copy
import logging
import traceback
import warnings
from typing import Any

import torch
import torch.fx as fx

from torch_patches import config
from torch_patches._errors import SavedTensorsHookConfigError, SavedTensorsHookError, SavedTensorsHookWarning
from torch_patches._functorch._aot_autograd import compile_facts, offload_prefetch, saved_tensor_records as records

log = logging.getLogger(__name__)

#: The attribute tables of an ``nn.Module`` the phases may add to (constants a hook
#: created, the attributes an adopted partition's graph reads).
_TABLES = ("_parameters", "_buffers", "_modules")


class GraphPairSnapshot:
    """The forward and backward modules as the inliner was handed them, to put back.

    Each graph is copied (``copy.deepcopy``: its nodes with the same names and a shallow copy
    of their ``meta``); the attribute names of each module and its ``meta`` are remembered,
    so that constants the rewrite set and attributes an adopted partition brought go again.
    The runtime metadata loses what the phases put on it (the offloads it reloads)."""

    def __init__(self, fw_module: fx.GraphModule, bw_module: fx.GraphModule, inner_meta: Any) -> None:
        self.inner_meta = inner_meta
        self.modules = [(m, copy.deepcopy(m.graph), _attribute_names(m), dict(m.meta)) for m in (fw_module, bw_module)]

    @property
    def graphs(self) -> tuple[fx.Graph, fx.Graph]:
        """The copies of the forward's and the backward's graphs as they were handed over."""
        return self.modules[0][1], self.modules[1][1]

    def restore(self) -> None:
        for module, graph, names, meta in self.modules:
            for table, name in _attribute_names(module) - names:
                if table != "__dict__":
                    getattr(module, table).pop(name, None)
                elif isinstance(vars(module)[name], (torch.Tensor, torch.nn.Module)):  # what get_attr reads
                    delattr(module, name)
            module.graph = graph  # GraphModule's setter owns the graph and recompiles
            module.meta.clear()
            module.meta.update(meta)
        offload_prefetch.mark(self.inner_meta, 0, 0)


def snapshot(fw_module: fx.GraphModule, bw_module: fx.GraphModule, inner_meta: Any, ambient: Any, found: Any) -> GraphPairSnapshot | None:
    """The modules' :class:`GraphPairSnapshot` where the compilation has hooks (``ambient``,
    or in-region scopes on its facts ``found``); None without: nothing rewrites them."""
    if ambient is None and (found is None or not found.scopes):
        return None
    return GraphPairSnapshot(fw_module, bw_module, inner_meta)


def hooks_in_words(ambient: Any, found: Any) -> str:
    """The hooks of a compilation in a warning: the ambient pair (``HookPair``; a budget by
    its spec) and each in-region scope's pair (on its facts ``found``) by their names.  A
    budget pair's eager hooks keep every tensor, so its graph runs without them (no second
    warning); any other ambient pair runs as Python hooks, as stock runs it."""
    parts = []
    if ambient is not None:
        spec = ambient.kind.budget
        parts.append(spec.describe() if spec is not None else f"({ambient.names})")
    scopes = list(found.scopes.values()) if found is not None else []
    if scopes:
        parts.append(f"entered in the region ({'; '.join(pair.names for pair in scopes)})")
    return " and ".join(parts)


def _attribute_names(module: torch.nn.Module) -> set[tuple[str, str]]:
    names = {("__dict__", n) for n in vars(module)}
    for table in _TABLES:
        names |= {(table, n) for n in getattr(module, table)}
    return names


def is_internal(error: BaseException) -> bool:
    """Whether ``error`` is the inliner's own (a fallback then applies), not the user's."""
    return isinstance(error, Exception) and not isinstance(error, (SavedTensorsHookError, SavedTensorsHookConfigError))


def where_raised(error: BaseException) -> str:
    """``graph_surgery.py:514 in rewire_saved``: the innermost frame of the error's traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"


def describe_graph(graph: fx.Graph, what: str = "forward") -> str:
    """The graph in words: Dynamo's compile id and the function it compiles, where known
    (``graph 0/0 of forward at model.py:12``), and its size (``what`` nodes)."""
    from torch._guards import CompileContext

    parts = ["graph"]
    found = CompileContext.current_compile_id()
    if found is not None:
        parts.append(f"{found.frame_id}/{found.frame_compile_id}")
    code = _compiled_code()
    if code is not None:
        parts.append(f"of {code.co_name} at {code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}")
    parts.append(f"({len(graph.nodes)} {what} nodes)")
    return " ".join(parts)


def _compiled_code() -> Any:
    """The code object Dynamo is compiling (its translator is current while AOTAutograd
    partitions the frame's graph), or None outside Dynamo."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except (AttributeError, IndexError, RuntimeError):
        return None
    return getattr(tx, "f_code", None)


#: (hooks, error type, error site) already warned about: one warning each per process.
_warned: set[Any] = set()


def warn_once(error: BaseException, subject: str, failed: str, consequence: str) -> str:
    """Warn about an internal ``error`` once per ``subject`` (the hooks or the budget, in
    words) and error site: ``"torch_patches: {subject} {failed}: ..., {consequence}"``.
    Marks the compilation not cacheable; returns the reason in words, for the records."""
    site = where_raised(error)
    reason = f"{type(error).__name__}: {error} (at {site})"
    log.debug("internal error: %s %s", subject, failed, exc_info=error)
    key = (subject, type(error).__name__, site)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"torch_patches: {subject} {failed}: an internal error of torch_patches, {reason}. {consequence}. "
            "Please report it; torch_patches.config.internal_error_fallback = False raises the error instead",
            SavedTensorsHookWarning,
            stacklevel=3,
        )
    compile_facts.mark_not_cacheable(f"{subject} fell back from an internal error")
    return reason


def fall_back(error: BaseException, hooks: str, fw_module: fx.GraphModule, restored: GraphPairSnapshot | None) -> None:
    """Put the graphs back (``restored``; None: nothing rewrote them, the graph had no
    hooks), warn once per hooks and error site, record the fallback on the records and keep
    the compilation out of AOTAutogradCache.  ``hooks``: the hooks (or the budget) in words."""
    if restored is not None:
        restored.restore()
    reason = warn_once(
        error,
        f"saved tensors hooks {hooks}",
        f"could not be inlined into {describe_graph(fw_module.graph)}",
        "This graph runs as stock torch runs it: the partition as the partitioner made it, the "
        "ambient hooks as Python hooks, hooks entered inside the region not applied (their tensors "
        "kept as they are)",
    )
    records.publish(records.CompiledSavedTensors([], fallback=f"internal error, {reason}"))


def forget_partition_facts() -> None:
    """Drop what the partitioner patch told the inliner about this compilation's partition
    (its offer): the partition is upstream's own after all."""
    found = compile_facts.facts()
    if found is not None:
        found.partition_offer = None


def wants_fallback(error: BaseException) -> bool:
    """Whether ``error`` (raised by the inliner's driver) falls back (:func:`fall_back`)."""
    return is_internal(error) and bool(config.internal_error_fallback) and compile_facts.facts() is not None
