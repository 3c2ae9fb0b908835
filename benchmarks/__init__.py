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

#: The clone's root: the folder holding ``benchmarks/`` and ``torch_patches/``.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_env() -> dict[str, str]:
    """The environment of a worker process (``python -m benchmarks.X --worker``): this
    process's, with the clone's root first on ``PYTHONPATH`` so that the worker imports the
    same ``benchmarks`` (and ``torch_patches``) whatever its working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env
