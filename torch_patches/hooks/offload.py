"""In-graph CPU activation offload: the ``saved_tensors_hooks::offload`` / ``reload_*`` ops and
:func:`cpu_offload`.

Three custom ops (``torch.library.custom_op``, namespace ``saved_tensors_hooks``), with fake
implementations so they trace under make_fx, Dynamo, AOTAutograd and Inductor (which runs
them as fallback kernels, where the inliner placed them):

``offload(Tensor src, bool pin_memory) -> Tensor``
    A CPU copy of ``src``, with ``src``'s strides when ``src`` is dense (``empty_like``).
``reload_start(Tensor cpu, Device device, SymInt[]? stride=None) -> Tensor``
    Starts copying ``cpu`` to ``device`` (into a tensor with strides ``stride``, default
    ``cpu``'s); returns a *ticket*: a 0-d int64 CPU tensor naming the copy in flight.  The
    destination tensor is held by the op, not returned.
``reload_wait(Tensor ticket, Tensor cpu, Device device, SymInt[]? stride=None) -> Tensor``
    Waits for the copy ``ticket`` names and returns its destination, a tensor on ``device``
    like ``cpu`` (with strides ``stride``).

On CPU tensors (``src`` on the CPU, ``device == cpu``) the ops are plain synchronous copies:
results are bit-identical, no memory is saved (useful for tests and for the graphs).

CUDA (checked on an H100, torch 2.11: ``benchmarks/gpu_offload_profile.py``):

* one side stream per device does every copy, so a reload is ordered after the offload that
  wrote its input without any host synchronisation;
* no ``record_stream``: a block a side stream used and the current stream freed would stay
  out of the caching allocator's reach until the GPU itself passed the free, and the host
  runs a whole step ahead of the GPU, so every offloaded block stayed reserved (measured:
  reserved 1.8x of no hooks, allocated 0.55x).  Instead each device block changes hands by
  an event the *current stream* waits for, and is freed on the current stream, where the
  caching allocator reuses it in stream order at once;
* ``offload``: ``side.wait_stream(current)`` (``src`` is complete), the device-to-host copy
  into pinned memory (``pin_memory=True``, from torch's caching host allocator, a pool reused
  once a copy's event has passed; pageable memory makes the copy synchronous) on ``side``, an
  event after it.  The op keeps ``src`` until the current stream has waited for that event:
  each ``offload`` (and ``reload_start``) first lets go of the sources of the copies that
  are done (their events have passed, a host query), and once more than
  ``config.offload_copies_in_flight`` copies of the device are still running, makes the
  current stream wait for the oldest and lets its ``src`` go.  The compute stream thus runs
  at most that many copies ahead of the copy engine, a finished copy's block is back with
  the allocator by the next offload, and the host never blocks.  The returned CPU tensor is complete only once
  ``side`` has run the copy: the only consumer that may read it is ``reload_start``
  (stream-ordered).  So ``cpu_offload()`` must be the *last* pair of a
  :func:`~torch_patches.hooks.chain`, never followed by a pair that computes on the CPU
  tensor;
* Inductor's buffer reuse: Inductor plans memory for one stream.  Once ``offload`` returns,
  Inductor considers ``src`` dead and may hand its buffer to a later kernel (``buf7 = buf3``)
  while ``side`` still reads it; the caching allocator never sees that reuse.  Inductor's
  own remedy, ``never_reuse_buffers``, also keeps the buffer from being freed at all (alive
  to the end of the graph: no memory saved).  We register an Inductor lowering for
  ``offload`` (the ordinary fallback kernel) that marks the buffers it reads *free without
  reuse* (patch ``inductor.free_without_reuse`` in
  ``torch_patches/_inductor/codegen/wrapper.py``): a plain ``del`` at the op, never a reuse
  candidate, in place included (patch ``inductor.no_inplace_reuse``: Inductor realizes
  pointwise ops lazily, so ``gelu(mm)`` runs *after* the offload of ``mm``'s output and, as
  its last reader, would write its output into that buffer in place).  And Inductor's
  peak-memory reordering leaves graphs holding these ops in the inliner's order (patch
  ``inductor.offload_order_kept``, ``torch_patches/_inductor/memory.py``): its model cannot
  see the device memory ``reload_start`` allocates and moved every reload to the start of
  the backward.
* ``reload_start``: allocates the destination on the current stream (freed there by its last
  user, in stream order), ``side.wait_stream(current)`` (the block's earlier users are
  done), the host-to-device copy on ``side`` (``non_blocking``), an event;
* ``reload_wait``: ``current.wait_event(event)``.  The host never blocks.

Why a ticket instead of ``reload_start`` returning the destination and ``reload_wait(dst)``
returning it again: an op made with ``torch.library.custom_op`` must return tensors that do
not alias its inputs (torch checks it at run time).  The ways around it all cost or break
something: a mutating ``reload_wait(Tensor(a!) dst)`` is functionalized into
``auto_functionalized``, which outside Inductor's reinplacing *clones* ``dst`` (a copy on
aot_eager, and one that reads ``dst`` on the current stream *before* the wait: a race); a
view-returning op (``Tensor(a) -> Tensor(a)``) is not supported by every torch we support
and leaves Inductor reasoning about an alias of a buffer another stream writes.  With the
ticket, the destination is a fresh tensor from the graph's point of view when
``reload_wait`` returns it, which is exactly when it becomes valid; the data dependency
ticket -> ``reload_wait`` keeps the two ops ordered, and ``reload_wait`` takes ``cpu`` and
``device`` so its fake implementation knows the result's metadata (and ``cpu`` stays alive
until the copy is waited for).

A reload may also start *before* the graph that waits for it runs: :func:`prefetch` starts
the copy of a host tensor ``offload`` returned (it carries its device and strides) and leaves
the copy's ticket with that host tensor; the ``reload_start`` that later asks for the same copy
takes that ticket instead of starting another.  The compiler calls :func:`prefetch` for the
saved tensors of the graph autograd runs next in the backward (each layer compiled on its own:
``torch_patches/_functorch/_aot_autograd/offload_prefetch.py``), so a layer's reloads run
behind the backward compute of the layer after it.  A prefetched ticket lives exactly as long
as its host tensor (a backward that raised, or never reached the graph, drops it with the
autograd graph, and its destination with it, after the copy into it).

The ops are pure from the graph's point of view (every output is used, nothing else is
written), so no effect tokens are needed: they are not dead code, and data dependencies
order offload after the saved tensor's producer, ``reload_start`` before ``reload_wait``
and ``reload_wait`` before the first backward use.  Where between those the compiler puts
``reload_start`` decides the overlap: the inliner puts it
``max(config.unpack_prefetch_distance, config.reload_prefetch_distance)`` backward nodes
before the first use.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import weakref
from typing import Any

import torch
from torch import Tensor

from torch_patches.hooks._inlineable import inlineable

__all__ = ["copy_log", "cpu_offload", "offload", "offload_order", "prefetch", "reload_start", "reload_wait"]

_NS = "saved_tensors_hooks"


# ------------------------------------------------------------------------ streams

_streams_lock = threading.Lock()
_side_streams: dict[int, Any] = {}


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(device: torch.device) -> Any:
    """The per-device stream every offload/reload copy of that device runs on."""
    index = _index(device)
    with _streams_lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


@dataclasses.dataclass
class _CopyOut:
    src: Tensor  # the device tensor a side-stream copy reads; held until that copy is waited for
    event: Any  # torch.cuda.Event recorded on the side stream after the copy


#: Per device index: the device-to-host copies whose source is still held, oldest first.
_copies_out: dict[int, collections.deque[_CopyOut]] = {}


def _release_copied(device: torch.device, keep: int) -> None:
    """Let go of the sources of the pending device-to-host copies of ``device`` that are done
    (their event has passed: nothing reads them any more), then of all but the newest
    ``keep`` still running: the current stream waits for each of those first, so the freed
    block is reused (on the current stream, in its order) only after the copy has read it.
    Only copies still running count against ``keep``: the compute waits for a copy only
    when more than ``keep`` are behind it, and a finished copy's block goes back to the
    allocator at the next offload or reload, with no wait."""
    index = _index(device)
    with _streams_lock:
        pending = _copies_out.get(index)
        while pending and pending[0].event.query():  # a host query; it never blocks
            pending.popleft()
        done = [pending.popleft() for _ in range(len(pending) - keep)] if pending and len(pending) > keep else []
    if done:
        current = torch.cuda.current_stream(index)
        for copy in done:
            current.wait_event(copy.event)
    # Dropping ``done`` drops the last references this module held to the sources.


def _copies_in_flight() -> int:
    from torch_patches import config

    return max(0, int(config.offload_copies_in_flight))


# ------------------------------------------------------------- reload facts, copy log


@dataclasses.dataclass
class _Reload:
    """What a host tensor ``offload`` returned carries for its way back: the device and
    strides of the tensor it copies, its place in offload order, and the ticket of a reload
    started ahead of its ``reload_start`` (:func:`prefetch`), until that takes it."""

    device: torch.device
    stride: tuple[int, ...]
    seq: int
    ticket: Tensor | None = None


_RELOAD_ATTR = "_saved_tensors_hooks_reload"
_offload_seq = itertools.count()


def _reload_of(cpu: Tensor) -> _Reload | None:
    return cpu.__dict__.get(_RELOAD_ATTR)


def offload_order(t: Tensor) -> int | None:
    """Where host tensor ``t`` stands in the process's offload order (later offloads are
    larger), or None when ``t`` is not a tensor :func:`offload` returned."""
    info = t.__dict__.get(_RELOAD_ATTR)
    return None if info is None else info.seq


#: While :func:`copy_log` records: its event list (``None`` otherwise).
_events: list[tuple[str, int, Any]] | None = None
_events_lock = threading.Lock()


def _note(kind: str, cpu: Tensor) -> None:
    if _events is None:
        return
    info = _reload_of(cpu)
    with _events_lock:
        if _events is not None:
            _events.append((kind, info.seq if info is not None else -1, torch._C._current_autograd_node()))


@contextlib.contextmanager
def copy_log() -> Any:
    """Record the offload ops' copies while the block runs: a list of ``(event, tensor,
    node)``, ``event`` one of ``"offload"`` (a device-to-host copy issued), ``"prefetch"``
    (a reload started ahead of its graph, :func:`prefetch`), ``"start"`` (a reload started
    by ``reload_start`` itself), ``"take"`` (``reload_start`` took a prefetched reload) and
    ``"wait"`` (``reload_wait``); ``tensor`` numbers the host tensor in offload order;
    ``node`` is the autograd node running then (``torch._C._current_autograd_node()``: the
    compiled graph's backward node, None in the forward).  For tests and debugging: the log
    keeps the nodes alive."""
    global _events
    with _events_lock:
        if _events is not None:
            raise RuntimeError("copy_log() is already recording")
        out: list[tuple[str, int, Any]] = []
        _events = out
    try:
        yield out
    finally:
        with _events_lock:
            _events = None


# ------------------------------------------------------------------------ offload


def _host_like(src: Tensor, pin_memory: bool) -> Tensor:
    # empty_like keeps src's strides when src is dense and non-overlapping (the fake
    # implementation computes the same), else it is contiguous.
    return torch.empty_like(src, device="cpu", pin_memory=pin_memory)


@torch.library.custom_op(f"{_NS}::offload", mutates_args=())
def offload(src: Tensor, pin_memory: bool) -> Tensor:
    """Copy ``src`` to host memory (pinned when ``pin_memory`` and ``src`` is on CUDA).

    On CUDA the copy is asynchronous, on the device's side stream; see the module docstring
    for what keeps ``src`` intact until it is done and when its device memory is released.
    """
    if not _is_cuda(src.device):
        # CPU (and devices without a stream path): a synchronous copy.
        out = _host_like(src, pin_memory=False)
        out.copy_(src)
        return _stamped(out, src)
    side = _side_stream(src.device)
    out = _host_like(src, pin_memory=pin_memory)
    side.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(side):
        # Pageable host memory makes this copy synchronous (non_blocking is ignored).
        out.copy_(src, non_blocking=pin_memory)
        event = torch.cuda.Event()
        event.record(side)
    with _streams_lock:
        _copies_out.setdefault(_index(src.device), collections.deque()).append(_CopyOut(src, event))
    _release_copied(src.device, keep=_copies_in_flight())
    return _stamped(out, src)


def _stamped(out: Tensor, src: Tensor) -> Tensor:
    """``out`` carrying what :func:`prefetch` needs to bring it back to ``src``'s place."""
    setattr(out, _RELOAD_ATTR, _Reload(src.device, tuple(src.stride()), next(_offload_seq)))
    _note("offload", out)
    return out


@offload.register_fake
def _offload_fake(src: Tensor, pin_memory: bool) -> Tensor:
    return torch.empty_like(src, device="cpu")


# ------------------------------------------------------------------------- reload


@dataclasses.dataclass
class _InFlight:
    dst: Tensor
    event: Any  # torch.cuda.Event, None for synchronous copies
    # The host memory, kept until the copy is waited for: its storage, not the tensor, whose
    # reload facts may hold this very copy's ticket (a prefetched reload): the entry must not
    # keep that ticket alive, or a ticket never taken would never be released.
    src: Any
    # Device memory the copy reads besides (the compact copy of an overlapping layout).
    compact: Any = None


_tickets = itertools.count()
_in_flight: dict[int, _InFlight] = {}


def _device_like(cpu: Tensor, device: torch.device, stride: list[int] | None) -> Tensor:
    if stride is None:
        return torch.empty_like(cpu, device=device)
    return torch.empty_strided(cpu.shape, stride, dtype=cpu.dtype, device=device)


def _overlaps(shape: Any, stride: list[int]) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``stride`` share a memory location
    (an expanded view's stride 0): a copy cannot write into such a layout."""
    reach = 0
    for step, size in sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1):
        if step <= reach:
            return True
        reach += (size - 1) * step
    return False


def _layout_storage(cpu: Tensor, device: torch.device, stride: list[int]) -> Tensor:
    """The storage a tensor of ``cpu``'s shape and ``stride`` reads, on ``device``."""
    size = 1 + sum((n - 1) * st for n, st in zip(cpu.shape, stride)) if cpu.numel() else 0
    return torch.empty(size, dtype=cpu.dtype, device=device)


def _in_layout(dense: Tensor, storage: Tensor, stride: list[int]) -> Tensor:
    """``dense`` (a compact copy) as a tensor of ``stride``, whose elements overlap: written
    into ``storage`` (:func:`_layout_storage`) element by element (those sharing a location
    are equal), viewed with ``stride``."""
    if dense.numel():
        where = torch.arange(storage.numel(), device=dense.device).as_strided(dense.shape, stride)
        storage[where.reshape(-1)] = dense.reshape(-1)
    return storage.as_strided(dense.shape, stride)


def _start_copy(cpu: Tensor, device: torch.device, stride: list[int] | None) -> Tensor:
    """Start copying ``cpu`` to ``device``; the copy's ticket (see :func:`reload_start`)."""
    ticket = next(_tickets)
    # An expanded view's strides overlap: copied compact, then laid out (_in_layout).
    overlap = stride if stride is not None and _overlaps(cpu.shape, stride) else None
    layout = None if overlap is not None else stride
    if not _is_cuda(device):
        dst = _device_like(cpu, device, layout)
        dst.copy_(cpu)
        if overlap is not None:
            dst = _in_layout(dst, _layout_storage(cpu, device, overlap), overlap)
        _in_flight[ticket] = _InFlight(dst, None, cpu.untyped_storage())
    else:
        # The backward has begun: the forward's copies out are waited for and let go.
        _release_copied(device, keep=0)
        side = _side_stream(device)
        # Allocated on the current stream, which frees it after its last use; side waits for
        # the kernels the current stream has queued so far (the block's earlier users).
        dst = _device_like(cpu, device, layout)
        storage = _layout_storage(cpu, device, overlap) if overlap is not None else None
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dst.copy_(cpu, non_blocking=True)
            compact, dst = dst, _in_layout(dst, storage, overlap) if storage is not None and overlap is not None else dst
            event = torch.cuda.Event()
            event.record(side)
        # (the compact copy too: the side stream reads it until the event)
        _in_flight[ticket] = _InFlight(dst, event, cpu.untyped_storage(), compact)
    out = torch.tensor(ticket, dtype=torch.int64)
    # A ticket dropped unwaited (a backward that raised between the two ops, a prefetched
    # reload whose graph never ran) takes its entry, and with it the destination's device
    # memory, along.
    weakref.finalize(out, _drop_unwaited, ticket)
    return out


def _take_prefetched(cpu: Tensor, device: torch.device, stride: list[int] | None) -> Tensor | None:
    """The ticket of a reload of ``cpu`` :func:`prefetch` started, if it is the copy asked
    for (same device and strides); taken once.  A prefetched copy of another layout is let go."""
    info = _reload_of(cpu)
    if info is None or info.ticket is None:
        return None
    ticket, info.ticket = info.ticket, None
    wanted = tuple(stride) if stride is not None else tuple(cpu.stride())
    if info.device != device or info.stride != wanted:
        return None
    return ticket


@torch.library.custom_op(f"{_NS}::reload_start", mutates_args=())
def reload_start(cpu: Tensor, device: torch.device, stride: list[int] | None = None) -> Tensor:
    """Start copying host tensor ``cpu`` to ``device``; returns the copy's ticket.

    The destination has strides ``stride`` (``None``: ``cpu``'s).  The ticket is a 0-d
    int64 CPU tensor; pass it to :func:`reload_wait` (exactly once).  A ticket freed
    without being waited for releases the copy (its destination) with it.  Where
    :func:`prefetch` already started this copy, its ticket is returned instead.
    """
    ticket = _take_prefetched(cpu, device, stride)
    if ticket is not None:
        _note("take", cpu)
        return ticket
    _note("start", cpu)
    return _start_copy(cpu, device, stride)


def prefetch(cpu: Tensor) -> int:
    """Start bringing back ``cpu``, a host tensor :func:`offload` returned, to the device and
    strides of the tensor it copies, now, ahead of the ``reload_start`` that will ask for
    it; the copy's ticket stays with ``cpu`` until that takes it (or ``cpu`` dies, which
    releases the copy).  Returns the bytes started (0: not an offloaded tensor, or its
    reload is already started).  Not an op: the runtime calls it between graphs."""
    info = _reload_of(cpu)
    if info is None or info.ticket is not None:
        return 0
    _note("prefetch", cpu)
    info.ticket = _start_copy(cpu, info.device, list(info.stride))
    return cpu.numel() * cpu.element_size()


def _drop_unwaited(ticket: int) -> None:
    entry = _in_flight.pop(ticket, None)
    if entry is not None and entry.event is not None:
        # The destination goes back to the current stream's pool: not before the copy into it.
        torch.cuda.current_stream(entry.dst.device).wait_event(entry.event)


@reload_start.register_fake
def _reload_start_fake(cpu: Tensor, device: torch.device, stride: list[int] | None = None) -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(f"{_NS}::reload_wait", mutates_args=())
def reload_wait(ticket: Tensor, cpu: Tensor, device: torch.device, stride: list[int] | None = None) -> Tensor:
    """Wait for the copy ``ticket`` names (started by :func:`reload_start`); return it.

    On CUDA the *current stream* waits (an event), not the host; the result may then be used
    on the current stream like any tensor.
    """
    key = int(ticket.item())  # a CPU tensor: no device synchronisation
    _note("wait", cpu)
    entry = _in_flight.pop(key, None)
    if entry is None:
        raise RuntimeError(
            f"saved_tensors_hooks::reload_wait: no reload in flight for ticket {key} (each reload_start ticket is waited for exactly once)"
        )
    if entry.event is not None:
        torch.cuda.current_stream(entry.dst.device).wait_event(entry.event)
    return entry.dst


@reload_wait.register_fake
def _reload_wait_fake(ticket: Tensor, cpu: Tensor, device: torch.device, stride: list[int] | None = None) -> Tensor:
    return _device_like(cpu, device, stride)


# ---------------------------------------------------------------------- the hooks


def _offload_pack(pin_memory: bool) -> Any:
    def cpu_offload_pack(x: Tensor) -> Any:
        # The strides too: a compiled backward given the unpacked tensor by Python hooks
        # expects the saved tensor's exact strides, also for views with gaps (q of a qkv
        # split); the host copy itself is compact.
        return (torch.ops.saved_tensors_hooks.offload(x, pin_memory), x.device, list(x.stride()))

    return cpu_offload_pack


def cpu_offload_unpack(packed: Any) -> Tensor:
    """Unpack of :func:`cpu_offload`: start the reload, wait for it."""
    cpu, device, stride = packed
    ops = torch.ops.saved_tensors_hooks
    return ops.reload_wait(ops.reload_start(cpu, device, stride), cpu, device, stride)


def cpu_offload(pin_memory: bool = True) -> tuple[Any, Any]:
    """Hooks moving saved tensors to host memory in the forward, back in the backward.

    Pack: ``(torch.ops.saved_tensors_hooks.offload(x, pin_memory), x.device, x.stride())``; unpack:
    ``reload_start`` then ``reload_wait`` back to that device.  Every saved tensor the hooks
    see is moved, whatever its dtype (the copy is exact).  Inlined (any backend,
    ``fullgraph=True`` included), the offload runs right after the saved
    tensor's last forward use, ``reload_start`` ``max(config.unpack_prefetch_distance,
    config.reload_prefetch_distance)`` backward nodes before its first backward use and
    ``reload_wait`` right before it, so the host-to-device copy overlaps the compute in
    between.  As eager hooks, unpack starts and waits at once.

    On CUDA the copies run on a side stream into pinned host memory (``pin_memory=True``;
    ``False`` uses pageable memory, which makes each device-to-host copy synchronous), and
    neither the caching allocator nor Inductor reuses a saved tensor's memory before its
    copy is done (module docstring of ``torch_patches.hooks.offload``).  On CPU tensors the
    ops are plain copies: results unchanged, no memory saved.

    Error bound: exact (``unpack(pack(x))`` equals ``x`` bit for bit, with its dtype, shape,
    device and strides; the host copy is compact even when ``x`` is a view with gaps).  Device memory: none for the saved tensor
    between its last forward and first backward use; host memory: its full size.

    Compose it *last*: ``chain(fp8_rowwise(), cpu_offload())`` compresses, then offloads the
    fp8 payload and its scales (a quarter of float32's transfer).  A pair chained after
    ``cpu_offload()`` would read host tensors whose copy may still be in flight.
    """
    # upstream: not exported
    from torch_patches import applied_patches, is_applied

    # upstream: not exported
    if is_applied() and "inductor.free_without_reuse" not in applied_patches():
        raise RuntimeError(
            "cpu_offload() needs the offload patches (Inductor would reuse an offloaded "
            "buffer while its copy still reads it): torch_patches.apply() was called with "
            "offload=False; unapply() and apply() without it"
        )
    return inlineable(_offload_pack(bool(pin_memory)), cpu_offload_unpack)
