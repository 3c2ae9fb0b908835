"""The inliner's decisions while compiling, as the bench reports them (``kept MiB``, ``plan MiB``).

Read from the inliner's records (``saved_tensor_records.recording``, which
``torch_patches.testing.saved_tensor_records`` documents; imported from the compiler's
module so the bench does not need the test dependencies): one
record per saved tensor and one summary per budget plan, for every graph compiled while
:func:`recording_decisions` records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch_patches._functorch._aot_autograd.saved_tensor_records import recording


class Decisions:
    """What the inliner decided while :func:`recording_decisions` was recording."""

    def __init__(self, compiled: list[Any]) -> None:
        self._compiled = compiled

    @property
    def _plans(self) -> list[Any]:
        return [p for c in self._compiled for p in c.plans]

    @property
    def kept_bytes(self) -> int:
        """Bytes of saved tensors left unhooked because a select predicate rejected them."""
        return sum(r.nbytes for c in self._compiled for r in c.records if r.decided_by == "select" and not r.hooked)

    @property
    def plan_graphs(self) -> int:
        """Budget plans made (one per budget scope of each compiled graph)."""
        return len(self._plans)

    @property
    def planned(self) -> int:
        """The budget plans' predicted saved bytes, summed."""
        return sum(p.planned_bytes for p in self._plans)

    @property
    def saved(self) -> int:
        """What the planned scopes save without hooks, summed."""
        return sum(p.baseline_bytes for p in self._plans)

    @property
    def budget(self) -> int:
        """The plans' budgets in bytes, summed."""
        return sum(p.budget_bytes for p in self._plans)


@contextlib.contextmanager
def recording_decisions() -> Iterator[Decisions]:
    """Record the inliner's decisions for every graph compiled inside the block."""
    with recording() as compiled:
        yield Decisions(compiled)
