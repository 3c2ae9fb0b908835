"""Tracing saved-tensor hooks into graphs, and the hook contract checked on the way.

Used by the inliner (``graph_compile``) for every saved tensor and by Dynamo's in-region
scopes (``torch_patches/_dynamo/variables/ctx_manager.py``) to trial-trace hooks when a
scope is entered.  A hook is traced with ``make_fx`` on the saved tensor's fake value,
functionalized, with the backend's decompositions; captured tensors become graph constants;
side effects (I/O, audit events), mutation of what the hook captures or of its input, and
reads of tensor values are refused with a :class:`SavedTensorsHookError` naming the hook, the
saved tensor and the reason.  What unpack returns is checked against the saved tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx, py_sym_types
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_patches import config
from torch_patches._errors import SavedTensorsHookError
from torch_patches._functorch._aot_autograd import hook_audit, hook_identity as hook_keys, packed_subclasses, utils as hook_utils
from torch_patches._functorch._aot_autograd.hook_identity import hook_identity
from torch_patches.hooks.markers import PairKind, decode

_CONSTANT_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


@dataclasses.dataclass(frozen=True)
class HookPair:
    """The hooks that apply to a group of saved tensors: a pair (the library's ``HookPair``)
    with the scope it was entered in."""

    pack: Callable[..., Any]
    unpack: Callable[..., Any]
    label: str  # "ambient", or the in-graph scope's name
    #: What the pair is (inlineable, a ``select``, a ``budget``), decoded once.
    kind: PairKind = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", decode((self.pack, self.unpack)))

    @property
    def names(self) -> str:
        return f"pack={hook_utils.hook_name(self.pack)}, unpack={hook_utils.hook_name(self.unpack)}"


def dynamo_fullgraph() -> bool:
    """True when the compilation in progress was asked for one graph."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not under Dynamo
        return False
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


_BRANCHES = ("if ", "elif ", "while ", "assert ")


def _hook_line(e: BaseException, fn: Any) -> tuple[str, int, str] | None:
    """(file, line, source) of the hook's own line the error came from, if any."""
    import linecache

    code = getattr(fn, "__code__", None)
    found = None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            found = (code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    return (*found, linecache.getline(*found).strip())


def _describe_trace_error(e: BaseException, fn: Any = None) -> str:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    where = _hook_line(e, fn)
    at = f" (at {where[0]}:{where[1]}: {where[2]})" if where else ""
    if isinstance(e, (GuardOnDataDependentSymNode, DataDependentOutputException)):
        # Which one a value read raises depends on the fake mode's settings; the hook's
        # line tells a Python branch on values from a value read into Python.
        if isinstance(e, GuardOnDataDependentSymNode) or (where and where[2].startswith(_BRANCHES)):
            return f"it branches on a tensor's values (data-dependent Python control flow){at}"
        return f"it reads a tensor's values into Python (.item(), .tolist(), ...){at}"
    if isinstance(e, DynamicOutputShapeException):
        return f"it has an output whose shape depends on tensor values{at}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"tracing it raised {type(e).__name__}: {first}{at}"


class _NotTraceableOutput(Exception):
    """A hook returned something the graphs cannot carry."""


@dataclasses.dataclass
class Traced:
    gm: fx.GraphModule
    out_args: Any  # output node args: pytree of fx.Node / constants
    out_vals: Any  # same structure, with example values
    # pack only: how tensor-subclass outputs were flattened into out_args (None: none were)
    layout: packed_subclasses.SubclassLayout | None = None
    #: How many trailing placeholders stand for tensors the hook reads that are runtime
    #: inputs of the graphs (``hook_inputs.find_inputs``), in the order they were given.
    num_inputs: int = 0


def hook_error(
    fn: Any,
    reason: str,
    cause: BaseException | None = None,
    *,
    role: str,
    pair: HookPair,
    saved: fx.Node | None,
) -> SavedTensorsHookError:
    """The error that says why ``fn`` cannot be inlined (for ``saved``, where known)."""
    hook = hook_utils.hook_name(fn)
    where = "" if saved is None else (f" for saved tensor {saved.name!r} ({hook_utils.describe_value(saved.meta.get('val'))})")
    err = SavedTensorsHookError(f"{role} hook {hook} cannot be inlined{where}: {reason}", hook=hook, reason=reason)
    err.scope = pair.label  # type: ignore[attr-defined]
    err.identity = hook_identity(fn).digest  # type: ignore[attr-defined]
    err.hook_object = fn  # type: ignore[attr-defined]
    err.__cause__ = cause
    return err


def check_keyable(pair: HookPair) -> None:
    """Raise if a dependency of the pair cannot be keyed (outcome (c) of ``hook_walk``):
    a graph with it baked in could be reused after it changed, so it is not inlined."""
    for role, fn in (("pack", pair.pack), ("unpack", pair.unpack)):
        reasons = hook_identity(fn).unkeyable
        if reasons:
            raise hook_error(fn, reasons[0], role=role, pair=pair, saved=None)


def _recording(name: str) -> Any:
    """``dict``'s method ``name``, recording that it was called (:class:`HookContext`)."""
    method = getattr(dict, name)

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.read = True
        return method(self, *args, **kwargs)

    return recorded


class HookContext(dict):
    """Upstream's saved-tensor hook context (``_get_saved_tensor_hook_context()``: the
    graphs and the saved node), recording whether the hook read it: a trace that did
    depends on the saved tensor it was made for and is not reused for another."""

    read = False

    __getitem__ = _recording("__getitem__")
    __contains__ = _recording("__contains__")
    __iter__ = _recording("__iter__")
    get = _recording("get")
    keys = _recording("keys")
    values = _recording("values")
    items = _recording("items")
    copy = _recording("copy")


def trace_key(pair: HookPair, val: torch.Tensor) -> Any:
    """What a hook's trace depends on besides the hook: the saved tensor's metadata (sizes
    and strides as expressions, so symbolic shapes key by symbol)."""
    return (
        id(pair.pack),
        id(pair.unpack),
        val.dtype,
        val.device,
        val.layout,
        tuple(str(s) for s in val.shape),
        tuple(str(s) for s in val.stride()),
        str(val.storage_offset()),
    )


def trace_hook(
    fn: Callable[..., Any],
    example: Any,
    *,
    aot_config: Any,
    role: str,
    pair: HookPair,
    saved: fx.Node | None,
    context: HookContext | None = None,
    layout: packed_subclasses.SubclassLayout | None = None,
    inputs: tuple[torch.Tensor, ...] = (),
) -> Traced:
    """make_fx one hook on ``example`` (a pytree), functionalized, with decompositions.

    Pack outputs that are tensor subclasses are traced flattened (``Traced.layout`` says
    how); an unpack given that ``layout`` receives them rebuilt.  ``inputs``: tensors the
    hook reads that are runtime inputs of the graphs: traced as trailing placeholders (the
    tracer follows the objects themselves, however the hook reaches them), so nothing
    computed from them is baked into the graph.
    """
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
    from torch._functorch._aot_autograd import graph_compile as gc
    from torch._functorch._aot_autograd.utils import contain_metadata_mutation_ops

    flat, spec = pytree.tree_flatten(example)

    flattened: list[packed_subclasses.SubclassLayout | None] = [None]

    def flat_fn(*all_args: Any) -> Any:
        args = all_args[: len(flat)]  # the rest: ``inputs``, read by the hook itself
        if layout is not None:
            arg = packed_subclasses.rebuild_subclasses(list(args), layout)
        else:
            arg = pytree.tree_unflatten(list(args), spec)
        out = fn(arg)
        if role == "pack":
            out, flattened[0] = packed_subclasses.flatten_subclasses(out)
        for leaf in pytree.tree_leaves(out):
            if is_traceable_wrapper_subclass(leaf):  # unpack: the saved tensor is plain
                raise _NotTraceableOutput(
                    f"it returns a tensor subclass ({type(leaf).__qualname__}); unpack must return a plain tensor like the saved one"
                )
            if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES, *py_sym_types)):
                raise _NotTraceableOutput(f"it returns a {type(leaf).__name__}, which is neither a tensor nor a constant")
        return out

    fail = functools.partial(hook_error, fn, role=role, pair=pair, saved=saved)

    before = _purity_key(fn)
    try:
        with (
            gc._saved_tensor_hook_context(context if context is not None else {}),
            _disable_saved_tensors_hooks_during_tracing(),
            _captured_tensors_as_constants(flat),
            _no_side_effects(fn) as effects,
        ):
            gm = make_fx(
                torch.func.functionalize(flat_fn, remove="mutations"),
                decomposition_table=getattr(aot_config, "decompositions", None),
                record_module_stack=True,
            )(*flat, *inputs)
    except SavedTensorsHookError:
        raise
    except _NotTraceableOutput as e:
        raise fail(str(e)) from None
    except Exception as e:  # noqa: BLE001 - every tracing failure is reported
        raise fail(_describe_trace_error(e, fn), e) from e
    if effects:
        raise fail(f"it has side effects ({'; '.join(effects)})")
    if before is not None and _purity_key(fn) != before:
        raise fail("it mutates state it captures (a global, closure cell or captured tensor)")

    if gm.graph.find_nodes(op="call_function", target=torch.ops.aten._local_scalar_dense.default):
        # Traceable as an unbacked symbol, but a device-to-host sync per saved tensor and
        # a graph that depends on tensor values: not what a saved-tensors hook should do.
        raise fail("it reads a tensor's values into Python (.item(), .tolist(), ...)")
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.copy_.default and node.args[0] in placeholders:
            raise fail("it mutates its input in place")
    if contain_metadata_mutation_ops(gm):
        raise fail("it mutates tensor metadata (set_, resize_, ...)")

    out_args = gm.graph.output_node().args[0]
    out_vals = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), out_args)
    for leaf in pytree.tree_leaves(out_vals):
        if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES, *py_sym_types)):
            raise fail(f"it returns a {type(leaf).__name__}, which is neither a tensor nor a constant")
    return Traced(gm, out_args, out_vals, flattened[0], len(inputs))


def trace_pair(
    pair: HookPair,
    example: Any,
    *,
    aot_config: Any,
    saved: fx.Node | None,
    context: HookContext | None = None,
    inputs: tuple[torch.Tensor, ...] = (),
) -> tuple[Traced, Traced]:
    """Trace ``pair.pack`` on ``example`` and ``pair.unpack`` on what pack returns
    (``inputs``: see :func:`trace_hook`)."""
    pack = trace_hook(pair.pack, example, aot_config=aot_config, role="pack", pair=pair, saved=saved, context=context, inputs=inputs)
    unpack = trace_hook(
        pair.unpack,
        pack.out_vals,
        aot_config=aot_config,
        role="unpack",
        pair=pair,
        saved=saved,
        context=context,
        layout=pack.layout,
        inputs=inputs,
    )
    return pack, unpack


@contextlib.contextmanager
def _captured_tensors_as_constants(flat: list[Any]) -> Iterator[None]:
    """Let the hook use real tensors it captured (a scale, a buffer, a parameter).

    make_fx records each as a constant of the traced graph (``get_attr``), which the
    inliner moves onto the forward/backward module: the compiled graph holds the tensor
    itself, never a copy or its printed values, whatever its size. The fake mode has to
    accept them as inputs for that (it would otherwise refuse with an internal assertion
    that prints the tensor element by element). Whether a captured tensor may be reused is
    the guard's business (``hook_walk``: small CPU tensors by value, others by
    identity and version).
    """
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    modes = {id(m): m for m in (maybe_get_fake_mode(x) for x in flat) if m is not None}
    saved = [(m, m.allow_non_fake_inputs) for m in modes.values()]
    for m, _ in saved:
        m.allow_non_fake_inputs = True
    try:
        yield
    finally:
        for m, value in saved:
            m.allow_non_fake_inputs = value


def trial_trace(pair: HookPair, devices: Sequence[torch.device] = ()) -> SavedTensorsHookError | None:
    """Trace ``pair`` on a stand-in activation (fake float32[4, 8]); the error, if any.

    Run by Dynamo when a scope is entered inside a compiled region, so an untraceable
    hook is reported (or graph-broken around) before the region is compiled. The stand-in
    is tried on each of ``devices`` (the region's: a hook reading a CUDA tensor traces on a
    CUDA activation, not on a CPU one), the CPU where none is given; the hook traces if it
    traces on one of them, else the first device's error. The inliner traces again on each
    real saved tensor.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    sel = pair.kind.selection
    try:
        check_keyable(pair)
    except SavedTensorsHookError as e:
        return e
    if sel is not None:  # traced as the inliner traces it: the inner hooks
        pair = HookPair(sel.pack, sel.unpack, pair.label)
    first = None
    for device in dict.fromkeys(devices or (torch.device("cpu"),)):
        # With a ShapeEnv, as in AOTAutograd: the same failures, for the same reasons.
        with FakeTensorMode(shape_env=ShapeEnv()):
            example = torch.empty(4, 8, device=device)
        try:
            trace_pair(pair, example, aot_config=None, saved=None)
        except SavedTensorsHookError as e:
            first = first or e
            continue
        return None
    return first


def _purity_key(fn: Any) -> Any:
    # Plain functions can read (and so mutate) globals and closures; GraphModules cannot.
    if isinstance(fn, torch.fx.GraphModule):
        return None
    try:
        return hook_keys.content_key(fn)
    except Exception:  # noqa: BLE001
        return None


@contextlib.contextmanager
def _no_side_effects(fn: Any) -> Iterator[list[str]]:
    """Collect I/O a plain-function hook attempts while it is traced (files, processes,
    sockets; this thread only), through the package's audit hook (``hook_audit``).

    Prints are found before tracing, in the hook's code (``hook_walk``: a hook that
    reaches ``print``/``open``/``sys.stdout`` is not keyable), so no stream is ever swapped.
    GraphModules cannot reach the world: nothing to record."""
    if isinstance(fn, torch.fx.GraphModule):
        yield []
        return
    with hook_audit.recording() as records:
        yield records


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return a.dim() == b.dim() and statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape)))


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(statically_known_true(sa == sb) or statically_known_true(n <= 1) for sa, sb, n in zip(a.stride(), b.stride(), a.shape))


def check_unpacked(out: Any, val: torch.Tensor, pair: HookPair, saved: fx.Node) -> bool:
    """Validate unpack's output; True if its strides must be restored in-graph."""
    hook = hook_utils.hook_name(pair.unpack)

    def mismatch(what: str, expected: Any, got: Any) -> SavedTensorsHookError:
        reason = f"{what} mismatch: expected {expected}, got {got}"
        return SavedTensorsHookError(
            f"unpack hook {hook} returned a tensor that does not match saved tensor "
            f"{saved.name!r}: {reason} (expected {hook_utils.describe_value(val)}, got {hook_utils.describe_value(out)})",
            hook=hook,
            reason=reason,
        )

    if not isinstance(out, torch.Tensor):
        raise SavedTensorsHookError(
            f"unpack hook {hook} must return one tensor for saved tensor {saved.name!r}, got {type(out).__name__}",
            hook=hook,
            reason="unpack must return one tensor",
        )
    if not config.validate_unpack:
        return False
    if out.dtype != val.dtype:
        raise mismatch("dtype", val.dtype, out.dtype)
    if not _same_shape(out, val):
        raise mismatch("shape", list(val.shape), list(out.shape))
    if out.device != val.device:
        raise mismatch("device", val.device, out.device)
    return not _same_strides(out, val)
