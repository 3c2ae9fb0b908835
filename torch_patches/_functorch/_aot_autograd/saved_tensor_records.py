"""One record per saved tensor: the inliner's spine and its one output.

The inliner (``inline_phases.inline``) makes one :class:`SavedTensorRecord` per tensor the
partitioned forward saves for the backward, then runs its phases over the records, each a
function that fills in its part:

=============  ==============================================  =========================
phase          fills in                                        code
=============  ==============================================  =========================
collect        name, producer, scope, storage root, readers,   ``saved_tensor_collect.collect``
               tolerance, backward span
filter         decision ``unhooked`` by ``filter`` and why      ``saved_tensor_selection.filter_hookable``
select         the hooks a ``select`` pair leaves it, or why    ``saved_tensor_selection.resolve_select``
plan           a budget's option, or kept/recomputed and why    ``activation_budget.planner``
place/rewrite  packed bytes, where pack and unpack went         ``inline_phases.inline``,
                                                                ``graph_surgery``
=============  ==============================================  =========================

The records of one compilation (a :class:`CompiledSavedTensors`) are kept on its facts
(``compile_facts.CompileFacts.saved_tensors``); the debug log
(``TORCH_LOGS="torch_patches"``) writes them (:func:`log_records`); tests and the bench read
them through ``torch_patches.testing.saved_tensor_records()``, never the log's text.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import logging
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.fx as fx

from torch_patches._functorch._aot_autograd import compile_facts, saved_numerics
from torch_patches._functorch._aot_autograd.hook_tracing import HookPair
from torch_patches.hooks.markers import SavedTensorInfo

__all__ = [
    "ALIAS",
    "HOOKED",
    "RECOMPUTED",
    "UNHOOKED",
    "Bounds",
    "BudgetPlanSummary",
    "CompiledSavedTensors",
    "DecidedBy",
    "Decision",
    "PlannedStorage",
    "SavedTensorRecord",
    "log_records",
    "observed",
    "publish",
    "recording",
    "keep_with",
]


class _Text(str, enum.Enum):
    """A ``str`` enum that reads as its value wherever it is written: ``str()``,
    ``format()`` and f-strings (which Python 3.11 changed for mixed-in enums), ``repr()``
    (a record's repr, a dict of decisions), JSON; it compares and hashes as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)


class Decision(_Text):
    """What became of a saved tensor (``SavedTensorRecord.decision``)."""

    HOOKED = "hooked"  # packed in the forward, unpacked in the backward
    UNHOOKED = "unhooked"  # saved as it is (``decided_by`` and ``reason`` say why)
    RECOMPUTED = "recomputed"  # not saved: the backward recomputes it (a budget plan)
    ALIAS = "alias"  # a pure alias of another hooked saved tensor: shares its packed form


class DecidedBy(_Text):
    """The phase that decided (``SavedTensorRecord.decided_by``)."""

    SCOPE = "scope"  # no hooks in its scope
    FILTER = "filter"  # the inliner's filters (dtype, views, what cannot be packed)
    SELECT = "select"  # a ``select`` pair's predicate
    BUDGET = "budget"  # a budget pair's plan
    ALIAS = "alias"  # shares the packed form of another saved tensor
    HOOKS = "hooks"  # taken as its scope's hooks
    PARTITIONER = "partitioner"  # the partitioner's knapsack under a budget recomputes it
    CHECKPOINT = "checkpoint"  # activation checkpointing recomputes it


class Bounds(_Text):
    """Which points a budget bounds (``BudgetPlanSummary.bounded_at``)."""

    EVERY_POINT = "every_point"  # every point of the backward: the graph is its step
    FORWARD_END = "forward_end"  # the forward's end: one graph of several of its step


# The decisions, as module names (``SavedTensorRecord.decision``).
HOOKED = Decision.HOOKED
UNHOOKED = Decision.UNHOOKED
RECOMPUTED = Decision.RECOMPUTED
ALIAS = Decision.ALIAS


@dataclasses.dataclass(eq=False)
class SavedTensorRecord:
    """One saved tensor of a compiled forward graph and what the inliner decided for it.

    Attributes:
        name: the forward graph's node (and the backward's input of the same name).
        producer: the op that computed it (``"aten.mm.default"``, ``"getitem:1 of
            aten.native_layer_norm.default"``), None for a graph input.
        module: the module whose forward computed it, as the compiled module's
            ``named_modules()`` names it (``"model.layers.0.mlp.up_proj"``; a module the
            compiled code reads as a global keeps its name); ``""`` outside any submodule
            (a graph input, the compiled function's own code).
        dtype, shape, nbytes, device: the tensor's (symbolic sizes as their hints).
        is_input: a graph input (a parameter, a leaf, an input the caller keeps).
        storage_root: the node whose storage it is a view of (itself when it is a base).
        scope: the hooks' scope: ``"ambient"``, an in-region scope's name, or None (no hooks).
        readers: ``"op[argument]"`` for every argument the backward reads it as on the way
            to a gradient (the numerics walk, ``saved_numerics``; only for tensors with hooks).
        tolerance: the lossiest storage the numerics allowlist accepts for it, and
            ``tolerance_why`` what limits it (None without hooks: not walked).
        span: (first, last) position in the backward graph of the nodes using it (before the
            rewrite), None when the backward does not use it.
        fw_span: (producer, last use) position in the forward graph (before the rewrite; a
            graph input's producer is its placeholder).
        decision: :data:`HOOKED`, :data:`UNHOOKED`, :data:`RECOMPUTED` or :data:`ALIAS`
            (a :class:`Decision`: a ``str``, compares and prints as its value).
        decided_by: the phase that decided (a :class:`DecidedBy`): ``"scope"`` (no hooks), ``"filter"``,
            ``"select"``, ``"budget"``, ``"alias"``, ``"hooks"`` (taken as its scope's),
            ``"partitioner"`` (the default partition saves it, the partitioner's knapsack
            taken under a budget recomputes it: :data:`RECOMPUTED`), or ``"checkpoint"``
            (activation checkpointing recomputes it: :data:`RECOMPUTED`, never saved).
        reason: why, in words (None for a plainly hooked tensor).
        hooks: the names of the hooks it takes (after selection and planning), or None.
        option: a budget plan's option for it (``"keep"``, ``"bf16"``, ..., ``"recompute"``).
        alias_of: the saved tensor whose packed form it shares (:data:`ALIAS`).
        packed_bytes: bytes of its packed form on its device (0: offloaded), when hooked.
        pack_after: the forward node its pack follows; ``unpack_before``: the backward node
            its unpack precedes (the first use, ``unpack_prefetch_distance`` earlier).
        aliases_output: it shares its storage with an output of the forward (a budget plan
            stores it otherwise all the same: the caller drops such outputs after the forward).
        checkpoint: its part in activation checkpointing, in words (``checkpointed.role``:
            an input a checkpointed region is recomputed from, a tensor a selective
            checkpoint's policy keeps), None outside checkpointing.  A tensor a checkpoint
            recomputes is not saved: its record is :data:`RECOMPUTED`, decided by
            ``"checkpoint"``.
    """

    name: str
    producer: str | None
    module: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    device: str
    is_input: bool
    storage_root: str
    scope: str | None
    readers: tuple[str, ...]
    tolerance: str | None
    tolerance_why: str | None
    span: tuple[int, int] | None
    fw_span: tuple[int, int] | None = None
    decision: Decision = UNHOOKED
    decided_by: DecidedBy = DecidedBy.SCOPE
    reason: str | None = None
    hooks: str | None = None
    option: str | None = None
    alias_of: str | None = None
    packed_bytes: int | None = None
    pack_after: str | None = None
    unpack_before: str | None = None
    aliases_output: bool = False
    checkpoint: str | None = None
    # Compile-time only: the graphs' nodes and the hook pairs (dropped by :func:`publish`).
    node: fx.Node | None = dataclasses.field(default=None, repr=False)
    bw_input: fx.Node | None = dataclasses.field(default=None, repr=False)
    pair: HookPair | None = dataclasses.field(default=None, repr=False)  # the scope's pair
    chosen: HookPair | None = dataclasses.field(default=None, repr=False)  # the pair it takes

    @property
    def hooked(self) -> bool:
        return self.decision == HOOKED

    # While compiling, the inliner's phases read the compile-time fields of the records
    # they decide (a saved tensor's, with hooks in its scope): set until :func:`publish`.
    @property
    def fw_node(self) -> fx.Node:
        """:attr:`node`, while compiling."""
        return cast(fx.Node, self.node)

    @property
    def scope_pair(self) -> HookPair:
        """:attr:`pair` of a saved tensor with hooks in its scope, while compiling."""
        return cast(HookPair, self.pair)

    @property
    def chosen_pair(self) -> HookPair:
        """:attr:`chosen` of a hooked saved tensor, while compiling."""
        return cast(HookPair, self.chosen)

    def leave(self, by: DecidedBy, reason: str, decision: Decision = UNHOOKED) -> None:
        """Decide that it is not packed (``decision``), by phase ``by``, because ``reason``."""
        self.decision, self.decided_by, self.reason, self.chosen = decision, by, reason, None
        self.hooks = None

    def take(self, pair: HookPair, by: DecidedBy, reason: str | None = None) -> None:
        """Decide that it is packed by ``pair``, by phase ``by``."""
        self.decision, self.decided_by, self.reason, self.chosen = HOOKED, by, reason, pair
        self.hooks = pair.names

    def info(self) -> SavedTensorInfo:
        """The :class:`SavedTensorInfo` a ``where=`` predicate sees for it."""
        return SavedTensorInfo(
            name=self.name,
            producer=self.producer,
            dtype=self.dtype,
            shape=self.shape,
            nbytes=self.nbytes,
            backward_consumers=saved_numerics.reader_ops(self.readers),
            is_input=self.is_input,
            scope=self.scope or "",
            tolerance=cast(str, self.tolerance),  # walked: a saved tensor with hooks
            why=self.tolerance_why,
            readers=self.readers,
        )

    def describe(self) -> str:
        """``mul_3 (float32[4, 8] on cpu, 128 B, from aten.mul.Tensor)``."""
        source = "a graph input" if self.is_input else f"from {self.producer}"
        shape = list(self.shape)
        return f"{self.name} ({str(self.dtype).replace('torch.', '')}{shape} on {self.device}, {self.nbytes} B, {source})"

    def line(self) -> str:
        """The record as one log line."""
        what = {
            HOOKED: f"hooked: {self.hooks}",
            UNHOOKED: "left unhooked",
            RECOMPUTED: "recomputed in the backward",
            ALIAS: f"alias of {self.alias_of}, shares its packed tensor",
        }[self.decision]
        parts = [f"saved {self.describe()} {what}"]
        if self.module:
            parts.append(f"module {self.module}")
        if self.checkpoint:
            parts.append(f"checkpoint: {self.checkpoint}")
        if self.option is not None:
            parts.append(f"budget option {self.option}")
        if self.reason:
            parts.append(f"{self.decided_by}: {self.reason}")
        if self.packed_bytes is not None:
            parts.append(f"packed {self.packed_bytes} B")
        if self.pack_after is not None:
            parts.append(f"pack after {self.pack_after}, unpack before {self.unpack_before}")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class PlannedStorage:
    """One unit of a budget plan: a storage and the saved tensors reading it."""

    saved: tuple[str, ...]  # the saved tensors reading the storage (q, k, v of one projection)
    option: str  # "keep", "bf16", ..., "recompute"
    device_bytes: int  # what it holds on the device at the forward's end with that option
    estimated_ms: float  # the option's estimated cost
    reads: tuple[str, ...] = ()  # a recomputation's inputs
    offered: tuple[str, ...] = ()  # the options the plan weighed for it (keep first)
    copy_bytes: int = 0  # an offload's bytes copied each way


@dataclasses.dataclass(frozen=True)
class BudgetPlanSummary:
    """One budget pair's plan over the saved tensors of its scope (bytes on the device)."""

    scope: str
    spec: str
    planned_bytes: int  # the saved bytes the plan predicts at the forward's end
    baseline_bytes: int  # the bytes the scope saves without hooks
    budget_bytes: int
    peak_bytes: int  # the most the plan holds at any point of the backward
    peak_at: str
    met: bool
    preference: str  # which plan was taken and why
    estimated_ms: float
    units: tuple[PlannedStorage, ...] = ()
    #: Under an ambient fractional budget, the share of the default partition's activation
    #: bytes the partitioner's cheap exact recomputation saves (``torch_patches/_functorch/
    #: partitioners.py``), and whether that met the budget (the plan then starts from it).
    partitioner_ratio: float | None = None
    partitioner_met: bool | None = None
    #: When no plan meets the budget: the floor (the least the allowed options hold, which
    #: the plan holds) and what holds it at its peak, largest first, in words.
    floor_bytes: int | None = None
    floor_holders: tuple[str, ...] = ()
    #: Filled only while a report records: ``(fraction, planned peak bytes, estimated ms,
    #: met)`` of the plan at fractions 0.1 to 1.0 of the saved bytes.
    pareto: tuple[tuple[float, int, float, bool], ...] = ()
    #: Which points the budget bounds and why: every point of the backward (a graph that is
    #: its step), or the forward's end (one graph of several: ``config.activation_budget_bounds``).
    bounds: str = ""
    #: The same as data: ``"every_point"`` or ``"forward_end"``.
    bounded_at: Bounds = Bounds.EVERY_POINT
    #: The chosen offloads' copies: their time on the copy link (out and back, estimated)
    #: and the part of it no compute hides; the reloads of the graphs autograd runs next
    #: that this graph's backward holds, started ahead (``config.offload_prefetch_graphs``).
    copy_ms: float = 0.0
    copy_exposed_ms: float = 0.0
    ahead_bytes: int = 0
    #: The step's peak the plan predicts: its saved tensors with what the graphs hold beside
    #: them (gradients, intermediates, outputs: ``activation_budget/working_set.py``), and
    #: where.
    #: Loss heads computed in chunks in this compilation (``loss_head.rewrite_loss_heads``),
    #: each in words: its chunks, the unchunked head's (tokens x vocabulary) bytes, whether the
    #: returned logits are recomputed and what that costs.
    loss_heads: tuple[str, ...] = ()
    #: Saved graph inputs whose gradients the backward writes over them where the caller
    #: dropped them (``donated_inputs``), each in words.
    donated_inputs: tuple[str, ...] = ()
    predicted_peak_bytes: int | None = None
    predicted_peak_at: str = ""
    #: The step's peak of the graphs as compiled, by Inductor's accounting, and where
    #: (``activation_budget/inductor_accounting.py``; None where nothing priced them; the
    #: forward's peak where the budget bounds the forward's end: the backward is not priced), and
    #: the ceiling's verdict in words: which accounting priced the plan, against what, and
    #: whether it stands or was withdrawn (``activation_budget/ceiling.py``).
    accounted_peak_bytes: int | None = None
    accounted_peak_at: str = ""
    accounting: str = ""

    def copies(self) -> str:
        """The offloads' copies in words (empty without offloads)."""
        if not self.copy_ms:
            return ""
        hidden = self.copy_ms - self.copy_exposed_ms
        ahead = f"; {self.ahead_bytes} B of the next graph's reloads held in its backward" if self.ahead_bytes else ""
        return f"offload copies {self.copy_ms:.3f} ms: {hidden:.3f} ms hidden by compute, {self.copy_exposed_ms:.3f} ms exposed{ahead}"

    def options(self) -> dict[str, str]:
        """Option per storage, keyed by the first saved tensor reading it."""
        return {u.saved[0]: u.option for u in self.units}


@dataclasses.dataclass
class CompiledSavedTensors:
    """What the inliner decided for one compiled forward/backward pair."""

    records: list[SavedTensorRecord]
    plans: list[BudgetPlanSummary] = dataclasses.field(default_factory=list)
    #: The hooks fell back to eager hooks (nothing was inlined): why.
    fallback: str | None = None
    #: Nodes of the forward and backward graphs (before the rewrite): the records' positions
    #: are along them.
    fw_len: int = 0
    bw_len: int = 0
    #: Filled only while a report records (:func:`observed`): the partitioner's own saved
    #: set at each ``activation_memory_budget`` fraction, ``(fraction, saved activation
    #: bytes, estimated recomputation ms)`` (``torch_patches/_functorch/partitioners.py``).
    stock_pareto: tuple[tuple[float, int, float], ...] = ()
    #: Dynamo's id of the compilation (``"frame/recompile"``): graphs of one frame's
    #: recompiles share the frame (each decoder layer's, when the layers recompile).
    compile_id: str | None = None

    def __getitem__(self, name: str) -> SavedTensorRecord:
        for r in self.records:
            if r.name == name:
                return r
        raise KeyError(name)

    def by_decision(self, decision: Decision) -> list[SavedTensorRecord]:
        return [r for r in self.records if r.decision == decision]


# ------------------------------------------------------------------- observers

_observers: contextvars.ContextVar[tuple[list[CompiledSavedTensors], ...]] = contextvars.ContextVar(
    "saved_tensor_records_observers", default=()
)


_reporting: contextvars.ContextVar[bool] = contextvars.ContextVar("saved_tensor_records_reporting", default=False)


@contextlib.contextmanager
def recording(report: bool = False) -> Iterator[list[CompiledSavedTensors]]:
    """Collect the :class:`CompiledSavedTensors` of every graph the inliner handles inside
    the block (this thread and context), in compile order.  ``report``: also the graphs
    without hooks, and each budget's and the partitioner's pareto (:func:`observed`)."""
    out: list[CompiledSavedTensors] = []
    token = _observers.set((*_observers.get(), out))
    flag = _reporting.set(_reporting.get() or report)
    try:
        yield out
    finally:
        _reporting.reset(flag)
        _observers.reset(token)


def observed() -> bool:
    """Whether a report records the compilations now: the extra records and plans it reads
    (graphs without hooks, the paretos) cost compile time and are made only then."""
    return _reporting.get()


#: Attribute of the compiled graph's runtime metadata (``ViewAndMutationMeta``) holding its
#: records: AOTAutogradCache saves that object with the graph, so a cache hit has them too.
RECORDS_ATTR = "saved_tensors_hooks_records"


def publish(compiled: CompiledSavedTensors) -> None:
    """The compilation's records are final: drop their compile-time references (graph
    nodes, hook pairs), keep them on the compilation's facts, hand them to the observers.
    (The runtime-wrapper factory then puts the facts' records on the graph's runtime
    metadata, :func:`keep_with`, which AOTAutogradCache saves.)

    Not on the graph modules' ``meta``: the compile caches hash and pickle the modules.
    """
    for r in compiled.records:
        r.node = r.bw_input = r.pair = r.chosen = None
    compiled.compile_id = _compile_id()
    found = compile_facts.facts()
    if found is not None:
        found.saved_tensors.append(compiled)
    for out in _observers.get():
        out.append(compiled)


def keep_with(runtime_metadata: Any) -> None:
    """When the compiled graph's runtime wrapper is made: a fresh compilation's records go
    on its runtime metadata (``ViewAndMutationMeta``, saved with the graph by
    AOTAutogradCache); a graph loaded from the cache (no inliner ran) hands the records saved
    with it to the observers."""
    found = compile_facts.facts()
    if found is not None and found.saved_tensors:
        setattr(runtime_metadata, RECORDS_ATTR, tuple(found.saved_tensors))
        return
    for compiled in getattr(runtime_metadata, RECORDS_ATTR, ()):
        for out in _observers.get():
            out.append(dataclasses.replace(compiled, compile_id=_compile_id()))


def _compile_id() -> str | None:
    from torch._guards import CompileContext

    found = CompileContext.current_compile_id()
    return None if found is None else f"{found.frame_id}/{found.frame_compile_id}"


def log_records(compiled: CompiledSavedTensors, artifact: logging.Logger) -> None:
    """The records on the debug log, one line each, then each budget plan's summary."""
    if not artifact.isEnabledFor(logging.DEBUG):
        return
    for r in compiled.records:
        artifact.debug("%s", r.line())
    for p in compiled.plans:
        if p.partitioner_ratio is not None:
            artifact.debug(
                "budget plan (%s): the partitioner's cheap recomputation saves %.3f of the activation bytes; %s",
                p.scope,
                p.partitioner_ratio,
                "it meets the budget" if p.partitioner_met else "the plan starts from the default partition",
            )
        artifact.debug(
            "budget plan (%s): %d B planned of %d B saved, budget %d B; peak %d B at %s; est %.3f ms; %s (%s); bounds: %s; "
            "with the graphs' own tensors the step peaks at %s B at %s",
            p.scope,
            p.planned_bytes,
            p.baseline_bytes,
            p.budget_bytes,
            p.peak_bytes,
            p.peak_at,
            p.estimated_ms,
            "met" if p.met else "NOT met",
            p.preference,
            p.bounds,
            p.predicted_peak_bytes,
            p.predicted_peak_at,
        )
        for head in p.loss_heads:
            artifact.debug("budget plan (%s): %s", p.scope, head)
        for donated in p.donated_inputs:
            artifact.debug("budget plan (%s): %s", p.scope, donated)
        if p.floor_bytes is not None:
            artifact.debug("budget plan (%s): floor %d B, held by %s", p.scope, p.floor_bytes, "; ".join(p.floor_holders))
        if p.copies():
            artifact.debug("budget plan (%s): %s", p.scope, p.copies())
    if compiled.fallback:
        artifact.debug("eager fallback: %s", compiled.fallback)
