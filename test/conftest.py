"""Settings of a test session that runs on pytest-xdist workers (``-n auto``).

Each worker gets its share of the machine's cores for torch's intra-op threads, and the
subprocesses it starts (fresh-process checks, bench rows) inherit that share through
``OMP_NUM_THREADS``: left alone, every worker and every subprocess uses all the cores, and
OpenMP threads spinning for cores the other workers hold make a training test several times
slower than when it runs alone. Inductor compiles in the worker itself for the same reason (a
pool of compile workers per process is started, and paid for, by every fresh process).
"""

from __future__ import annotations

import json
import os
import pathlib
import threading

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))

if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    import torch

    torch.set_num_threads(_threads)


def _choose_the_vector_isa(config) -> None:  # noqa: ANN001 - pytest's config
    """Inductor checks that the C++ compiler builds and loads code for each SIMD instruction
    set the CPU reports, compiling a program that includes ATen's vector headers per set
    (about 3 s each cold, one after another, once per process and cache directory). The
    tests take the CPU's report, as ``TORCHINDUCTOR_VEC_ISA_OK=1`` tells Inductor to (the
    workers and every subprocess they start): a compiler that cannot build for the CPU fails
    the first Inductor test, naming its flags, rather than a probe falling back quietly.

    A run that leaves the slow tests out (the fast tier, ``-m "not slow"``) builds the
    kernels scalar instead, ``TORCHINDUCTOR_VEC_ISA_OK=0`` (no instruction set, none probed).
    Every vectorized kernel file instantiates ATen's ``Vectorized`` templates again, which
    the precompiled header cannot hold: about 0.4 s of each build's 1.1, 12% of the tier's
    test time (two runs of each, side by side). No code of torch_patches emits or changes a
    kernel's loops (its Inductor patches are the graphs it is given, buffer reuse and cache
    keys), so the fast tier checks the same things; the whole suite (CI's torch 2.13 run)
    builds the kernels vectorized, as users get them.

    Set the variable beforehand to choose otherwise (``1`` in the fast tier: vectorized; any
    other value: Inductor's probe)."""
    if "TORCHINDUCTOR_VEC_ISA_OK" in os.environ:
        return
    vectorized = "not slow" not in (config.getoption("markexpr", "") or "")
    os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "1" if vectorized else "0"
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = vectorized  # read from the environment at its import


#: The checks Inductor still makes with the report taken (whether AVX-512 BF16 and AMX
#: tiles build: small programs, about 0.6 s each cold), run while the test modules are
#: collected (:func:`pytest_collection_finish` waits for them): the compiler's process and
#: the collection's imports use a core each.
_VEC_ISA_CHECKS: list[threading.Thread] = []


def _check_vec_isa_during_collection() -> None:
    try:
        # Imported here, in the main thread: the checks import nothing more.
        from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
    except ImportError:  # another release's layout: the first compile checks
        return

    def check() -> None:
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - another release's internals: the first compile checks
            pass

    thread = threading.Thread(target=check, name="vec-isa-checks", daemon=True)
    thread.start()
    _VEC_ISA_CHECKS.append(thread)


def pytest_runtest_setup(item) -> None:  # noqa: ANN001 - pytest's hook
    """Tests outside torch_patches' ``TestCase`` run on stock torch: that class leaves the
    patches applied from one of its tests to the next (``torch_patches/testing/case.py``)."""
    from torch_patches.testing import TestCase

    cls = getattr(item, "cls", None)
    if not (isinstance(cls, type) and issubclass(cls, TestCase)):
        import torch_patches

        torch_patches.unapply()


def _one_collection_at_the_end(config) -> None:  # noqa: ANN001 - pytest's Config
    """pytest looks for exceptions raised in ``__del__`` at the end of the session after five
    full collections of the heap, which a process that has compiled for minutes holds a
    lot of: about 1.3 s each, 6 s of every worker's run. One collection frees what the
    tests left in reference cycles; pytest's own pytester sets the same knob (to 0)."""
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # another pytest: its default
        return
    config.stash[gc_collect_iterations_key] = 1


def _no_guard_latency_probe() -> None:
    """Dynamo times every new guard once for its compile metrics
    (``torch._dynamo.guards.profile_guard_manager``), after evicting the CPU's caches by
    writing a buffer larger than them: about 25 ms of every frame compiled, a tenth of the
    fast tier's compile time. The number only feeds the metrics log, which no test reads
    (Dynamo's test case turns ``log_compilation_metrics`` off); the guard itself is still
    built and checked on the frame's own inputs."""
    from torch._dynamo import guards

    if hasattr(guards, "profile_guard_manager"):
        guards.profile_guard_manager = lambda *args, **kwargs: 0.0


#: Collections of the youngest generation after this many net allocations (CPython: 700),
#: and of the older two after this many of the younger one's (10 and 10).
_GC_THRESHOLD = (20_000, 20, 20)


def _fewer_collections() -> None:
    """A worker holds over half a million objects once it has imported torch and
    transformers, and compiling makes many short-lived ones: at CPython's thresholds the
    cyclic collector ran some 3,000 times in a worker's share of the fast tier and walked
    the whole heap a dozen times, a tenth of the worker's time. Collections only free
    reference cycles, which no test leaves holding what it measures (peaks are read around
    one step), so the tests run with rarer ones, and what collection imported is frozen
    (:func:`pytest_collection_finish`), out of every later full collection. ``apply()``
    reads every module's dict for aliases, frozen or not (``_registry/install.py``;
    ``test_registry.test_aliases_found_among_frozen_objects``)."""
    import gc

    gc.set_threshold(*_GC_THRESHOLD)


def pytest_collection_finish(session) -> None:  # noqa: ANN001 - pytest's hook
    import gc

    while _VEC_ISA_CHECKS:
        _VEC_ISA_CHECKS.pop().join()
    if gc.get_threshold() == _GC_THRESHOLD:  # a worker (or a run without xdist)
        gc.collect()
        gc.freeze()


#: Seconds each test of a second or more took (setup, call and teardown), by node id:
#: ``--store-durations`` writes it; workers run the longest first.
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
#: Tests shorter than this are not recorded: their order among themselves is kept.
_RECORDED_FROM = 1.0


def _recorded() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):  # no file yet, or one to rewrite
        return {}


def _test_id(nodeid: str) -> str:
    """A test's node id without xdist's ``@group`` suffix (the same test in any group)."""
    return nodeid.partition("@")[0]


def pytest_addoption(parser) -> None:  # noqa: ANN001 - pytest's hook
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"record the run's tests of {_RECORDED_FROM:g} s or more in test/durations.json (the order workers run them in)",
    )


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook
    """Under xdist, each worker runs the longest tests first (as recorded in
    ``durations.json``; the others after them, in file order): xdist hands each worker its
    next tests as it finishes, so the run ends on short tests and the workers end together,
    where a long test scheduled last kept one core busy alone for up to its whole length."""
    if not hasattr(config, "workerinput"):
        return
    recorded = _recorded()
    items.sort(key=lambda item: -recorded.get(_test_id(item.nodeid), 0.0))


class _DurationRecorder:
    """``--store-durations``: each test's setup, call and teardown, summed, written to
    ``durations.json`` at the end (in xdist's controller, which receives every worker's
    reports, or in a run without workers)."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 - pytest's hook
        nodeid = _test_id(report.nodeid)
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        recorded = _recorded()
        for nodeid, seconds in self.seconds.items():  # tests this run did not run keep their entries
            if seconds >= _RECORDED_FROM:
                recorded[nodeid] = round(seconds, 1)
            else:
                recorded.pop(nodeid, None)
        kept = {k: v for k, v in sorted(recorded.items()) if (self.root / k.partition("::")[0]).exists()}
        DURATIONS.write_text(json.dumps(kept, indent=0) + "\n")


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationRecorder(pathlib.Path(str(config.rootpath))))
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test: its workers set up their own
    _one_collection_at_the_end(config)
    _choose_the_vector_isa(config)
    _check_vec_isa_during_collection()
    _no_guard_latency_probe()
    _fewer_collections()


def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest's hook
    if hasattr(config, "workerinput"):
        import atexit

        atexit.register(_exit_without_teardown)  # the last registered: the first to run


def _exit_without_teardown() -> None:
    """An xdist worker's last act: every other exit handler runs, as at any exit, then the
    process ends without the interpreter's teardown. Freeing the heap of a process that has
    compiled for minutes, object by object, took 4-5 s at the end of every fast-tier run,
    which xdist's controller waits for; the worker's reports went over xdist's channel
    before it was told to exit, and the kernel frees its memory at once."""
    import atexit
    import sys

    atexit.unregister(_exit_without_teardown)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
