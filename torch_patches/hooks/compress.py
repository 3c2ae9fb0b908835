"""Ready-made compression hooks for saved tensors: bf16, fp8 and int8 row-wise, chaining.

Each factory returns a ``(pack, unpack)`` pair for
``torch.autograd.graph.saved_tensors_hooks``.  The functions are pure and traceable and
marked with :func:`torch_patches.hooks.inlineable`: with ``torch_patches.apply()`` a compiled
graph (``fullgraph=True`` included, any backend) traces them into its forward and backward
graphs; without compilation they run as ordinary eager hooks::

    from torch_patches.hooks import fp8_rowwise

    with torch.autograd.graph.saved_tensors_hooks(*fp8_rowwise()):
        loss = model(batch).sum()
    loss.backward()

Common contract of every hook here:

* ``unpack(pack(x))`` has ``x``'s dtype, shape and device (row-wise hooks keep ``x``'s
  strides for dense ``x``; ``bf16`` too);
* only floating-point tensors wider than the storage format are compressed; everything else
  (bool masks, integer indices, complex tensors, tensors already as narrow as the storage
  format, empty tensors) is returned unchanged by ``pack`` and ``unpack``, so the hooks are
  safe as plain eager hooks, which see every saved tensor;
* the error bounds in each docstring hold for finite inputs (``x̂ = unpack(pack(x))``).  A row
  holding ``inf`` or ``NaN`` is not preserved by the row-wise hooks;
* the pair is a function of its arguments only: calling a factory again gives hooks with the
  same content, so recreating them every step does not recompile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_patches.hooks._inlineable import inlineable, is_inlineable
from torch_patches.hooks.select import (
    BF16,
    FP8,
    INT8,
    HookPair,
    SavedTensorInfo,
    numerics_safe,
    select,
    select_otherwise,
    unwrap_select,
)

__all__ = ["bf16", "chain", "fp8_rowwise", "int8_rowwise"]

#: A ``where=`` predicate (:func:`torch_patches.hooks.select`); None: every saved tensor.
Where = Callable[[SavedTensorInfo], bool] | None


def _where(pair: HookPair, where: Where, storage: str, otherwise: HookPair | str | None = None) -> HookPair:
    """``pair`` applied where ``where`` accepts (``otherwise`` elsewhere); the default,
    :func:`numerics_safe`, is asked for this hook's ``storage`` (``"bf16"``, ``"int8"``,
    ``"fp8"``); ``otherwise="bf16"`` is :func:`bf16` (with its own default ``where``)."""
    if where is None:
        return pair
    if where is numerics_safe:
        where = functools.partial(numerics_safe, storage=storage)
    if isinstance(otherwise, str):
        if otherwise != "bf16":
            raise ValueError(f"otherwise must be a (pack, unpack) pair, 'bf16' or None, got {otherwise!r}")
        otherwise = bf16()
    return select(*pair, where=where, otherwise=otherwise)


#: The OCP fp8 formats fp8_rowwise stores (the ``fnuz`` variants are not supported: their
#: ``torch.finfo`` misreports e5m2fnuz's eps, and the bounds here are stated for these two).
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _compressible(x: torch.Tensor, storage_bytes: int) -> bool:
    """True when storing ``x`` in a ``storage_bytes``-per-element format saves memory.

    Only real floating-point tensors qualify.  Under tracing every test here is on static
    metadata (dtype), or on ``numel() == 0`` which symbolic sizes answer without a guard
    (Dynamo specialises sizes 0 and 1).
    """
    return x.is_floating_point() and x.element_size() > storage_bytes and x.numel() != 0


# ------------------------------------------------------------------------------ bf16


def bf16_pack(x: torch.Tensor) -> Any:
    """Store a float32/float64 tensor as bfloat16 (with its dtype); others unchanged."""
    if not _compressible(x, 2):
        return x
    return (x.to(torch.bfloat16), x.dtype)


def bf16_unpack(packed: Any) -> torch.Tensor:
    """Inverse of :func:`bf16_pack`: the bfloat16 copy cast back to the original dtype."""
    if isinstance(packed, torch.Tensor):
        return packed
    stored, dtype = packed
    return stored.to(dtype)


def bf16(where: Where = numerics_safe) -> HookPair:
    """Hooks storing floating-point saved tensors as bfloat16 (2 bytes per element).

    float32 and float64 tensors are rounded to bfloat16 (round to nearest even) and cast back
    to their dtype by unpack; float16, bfloat16 and float8 tensors are already at most 2 bytes
    per element and pass through exactly, as do non-floating-point tensors.

    Error bound: bfloat16 keeps 8 significant bits and rounds to nearest, so for ``|x|`` in
    bfloat16's normal range (``2^-126 <= |x| <= 3.39e38``) ``|x - x̂| <= 2^-8 * |x|`` per
    element (float64 inputs are rounded through float32: ``(2^-8 + 2^-24) * |x|``); below it
    ``|x - x̂| <= 2^-134``, half the subnormal spacing.  Values beyond bfloat16's range
    overflow to ``inf`` (float64 ones, and float32 ones within half an ulp of float32's
    maximum).
    Memory: 1/2 of float32, 1/4 of float64.

    ``where``: which saved tensors to compress (:func:`torch_patches.hooks.select`); the
    default, :func:`~torch_patches.hooks.select.numerics_safe`, leaves tensors whose backward
    use amplifies absolute error (angles, logits, statistics) as they are; ``None``: all.
    """
    return _where(inlineable(bf16_pack, bf16_unpack), where, BF16)


# ------------------------------------------------------------------------- row-wise

#: Smallest row scale: float32's smallest normal number, 2^-126.
_MIN_SCALE = float(torch.finfo(torch.float32).tiny)


def _blocks(x: torch.Tensor, block_size: int | None) -> bool:
    """Whether ``x`` is scaled per block of ``block_size`` along its last dim (a multiple of
    it, and longer), rather than per row."""
    return block_size is not None and x.dim() >= 1 and x.shape[-1] > block_size and x.shape[-1] % block_size == 0


def _rowwise_quantize(
    x: torch.Tensor, qmax: float, qdtype: torch.dtype, *, round_to_int: bool, block_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` per row of its last dim: ``(q, scale)`` with ``x ≈ q * scale``.

    ``scale = max(amax_row / qmax, 2^-126)`` in float32 (shape ``x.shape[:-1] + (1,)``; 0-d
    and 1-d tensors are one row).  The floor (float32's smallest normal) keeps an all-zero row
    (and a row of float32 subnormals, whose ``amax / qmax`` would underflow to 0) from being
    divided by zero: such a row stores ``0 / 2^-126 = 0``, no NaN.  With ``block_size`` (see
    :func:`_blocks`) each block of the last dim is a row: ``q`` has shape
    ``x.shape[:-1] + (n // block_size, block_size)``.
    """
    xf = x.to(torch.float32)
    if block_size is not None and _blocks(x, block_size):
        xf = xf.unflatten(-1, (x.shape[-1] // block_size, block_size))
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / qmax).clamp_min(_MIN_SCALE)
    v = xf / scale
    if round_to_int:
        v = v.round()
    # amax / scale can exceed qmax by a rounding error; fp8 e4m3fn has no inf to absorb it.
    return v.clamp(-qmax, qmax).to(qdtype), scale


def _rowwise_dequantize(packed: Any) -> torch.Tensor:
    """Unpack of the row-wise hooks: ``q * scale`` in float32, cast to the original dtype."""
    if isinstance(packed, torch.Tensor):
        return packed
    q, scale, dtype = packed[:3]
    x = q.to(torch.float32) * scale
    if len(packed) == 4:  # scaled per block: (q, scale, dtype, "blocks")
        x = x.flatten(-2)
    return x.to(dtype)


def _rowwise_pack(x: torch.Tensor, qmax: float, qdtype: torch.dtype, round_to_int: bool, block_size: int | None) -> Any:
    q, scale = _rowwise_quantize(x, qmax, qdtype, round_to_int=round_to_int, block_size=block_size)
    return (q, scale, x.dtype, "blocks") if _blocks(x, block_size) else (q, scale, x.dtype)


def _check_block_size(block_size: Any, what: str) -> int | None:
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"{what}: block_size must be a positive int or None, got {block_size!r}")
    return block_size


def fp8_rowwise(
    dtype: torch.dtype = torch.float8_e4m3fn,
    where: Where = numerics_safe,
    *,
    block_size: int | None = None,
    otherwise: HookPair | str | None = "bf16",
) -> HookPair:
    """Hooks storing floating-point saved tensors as fp8 with one float32 scale per row.

    A row is the last dimension (a 0-d or 1-d tensor is one row).  Pack computes
    ``amax = max |x|`` of each row in float32, the row scale ``s = max(amax / F, 2^-126)``
    (``F = finfo(dtype).max``: 448 for e4m3fn, 57344 for e5m2; the floor keeps an all-zero
    row from a division by zero) and stores ``(fp8(clamp(x / s, -F, F)), s, x.dtype)``; unpack
    returns ``(q * s).to(x.dtype)``.  Tensors of at most one byte per element and
    non-floating-point tensors pass through exactly.  ``dtype``: ``torch.float8_e4m3fn``
    (3 mantissa bits, range 448) or ``torch.float8_e5m2`` (2 mantissa bits, range 57344).

    Error bound.  A float format with ``m`` mantissa bits has spacing ``2^(e-m)`` in the
    binade ``[2^e, 2^(e+1))``; rounding to nearest costs at most half of it, so a normal value
    ``v`` is stored with ``|v - fp8(v)| <= (eps/2) * |v|``, ``eps = 2^-m``, and a subnormal
    one with at most half the subnormal spacing, ``(eps/2) * n`` (``n`` the smallest normal,
    ``finfo(dtype).smallest_normal``).  Scaling by ``s``, per element::

        |x - x̂| <= (eps/2) * |x| + (eps/2) * n * s + u * |x̂|
        e4m3fn (eps = 2^-3, n = 2^-6):   2^-4 * |x| + 2^-10 * s + u * |x̂|
        e5m2   (eps = 2^-2, n = 2^-14):  2^-3 * |x| + 2^-17 * s + u * |x̂|

    where ``u`` is the rounding of the cast back to ``x``'s dtype: ``2^-8`` for bfloat16,
    ``2^-11`` for float16, 0 for float32/float64 (float32 arithmetic adds under
    ``2^-21 * |x|``).  Per row (``s = amax / F``, i.e. ``amax >= F * 2^-126``) the largest
    error is half the spacing of the top binade, ``[256, 448]`` for e4m3fn:
    ``16 * s = amax / 28`` before the cast back; with it, for every input dtype,
    ``|x - x̂| <= 2^-4 * amax_row`` (e4m3fn) and ``<= 2^-3 * amax_row`` (e5m2, whose top-binade
    bound is ``amax / 14``).

    Memory: 1 byte per element plus 4 bytes per row.  The scale is float32: float64 rows with
    ``amax`` beyond float32's range are not supported.

    ``block_size``: one scale per block of that many elements of the last dimension instead
    of per row (for rows that are a multiple of it, and longer; others stay row-wise): the
    bounds hold with the block's ``amax`` for the row's, at 4 bytes per block.

    ``where``: which saved tensors to compress.  The default, the numerics allowlist
    (:func:`~torch_patches.hooks.select.numerics_safe` for ``"fp8"``), accepts the operands of
    matmuls that compute a parameter's gradient (a linear layer's input: its error averages
    over the tokens the weight gradient sums); ``None``: every floating-point tensor.
    ``otherwise``: the pair for the saved tensors ``where`` rejects: ``"bf16"`` (the default,
    :func:`bf16` with its own allowlist default: the coefficients of activation gradients,
    q/k/v, norm inputs, derivatives of activations, where fp8's error costs training
    quality), another pair (``int8_rowwise()``), or ``None`` (keep them as they are).
    See ``benchmarks/results/convergence.md`` for what each costs.
    """
    _check_block_size(block_size, "fp8_rowwise")
    if dtype not in _FP8_DTYPES:
        raise ValueError(f"fp8_rowwise: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    fmax = float(torch.finfo(dtype).max)

    def fp8_rowwise_pack(x: torch.Tensor) -> Any:
        if not _compressible(x, 1):
            return x
        return _rowwise_pack(x, fmax, dtype, False, block_size)

    def fp8_rowwise_unpack(packed: Any) -> torch.Tensor:
        return _rowwise_dequantize(packed)

    return _where(inlineable(fp8_rowwise_pack, fp8_rowwise_unpack), where, FP8, otherwise)


_INT8_MAX = 127.0


def int8_rowwise(where: Where = numerics_safe, *, block_size: int | None = None, otherwise: HookPair | str | None = "bf16") -> HookPair:
    """Hooks storing floating-point saved tensors as symmetric int8 with a scale per row.

    A row is the last dimension (a 0-d or 1-d tensor is one row).  Pack computes
    ``amax = max |x|`` of each row in float32, the row scale ``s = max(amax / 127, 2^-126)``
    (the floor keeps an all-zero row from a division by zero) and stores
    ``(clamp(round(x / s), -127, 127).to(int8), s, x.dtype)``, rounding to nearest (ties to
    even).  Unpack returns ``(q * s).to(x.dtype)``.  Tensors of one byte per element and
    non-floating-point tensors pass through exactly.

    Error bound: ``|x / s - q| <= 1/2``, so per element::

        |x - x̂| <= s / 2 + u * |x̂|        (s / 2 = amax_row / 254)

    where ``u`` is the rounding of the cast back to ``x``'s dtype: ``2^-8`` for bfloat16,
    ``2^-11`` for float16, 0 for float32/float64 (float32 arithmetic adds under
    ``2^-21 * |x|``).  Per row: ``|x - x̂| <= amax_row / 254`` for float32/float64 inputs,
    and ``<= amax_row / 127`` for every input dtype (bfloat16: ``amax/254 + amax/256``).
    Unlike fp8 the error is absolute within a row: values much smaller than their row's
    ``amax`` keep no relative precision.

    Memory: 1 byte per element plus 4 bytes per row.  The scale is float32: float64 rows with
    ``amax`` beyond float32's range are not supported.

    ``block_size``: as for :func:`fp8_rowwise`.  ``where``: the numerics allowlist for
    ``"int8"`` by default (every saved tensor it lists: a gradient's coefficients as well as
    weight-gradient operands); ``otherwise``: as for :func:`fp8_rowwise`.
    """
    _check_block_size(block_size, "int8_rowwise")

    def int8_rowwise_pack(x: torch.Tensor) -> Any:
        if not _compressible(x, 1):
            return x
        return _rowwise_pack(x, _INT8_MAX, torch.int8, True, block_size)

    def int8_rowwise_unpack(packed: Any) -> torch.Tensor:
        return _rowwise_dequantize(packed)

    return _where(inlineable(int8_rowwise_pack, int8_rowwise_unpack), where, INT8, otherwise)


# ------------------------------------------------------------------------- chaining


def _chain2(first: HookPair, second: HookPair) -> HookPair:
    first_pack, first_unpack = first
    second_pack, second_unpack = second

    def chain_pack(x: torch.Tensor) -> Any:
        # first's packed form, its tensor leaves replaced by 0 (its "skeleton"), which leaves
        # were tensors, and second's packed form of each tensor leaf, in order.
        leaves, spec = pytree.tree_flatten(first_pack(x))
        is_tensor = tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)
        skeleton = pytree.tree_unflatten([0 if t else leaf for leaf, t in zip(leaves, is_tensor)], spec)
        packed = tuple(second_pack(leaf) for leaf, t in zip(leaves, is_tensor) if t)
        return (skeleton, is_tensor, packed)

    def chain_unpack(packed: Any) -> torch.Tensor:
        skeleton, is_tensor, inner = packed
        leaves, spec = pytree.tree_flatten(skeleton)
        restored = iter([second_unpack(p) for p in inner])
        return first_unpack(pytree.tree_unflatten([next(restored) if t else leaf for leaf, t in zip(leaves, is_tensor)], spec))

    if all(is_inlineable(f) for f in (*first, *second)):
        return inlineable(chain_pack, chain_unpack)
    return chain_pack, chain_unpack


def chain(first: HookPair, *rest: HookPair) -> HookPair:
    """Compose hook pairs: ``chain(a, b)`` packs with ``a`` then ``b``, unpacks in reverse.

    Semantics: ``pack(x)`` runs ``a.pack(x)``, then ``b.pack`` on every *tensor* leaf of that
    result (tuples, lists, dicts and namedtuples are walked with ``torch.utils._pytree``);
    constants (dtypes, sizes, flags) in ``a``'s result are kept as they are.  ``unpack`` runs
    ``b.unpack`` on each of those packed leaves, puts the restored tensors back in place and
    calls ``a.unpack`` on the rebuilt structure.  So ``b`` sees each tensor ``a`` stores, e.g.
    ``chain(fp8_rowwise(), offload)`` moves both the fp8 payload and its float32 scales.  More
    than two pairs fold from the left: ``chain(a, b, c) == chain(chain(a, b), c)``; chains nest
    freely (the structure is recorded position by position, no markers are matched).

    Error: ``b`` acts on ``a``'s stored tensors, so the bounds compose through ``a``'s unpack;
    with a lossless ``b`` (offload, reshaping) ``chain(a, b)`` round-trips exactly as ``a``.

    Pairs made with :func:`~torch_patches.hooks.select` (the lossy hooks by default) make the
    whole chain selective: it applies to the saved tensors every such pair accepts; the
    others are saved as they are, or take the chain with the pair's ``otherwise`` in its
    place (``chain(fp8_rowwise(), cpu_offload())`` neither compresses nor offloads RoPE
    angles; pass ``where=None`` to the lossy pair to offload everything).

    The chained functions are marked inlineable when every function of every pair is
    (``fx.GraphModule`` or marked); otherwise they are returned unmarked and run as eager
    hooks, since inlining would trace functions nobody promised are traceable.
    """
    pairs = (first, *rest)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(map(callable, pair))):
            raise TypeError(f"chain: argument {i} is not a (pack, unpack) pair of callables")
    # Selective pairs (select(), the lossy hooks' numerics-safe default) distribute over the
    # chain: chain(a, select(b, w, otherwise=c)) == select(chain(a, b), w, otherwise=chain(a, c)),
    # so the chain applies to the saved tensors every such pair accepts (its otherwise pair
    # to the others).
    for i, pair in enumerate(pairs):
        sel = unwrap_select(pair)
        if sel is None:
            continue
        other = select_otherwise(pair)

        def swap(p: HookPair, i: int = i) -> HookPair:
            return chain(*pairs[:i], p, *pairs[i + 1 :])

        return select(*swap((sel[0], sel[1])), where=sel[2], otherwise=None if other is None else swap(other))
    result: HookPair = (pairs[0][0], pairs[0][1])
    for pair in pairs[1:]:
        result = _chain2(result, (pair[0], pair[1]))
    return result
