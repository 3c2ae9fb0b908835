"""The research harness of torch_patches, beside its results (``benchmarks/results/``).

Run from the root of a clone (the package is installed; this folder is not)::

    python -m benchmarks.convergence      # training on real text: eval loss against no hooks
    python -m benchmarks.budget_sweep     # budget(F) against stock's activation_memory_budget
    python -m benchmarks.overhead         # what hooks cost per compiled call, against stock

The memory and speed table of one training step is the package's own command,
``python -m torch_patches bench`` (:mod:`torch_patches.bench`); the scripts here build on its
public names. What each command measures and the latest results: ``benchmarks/README.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

#: The clone's root: the folder holding ``benchmarks/`` and ``torch_patches/``.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_env() -> dict[str, str]:
    """The environment of a worker process (``python -m benchmarks.X --worker``): this
    process's, with the clone's root first on ``PYTHONPATH`` so that the worker imports the
    same ``benchmarks`` (and ``torch_patches``) whatever its working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


def interleaved_times(step: Callable[[str], float], names: Sequence[str], steps: int, warmup: int = 3) -> dict[str, list[float]]:
    """Each row's step times, the rows' steps alternating (ABC, CBA, ...) in one process so
    that a shared machine's slow phases fall on every row alike: ``step(name)`` runs one step
    of row ``name`` and returns its seconds; ``warmup`` untimed steps a row first (compiles)."""
    for name in names:
        for _ in range(warmup):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    order = list(names)
    for i in range(steps):
        for name in order if i % 2 == 0 else order[::-1]:
            times[name].append(step(name))
    return times
