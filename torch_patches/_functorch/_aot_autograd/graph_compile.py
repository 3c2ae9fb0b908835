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
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import is_sym_node, make_fx, py_sym_types
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_patches import _compile_facts, _hook_scopes, _logging as tp_logging, config
from torch_patches._errors import SavedTensorsHookError
from torch_patches._functorch._aot_autograd import (
    activation_inputs as act_inputs,
    packed_subclasses,
    utils as hook_utils,
)
from torch_patches._hook_identity import hook_identity


log = logging.getLogger(__name__)
UPSTREAM_MODULE = "torch._functorch._aot_autograd.graph_compile"

#: node.meta key on every node we insert: {"role": "pack"|"unpack", "saved": name, "hook": label}
HOOK_META = "torch_patches_hook"

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
    """The hooks that apply to a group of saved tensors."""

    pack: Callable[..., Any]
    unpack: Callable[..., Any]
    label: str  # "ambient", or the in-graph scope's name

    @property
    def names(self) -> str:
        return f"pack={hook_utils.hook_name(self.pack)}, unpack={hook_utils.hook_name(self.unpack)}"


# --------------------------------------------------------------- compile decisions

def _record_decision(inlined: bool) -> None:
    # Read by the runtime-wrapper patch of the same compilation, so a graph whose hooks
    # fell back to eager keeps them enabled at runtime.
    found = _compile_facts.facts()
    if found is not None:
        key = hook_utils.hooks_guard_key(hook_utils.top_saved_tensors_hooks())
        found.hooks_inlined = (key, inlined)


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
        f"torch_patches: {error}. {consequence}. Compile with fullgraph=True to make "
        "this an error.",
        stacklevel=3,
    )


def mark_not_cacheable(reason: str) -> bool:
    """The compilation in progress must not be saved to AOTAutogradCache.

    Recorded on the compilation's facts (read by the AOTAutogradCache save patch, also when
    the entry is saved at the first backward on autograd's thread, under the restored
    context). False when there is no compilation context to carry it.
    """
    found = _compile_facts.facts()
    if found is None:
        return False
    log.info("not cacheable: %s", reason)
    found.not_cacheable.append(reason)
    return True


def not_cacheable_reasons() -> list[str]:
    """Why the compilation in progress must not be saved to AOTAutogradCache (empty: it may)."""
    found = _compile_facts.facts()
    return list(found.not_cacheable) if found is not None else []


def inlined_decision() -> bool | None:
    """Whether the compilation in progress inlined the ambient hooks (None: it did not try,
    e.g. a cache hit, or the ambient hooks changed since)."""
    found = _compile_facts.facts()
    if found is None or found.hooks_inlined is None:
        return None
    key, inlined = found.hooks_inlined
    if key != hook_utils.hooks_guard_key(hook_utils.top_saved_tensors_hooks()):
        return None
    return inlined


# ------------------------------------------------------------------- scope lookup


def _ambient_pair() -> HookPair | None:
    hooks = hook_utils.top_saved_tensors_hooks()
    if not hook_utils.saved_tensors_hooks_are_inlineable(hooks):
        return None
    return HookPair(hooks[0], hooks[1], "ambient")


def hooks_for_saved(
    saved: fx.Node,
    bw_input: fx.Node | None,
    bw_order: dict[fx.Node, int],
    ambient: HookPair | None,
) -> HookPair | None:
    """The hooks a saved tensor takes: those of the scope the op that saved it ran in.

    In-graph scopes (``saved_tensors_hooks`` entered inside the compiled region) are
    recorded on nodes by the Dynamo patch (see ``scope_of`` for the rule); a saved tensor
    outside every in-graph scope takes the hooks active around the compiled call.
    """
    scope = _hook_scopes.scope_of(saved, bw_input, bw_order)
    if scope is _hook_scopes.NO_SCOPE:
        return ambient
    return scope


# ---------------------------------------------------------------------- selection


def _filtered_by_mode(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    saved_tensors: list[fx.Node],
    num_inner_fwd_outputs: int,
    static_input_indices: list[int],
) -> set[fx.Node] | None:
    """Saved tensors upstream's filtering mode allows hooks on (None = all)."""
    from torch._functorch._aot_autograd import graph_compile as gc, utils as aot_utils

    mode = torch._functorch.config.saved_tensors_hooks_filtering_mode
    if mode == "all":
        return None
    if mode == "no_static":
        placeholders = fw_module.graph.find_nodes(op="placeholder")
        static = {placeholders[i] for i in static_input_indices}
        return {n for n in saved_tensors if n not in static}
    if mode != "donated":
        raise ValueError(f"unknown saved_tensors_hooks_filtering_mode {mode!r}")
    # Donated buffers: saved intermediates that alias no graph input or output, so
    # packing them really frees their memory.
    if aot_utils.contain_metadata_mutation_ops(
        fw_module
    ) or aot_utils.contain_metadata_mutation_ops(bw_module):
        return set()

    def vals(nodes: Any) -> list[Any]:
        return [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]

    fw_outs = fw_module.graph.output_node().args[0]
    bw_outs = bw_module.graph.output_node().args[0]
    idxs = gc.collect_fw_donated_buffer_idxs(
        vals(fw_module.graph.find_nodes(op="placeholder")),
        vals(fw_outs[:num_inner_fwd_outputs]),
        vals(bw_outs),
        vals(saved_tensors),
    )
    return {saved_tensors[i] for i in idxs}


# ------------------------------------------------------------------------ tracing


def _dynamo_fullgraph() -> bool:
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
class _Traced:
    gm: fx.GraphModule
    out_args: Any  # output node args: pytree of fx.Node / constants
    out_vals: Any  # same structure, with example values
    # pack only: how tensor-subclass outputs were flattened into out_args (None: none were)
    layout: packed_subclasses.SubclassLayout | None = None


def _hook_error(
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
    where = "" if saved is None else (
        f" for saved tensor {saved.name!r} ({hook_utils.describe_value(saved.meta.get('val'))})"
    )
    err = SavedTensorsHookError(
        f"{role} hook {hook} cannot be inlined{where}: {reason}", hook=hook, reason=reason
    )
    err.scope = pair.label  # type: ignore[attr-defined]
    err.identity = hook_identity(fn).digest  # type: ignore[attr-defined]
    err.hook_object = fn  # type: ignore[attr-defined]
    err.__cause__ = cause
    return err


def check_keyable(pair: HookPair) -> None:
    """Raise if a dependency of the pair cannot be keyed (outcome (c) of ``_hook_identity``):
    a graph with it baked in could be reused after it changed, so it is not inlined."""
    for role, fn in (("pack", pair.pack), ("unpack", pair.unpack)):
        reasons = hook_identity(fn).unkeyable
        if reasons:
            raise _hook_error(fn, reasons[0], role=role, pair=pair, saved=None)


def _trace_hook(
    fn: Callable[..., Any],
    example: Any,
    *,
    aot_config: Any,
    role: str,
    pair: HookPair,
    saved: fx.Node | None,
    bw_graph: fx.Graph | None,
    layout: packed_subclasses.SubclassLayout | None = None,
) -> _Traced:
    """make_fx one hook on ``example`` (a pytree), functionalized, with decompositions.

    Pack outputs that are tensor subclasses are traced flattened (``_Traced.layout`` says
    how); an unpack given that ``layout`` receives them rebuilt.
    """
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
    from torch._functorch._aot_autograd import graph_compile as gc
    from torch._functorch._aot_autograd.utils import contain_metadata_mutation_ops

    flat, spec = pytree.tree_flatten(example)

    flattened: list[packed_subclasses.SubclassLayout | None] = [None]

    def flat_fn(*args: Any) -> Any:
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
                    f"it returns a tensor subclass ({type(leaf).__qualname__}); unpack "
                    "must return a plain tensor like the saved one"
                )
            if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES, *py_sym_types)):
                raise _NotTraceableOutput(
                    f"it returns a {type(leaf).__name__}, which is neither a tensor nor a constant"
                )
        return out

    fail = functools.partial(_hook_error, fn, role=role, pair=pair, saved=saved)

    before = _purity_key(fn)
    try:
        with (
            gc._saved_tensor_hook_context(
                {"_fw_graph": saved.graph, "_bw_graph": bw_graph, "_node": saved}
                if saved is not None
                else {}
            ),
            _disable_saved_tensors_hooks_during_tracing(),
            _captured_tensors_as_constants(flat),
            _no_side_effects(fn) as effects,
        ):
            gm = make_fx(
                torch.func.functionalize(flat_fn, remove="mutations"),
                decomposition_table=getattr(aot_config, "decompositions", None),
                record_module_stack=True,
            )(*flat)
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
            raise fail(
                f"it returns a {type(leaf).__name__}, which is neither a tensor nor a constant"
            )
    return _Traced(gm, out_args, out_vals, flattened[0])


@__import__("contextlib").contextmanager
def _captured_tensors_as_constants(flat: list[Any]) -> Iterator[None]:
    """Let the hook use real tensors it captured (a scale, a buffer, a parameter).

    make_fx records each as a constant of the traced graph (``get_attr``), which the
    inliner moves onto the forward/backward module: the compiled graph holds the tensor
    itself, never a copy or its printed values, whatever its size. The fake mode has to
    accept them as inputs for that (it would otherwise refuse with an internal assertion
    that prints the tensor element by element). Whether a captured tensor may be reused is
    the guard's business (``_hook_identity``: small CPU tensors by value, others by
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


def trial_trace(pair: HookPair) -> SavedTensorsHookError | None:
    """Trace ``pair`` on a stand-in activation (fake float32[4, 8]); the error, if any.

    Run by Dynamo when a scope is entered inside a compiled region, so an untraceable
    hook is reported (or graph-broken around) before the region is compiled. The inliner
    traces again on each real saved tensor.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # With a ShapeEnv, as in AOTAutograd: the same failures, for the same reasons.
    with FakeTensorMode(shape_env=ShapeEnv()):
        example = torch.empty(4, 8)
    from torch_patches.hooks.select import unwrap_select

    sel = unwrap_select((pair.pack, pair.unpack))
    try:
        check_keyable(pair)
        if sel is not None:  # traced as the inliner traces it: the inner hooks
            pair = HookPair(sel[0], sel[1], pair.label)
        packed = _trace_hook(pair.pack, example, aot_config=None, role="pack", pair=pair, saved=None, bw_graph=None)
        _trace_hook(
            pair.unpack,
            packed.out_vals,
            aot_config=None,
            role="unpack",
            pair=pair,
            saved=None,
            bw_graph=None,
            layout=packed.layout,
        )
    except SavedTensorsHookError as e:
        return e
    return None


def _purity_key(fn: Any) -> Any:
    # Plain functions can read (and so mutate) globals and closures; GraphModules cannot.
    if isinstance(fn, torch.fx.GraphModule):
        return None
    try:
        return hook_utils.content_key(fn)
    except Exception:  # noqa: BLE001
        return None


_MODULE_FILES = (".py", ".pyc", ".so", ".pyd")


class _SideEffectProbe:
    """Records I/O a plain-function hook attempts while it is traced (files, processes,
    sockets), through a Python audit hook.

    Prints are found before tracing, in the hook's code (``_hook_identity``: a hook that
    reaches ``print``/``open``/``sys.stdout`` is not keyable), so no stream is ever swapped.
    Audit hooks cannot be removed (PEP 578): ours is added once, at the first trace of a
    plain-function hook, and records only in the thread that is tracing, while it traces;
    at any other time, and after ``torch_patches.unapply()``, it returns at once.
    """

    _installed = False
    _lock = threading.Lock()
    _active = threading.local()
    _EVENTS = ("open", "os.", "subprocess.", "socket.", "shutil.", "builtins.input")

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                import sys

                sys.addaudithook(cls._audit)
                cls._installed = True

    @classmethod
    def _audit(cls, event: str, args: tuple[Any, ...]) -> None:
        records = getattr(cls._active, "records", None)
        if records is None:
            return
        if event == "open" and args and isinstance(args[0], str) and args[0].endswith(_MODULE_FILES):
            return  # imports and source lookups, not the hook's I/O
        if event.startswith(cls._EVENTS) and not event.startswith("os.listdir"):
            records.append(event)


@__import__("contextlib").contextmanager
def _no_side_effects(fn: Any) -> Iterator[list[str]]:
    """Collect I/O a plain-function hook performs while it is traced (this thread only)."""
    records: list[str] = []
    if isinstance(fn, torch.fx.GraphModule):
        yield records
        return
    _SideEffectProbe.install()
    _SideEffectProbe._active.records = records
    try:
        yield records
    finally:
        _SideEffectProbe._active.records = None
        records[:] = list(dict.fromkeys(records))


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return a.dim() == b.dim() and statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape)))


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(
        statically_known_true(sa == sb) or statically_known_true(n <= 1)
        for sa, sb, n in zip(a.stride(), b.stride(), a.shape)
    )


# --------------------------------------------------------------------- the plan


@dataclasses.dataclass
class _SavedPlan:
    saved: fx.Node  # forward output node saved for backward
    pair: HookPair
    pack: _Traced
    unpack: _Traced
    restride: bool


def _unique(graphs: tuple[fx.Graph, ...], candidate: str) -> str:
    names = set()
    for g in graphs:
        names.update(n.name for n in g.nodes)
    if candidate not in names:
        return candidate
    for i in itertools.count():
        c = f"{candidate}_{i}"
        if c not in names:
            return c
    raise AssertionError("unreachable")


def _copy_into(
    graph: fx.Graph,
    owner: fx.GraphModule,
    src: fx.GraphModule,
    env: dict[fx.Node, Any],
    names: dict[fx.Node, str],
    tag: dict[str, str],
    only: set[fx.Node] | None = None,
) -> list[fx.Node]:
    """Copy ``src``'s body (no placeholders/output; only the nodes in ``only``, when
    given, and those not copied yet) at the graph's insert point."""
    new_nodes = []
    for node in src.graph.nodes:
        if node.op in ("placeholder", "output") or node in env:
            continue
        if only is not None and node not in only:
            continue
        target = node.target
        if node.op == "get_attr":
            # Constants the hook created (make_fx lifts them onto its module).
            value = getattr(src, str(node.target))
            target = _unique((graph,), "_torch_patches_hook_constant")
            while hasattr(owner, target):
                target += "_"
            setattr(owner, target, value)
        new = graph.create_node(
            node.op,
            target,
            fx.map_arg(node.args, lambda n: env[n]),
            fx.map_arg(node.kwargs, lambda n: env[n]),
            name=names.get(node),
            type_expr=node.type,
        )
        new.meta = copy.copy(node.meta)
        new.meta[HOOK_META] = dict(tag)
        env[node] = new
        new_nodes.append(new)
        if node.op == "get_attr" and isinstance(getattr(owner, target), torch.Tensor):
            # Read the constant through lift_fresh, as AOTAutograd does for constants it
            # traces: fake-tensor propagation of the graph (Inductor re-runs it) accepts a
            # real tensor only there. lift_fresh returns its input (no copy; Inductor: a
            # nop). 0-d constants take lift_fresh_copy: Inductor inlines them as a scalar,
            # which only a computation (the copy, fused into its reader) can consume.
            value = getattr(owner, target)
            lift = torch.ops.aten.lift_fresh_copy if value.dim() == 0 else torch.ops.aten.lift_fresh
            lifted = graph.call_function(lift.default, (new,))
            lifted.meta = {"val": _fake_constant(value, env), HOOK_META: dict(tag)}
            env[node] = lifted
            new_nodes.append(lifted)
    return new_nodes


def _fake_constant(value: torch.Tensor, env: dict[fx.Node, Any]) -> Any:
    """A fake of ``value`` in the fake mode of the graph being edited, for node meta."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    for known in env.values():
        mode = maybe_get_fake_mode(known.meta.get("val")) if isinstance(known, fx.Node) else None
        if mode is not None:
            return mode.from_tensor(value, static_shapes=True)
    return None


def _mutates(user: fx.Node, arg: fx.Node) -> bool:
    target = user.target
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
            if value is arg:
                return True
    return False


def _forward_anchor(saved: fx.Node, order: dict[fx.Node, int], placement: str) -> fx.Node:
    """The node after which saved's pack goes."""
    graph = saved.graph
    output = graph.output_node()
    if placement == "boundary":
        return output.prev
    last_placeholder = graph.find_nodes(op="placeholder")[-1]
    users = [u for u in saved.users if u is not output]
    mutations = sorted((u for u in users if _mutates(u, saved)), key=order.__getitem__)
    if mutations:
        # Pack the value the backward expects: before anything overwrites it.
        anchor = mutations[0].prev
    elif users:
        anchor = max(users, key=order.__getitem__)
    else:
        anchor = saved
    if order.get(anchor, 0) < order[last_placeholder]:
        anchor = last_placeholder
    return anchor


def _backward_insert_before(
    bw_input: fx.Node, order: dict[fx.Node, int], placement: str, prefetch: int
) -> fx.Node:
    """The node before which bw_input's unpack goes."""
    graph = bw_input.graph
    last_placeholder = graph.find_nodes(op="placeholder")[-1]
    if placement == "boundary" or not bw_input.users:
        return last_placeholder.next
    node = min(bw_input.users, key=order.__getitem__)
    for _ in range(max(prefetch, 0)):
        if node.prev is last_placeholder or node.prev.op == "placeholder":
            break
        node = node.prev
    return node


# ------------------------------------------------------------------------ driver


def maybe_inline_graph_saved_tensors_hooks(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_inner_fwd_outputs: int,
    inner_meta: Any,
    aot_config: Any,
    static_input_indices: list[int],
) -> None:
    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return
    found = _compile_facts.facts()
    if found is not None:
        found.hooks_inlined = None
    ambient = _ambient_pair()
    try:
        _inline(
            fw_module,
            bw_module,
            num_inner_fwd_outputs,
            inner_meta,
            aot_config,
            static_input_indices,
            ambient,
        )
    except SavedTensorsHookError as e:
        in_graph_scope = getattr(e, "scope", "ambient") != "ambient"
        if (
            ambient is None
            or in_graph_scope  # trial-traced when entered; no eager hooks to fall back to
            or _dynamo_fullgraph()
            or config.untraceable_hook == "error"
            # No compilation context (AOTAutograd without Dynamo) to tell the runtime
            # wrapper that the hooks stay eager: raise rather than run without them.
            or _compile_facts.facts() is None
        ):
            raise
        warn_untraceable_once(
            e,
            "Falling back to eager saved-tensors hooks for this graph (results stay "
            "correct; memory is saved only as eager hooks save it)",
        )
        log.debug("eager fallback for hooks %s", ambient.names, exc_info=True)
        _record_decision(inlined=False)
        mark_not_cacheable(f"saved tensors hooks {ambient.names} fell back to eager hooks")
        return
    if ambient is not None:
        _record_decision(inlined=True)


def _inline(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_inner_fwd_outputs: int,
    inner_meta: Any,
    aot_config: Any,
    static_input_indices: list[int],
    ambient: HookPair | None,
) -> None:
    fw_g, bw_g = fw_module.graph, bw_module.graph
    fw_out = fw_g.output_node()
    fw_outs = list(fw_out.args[0])
    saved_all = fw_outs[num_inner_fwd_outputs:]
    bw_inputs = {n.name: n for n in bw_g.find_nodes(op="placeholder")}

    saved_tensors = [
        n
        for n in saved_all
        if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    bw_order = {n: i for i, n in enumerate(bw_g.nodes)}
    candidates = [
        (n, hooks_for_saved(n, bw_inputs.get(n.name), bw_order, ambient)) for n in saved_tensors
    ]
    candidates = [(n, p) for n, p in candidates if p is not None]
    if not candidates:
        return
    allowed = _filtered_by_mode(
        fw_module, bw_module, saved_tensors, num_inner_fwd_outputs, static_input_indices
    )
    inputs = act_inputs.activation_inputs(
        fw_module, inner_meta, static_input_indices, num_inner_fwd_outputs
    )
    if allowed is not None:  # "donated": also the activations packing frees (see module)
        allowed |= {s for s in saved_tensors if inputs.get(act_inputs.storage_root(s), "") is None}
    artifact = tp_logging.artifact_logger(UPSTREAM_MODULE)

    for pair in dict.fromkeys(p for _, p in candidates):
        check_keyable(pair)

    # Phase 1: trace every hook. Nothing is modified until all of them traced.
    plans: list[_SavedPlan] = []
    hookable: dict[fx.Node, HookPair] = {}
    for saved, pair in candidates:
        val = saved.meta["val"]
        why = None
        if allowed is not None and saved not in allowed:
            root = act_inputs.storage_root(saved)
            if inputs.get(root) is not None:
                why = f"{'is' if root is saved else 'aliases'} graph input {root.name}: {inputs[root]}"
            else:
                why = f"filtered by saved_tensors_hooks_filtering_mode={torch._functorch.config.saved_tensors_hooks_filtering_mode!r}"
        elif not hook_utils.is_hookable_dtype(val.dtype):
            why = f"dtype {val.dtype} (config.hooked_saved_tensor_dtypes={config.hooked_saved_tensor_dtypes!r})"
        elif saved.name not in bw_inputs or not bw_inputs[saved.name].users:
            why = "unused by the backward"
        else:
            pair, why = _selected(saved, bw_inputs[saved.name], pair)
        if why is not None:
            artifact.debug("saved %s left unhooked: %s", _describe_saved(saved), why)
            continue
        hookable[saved] = pair
    if allowed is not None:
        for saved, why in act_inputs.partially_hooked(saved_tensors, hookable, inputs).items():
            artifact.debug("saved %s left unhooked: %s", _describe_saved(saved), why)
            del hookable[saved]
    # A saved tensor that is a pure alias (detach, alias) of another hooked saved tensor is
    # not packed again: the backward reads the root's unpacked tensor for both.
    aliases = _alias_roots(hookable)
    for saved, pair in hookable.items():
        if saved in aliases:
            artifact.debug("saved %s: alias of %s, shares its packed tensor", saved.name, aliases[saved].name)
            continue
        val = saved.meta["val"]
        pack = _trace_hook(
            pair.pack, val, aot_config=aot_config, role="pack", pair=pair, saved=saved, bw_graph=bw_g
        )
        unpack = _trace_hook(
            pair.unpack,
            pack.out_vals,
            aot_config=aot_config,
            role="unpack",
            pair=pair,
            saved=saved,
            bw_graph=bw_g,
            layout=pack.layout,
        )
        if pack.layout is not None:
            artifact.debug("saved %s: packed as %s, flattened between the graphs", saved.name, pack.layout.describe())
        out = unpack.out_vals
        if isinstance(out, (tuple, list)) and len(out) == 1:
            out = out[0]
        restride = _check_unpacked(out, val, pair, saved)
        plans.append(_SavedPlan(saved, pair, pack, unpack, restride))
    if not plans:
        return

    # Phase 2: rewrite the graphs.
    placement = config.hook_placement
    if placement not in ("use", "boundary"):
        raise ValueError(f"torch_patches.config.hook_placement must be 'use' or 'boundary', got {placement!r}")
    _merge_aliases(fw_module, bw_inputs, num_inner_fwd_outputs, aliases)
    fw_order = {n: i for i, n in enumerate(fw_g.nodes)}
    bw_order = {n: i for i, n in enumerate(bw_g.nodes)}
    packed_leaves: dict[fx.Node, list[Any]] = {}
    fw_tail: dict[fx.Node, fx.Node] = {}  # anchor -> last node inserted after it
    for plan in plans:
        packed_leaves[plan.saved] = _insert_pack(
            plan, fw_module, bw_g, fw_order, placement, fw_tail
        )
    bw_input_of: dict[fx.Node, fx.Node] = {}
    for plan in plans:
        bw_input_of |= _insert_unpack(
            plan,
            bw_module,
            fw_g,
            bw_inputs[plan.saved.name],
            packed_leaves[plan.saved],
            bw_order,
            placement,
        )
    _rewire_saved(fw_module, bw_module, num_inner_fwd_outputs, packed_leaves, bw_input_of)
    for plan in plans:
        artifact.debug("saved %s hooked: %s", _describe_saved(plan.saved), plan.pair.names)
    fw_g.lint()
    bw_g.lint()
    fw_module.recompile()
    bw_module.recompile()
    artifact.debug("forward graph with inlined hooks:\n%s", fw_module.print_readable(False))
    artifact.debug("backward graph with inlined hooks:\n%s", bw_module.print_readable(False))


def _describe_saved(saved: fx.Node) -> str:
    """``mul_3 (float32[4, 8] on cpu, 128 B, from aten.mul.Tensor)`` for the log."""
    from torch_patches.hooks.select import compiled_info

    val = saved.meta["val"]
    info = compiled_info(saved, None, "")
    source = "a graph input" if info.is_input else f"from {info.producer}"
    return f"{saved.name} ({hook_utils.describe_value(val)}, {info.nbytes} B, {source})"


def _selected(saved: fx.Node, bw_input: fx.Node, pair: HookPair) -> tuple[HookPair, str | None]:
    """The hooks ``saved`` takes and None, or ``pair`` and why it is left unhooked.

    A :func:`torch_patches.hooks.select` pair asks its ``where`` predicate, once per saved
    tensor at compile time, with the tensor's :class:`SavedTensorInfo`; an accepted tensor
    takes the pair's inner hooks (traced without the eager-mode branching).
    """
    from torch_patches.hooks.select import compiled_info, unwrap_select

    sel = unwrap_select((pair.pack, pair.unpack))
    if sel is None:
        return pair, None
    pack, unpack, where = sel
    info = compiled_info(saved, bw_input, pair.label)
    try:
        accepted = bool(where(info))
    except Exception as e:  # noqa: BLE001 - the user's predicate
        raise _hook_error(
            pair.pack,
            f"its where= predicate {hook_utils.hook_name(where)} raised {type(e).__name__}: {e}",
            e,
            role="pack",
            pair=pair,
            saved=saved,
        ) from e
    if not accepted:
        consumers = ", ".join(info.backward_consumers or ()) or "none"
        return pair, (
            f"not selected by where={hook_utils.hook_name(where)} "
            f"(backward consumers: {consumers})"
        )
    return HookPair(pack, unpack, pair.label), None


#: Ops whose output is the input itself (same storage, sizes, strides) under another name.
_PURE_ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _alias_roots(hookable: dict[fx.Node, HookPair]) -> dict[fx.Node, fx.Node]:
    """saved tensor -> the hooked saved tensor it purely aliases (same hooks), if any.

    The partitioner often saves both ``x`` and ``detach(x)`` (one backward formula reads the
    input, another the result). Packing each would store two compressed copies of one
    tensor; eager autograd would also call pack twice, but the hooks are pure by contract,
    so one packed copy serves both.
    """
    roots = {}
    for saved, pair in hookable.items():
        root = saved
        while root.op == "call_function" and root.target in _PURE_ALIAS_OPS:
            root = root.args[0]
        if root is not saved and hookable.get(root) == pair:
            roots[saved] = root
    return roots


def _merge_aliases(
    fw_module: fx.GraphModule,
    bw_inputs: dict[str, fx.Node],
    num_inner_fwd_outputs: int,
    aliases: dict[fx.Node, fx.Node],
) -> None:
    """Save each alias's root only: the backward reads the root where it read the alias."""
    if not aliases:
        return
    fw_g = fw_module.graph
    fw_out = fw_g.output_node()
    outs = list(fw_out.args[0])
    keep = [
        i < num_inner_fwd_outputs or not (isinstance(n, fx.Node) and n in aliases)
        for i, n in enumerate(outs)
    ]
    fw_out.args = (tuple(n for n, k in zip(outs, keep) if k),)
    desc = fw_out.meta.get("desc")
    if isinstance(desc, (list, tuple)) and len(desc) == len(outs):
        fw_out.meta["desc"] = [d for d, k in zip(desc, keep) if k]
    for alias, root in aliases.items():
        bw_alias = bw_inputs.pop(alias.name)
        bw_alias.replace_all_uses_with(bw_inputs[root.name])
        bw_alias.graph.erase_node(bw_alias)
        if not alias.users:
            fw_g.erase_node(alias)


def _check_unpacked(out: Any, val: torch.Tensor, pair: HookPair, saved: fx.Node) -> bool:
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
            f"unpack hook {hook} must return one tensor for saved tensor {saved.name!r}, "
            f"got {type(out).__name__}",
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


def _insert_pack(
    plan: _SavedPlan,
    fw_module: fx.GraphModule,
    bw_g: fx.Graph,
    order: dict[fx.Node, int],
    placement: str,
    tail: dict[fx.Node, fx.Node],
) -> list[Any]:
    """Insert saved's pack after its last forward use; return the packed leaves."""
    fw_g = fw_module.graph
    saved = plan.saved
    gm = plan.pack.gm
    (placeholder,) = gm.graph.find_nodes(op="placeholder")
    out_nodes = [x for x in pytree.tree_leaves(plan.pack.out_args) if isinstance(x, fx.Node)]
    names = {}
    for i, n in enumerate(out_nodes):
        if n is not placeholder and n not in names:
            suffix = "" if len(out_nodes) == 1 else f"_{i}"
            names[n] = _unique((fw_g, bw_g), f"{saved.name}_packed{suffix}")
    anchor = _forward_anchor(saved, order, placement)
    env: dict[fx.Node, Any] = {placeholder: saved}
    tag = {"role": "pack", "saved": saved.name, "hook": plan.pair.label}
    with fw_g.inserting_before(tail.get(anchor, anchor).next):
        new_nodes = _copy_into(fw_g, fw_module, gm, env, names, tag)
    if new_nodes:
        tail[anchor] = new_nodes[-1]
    leaves = [env[x] if isinstance(x, fx.Node) else x for x in pytree.tree_leaves(plan.pack.out_args)]
    if saved.meta.get("saved_tensor_with_no_vc_check", False):
        for leaf in leaves:
            if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor):
                leaf.meta["saved_tensor_with_no_vc_check"] = True
    return leaves


def _reload_start_closure(gm: fx.GraphModule) -> set[fx.Node]:
    """``torch_patches::reload_start`` calls in an unpack graph and the nodes they depend on.

    Placeholders excluded: they become backward inputs, placed at the top anyway.  Empty
    when the graph starts no reload (every hook but ``cpu_offload`` and chains ending in it).
    """
    ns = getattr(torch.ops, "torch_patches", None)
    op = getattr(ns, "reload_start", None) if ns is not None else None
    if op is None:  # torch_patches.hooks.offload never imported: no graph can call it
        return set()
    targets = (op, op.default)
    found: set[fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]
    while stack:
        node = stack.pop()
        if node in found or node.op == "placeholder":
            continue
        found.add(node)
        stack.extend(node.all_input_nodes)
    return found


def _insert_unpack(
    plan: _SavedPlan,
    bw_module: fx.GraphModule,
    fw_g: fx.Graph,
    bw_input: fx.Node,
    leaves: list[Any],
    order: dict[fx.Node, int],
    placement: str,
) -> dict[fx.Node, fx.Node]:
    """Insert saved's unpack before its first backward use.

    Returns forward packed leaf -> the backward input that receives it.
    """
    bw_g = bw_module.graph
    gm = plan.unpack.gm
    placeholders = gm.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(leaves):
        raise AssertionError(
            f"unpack graph takes {len(placeholders)} inputs for {len(leaves)} packed leaves"
        )
    env: dict[fx.Node, Any] = {}
    new_inputs: dict[fx.Node, fx.Node] = {}
    users_before = list(bw_input.users)
    for ph, leaf in zip(placeholders, leaves):
        if not isinstance(leaf, fx.Node):
            env[ph] = leaf  # constants (dtype, python numbers) are baked in
            continue
        if leaf is plan.saved:
            env[ph] = bw_input
            new_inputs[leaf] = bw_input
            continue
        if leaf in new_inputs:  # one symbol in several places (a subclass's sizes)
            env[ph] = new_inputs[leaf]
            continue
        with bw_g.inserting_before(bw_input):
            new = bw_g.placeholder(leaf.name)  # same name as the forward output
        new.meta = {k: v for k, v in leaf.meta.items() if k in ("val", "tensor_meta")}
        if "desc" in bw_input.meta:
            new.meta["desc"] = bw_input.meta["desc"]
        env[ph] = new
        new_inputs[leaf] = new
    before = _backward_insert_before(bw_input, order, placement, config.unpack_prefetch_distance)
    tag = {"role": "unpack", "saved": plan.saved.name, "hook": plan.pair.label}
    out_arg = gm.graph.output_node().args[0]
    (out_node,) = pytree.tree_leaves(out_arg)
    names = {out_node: _unique((fw_g, bw_g), f"{plan.saved.name}_unpacked")}
    early = _reload_start_closure(gm)
    if early:
        # Split reload (cpu_offload): the host-to-device copies start ahead of the use, so
        # they overlap the backward compute in between; the rest (reload_wait onwards)
        # goes right before the use as usual.
        # (unpack_prefetch_distance moves the whole unpack of other hooks; here it moves
        # only the copy's start: waiting early would gain nothing.)
        distance = max(config.unpack_prefetch_distance, config.reload_prefetch_distance)
        early_before = _backward_insert_before(bw_input, order, placement, distance)
        before = _backward_insert_before(bw_input, order, placement, 0)
        with bw_g.inserting_before(early_before):
            _copy_into(bw_g, bw_module, gm, env, names, tag, only=early)
    with bw_g.inserting_before(before):
        _copy_into(bw_g, bw_module, gm, env, names, tag)
        result = env[out_node]
        if plan.restride:
            val = plan.saved.meta["val"]
            empty = bw_g.call_function(
                torch.ops.aten.empty_strided.default,
                (list(val.shape), list(val.stride())),
                {"dtype": val.dtype, "device": val.device},
            )
            empty.meta["val"] = val.new_empty_strided(val.shape, val.stride())
            empty.meta[HOOK_META] = dict(tag)
            result = bw_g.call_function(torch.ops.aten.copy.default, (empty, result))
            result.meta["val"] = empty.meta["val"]
            result.meta[HOOK_META] = dict(tag)
    for user in users_before:
        user.replace_input_with(bw_input, result)
    if not bw_input.users:
        bw_g.erase_node(bw_input)
    return new_inputs


def _rewire_saved(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_inner_fwd_outputs: int,
    packed_leaves: dict[fx.Node, list[Any]],
    bw_input_of: dict[fx.Node, fx.Node],
) -> None:
    """Replace hooked saved tensors by their packed leaves in the fw outputs/bw inputs.

    Calling convention kept: forward outputs are (inner outputs, tensors saved with
    version-counter check, tensors saved without, opaque objects, symints); backward
    inputs start with (symints, tensors with check, tensors without, opaque objects).
    """
    fw_out = fw_module.graph.output_node()
    outs = list(fw_out.args[0])
    inner, saved = outs[:num_inner_fwd_outputs], outs[num_inner_fwd_outputs:]
    t_vc: list[fx.Node] = []
    t_novc: list[fx.Node] = []
    opaque: list[Any] = []
    syms: list[fx.Node] = []
    new_syms: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        if is_sym_node(node):
            syms.append(node)
        elif isinstance(node.meta.get("val"), torch.Tensor):
            (t_novc if node.meta.get("saved_tensor_with_no_vc_check", False) else t_vc).append(node)
        else:
            opaque.append(node)

    seen: set[fx.Node] = set()
    for node in saved:
        if node in packed_leaves:
            for leaf in packed_leaves[node]:
                if not isinstance(leaf, fx.Node) or leaf in seen:
                    continue  # constants are baked in; a leaf repeated is saved once
                seen.add(leaf)
                if is_sym_node(leaf):
                    new_syms.append(leaf)
                else:
                    place(leaf)
        else:
            place(node)
    new_saved = t_vc + t_novc + opaque + syms + new_syms
    desc = fw_out.meta.get("desc")
    fw_out.args = (tuple(inner + new_saved),)
    if isinstance(desc, (list, tuple)) and len(desc) == len(outs):
        fw_out.meta["desc"] = list(desc[:num_inner_fwd_outputs]) + _saved_descs(
            len(new_saved), len(t_vc), len(t_novc)
        )

    # Backward inputs in the same order, by name; everything else keeps its place.
    bw_g = bw_module.graph
    by_name = {n.name: n for n in bw_g.find_nodes(op="placeholder")}
    order = [syms + new_syms, t_vc, t_novc, opaque]
    wanted = [bw_input_of.get(n) or by_name[n.name] for group in order for n in group]
    if len(wanted) != len(new_saved):
        raise AssertionError("backward inputs do not match the saved forward outputs")
    wanted_set = set(wanted)
    rest = [n for n in bw_g.find_nodes(op="placeholder") if n not in wanted_set]
    cursor: fx.Node | None = None
    for node in wanted + rest:
        if cursor is None:
            first = next(iter(bw_g.nodes))
            if first is not node:
                first.prepend(node)
        else:
            cursor.append(node)
        cursor = node


def _saved_descs(n_saved: int, n_vc: int, n_novc: int) -> list[Any]:
    """Output descriptors for the rebuilt saved section."""
    from torch._functorch._aot_autograd.descriptors import (
        SavedForBackwardsAOTOutput,
        SavedForBackwardsNoVcCheckAOTOutput,
    )

    return [
        SavedForBackwardsNoVcCheckAOTOutput(i)
        if n_vc <= i < n_vc + n_novc
        else SavedForBackwardsAOTOutput(i)
        for i in range(n_saved)
    ]
