"""Test helpers for saved-tensors hooks under ``torch.compile``, in the style of PyTorch's
own compiler tests.

* :class:`TestCase` resets Dynamo and its counters around every test (it is a
  ``torch._dynamo.test_case.TestCase``) and adds assertions for goldens, hook errors and
  gradients.
* :class:`AotEagerAndRecordGraphs` / :class:`InductorAndRecordGraphs` are backends that
  record the AOT forward and backward graphs (after hook inlining) on the aot_eager and
  inductor paths.
* :func:`normalize_graph` turns a graph into stable golden text (comments, file paths
  and device indices removed; optional ``# <- pack(x)`` marks on hook nodes), for
  ``assertExpectedInline``.  Regenerate goldens with ``EXPECTTEST_ACCEPT=1``.
* :data:`TORCH_VERSION` for per-version goldens; :func:`instantiate_device_type_tests`
  parametrises over CPU (always) and CUDA (when present).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo.test_case
import torch._dynamo.testing
import torch.fx as fx
from torch.testing._internal.common_device_type import (
    instantiate_device_type_tests as _instantiate_device_type_tests,
)

from torch_patches._functorch._aot_autograd.activation_budget.cost_model import DEFAULT_RATES
from torch_patches.testing._internal.saved_tensors_hooks_graphs import (
    AotEagerAndRecordGraphs,
    InductorAndRecordGraphs,
    hook_nodes,
    normalize_graph,
)

if TYPE_CHECKING:
    from torch_patches._errors import SavedTensorsHookError


#: (major, minor) of the installed torch, for per-version goldens.
TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])  # type: ignore[assignment]

HAS_CUDA = torch.cuda.is_available()

#: The cost model's default rates as config knobs (``torch_patches.config.patch(**CPU_RATES)``):
#: a test whose plan depends on the machine's prices fixes them on every device with
#: ``CPU_RATES`` (at CUDA's defaults, 400 TFLOP/s and 2 TB/s, the same graph is another
#: instance); with ``CUDA_RATES`` and :func:`copy_engine_everywhere`, a CPU test plans as the
#: budget plans on a GPU.
CPU_RATES = dict(DEFAULT_RATES["cpu"])
CUDA_RATES = dict(DEFAULT_RATES["cuda"])


@contextlib.contextmanager
def copy_engine_everywhere() -> Iterator[None]:
    """The budget's cost model treats every device as one with a copy engine (as CUDA):
    on the CPU its offload option then runs as plain copies, which is how the plan's
    choices are tested without a GPU."""
    from unittest import mock

    from torch_patches._functorch._aot_autograd.activation_budget import cost_model, planner

    with mock.patch.object(cost_model, "copy_engine", lambda device: True), mock.patch.object(planner, "copy_engine", lambda device: True):
        yield


__all__ = [
    "AotEagerAndRecordGraphs",
    "HAS_CUDA",
    "InductorAndRecordGraphs",
    "TORCH_VERSION",
    "TestCase",
    "hook_nodes",
    "instantiate_device_type_tests",
    "normalize_graph",
    "hook_warnings",
    "peak_bytes",
    "saved_tensor_records",
]


def peak_bytes(fn: Callable[[], Any], device: str | torch.device) -> int:
    """The most memory ``fn`` holds on ``device`` at once beyond what it held on entry.

    CUDA: the caching allocator's peak.  CPU: the profiler's allocation events (every
    allocation and free of the CPU allocator, Inductor's buffers included), summed in
    time order."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return cpu_peak_of(prof)


def cpu_peak_of(prof: Any) -> int:
    """The most CPU memory held at once beyond what was held when ``prof`` (a finished
    ``torch.profiler.profile(profile_memory=True)``) started: its allocation events summed
    in time order."""
    from torch._C._profiler import _EventType

    sizes: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    held = most = 0
    for _, size in sorted(sizes):
        held += size
        most = max(most, held)
    return most


def hook_warnings(caught: Iterable[warnings.WarningMessage]) -> list[str]:
    """The messages of the saved-tensors hook warnings among ``caught``."""
    from torch_patches._errors import SavedTensorsHookWarning

    return [str(w.message) for w in caught if issubclass(w.category, SavedTensorsHookWarning)]


@contextlib.contextmanager
def saved_tensor_records() -> Iterator[list[Any]]:
    """What the inliner decided for every graph it handles inside the block, as data.

    Yields a list that fills, in compile order, with one
    :class:`~torch_patches._functorch._aot_autograd.saved_tensor_records.CompiledSavedTensors`
    per compiled forward/backward pair whose saved tensors had hooks: ``.records`` (one
    ``SavedTensorRecord`` per saved tensor: producer, bytes, scope, backward readers and
    tolerance, the decision, the phase that made it and why, the budget option, packed
    bytes, where pack and unpack went), ``.plans`` (each budget plan's summary) and
    ``.fallback`` (why the hooks fell back to eager hooks, if they did)::

        with torch_patches.testing.saved_tensor_records() as compiled:
            loss = compiled_model(x).sum()
        last = compiled[-1]
        print({r.name: r.decision for r in last.records})

    Graphs served from a compile cache were not inlined in this process and report
    nothing.  The same records are written, one line each, to the debug log
    (``TORCH_LOGS="torch_patches"``).
    """
    from torch_patches._functorch._aot_autograd import saved_tensor_records

    with saved_tensor_records.recording() as out:
        yield out


class TestCase(torch._dynamo.test_case.TestCase):
    """Dynamo-resetting test case with assertions for goldens, hook errors and gradients."""

    def setUp(self) -> None:
        super().setUp()
        # "One warning per untraceable hook" holds per test, not only per process (the
        # harness serves every commit of the stack: the inliner may not be there yet).
        from torch_patches._functorch._aot_autograd import graph_compile

        # (and "one warning per internal error site", where the fallback is there)
        fallback = getattr(graph_compile, "inline_fallback", None)
        for seen in (
            getattr(graph_compile, "_warned", None),
            getattr(graph_compile, "_warned_objects", None),
            getattr(fallback, "_warned", None),
        ):
            if seen is not None:
                seen.clear()

    def assertExpectedInline(  # noqa: N802
        self, actual: Any, expect: str, skip: int = 0, **kwargs: Any
    ) -> None:
        # Dynamo's TestCase adds a frame without adjusting ``skip``, which makes
        # EXPECTTEST_ACCEPT=1 rewrite the wrong file; call PyTorch's directly.
        from torch.testing._internal.common_utils import TestCase as TorchTestCase

        TorchTestCase.assertExpectedInline(self, actual, expect, skip=skip + 1, **kwargs)

    def assertExpectedGraph(  # noqa: N802 - unittest naming
        self, gm: fx.GraphModule, expect: str, *, mark_hooks: bool = True, skip: int = 0
    ) -> None:
        """``assertExpectedInline`` on :func:`normalize_graph` of ``gm``."""
        self.assertExpectedInline(normalize_graph(gm, mark_hooks=mark_hooks), expect, skip=skip + 1)

    @contextlib.contextmanager
    def assertRaisesHookError(self, regex: str = "") -> Iterator[list[SavedTensorsHookError]]:  # noqa: N802
        """The block raises a :class:`SavedTensorsHookError` whose message matches ``regex``.

        Raised while Dynamo compiles, the error reaches users wrapped in Dynamo's
        ``BackendCompilerFailed`` (its ``inner_exception``; the message is repeated in the
        wrapper's), or, for hooks entered inside the compiled region, as the cause of
        Dynamo's ``Unsupported``; all forms count. Yields a list that holds the error afterwards.
        """
        from torch_patches._errors import SavedTensorsHookError

        caught: list[SavedTensorsHookError] = []
        try:
            yield caught
        except Exception as e:  # noqa: BLE001 - inspected below
            inner = getattr(e, "inner_exception", e)
            if not isinstance(inner, SavedTensorsHookError):
                inner = e.__cause__  # Dynamo's Unsupported, for hooks entered in the region
            if not isinstance(inner, SavedTensorsHookError):
                raise
            if regex:
                self.assertRegex(str(inner), regex)
            caught.append(inner)
        else:
            self.fail("SavedTensorsHookError not raised")

    def assertGradsEqual(  # noqa: N802
        self,
        actual: Iterable[torch.Tensor | None],
        expected: Iterable[torch.Tensor | None],
        *,
        exact: bool = False,
        **tolerances: Any,
    ) -> None:
        """Gradients equal: bit-exact with ``exact=True``, else assertEqual tolerances."""
        actual, expected = list(actual), list(expected)
        self.assertEqual(len(actual), len(expected))
        for i, (a, e) in enumerate(zip(actual, expected)):
            if a is None or e is None:
                self.assertIs(a, e, msg=f"gradient {i}")
            elif exact:
                self.assertTrue(
                    torch.equal(a, e),
                    msg=f"gradient {i} differs: max abs diff {(a - e).abs().max().item()}",
                )
            else:
                self.assertEqual(a, e, msg=f"gradient {i}", **tolerances)


def instantiate_device_type_tests(cls: type, scope: dict[str, Any]) -> None:
    """Generate ``<cls>CPU`` (always) and ``<cls>CUDA`` (when present) test classes."""
    _instantiate_device_type_tests(cls, scope, only_for=("cpu", "cuda"))
