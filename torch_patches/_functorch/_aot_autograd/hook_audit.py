"""The one Python audit hook (PEP 578) torch_patches adds to a process, and what it tells.

Two parts of the package learn something only an audit hook can tell them:

* the tracer records the I/O a plain-function hook attempts while it is traced (files,
  processes, sockets: :func:`recording`, used by ``hook_tracing._no_side_effects``);
* the watches that re-check a hook's identity at every compiled call (``hook_watch``)
  learn that some function's ``__code__``, ``__defaults__`` or ``__kwdefaults__`` was
  assigned (:func:`function_writes`).  Reading those attributes is itself an audited event
  (``object.__getattr__``), which makes every read cost a call of every audit hook of the
  process; counting the writes instead costs nothing per call.

The hook is added once (the registry effect ``aot.side_effect_probe`` from ``apply()``, or
the first use of either part) and can never be removed, so it runs at every audited event
of the process for its lifetime: it returns at once for everything else (one comparison
for an attribute write, one thread-local read otherwise).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

#: Function attributes whose assignment changes what a function computes.
_FUNCTION_ATTRS = frozenset({"__code__", "__defaults__", "__kwdefaults__"})

#: Events recorded while a hook is traced (prefixes).
_IO_EVENTS = ("open", "os.", "subprocess.", "socket.", "shutil.", "builtins.input")

#: Files opened by imports and source lookups, not by the hook.
_MODULE_FILES = (".py", ".pyc", ".so", ".pyd")

_lock = threading.Lock()
_installed = False
_active = threading.local()
#: How many function attributes in _FUNCTION_ATTRS were assigned since the hook was added.
_writes = [0]


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "object.__setattr__":
        if args[1] in _FUNCTION_ATTRS:
            _writes[0] += 1
        return
    records = getattr(_active, "records", None)
    if records is None:
        return
    if event == "open" and args and isinstance(args[0], str) and args[0].endswith(_MODULE_FILES):
        return
    if event.startswith(_IO_EVENTS) and not event.startswith("os.listdir"):
        records.append(event)


def install() -> None:
    """Add the audit hook (once per process). Cannot be undone (PEP 578)."""
    global _installed
    if _installed:
        return
    with _lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True


def function_writes() -> list[int]:
    """The counter of function code/defaults assignments (a one-item list, read as
    ``[0]``), the hook added first so that none is missed from now on."""
    install()
    return _writes


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect the I/O events this thread raises inside the block (each event once)."""
    install()
    records: list[str] = []
    _active.records = records
    try:
        yield records
    finally:
        _active.records = None
        records[:] = list(dict.fromkeys(records))
