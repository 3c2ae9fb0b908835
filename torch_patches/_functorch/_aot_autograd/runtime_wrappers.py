"""What saved-tensors hooks do while a compiled autograd graph runs.

Upstream counterpart: ``_should_disable_saved_tensors_hooks`` /
``_create_runtime_wrapper`` in ``torch/_functorch/_aot_autograd/runtime_wrappers.py``.
Upstream decides at wrapper creation whether to disable the ambient hooks, from the
hooks' *type* alone.  We decide per compiled graph:

* hooks were inlined into this graph -> disable them at runtime (their work is in the
  graphs; running them again on the packed tensors would be wrong);
* hooks stay Python hooks (not inlineable, or inlining fell back) -> keep eager
  semantics, with our hook contract: only floating-point saved tensors reach the
  user's hooks by default (``config.hooked_saved_tensor_dtypes``), and what unpack
  returns is checked against the saved tensor (``config.validate_unpack``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._functorch._aot_autograd import runtime_wrappers as _upstream_runtime_wrappers
from torch.utils import _python_dispatch

from torch_patches import config
from torch_patches._errors import SavedTensorsHookError
from torch_patches._functorch._aot_autograd import (
    compile_facts,
    hook_identity as hook_keys,
    offload_prefetch,
    saved_tensor_records as records,
    utils as hook_utils,
)


def _should_disable_saved_tensors_hooks() -> bool:
    """Replacement: upstream's type-based decision is never taken.

    The runtime handling of hooks moved into the ``_create_runtime_wrapper`` wrapper
    below, which knows whether this graph's hooks were really inlined.
    """
    return False


def _runtime_context() -> Callable[..., Any] | None:
    """How a compiled graph runs (a function taking the call), decided when its wrapper is
    created; None: as upstream's wrapper does."""
    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return None
    hooks = hook_utils.ambient_saved_tensors_hooks()
    inlined = compile_facts.inlined(hook_keys.hooks_guard_key(hooks))
    if hooks is None:
        # Compiled without hooks: its guard also admits Python hooks (they do not change
        # the graph), which then run under the contract.
        return run_under_hooks_contract
    if inlined is None:
        # No inlining attempt in this compilation (a cache hit): keyable inlineable hooks
        # were inlined, since graphs whose hooks fell back to eager are never cached.
        inlined = hook_keys.hooks_guard_key(hooks) is not None
    return run_with_hooks_disabled if inlined else run_under_hooks_contract


def make_create_runtime_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap upstream's ``_create_runtime_wrapper`` with the per-graph hook context."""

    @functools.wraps(original)
    def _create_runtime_wrapper(*args: Any, **kwargs: Any) -> Any:
        runtime_wrapper = original(*args, **kwargs)
        if not kwargs.get("trace_joint", False):
            return runtime_wrapper
        records.keep_with(kwargs["runtime_metadata"])
        run = _runtime_context()
        if run is None:
            return runtime_wrapper
        return _per_call(runtime_wrapper, run, offload_prefetch.prefetching(kwargs["runtime_metadata"]))

    return _create_runtime_wrapper


# ===================================================================== per compiled call
# What runs at every call of a compiled graph (ARCHITECTURE.md, "What runs per compiled
# call"): lookups against what compiling recorded, never a walk, an input search or a trace
# (test_hook_guards.TestPerCallPath counts them).


def _per_call(runtime_wrapper: Callable[..., Any], run: Callable[..., Any], link: Any) -> Callable[..., Any]:
    """The compiled graph's runtime wrapper in ``run``'s context (a lookup and the call);
    with ``link``, its backward also starts the next graph's reloads."""
    if link is not None:

        @functools.wraps(runtime_wrapper)
        def _linked_runtime_wrapper(*a: Any, **kw: Any) -> Any:
            out = run(runtime_wrapper, *a, **kw)
            link(out)
            return out

        return _linked_runtime_wrapper

    @functools.wraps(runtime_wrapper)
    def _runtime_wrapper(*a: Any, **kw: Any) -> Any:
        return run(runtime_wrapper, *a, **kw)

    return _runtime_wrapper


def run_with_hooks_disabled(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one compiled call of a graph whose hooks were inlined: the Python hooks are
    disabled while it runs (upstream's context)."""
    with _upstream_runtime_wrappers._disable_saved_tensors_hooks():
        return run(*args, **kwargs)


def run_under_hooks_contract(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one compiled call with the ambient Python hooks (if any) under the hook contract.

    Every call of a graph compiled without hooks comes here: with no hooks active it is one
    lookup and the call itself."""
    hooks = hook_utils.top_saved_tensors_hooks()
    if hooks is None or not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # not in torch's stub
        return run(*args, **kwargs)
    with torch.autograd.graph.saved_tensors_hooks(*_contract_hooks(*hooks)):
        return run(*args, **kwargs)


def _contract_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    validate = config.validate_unpack

    def contract_pack(t: torch.Tensor) -> Any:
        if not hook_utils.is_hookable_dtype(t.dtype):
            return _Unhooked(t)
        return _Hooked(_run_as_eager(pack, t), t)

    def contract_unpack(p: Any) -> torch.Tensor:
        if isinstance(p, _Unhooked):
            return p.tensor
        out = unpack(p.packed)
        if validate:
            got = (out.dtype, out.shape, out.device) if isinstance(out, torch.Tensor) else None
            if got != (p.dtype, p.shape, p.device):
                hook = hook_utils.hook_name(unpack)
                expected = hook_utils.describe_tensor(p.dtype, p.shape, p.device)
                found = hook_utils.describe_tensor(*got) if got else type(out).__name__
                raise SavedTensorsHookError(
                    f"unpack hook {hook} returned {found} for a saved tensor of "
                    f"{expected} (hooks run by a compiled graph must give back the "
                    "saved tensor's dtype, shape and device)",
                    hook=hook,
                    reason=f"expected {expected}, got {found}",
                )
        if isinstance(out, torch.Tensor) and out.shape == p.shape:
            out = _restride(out, p.stride)
        return out

    return contract_pack, contract_unpack


class _Unhooked:
    """A saved tensor the user's hooks must not see (masks, indices...)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        # detach(): the saved object must not own a grad_fn (no reference cycle).
        self.tensor = tensor.detach()


class _Hooked:
    __slots__ = ("packed", "dtype", "shape", "device", "stride")

    def __init__(self, packed: Any, t: torch.Tensor) -> None:
        self.packed = packed
        self.dtype, self.shape, self.device, self.stride = t.dtype, t.shape, t.device, t.stride()


def _restride(out: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``out`` with the saved tensor's strides: a compiled backward was built for them
    (Inductor asserts them), but a hook may hand back a compact copy of a view with gaps
    (``q`` of a fused qkv projection) or a transposed tensor."""
    if out.dim() == len(stride) and all(size < 2 or a == b for size, a, b in zip(out.shape, out.stride(), stride)):
        return out
    fixed = torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device)
    fixed.copy_(out)
    return fixed


def _run_as_eager(hook: Callable[[Any], Any], arg: Any) -> Any:
    """Call a user's hook as eager code would: outside the dispatch mode upstream's runtime
    wrapper enters around a graph's first call (``_AnalyzeCustomOpInputOutputMode``, its
    check of the graph's custom ops).  Autograd calls a pack hook while that call saves
    tensors, so the hook would run under the mode, which defers every tensor subclass to the
    subclass's own dispatch and leaves one with none (``t.as_subclass(Scale)`` read as
    ``t[0]``) to fail in the dispatcher (fixed in torch 2.15).  The hook is not part of the
    compiled graph that mode checks."""
    if torch._C._len_torch_dispatch_stack() and isinstance(
        _python_dispatch._get_current_dispatch_mode(), _upstream_runtime_wrappers._AnalyzeCustomOpInputOutputMode
    ):
        with _python_dispatch._pop_mode_temporarily():
            return hook(arg)
    return hook(arg)
