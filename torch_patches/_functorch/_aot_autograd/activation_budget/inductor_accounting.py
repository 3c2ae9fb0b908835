"""A partitioned graph pair's step peak as Inductor will run it: Inductor's own accounting.

Where the backend is Inductor, the budget prices a partition (the default one without a
plan, the partitioner's recomputations, the graphs a plan was written into) by what
Inductor will run, not by a model of it: each graph goes through what Inductor's compile
does before it generates code (its post-grad passes, its lowering, its scheduler's fusion
and order, ``reorder_for_peak_memory`` included), and the bytes alive at each of the
scheduler's nodes are read off that schedule by upstream's own estimate
(``torch/_inductor/memory.py``: ``prepare_planning_info`` and ``estimate_peak_memory``, with
Inductor's rules for which inputs a graph frees and which buffers it writes in place).
Nothing is generated, compiled to machine code or run, so no device time is spent and the
price is a function of the graph, as the plan must be (it keys the compiled graph).

A step's peak is the forward's (its inputs are the caller's: not counted), or the
backward's with its incoming gradients (autograd holds them; Inductor's estimate leaves
them out), whichever is more.  The forward's end is what the forward returns: its saved
tensors and its outputs.  Both read symbolic sizes at their hints.  Where the budget bounds
the forward's end (a graph that is one of several, compiled per layer), partitions are
compared by that alone, and only the forward is lowered (``forward_only``).

Compile time only: one lowering and scheduling per graph, about what Inductor's own compile
spends before code generation.  :func:`price` raises where Inductor cannot lower a graph
the way it was asked; the callers then price by the fx model and say so.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._ordered_set import OrderedSet

from torch_patches import config
from torch_patches._errors import SavedTensorsHookConfigError
from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.utils import graph_outputs, is_incoming_gradient, nbytes_of

__all__ = ["Accounted", "Pricing", "price", "uses_inductor"]

log = logging.getLogger(__name__)

#: Ops whose outputs are host memory (``torch_patches.hooks.cpu_offload``'s copies out), by
#: their schema's name.
_HOST_COPIES = frozenset({"saved_tensors_hooks::offload"})
#: Ops returning the input they are given where they run (``donated_inputs.owned_or_copy``:
#: the backward's own donated input), by their schema's name.
_RETURN_THEIR_INPUT = frozenset({"saved_tensors_hooks::owned_or_copy"})

#: The accounting's name in the plan's summary and the log.
INDUCTOR = "Inductor's scheduler"
FX_MODEL = "the fx model"


@dataclasses.dataclass(frozen=True)
class Accounted:
    """A graph pair's step as Inductor's accounting has it (bytes on the device)."""

    #: The most the step holds at once: the forward's peak or the backward's with its
    #: incoming gradients.
    peak: int
    #: What the forward holds when it returns (saved tensors and outputs).
    forward_end: int
    #: Where the peak is, in words (``forward buf3``, ``backward op12``).
    at: str
    #: Seconds spent lowering and scheduling both graphs.
    seconds: float = 0.0
    #: Only the forward was priced (``peak`` is the forward's): the budget bounds the
    #: forward's end, which is all partitions are compared by.
    forward_only: bool = False

    def score(self, forward_end: bool, after: int) -> int:
        """What partitions are compared by (``partition_choice._score``'s rule): the
        forward's end where the budget bounds it (a graph that is one of several), else the
        step's peak as the graph sees it, at least its forward's end beside what the rest of
        the step holds after it (``after``: a loss after a graph break reads the logits)."""
        if forward_end:
            return self.forward_end
        if self.forward_only:
            raise RuntimeError("a step's peak asked of a price of the forward alone")
        return max(self.peak, self.forward_end + after)


def uses_inductor() -> bool:
    """Whether this compilation runs inside Inductor's ``compile_fx`` (whatever backend
    called it: ``torch.compile``'s default, or one built on ``compile_fx``): Inductor has
    set its fake mode (``torch._inductor.virtualized.V``) around AOTAutograd."""
    from torch._inductor.virtualized import NullHandler, V

    return not isinstance(V.fake_mode, NullHandler)


def price(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    graphs: tuple[fx.Graph, fx.Graph] | None = None,
    activation_inputs: frozenset[str] = frozenset(),
    forward_only: bool = False,
) -> Accounted:
    """The step's peak of a partitioned graph pair by Inductor's accounting (module
    docstring): the modules' graphs, or ``graphs`` over the modules' attributes.  Nothing
    is changed: each graph is lowered from a copy.  ``activation_inputs``: the names of the
    forward's inputs another graph made that the caller would drop (a loss compiled apart
    takes the logits): the forward's end holds those it saves for the backward as it is.
    ``forward_only``: the forward alone, where the forward's end is all that is compared."""
    start = time.perf_counter()
    fw_g, bw_g = graphs or (fw_module.graph, bw_module.graph)
    fw_live, fw_names = _live_bytes(_copy(fw_module, fw_g), is_backward=False)
    fw_top = max(range(len(fw_live)), key=fw_live.__getitem__)
    peak, at = fw_live[fw_top], f"forward {fw_names[min(fw_top, len(fw_names) - 1)]}"
    if not forward_only:
        bw_live, bw_names = _live_bytes(_copy(bw_module, bw_g), is_backward=True)
        tangents = sum(nbytes_of(n) for n in bw_g.find_nodes(op="placeholder") if is_incoming_gradient(n))
        bw_top = max(range(len(bw_live)), key=bw_live.__getitem__)
        if bw_live[bw_top] + tangents > peak:
            peak, at = bw_live[bw_top] + tangents, f"backward {bw_names[min(bw_top, len(bw_names) - 1)]}"
    saved_inputs = {a for a in graph_outputs(fw_g) if isinstance(a, fx.Node) and a.op == "placeholder" and a.name in activation_inputs}
    forward_end = fw_live[-1] + sum(nbytes_of(n) for n in saved_inputs)
    return Accounted(max(peak, forward_end), forward_end, at, time.perf_counter() - start, forward_only)


def _live_bytes(copy: fx.GraphModule, is_backward: bool) -> tuple[list[int], list[str]]:
    """The bytes alive at each of Inductor's scheduler nodes for the graph of ``copy`` (which
    Inductor's passes rewrite; the last entry: after every node ran, the outputs), and the
    nodes' names.  Inductor is imported here, as ``torch.compile`` imports it: on first
    use, not when torch_patches is."""
    from torch._inductor import memory
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    inputs = [n.meta.get("val") for n in copy.graph.find_nodes(op="placeholder")]
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None:
        raise RuntimeError("the graph's inputs carry no fake values")
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(copy, is_inference=False)
    lowering = GraphLowering(copy, example_inputs=inputs, shape_env=fake_mode.shape_env, is_inference=False, is_backward=is_backward)
    with DebugContext(), V.set_fake_mode(fake_mode), V.set_graph_handler(lowering), V.set_extern_kernel_nodes([]):
        lowering.run(*inputs)
        lowering._update_scheduler()
        scheduler = lowering.scheduler
        nodes = scheduler.nodes
        outputs = OrderedSet(lowering.get_output_names())
        _, freeable = memory.prepare_planning_info(
            nodes, scheduler.name_to_buf, scheduler.name_to_fused_node, OrderedSet(lowering.graph_inputs.keys()), outputs
        )
        _off_the_device(nodes, set(lowering.graph_inputs) - set(freeable))
        _, live = memory.estimate_peak_memory(nodes, freeable, outputs)
        return [int(b) for b in live], [n.get_name() for n in nodes] or ["(no kernel)"]


def _off_the_device(nodes: list[Any], held: set[str]) -> None:
    """Buffers that hold no bytes of the graph's device of their own, set to nothing in
    Inductor's estimate (which counts every buffer it schedules):

    * those aliasing what the caller holds (``held``: the graph's inputs Inductor does not
      free): an extern kernel returning an alias of an input (``save_apart``), whose output
      Inductor's estimate counts as an allocation (``FallbackKernel``'s ``size_alloc``),
      the outputs aliasing it in turn, and ``owned_or_copy``, which returns the donated
      input it is given;
    * the host copies ``cpu_offload``'s ``offload`` makes (host memory by contract, on a
      CPU-only run too)."""
    held = set(held)
    for node in nodes:
        for buf in node.get_outputs():
            ir_node = buf.node
            op = getattr(getattr(getattr(ir_node, "op_overload", None), "_schema", None), "name", None)
            aliases = list(getattr(ir_node, "get_inputs_that_alias_output", lambda: ())())
            if not aliases and op in _RETURN_THEIR_INPUT:
                aliases = [getattr(t, "get_name", lambda: "")() for t in getattr(ir_node, "inputs", ())]
            if (aliases and all(a in held for a in aliases)) or op in _HOST_COPIES:
                buf.mpi_buffer.size_alloc = buf.mpi_buffer.size_free = 0
                held.add(buf.get_name())


def _copy(module: fx.GraphModule, of: fx.Graph) -> fx.GraphModule:
    """A module over a copy of the graph ``of`` (the same nodes' names and a shallow copy of
    their ``meta``), reading ``module``'s attributes: Inductor's passes rewrite the copy."""
    graph = fx.Graph()
    out = graph.graph_copy(of, {})
    graph.output(out)
    return fx.GraphModule(module, graph)


def price_or_none(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    what: str,
    graphs: tuple[fx.Graph, fx.Graph] | None = None,
    activation_inputs: frozenset[str] = frozenset(),
    forward_only: bool = False,
) -> Accounted | None:
    """:func:`price`, or None where Inductor cannot lower the pair (said in the log: the
    caller then prices by the fx model)."""
    try:
        return price(fw_module, bw_module, graphs, activation_inputs, forward_only)
    except Exception as e:  # noqa: BLE001 - the fx model prices it instead; said in the log
        log.debug("%s could not be priced by %s (%s: %s); the fx model prices it", what, INDUCTOR, type(e).__name__, e, exc_info=True)
        return None


def nbytes_in_words(n: int) -> str:
    """``123456789 B (117.7 MiB)``."""
    return f"{n} B ({n / 2**20:.1f} MiB)"


class Pricing:
    """The accounting one compilation prices its partitions by, and what it priced, by role
    (``default``, ``cheap``, ``knapsack``, ``plan``): the partition choice and the ceiling
    price each partition once.  Disabled (every price None: the fx model prices) where the
    backend is not Inductor or ``config.activation_budget_accounting`` is ``"fx"``."""

    def __init__(self, enabled: bool, activation_inputs: frozenset[str] = frozenset()) -> None:
        self.enabled = enabled
        self.activation_inputs = activation_inputs
        self.priced: dict[str, Accounted | None] = {}

    @classmethod
    def for_compilation(cls, fw_module: fx.GraphModule, inner_meta: Any, static_input_indices: list[int]) -> Pricing:
        """The pricing of one compilation's partitions (its forward's inputs that are
        activations another graph made: :func:`price`'s ``activation_inputs``)."""
        mode = config.activation_budget_accounting
        if mode not in ("auto", "fx"):
            raise SavedTensorsHookConfigError(f"torch_patches.config.activation_budget_accounting must be 'auto' or 'fx', got {mode!r}")
        if mode != "auto" or not uses_inductor():
            return cls(False)
        held = act_inputs.held_by_caller(fw_module, inner_meta, static_input_indices)
        return cls(True, frozenset(n.name for n in fw_module.graph.find_nodes(op="placeholder") if n not in held))

    @property
    def name(self) -> str:
        return INDUCTOR if self.enabled else FX_MODEL

    def of(
        self,
        role: str,
        fw_module: fx.GraphModule,
        bw_module: fx.GraphModule,
        graphs: tuple[fx.Graph, fx.Graph] | None = None,
        forward_only: bool = False,
    ) -> Accounted | None:
        """``role``'s price (priced once; None where disabled or Inductor cannot lower it):
        the modules' graphs, or ``graphs`` over their attributes.  ``forward_only``: where
        the budget bounds the forward's end, the forward alone (a price of the pair serves
        too; one of the forward alone is priced again where the pair's is asked)."""
        if not self.enabled:
            return None
        known = self.priced.get(role)
        if role not in self.priced or (known is not None and known.forward_only and not forward_only):
            what = f"the {role} partition"
            self.priced[role] = found = price_or_none(fw_module, bw_module, what, graphs, self.activation_inputs, forward_only)
            if found is not None:
                log.debug("the %s partition priced by %s in %.2f s: %s", role, INDUCTOR, found.seconds, found)
        return self.priced[role]

    def rule_out(self, role: str) -> None:
        """``role``'s partition is not one to price or hold a plan against (the knapsack
        where it recomputes a random op or reads a mutated input)."""
        self.priced[role] = None
