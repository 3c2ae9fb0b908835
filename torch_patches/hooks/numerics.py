"""Which saved tensors tolerate lossy storage, and how lossy: the numerics allowlist.

A lossy hook replaces a saved tensor ``x`` by ``x + e``.  That is harmless only where every
op reading the tensor in the backward turns the error into an error of the gradient of the
same relative size.  A matmul operand does; the log-sum-exp a fused attention's backward
reads does not: it rebuilds the probabilities as ``exp(scores - lse)``, so a relative error
of ``lse`` becomes a relative error of every probability that grows with ``|lse|``.

**Levels.**  The storage formats, from least to most error (the error's norm relative to the
row's, for rows of typical activations): ``"exact"``; ``"bf16"`` (``2^-8`` of each element,
about 0.1%); ``"int8"`` (int8 row-wise: ``1/254`` of the row's largest magnitude, about
0.9%); ``"fp8"`` (fp8 e4m3 row-wise: up to ``2^-4`` of each element, about 2.5%).  A tensor's
tolerance is the lossiest level it may be stored in.

**Entries.**  An entry names one argument of one op and a level.  Where the saved tensor's
error meets a gradient (the first node of the backward that also depends on an incoming
gradient), the entry's level is what it tolerates there; on the way to that node (views,
casts, and what the backward recomputes from the tensor) an entry only says that the op
carries the error on in proportion.  An argument with no entry, of an op with no entry,
keeps the tensor exact: a new fused kernel is exact until somebody says otherwise.

**Built-in levels, from training** (``benchmarks/results/convergence.md``): where the
error meets a gradient in a matmul whose result is a parameter's gradient (``x^T @ dy``: the
error of ``x`` averages over the tokens the product sums), it tolerates ``"fp8"``; everywhere
else the error is a coefficient of the gradient that flows on to every earlier layer
(derivatives of activations, attention's q/k/v/out, norms' inputs, a matmul whose result is
an activation's gradient), and it tolerates ``"int8"``: fp8 there moved the eval loss of a
small Llama by +1.6% after 300 steps, int8 by +0.7%, and fp8 on weight-gradient operands with
bf16 elsewhere by -0.3% (bf16 everywhere: +0.4%; one run alone moves by about 1.5%).

Users add entries for their own ops (and override ours) with ``torch_patches.hooks.tolerate``
or ``config.numerics_allowlist``, which is part of every compiled graph's identity.  This
module is data and lookups only (no FX): the compiler walks the backward graph with it
(``_functorch/_aot_autograd/saved_numerics.py``), eager hooks use the part of it eager can see
(:func:`eager_verdict`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torch_patches import config

EXACT = "exact"
BF16 = "bf16"
INT8 = "int8"
FP8 = "fp8"

#: Tolerance levels, least lossy first.
LEVELS = (EXACT, BF16, INT8, FP8)
_RANK = {level: i for i, level in enumerate(LEVELS)}

#: An entry for every tensor argument of an op.
ALL_ARGS = "*"


def rank(level: str) -> int:
    return _RANK[level]


def least(levels: Iterable[str]) -> str:
    """The least lossy of ``levels`` (``"fp8"`` for none: nothing restricts)."""
    return min(levels, key=rank, default=FP8)


def tolerates(level: str, storage: str) -> bool:
    """Whether a tensor of tolerance ``level`` may be stored in ``storage`` (a level)."""
    return rank(storage) <= rank(level)


def check_level(level: Any, what: str) -> str:
    if level not in _RANK:
        raise ValueError(f"{what}: a storage level is one of {list(LEVELS)}, got {level!r}")
    return level


# ------------------------------------------------------------------- built-in list
#
# Keys are ``"namespace::name"`` (every overload) or ``"namespace::name.overload"``; values
# map a schema argument name (or ``"*"``) to a level.  Two kinds:
#
# * ops whose result depends on the argument linearly or through a bounded derivative
#   (views, casts, sums, products, bounded activations, backward kernels): ``"int8"`` where
#   the error meets a gradient there; matmuls ``"fp8"``, which the compiler lowers to
#   ``"int8"`` unless the matmul's result is only accumulated into a graph output that is a
#   parameter's gradient;
# * data movement and readers of shape or sign only: ``"fp8"`` (they never restrict).
#
# Ops whose result moves by far more than the argument's relative error are not listed:
# exp, log, sin/cos, reciprocal, rsqrt, sqrt, division *by* the argument, softmax of it,
# the statistics arguments of fused backward kernels (log-sum-exp, mean, rstd).
# Some readers need the value they read: ``pow`` by a constant exponent in [1, 3] and
# ``exp`` in three bounded forms (GELU's ``exp(-x^2/2)``, SiLU's ``1 / (1 + exp(-x))``,
# ``exp`` of a log-softmax output) are decided by the compiler from the graph.

#: Ops whose result is a product summed over tokens: ``"fp8"`` as a weight gradient.
MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul", "dot", "mv", "addmv", "linear", "einsum"})

#: The tolerance of attention's query and key (they enter through exp(q k^T * scale - lse),
#: bounded by the scale of the scores; measured as the other activation-gradient readers).
ATTENTION_QK = INT8

_ATTENTION_BACKWARD = (
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
)
#: The forward kernels (a recomputation the partitioner placed in the backward).
_ATTENTION_FORWARD = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


# A table, one row of ops per line: kept out of the formatter.
# fmt: off
def _builtin() -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}

    def add(names: Iterable[str], args: Mapping[str, str]) -> None:
        for name in names:
            table.setdefault(f"aten::{name}", {}).update(args)

    # Views, copies, casts, layout: the same values.
    add(
        (
            "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t",
            "unsqueeze", "squeeze", "slice", "select", "clone", "alias", "detach", "_to_copy",
            "contiguous", "as_strided", "flatten", "narrow", "unfold", "repeat", "roll", "flip",
            "cat", "stack", "split", "split_with_sizes", "unbind", "chunk", "unsafe_split",
            "unsafe_split_with_sizes", "tensor_split", "constant_pad_nd", "view_as_real",
            "index", "index_select", "gather", "_unsafe_index", "lift_fresh_copy", "copy",
            "expand_copy", "permute_copy", "view_copy", "t_copy", "transpose_copy",
            "unsqueeze_copy", "squeeze_copy", "slice_copy", "select_copy", "split_copy",
            "alias_copy", "_reshape_alias", "pixel_shuffle", "im2col", "col2im",
            "select_backward", "slice_backward",
        ),
        {ALL_ARGS: FP8},
    )
    for name in ("convert_element_type", "view_of", "broadcast_in_dim", "squeeze", "transpose", "collapse_view"):
        table[f"prims::{name}"] = {ALL_ARGS: FP8}
    for name in ("fma", "mul", "add", "sub", "neg", "sum", "where"):
        table[f"prims::{name}"] = {ALL_ARGS: INT8}
    # Products summed over tokens.
    add(MATMULS, {ALL_ARGS: FP8})
    # Linear maps and bounded functions: the error scales with the values.
    add(
        ("add", "sub", "rsub", "mul", "neg", "sum", "mean", "cumsum", "addcmul", "lerp",
         "where", "masked_fill", "fill", "_unsafe_masked_index_put_accumulate",
         "index_put", "_unsafe_index_put", "index_add", "scatter_add", "scatter",
         "embedding_dense_backward", "embedding", "native_dropout_backward",
         "avg_pool2d", "avg_pool2d_backward", "adaptive_avg_pool2d",
         "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "upsample_nearest2d",
         "upsample_nearest2d_backward", "convolution", "square",
         "var", "var_mean", "amax", "amin", "max", "min", "maximum", "minimum", "clamp",
         "clamp_min", "clamp_max", "abs", "relu", "hardtanh", "leaky_relu", "elu",
         "sigmoid", "tanh", "erf", "gelu", "silu", "softplus", "hardswish", "hardsigmoid",
         "mish", "logsigmoid", "max_pool2d_with_indices", "max_pool2d_with_indices_backward",
         "sort", "topk", "native_layer_norm", "native_group_norm", "native_batch_norm",
         "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
         "_fused_rms_norm", "rms_norm", "layer_norm", "group_norm", "batch_norm"),
        {ALL_ARGS: INT8},
    )
    # A convolution's backward reads its input for the weight's gradient (a sum over
    # positions and the batch, as a matmul's).
    add(("convolution_backward",), {"grad_output": INT8, "input": FP8, "weight": INT8})
    # Division: the numerator's error is proportional; the denominator's is not
    # (except 1 / (c + exp(.)), which the compiler recognises).
    add(("div",), {"self": INT8})
    # Backward kernels of bounded functions: the derivative is bounded where it reads the
    # input, so an error of the input moves the gradient proportionally.
    add(
        ("gelu_backward", "silu_backward", "threshold_backward", "hardtanh_backward",
         "leaky_relu_backward", "hardswish_backward", "hardsigmoid_backward", "mish_backward",
         "softplus_backward"),
        {"grad_output": INT8, "self": INT8},
    )
    add(("elu_backward",), {"grad_output": INT8, "self_or_result": INT8})
    add(("sigmoid_backward", "tanh_backward"), {"grad_output": INT8, "output": INT8})
    # softmax: the gradient is linear in the probabilities; log_softmax's reads exp(output):
    # an error d of a log-probability moves p by p*d <= d/e.
    add(("_softmax_backward_data", "_log_softmax_backward_data"), {"grad_output": INT8, "output": INT8})
    # nll_loss reads the log-probabilities' shape only; total_weight divides.
    add(("nll_loss_backward", "nll_loss2d_backward"), {"grad_output": INT8, "self": FP8})
    # Norms: the normalised input is proportional to the input's error while the mean is
    # not far larger than the spread; the statistics (mean, rstd) are not listed.
    add(("native_layer_norm_backward",), {"grad_out": INT8, "input": INT8, "weight": INT8, "bias": INT8})
    add(("native_group_norm_backward", "native_batch_norm_backward", "_fused_rms_norm_backward"),
        {"grad_out": INT8, "input": INT8, "weight": INT8})
    # Attention: the gradient is proportional to errors of v, out and the incoming gradient;
    # q and k enter through exp(q k^T * scale - lse) (ATTENTION_QK).
    for name in _ATTENTION_BACKWARD:
        grad = "grad_out_" if "efficient" in name else "grad_out"
        add((name,), {grad: INT8, "value": INT8, "out": INT8, "query": ATTENTION_QK, "key": ATTENTION_QK})
    add(_ATTENTION_FORWARD, {"value": INT8, "query": ATTENTION_QK, "key": ATTENTION_QK})
    # Shape, sign and comparisons.
    add(
        ("zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
         "new_empty", "new_full", "sym_size", "sym_stride", "sym_numel", "sign", "eq", "ne",
         "lt", "le", "gt", "ge", "logical_not", "isnan", "isinf"),
        {ALL_ARGS: FP8},
    )
    return table
# fmt: on


BUILTIN: dict[str, dict[str, str]] = _builtin()

#: Outputs after the first of a multi-output op are statistics (mean, rstd, log-sum-exp,
#: indices, RNG state) and stay exact, except for these ops, whose outputs are all data.
DATA_OUTPUTS = frozenset(
    {
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "unsafe_split",
        "unsafe_split_with_sizes",
        "tensor_split",
        "split_copy",
        "split_with_sizes_copy",
        "unbind_copy",
    }
)
#: Ops whose first output is a statistic (kept exact whatever reads it).
STATISTICS = frozenset(
    {"logsumexp", "rsqrt", "reciprocal", "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "_batch_norm_impl_index"}
)


def op_key(target: Any) -> tuple[str, str] | None:
    """``("aten::mm", "aten::mm.default")`` for an OpOverload; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name  # "aten::mm"
        return packet, f"{packet}.{target._overloadname}"
    return None


def entries() -> dict[str, dict[str, str]]:
    """The built-in list with ``config.numerics_allowlist`` over it."""
    user = config.numerics_allowlist
    if not user:
        return BUILTIN
    merged = {k: dict(v) for k, v in BUILTIN.items()}
    for op, args in user.items():
        for arg, level in args.items():
            check_level(level, f"torch_patches.config.numerics_allowlist[{op!r}][{arg!r}]")
        merged.setdefault(op, {}).update(args)
    return merged


def lookup(table: Mapping[str, Mapping[str, str]], target: Any, arg: str) -> str | None:
    """The level of argument ``arg`` of ``target`` (overload entries first), or None."""
    keys = op_key(target)
    if keys is None:
        return None
    found: str | None = None
    for key in keys:  # the packet's entry, then the overload's, which wins
        args = table.get(key)
        if args is None:
            continue
        if arg in args:
            found = args[arg]
        elif ALL_ARGS in args:
            found = args[ALL_ARGS]
    return found


def is_matmul(target: Any) -> bool:
    keys = op_key(target)
    return keys is not None and keys[0].startswith("aten::") and keys[0][6:] in MATMULS


def base_name(op: str) -> str:
    """``"aten.sin.default"``/``"aten::sin"`` -> ``"sin"``; ``"SinBackward0"`` -> ``"sin"``;
    ``"getitem:1 of aten.native_layer_norm.default"`` -> ``"native_layer_norm"``."""
    import re

    if op.endswith(")") and "(" in op:  # "aten.pow.Tensor_Scalar(2)"
        op = op[: op.rindex("(")]
    if " of " in op:
        op = op.split(" of ", 1)[1]
    if op.startswith(("aten.", "prims.")):
        return op.split(".")[1]
    if "::" in op:
        return op.split("::", 1)[1].split(".")[0]
    match = re.fullmatch(r"(\w+?)Backward\d+", op)
    if match:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()
    return op


# -------------------------------------------------------------------------- eager


def eager_verdict(t: torch.Tensor) -> tuple[str, str | None]:
    """What eager autograd can know at pack time: ``(level, why)``.

    Eager sees the tensor and the node that produced it (``grad_fn``, ``output_nr``), not
    the op that saves it, so the readers' part of the rule is the compiler's: an activation
    gets the level of a gradient's coefficient (``"int8"``), never the weight-gradient
    operand's ``"fp8"``.  Kept exact: tensors that do not require grad (non-differentiable
    outputs such as an attention's log-sum-exp or a norm's mean and rstd, masks, position
    tables, the batch), leaves (parameters and inputs: packing them frees nothing), outputs
    after the first of a multi-output op other than a split (statistics), and outputs of
    statistics ops.
    """
    grad_fn = t.grad_fn
    if not t.requires_grad:
        return EXACT, "does not require grad (statistics, masks, constants: not an activation)"
    if grad_fn is None:
        return EXACT, "a leaf (parameter or input: packing it frees nothing)"
    producer = base_name(type(grad_fn).__name__)
    if getattr(t, "output_nr", 0) > 0 and producer not in DATA_OUTPUTS:
        return EXACT, f"output {t.output_nr} of {type(grad_fn).__name__} (statistics)"
    if producer in STATISTICS:
        return EXACT, f"produced by {type(grad_fn).__name__} (statistics)"
    return INT8, "eager hooks cannot see the op that reads it (a gradient's coefficient: int8)"
