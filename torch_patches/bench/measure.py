"""Byte accounting of the bench: the bytes an autograd graph holds for backward, counted
exactly (``saved MiB``), the working set of one block's backward (``floor MiB``), the
process's memory status (CPU peaks). The columns: ``docs/bench.md``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def proc_status(field: str) -> int:
    """A field of ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _tensor_leaves(obj: Any) -> list[Any]:
    """The tensors in ``obj`` (nested tuples, lists and dicts); a traceable wrapper subclass
    (packed formats) is replaced by its inner tensors, which own the storage."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out, todo = [], [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            if is_traceable_wrapper_subclass(o):
                names, _ = o.__tensor_flatten__()
                todo.extend(getattr(o, n) for n in names)
            else:
                out.append(o)
        elif isinstance(o, (tuple, list)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
    return out


def _storages(tensors: Iterable[Any]) -> dict[tuple[str, int], int]:
    """(device, storage data_ptr) -> storage nbytes, each storage once."""
    out = {}
    for t in _tensor_leaves(list(tensors)):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (e.g. a sparse or meta tensor)
            continue
        if st.nbytes():
            out[(str(t.device), st.data_ptr())] = st.nbytes()
    return out


def tensor_bytes(tensors: Iterable[Any], exclude: Iterable[Any] = ()) -> int:
    """Bytes of the storages of ``tensors`` (nested containers allowed), each storage once,
    leaving out the storages of the tensors in ``exclude``."""
    excluded = _storages(exclude)
    return sum(n for key, n in _storages(tensors).items() if key not in excluded)


def saved_tensors_of(node: Any) -> list[Any]:
    """The tensors one autograd node keeps for its backward. Reading a saved tensor unpacks
    it: under runtime saved-tensor hooks this returns (and allocates) unpacked tensors."""
    import torch

    if isinstance(node, torch.autograd.function.BackwardCFunction):
        # An autograd.Function's ctx (a compiled function's backward node): what it saved with
        # save_for_backward, and tensors kept as attributes (AOT's _tensors_no_vc_check).
        try:
            saved = node.saved_tensors
        except RuntimeError:  # freed: backward already ran
            saved = ()
        return _tensor_leaves([saved, list(vars(node).values())])
    found = []
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                found.append(getattr(node, name))
            except RuntimeError:  # freed (backward already ran) or not saved on this path
                continue
    return _tensor_leaves(found)


def saved_tensors(output: Any) -> list[Any]:
    """The tensors the autograd graph behind ``output`` (a tensor or a nested container of
    them) holds for backward: every node reachable from the outputs' ``grad_fn`` through
    ``next_functions``, the tensors it saved (:func:`saved_tensors_of`)."""
    seen, todo, saved = set(), [], []
    for t in _tensor_leaves(output):
        if t.grad_fn is not None:
            todo.append(t.grad_fn)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved.extend(saved_tensors_of(node))
        todo.extend(fn for fn, _ in node.next_functions)
    return saved


def saved_bytes(output: Any, exclude: Iterable[Any] = ()) -> int:
    """Bytes the autograd graph behind ``output`` holds for backward (:func:`saved_tensors`),
    counted exactly, each storage once, without the storages of ``exclude`` (parameters,
    inputs). Call it after the forward and before backward."""
    return tensor_bytes(saved_tensors(output), exclude)


def saved_bytes_by_device(output: Any, exclude: Iterable[Any] = ()) -> dict[str, int]:
    """:func:`saved_bytes` per device (``"cuda:0"``, ``"cpu"``): where the held tensors are."""
    skip = _storages(exclude)
    out: dict[str, int] = {}
    for (device, ptr), n in _storages(saved_tensors(output)).items():
        if (device, ptr) not in skip:
            out[device] = out.get(device, 0) + n
    return out


def recording_pack(pack: Callable[[Any], Any], packed: list[Any]) -> Callable[[Any], Any]:
    """``pack`` that also appends what it returns to ``packed`` (runtime hooks only)."""

    def recording_pack(x: Any) -> Any:
        out = pack(x)
        packed.append(out)
        return out

    return recording_pack


def block_working_set(model: Any, x: Any, blocks: list[Any]) -> int:
    """Largest working set of one block's backward, from exact counts (``floor MiB`` in
    :mod:`torch_patches.bench`): for each block run eagerly (no hooks) on the input it gets in
    ``model(x)``, the bytes it saves for backward (its parameters, buffers and inputs left
    out) + its output (incoming gradient) + its differentiable inputs (outgoing gradient)."""
    import torch
    import torch.utils._pytree as pytree

    inputs: dict[int, tuple[Any, Any]] = {}

    def capture(i: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            inputs.setdefault(i, pytree.tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (args, kwargs)))

        return hook

    handles = [b.register_forward_pre_hook(capture(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        with torch.enable_grad():
            model(x)  # records each block's real input; the graph is dropped at once
    finally:
        for h in handles:
            h.remove()
    best = 0
    for i, block in enumerate(blocks):
        args, kwargs = inputs.pop(i)
        if "past_key_values" in kwargs:  # a replay must not grow a KV cache
            kwargs = {**kwargs, "past_key_values": None, "use_cache": False}
        out = block(*args, **kwargs)
        diff_in = [t for t in _tensor_leaves((args, kwargs)) if t.requires_grad]
        diff_out = [t for t in _tensor_leaves(out) if t.requires_grad]
        exclude = (*block.parameters(), *block.buffers(), *_tensor_leaves((args, kwargs)))
        best = max(best, saved_bytes(out, exclude) + tensor_bytes(diff_out) + tensor_bytes(diff_in))
        del out
    return best
