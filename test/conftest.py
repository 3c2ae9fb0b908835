"""Settings of a test session that runs on pytest-xdist workers (``-n auto``).

Each worker gets its share of the machine's cores for torch's intra-op threads, and the
subprocesses it starts (fresh-process checks, bench rows) inherit that share through
``OMP_NUM_THREADS``: left alone, every worker and every subprocess uses all the cores, and
OpenMP threads spinning for cores the other workers hold make a training test several times
slower than when it runs alone. Inductor compiles in the worker itself for the same reason (a
pool of compile workers per process is started, and paid for, by every fresh process).
"""

from __future__ import annotations

import os

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))

if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    import torch

    torch.set_num_threads(_threads)
