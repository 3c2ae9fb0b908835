"""The inliner's decisions while compiling, as the bench reports them (``kept MiB``, ``plan MiB``).

TODO(records): replaced by torch_patches.testing.saved_tensor_records()

For now read from the inliner's debug-log text on the ``torch_patches`` artifact log: the
handlers below parse its lines. :func:`recording_decisions` is the only interface the bench
uses, so only this module changes when the structured records replace the log scraping.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any


class Decisions:
    """What the inliner decided while :func:`recording_decisions` was recording (read it
    after the block: the sums are final once it exits)."""

    def __init__(self, kept: _KeptBytes, plan: _BudgetPlan) -> None:
        self._kept, self._plan = kept, plan

    @property
    def kept_bytes(self) -> int:
        """Bytes of saved tensors left unhooked because a select predicate rejected them."""
        return self._kept.total

    @property
    def plan_graphs(self) -> int:
        """Graphs the activation-memory budget planner planned (its summary lines)."""
        return self._plan.graphs

    @property
    def planned(self) -> int:
        """The budget plans' predicted saved bytes, summed over graphs."""
        return self._plan.planned

    @property
    def saved(self) -> int:
        """The bytes the planned graphs save without hooks, summed."""
        return self._plan.saved

    @property
    def budget(self) -> int:
        """The budgets in bytes, summed over planned graphs."""
        return self._plan.budget


@contextlib.contextmanager
def recording_decisions() -> Iterator[Decisions]:
    """Record the inliner's decisions while compiling inside the block."""
    with _KeptBytes.recording() as kept, _BudgetPlan.recording() as plan:
        yield Decisions(kept, plan)


class _LogLines(logging.Handler):
    """Base of handlers that read the inliner's lines on the ``torch_patches`` artifact log
    (``torch._functorch._aot_autograd.graph_compile``) while compiling."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    @classmethod
    @contextlib.contextmanager
    def recording(cls) -> Any:
        from torch_patches import _logging as tp_logging

        logger = tp_logging.artifact_logger("torch._functorch._aot_autograd.graph_compile")
        handler, level = cls(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            yield handler
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)


class _KeptBytes(_LogLines):
    """Sums the bytes of saved tensors the inliner reports as "not selected" while compiling
    (producer, bytes and reason per saved tensor)."""

    _LINE = re.compile(r", (\d+) B, [^)]*\) left unhooked: not selected by")

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def emit(self, record: logging.LogRecord) -> None:
        m = self._LINE.search(record.getMessage())
        if m:
            self.total += int(m.group(1))


class _BudgetPlan(_LogLines):
    """Sums the budget planner's summary lines, one per planned graph: planned (predicted
    saved) bytes, saved bytes without hooks, budget bytes."""

    _LINE = re.compile(r"budget plan \(([^)]*)\): (\d+) B planned of (\d+) B saved, budget (\d+) B")

    def __init__(self) -> None:
        super().__init__()
        self.graphs = 0
        self.planned = self.saved = self.budget = 0

    def emit(self, record: logging.LogRecord) -> None:
        m = self._LINE.search(record.getMessage())
        if m:
            self.graphs += 1
            self.planned += int(m.group(2))
            self.saved += int(m.group(3))
            self.budget += int(m.group(4))

