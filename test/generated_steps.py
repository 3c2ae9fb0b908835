"""Random small training steps: the programs ``test_generated_steps.py`` compiles under every
hook and budget, looking for the next graph our compiler code cannot handle.

A :class:`Program` is a list of statements over a pool of ``[n, n]`` float tensors (the
input ``x`` first), each statement adding one tensor to the pool: matmuls with weights,
pointwise ops, views (transposes, slices, reshapes, broadcasts), in-place ops (on a fresh
tensor, directly and through a view), ops with several outputs (``max``, ``var_mean``,
``sort``, ``chunk``; the second used or dropped), masks and indices (``where``,
``masked_fill``, ``gather``, an embedding of integer ids), ``no_grad`` islands, dropout,
graph breaks, and checkpointed regions (reentrant, non-reentrant, selective with a policy
or a list of ops to save) whose bodies are statements too.  The step returns the loss
(a mean of squares of some of the pool) and, beside it, views of other tensors of the pool
(outputs that alias saved tensors).  :func:`run` interprets a program; Dynamo traces the
interpreter, so the compiled graphs are the program's.

Programs are drawn from a :class:`Source` of choices: ``RandomSource`` (a seeded
``random.Random``) or ``HypothesisSource`` (a Hypothesis ``data`` object, so that a failing
program shrinks).  :func:`source_text` prints a program as the Python it runs, for failure
reports and regression tests.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# ------------------------------------------------------------------------ choices


class Source:
    """Where a program's choices come from."""

    def integer(self, lo: int, hi: int) -> int:  # inclusive
        raise NotImplementedError

    def choice(self, options: tuple[Any, ...]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def boolean(self) -> bool:
        return bool(self.integer(0, 1))


class RandomSource(Source):
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class HypothesisSource(Source):
    def __init__(self, data: Any) -> None:
        import hypothesis.strategies as st

        self.data, self.st = data, st

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))


# ------------------------------------------------------------------------ programs

UNARY = ("tanh", "sigmoid", "relu", "gelu", "sin", "exp", "square", "rsqrt", "softmax", "layer_norm", "log_softmax")
BINARY = ("add", "mul", "sub", "matmul", "div")
VIEWS = ("t", "slice", "reshape", "expand", "unsqueeze")
INPLACE = ("mul_", "add_", "relu_", "sigmoid_", "view_mul_", "copy_")
MULTI = ("max", "var_mean", "sort", "chunk")
MASKS = ("where", "masked_fill", "gather", "embed")
FORMS = ("non_reentrant", "reentrant", "sac_must_save", "sac_prefer_recompute", "sac_op_list")


@dataclasses.dataclass(frozen=True)
class Program:
    """One training step: ``stmts`` over the pool (slot 0 is ``x``), the loss from the
    ``loss`` slots, ``aux`` views returned beside it (``(slot, view)``); ``dynamic``: compiled
    with ``dynamic=True`` (sizes symbolic, saved beside the tensors)."""

    n: int
    weights: int
    stmts: tuple[tuple[Any, ...], ...]
    loss: tuple[int, ...]
    aux: tuple[tuple[int, str], ...] = ()
    x_requires_grad: bool = True
    dynamic: bool = False

    def has(self, kind: str) -> bool:
        def walk(stmts: tuple[tuple[Any, ...], ...]) -> bool:
            return any(s[0] == kind or (s[0] == "checkpoint" and walk(s[3])) for s in stmts)

        return walk(self.stmts)


def _statement(src: Source, size: int, weights: int, depth: int) -> tuple[Any, ...]:
    """One statement reading slots below ``size``."""
    slot = lambda: src.integer(0, size - 1)  # noqa: E731
    kinds = ("linear", "unary", "unary", "binary", "view", "inplace", "multi", "mask", "nograd", "dropout", "function", "detach")
    if depth == 0:  # (a checkpointed region runs twice: no side effects in it)
        kinds += ("break", "buffer")
    if depth < 2:
        kinds += ("checkpoint", "checkpoint")
    kind = src.choice(kinds)
    if kind == "linear":
        return ("linear", slot(), src.integer(0, weights - 1))
    if kind == "unary":
        return ("unary", src.choice(UNARY), slot())
    if kind == "binary":
        return ("binary", src.choice(BINARY), slot(), slot())
    if kind == "view":
        return ("view", src.choice(VIEWS), slot())
    if kind == "inplace":
        return ("inplace", src.choice(INPLACE), slot(), slot())
    if kind == "multi":
        return ("multi", src.choice(MULTI), slot(), src.boolean())
    if kind == "mask":
        return ("mask", src.choice(MASKS), slot(), slot())
    if kind == "nograd":
        return ("nograd", src.choice(UNARY), slot())
    if kind == "dropout":
        return ("dropout", slot(), src.choice((0.0, 0.25)))
    if kind == "break":
        return ("break", slot())
    if kind == "buffer":
        return ("buffer", slot())
    if kind == "function":
        return ("function", slot(), slot())
    if kind == "detach":
        return ("detach", src.choice(("detach", "t_contiguous", "clone")), slot())
    inputs = tuple(sorted({slot() for _ in range(src.integer(1, 2))}))
    body = tuple(_statement(src, len(inputs) + i, weights, depth + 1) for i in range(src.integer(1, 5)))
    return ("checkpoint", src.choice(FORMS), inputs, body)


def draw_program(src: Source, max_stmts: int = 10) -> Program:
    n = src.choice((4, 8))
    weights = src.integer(1, 3)
    stmts = tuple(_statement(src, 1 + i, weights, 0) for i in range(src.integer(1, max_stmts)))
    size = 1 + len(stmts)
    loss = tuple(sorted({size - 1, *(src.integer(1, size - 1) for _ in range(src.integer(0, 2)))}))
    aux = tuple((src.integer(0, size - 1), src.choice(("t", "slice", "self"))) for _ in range(src.integer(0, 2)))
    return Program(n, weights, stmts, loss, aux, x_requires_grad=src.integer(0, 4) > 0, dynamic=src.integer(0, 4) == 0)


# ------------------------------------------------------------------------ running


def _unary(op: str, t: torch.Tensor) -> torch.Tensor:
    if op == "exp":
        return t.clamp(max=3.0).exp()
    if op == "square":
        return t * t
    if op == "rsqrt":
        return (t * t + 1.0).rsqrt()
    if op == "softmax":
        return t.softmax(dim=-1)
    if op == "log_softmax":
        return t.log_softmax(dim=-1)
    if op == "layer_norm":
        return F.layer_norm(t, t.shape[-1:])
    if op == "gelu":
        return F.gelu(t)
    return getattr(torch, op)(t)


def _binary(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if op == "matmul":
        return (a @ b) / a.shape[-1] ** 0.5
    if op == "div":
        return a / (b.abs() + 1.0)
    return getattr(torch, op)(a, b)


def _view(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "t":
        return t.t()
    if kind == "slice":
        return t[:, : t.shape[1]]
    if kind == "reshape":
        return t.reshape(-1).view(t.shape)
    if kind == "expand":
        return t[:1].expand(t.shape)
    return t.unsqueeze(0)[0]


def _inplace(op: str, t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    fresh = t * 1.5
    if op == "mul_":
        fresh.mul_(other)
    elif op == "add_":
        fresh.add_(other)
    elif op == "relu_":
        fresh.relu_()
    elif op == "sigmoid_":
        fresh.sigmoid_()
    elif op == "view_mul_":
        fresh[:, : fresh.shape[1] // 2].mul_(2.0)
    else:
        fresh.copy_(other)
    return fresh


def _multi(kind: str, t: torch.Tensor, use_second: bool) -> torch.Tensor:
    if kind == "max":
        values, index = t.max(dim=1, keepdim=True)
        out = t - values
        return out + torch.gather(t, 1, index) if use_second else out
    if kind == "var_mean":
        var, mean = torch.var_mean(t, dim=1, keepdim=True)
        return (t - mean) * (var + 1.0).rsqrt() if use_second else t - mean
    if kind == "sort":
        values, index = t.sort(dim=1)
        return values * (index.to(t.dtype) + 1.0) / t.shape[1] if use_second else values
    first, second = t.chunk(2, dim=1)
    return torch.cat([second, first * 2.0], dim=1) if use_second else torch.cat([first, first], dim=1)


def _mask(kind: str, a: torch.Tensor, b: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if kind == "where":
        return torch.where(a > 0, a, b)
    if kind == "masked_fill":
        return a.masked_fill(b < 0, 0.0)
    if kind == "gather":
        return torch.gather(a, 1, b.argsort(dim=1))
    return F.embedding(ids, table) * a


class ScaledTanh(torch.autograd.Function):
    """A user's autograd.Function saving its input and output (Dynamo traces it)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(a) * b
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        t = torch.tanh(a)
        return grad * b * (1 - t * t), grad * t


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _prefer_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(form: str, eager: bool = False) -> dict[str, Any]:
    """``checkpoint``'s keyword arguments for a region of ``form``.  ``eager``: as an eager
    reference runs it (a reentrant checkpoint whose inputs need no gradient gives none in
    eager code, where Dynamo's higher-order op, like the non-reentrant one, does)."""
    if form == "reentrant":
        return {"use_reentrant": eager is False}
    if form == "sac_must_save":
        return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)}
    if form == "sac_prefer_recompute":
        return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, _prefer_recompute)}
    if form == "sac_op_list":
        ops = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
        return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, ops)}
    return {"use_reentrant": False}


def _execute(stmts: tuple[tuple[Any, ...], ...], pool: list[torch.Tensor], params: dict[str, Any], eager: bool) -> None:
    for stmt in stmts:
        kind = stmt[0]
        if kind == "linear":
            out = pool[stmt[1]] @ params["w"][stmt[2]]
        elif kind == "unary":
            out = _unary(stmt[1], pool[stmt[2]])
        elif kind == "binary":
            out = _binary(stmt[1], pool[stmt[2]], pool[stmt[3]])
        elif kind == "view":
            out = _view(stmt[1], pool[stmt[2]])
        elif kind == "inplace":
            out = _inplace(stmt[1], pool[stmt[2]], pool[stmt[3]])
        elif kind == "multi":
            out = _multi(stmt[1], pool[stmt[2]], stmt[3])
        elif kind == "mask":
            out = _mask(stmt[1], pool[stmt[2]], pool[stmt[3]], params["table"], params["ids"])
        elif kind == "nograd":
            with torch.no_grad():
                out = _unary(stmt[1], pool[stmt[2]])
        elif kind == "dropout":
            out = F.dropout(pool[stmt[1]], stmt[2], training=True)
        elif kind == "break":
            torch._dynamo.graph_break()
            out = pool[stmt[1]] * 1.0
        elif kind == "buffer":
            # A buffer updated in place (a running statistic): an input the graph mutates.
            buf = params["buffer"]
            with torch.no_grad():
                buf.mul_(0.9).add_(pool[stmt[1]].mean(dim=0) * 0.1)
            out = pool[stmt[1]] + buf  # (read, not saved: a later update would be an error)
        elif kind == "function":
            out = ScaledTanh.apply(pool[stmt[1]], pool[stmt[2]])
        elif kind == "detach":
            t = pool[stmt[2]]
            out = t.detach() if stmt[1] == "detach" else t.t().contiguous() if stmt[1] == "t_contiguous" else t.clone()
        else:
            _, form, inputs, body = stmt
            out = checkpoint(functools.partial(_region, body, params, eager), *[pool[i] for i in inputs], **checkpoint_kwargs(form, eager))
        pool.append(out)


def _region(body: tuple[tuple[Any, ...], ...], params: dict[str, Any], eager: bool, *inputs: torch.Tensor) -> torch.Tensor:
    pool = list(inputs)
    _execute(body, pool, params, eager)
    return pool[-1]


def run(program: Program, params: dict[str, Any], x: torch.Tensor, eager: bool = False) -> tuple[torch.Tensor, ...]:
    """The step's forward: the loss, then the aux views."""
    pool = [x]
    _execute(program.stmts, pool, params, eager)
    # (the last tensor through a weight too, so that the loss always needs a gradient)
    loss = sum(pool[i].square().mean() for i in program.loss) + (pool[-1] @ params["w"][0]).square().mean()
    aux = []
    for slot, view in program.aux:
        t = pool[slot]
        aux.append(t.t() if view == "t" else t[:, :1] if view == "slice" else t)
    return (loss, *aux)


def make_params(program: Program, device: str, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = program.n
    w = [(torch.randn(n, n, generator=gen) / n**0.5).to(device).requires_grad_() for _ in range(program.weights)]
    table = (torch.randn(16, n, generator=gen)).to(device).requires_grad_()
    ids = torch.randint(0, 16, (n,), generator=gen).to(device)
    x = torch.randn(n, n, generator=gen).to(device).requires_grad_(program.x_requires_grad)
    return {"w": w, "table": table, "ids": ids, "x": x, "buffer": torch.zeros(n, device=device)}


def leaves(params: dict[str, Any]) -> list[torch.Tensor]:
    return [*params["w"], params["table"], params["x"]]


# ------------------------------------------------------------------------ printing


#: Per statement kind, the positions of its arguments that are pool slots.
_SLOTS = {
    "linear": (1,),
    "unary": (2,),
    "binary": (2, 3),
    "view": (2,),
    "inplace": (2, 3),
    "multi": (2,),
    "mask": (2, 3),
    "nograd": (2,),
    "dropout": (1,),
    "break": (1,),
    "buffer": (1,),
    "function": (1, 2),
    "detach": (2,),
}


def _stmt_text(stmt: tuple[Any, ...], indent: str, size: int, prefix: str = "v") -> list[str]:
    name = f"{prefix}{size}"
    kind = stmt[0]
    if kind == "checkpoint":
        _, form, inputs, body = stmt
        inner = prefix + "r"
        lines = [f"{indent}def region_{name}({', '.join(f'{inner}{i}' for i in range(len(inputs)))}):"]
        for j, s in enumerate(body):
            lines += _stmt_text(s, indent + "    ", len(inputs) + j, inner)
        lines.append(f"{indent}    return {inner}{len(inputs) + len(body) - 1}")
        lines.append(f"{indent}{name} = checkpoint(region_{name}, {', '.join(f'{prefix}{i}' for i in inputs)}, form={form!r})")
        return lines
    args = [f"{prefix}{a}" if i in _SLOTS[kind] else repr(a) for i, a in enumerate(stmt) if i > 0]
    return [f"{indent}{name} = {kind}({', '.join(args)})"]


def source_text(program: Program) -> str:
    """The program as the statements it runs (``v0`` is ``x``), for reports."""
    lines = [f"# n={program.n} weights={program.weights} x_requires_grad={program.x_requires_grad} dynamic={program.dynamic}"]
    for i, stmt in enumerate(program.stmts):
        lines += _stmt_text(stmt, "", i + 1)
    terms = [f"mean(v{i} ** 2)" for i in program.loss] + [f"mean((v{len(program.stmts)} @ w0) ** 2)"]
    lines.append(f"loss = {' + '.join(terms)}; aux = {list(program.aux)}")
    return "\n".join(lines)
