"""One row of ``python -m torch_patches bench``: :class:`Case`, the modes, the ``hook`` column."""

from __future__ import annotations

import dataclasses
from typing import Any

MODES = ("no-hooks", "eager-hooks", "stock-inline", "ours")
#: Rows ``--budget F`` adds (one pair per fraction F), beside ``MODES``.
BUDGET_MODES = ("budget", "stock-budget")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "mlp8"
    backend: str = "aot_eager"
    hook: str = "bf16"
    mode: str = "ours"
    device: str = "cpu"
    batch: int = 2048
    dim: int = 128
    blocks: int = 8
    steps: int = 5
    reorder_for_peak_memory: bool = True
    #: Modes ``budget`` / ``stock-budget``: the activation-memory budget, a fraction in (0, 1]
    #: of the bytes the compiled graph saves without hooks. None for every other mode.
    budget: float | None = None

    def __post_init__(self) -> None:
        if (self.mode in BUDGET_MODES) != (self.budget is not None):
            raise ValueError(f"mode {self.mode!r} with budget={self.budget!r}: a budget goes with, and only with, modes {BUDGET_MODES}")
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget!r}")

    @property
    def label(self) -> str:
        return f"{self.model} {self.backend} {hook_column(dataclasses.asdict(self))} {self.mode}"


def hook_column(case: dict[str, Any]) -> str:
    """The ``hook`` column of a case (as a dict: results hold cases as JSON)."""
    mode = case["mode"]
    if mode == "budget":
        return f"budget {case['budget']:g}"
    if mode == "stock-budget":
        return f"amb {case['budget']:g}"
    return "-" if mode == "no-hooks" else case["hook"]
