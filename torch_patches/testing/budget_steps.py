"""Random training steps that test the budget's promise, and their measure.

The promise (README, docs/budget.md): under Inductor, ``budget(F)`` never peaks above the
same step without a budget, nor above stock's ``activation_memory_budget = F``, and a
tighter ``F`` never peaks higher than a looser one.  Models the bench sweeps cannot prove
it; a step nobody tuned for can break it.  :func:`draw` makes such steps from a seed:

* blocks: an MLP (thin or wide hidden layer; GELU, SiLU, ReLU or tanh), a SwiGLU MLP,
  self-attention (heads over the tokens, softmax written out or fused), each with or
  without a norm before it (LayerNorm, RMSNorm) and a residual around it, optionally
  gated after it (``y * sigmoid(y)``); an embedding of token ids first, or a float input
  with or without ``requires_grad``;
* losses: a sum, a mean square, an MSE against a target, a cross-entropy over a head;
* compiled whole or each block apart (the loss outside, as torchtitan compiles);
* static shapes, or dynamic (the step runs at a second length that recompiles with
  dynamic shapes, and is measured there).

:func:`measure` runs one step's rows in this process, each after ``torch._dynamo.reset()``:
no budget, then for each fraction stock's knob and ``budget(F)`` (through
``torch_patches.config.activation_memory_budget``), each a warm step's peak by the CPU
allocator's events (the profiler) or CUDA's allocator, with what the plans predicted.
:func:`violations` reads the promise off a measured step.  The bench runs it over many
seeds (``python -m benchmarks.budget_promise``), the tests over a few
(``test/test_budget_promise.py``); every counterexample found becomes a test of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torch_patches

__all__ = ["Step", "Measured", "draw", "measure", "violations"]

#: A tiny graph's slack: the promise holds to 1% of the peak or this many bytes, whichever
#: is more (an allocator's rounding, a scalar's buffer).
SLACK_BYTES = 1 << 20
SLACK = 0.01

ACTIVATIONS = ("gelu", "silu", "relu", "tanh")
BLOCKS = ("mlp", "swiglu", "attention")
NORMS = ("layernorm", "rmsnorm", "none")
LOSSES = ("sum", "meansq", "mse", "cross_entropy")


@dataclasses.dataclass(frozen=True)
class Step:
    """One generated training step (every field drawn by :func:`draw`)."""

    seed: int
    blocks: tuple[str, ...]
    width: int
    hidden: int
    heads: int
    activation: str
    norm: str
    residual: bool
    gated: bool
    embedding: bool
    input_grad: bool
    loss: str
    batch: int
    tokens: int
    per_layer: bool
    dynamic: bool

    def describe(self) -> str:
        shape = "dynamic" if self.dynamic else "static"
        compiled = "each block apart" if self.per_layer else "whole"
        inp = "token ids" if self.embedding else ("x (requires grad)" if self.input_grad else "x")
        return (
            f"seed {self.seed}: {'+'.join(self.blocks)} x width {self.width} (hidden {self.hidden}, {self.activation}, "
            f"norm {self.norm}, residual {self.residual}, gated {self.gated}), input {inp}, {self.batch} x {self.tokens} "
            f"tokens, loss {self.loss}, compiled {compiled}, {shape} shapes"
        )


def draw(seed: int, small: bool = False) -> Step:
    """The step of ``seed`` (``small``: sizes for the fast tests)."""
    rng = random.Random(seed)
    width = rng.choice((64, 128, 256) if small else (256, 512, 1024, 2048))
    hidden = rng.choice((max(16, width // 16), width // 4, width * 2, width * 4))
    heads = rng.choice((1, 2, 4))
    n = rng.randint(2, 3 if small else 8)
    return Step(
        seed=seed,
        blocks=tuple(rng.choice(BLOCKS) for _ in range(n)),
        width=width,
        hidden=hidden,
        heads=heads,
        activation=rng.choice(ACTIVATIONS),
        norm=rng.choice(NORMS),
        residual=rng.random() < 0.7,
        gated=rng.random() < 0.3,
        embedding=rng.random() < 0.25,
        input_grad=rng.random() < 0.5,
        loss=rng.choice(LOSSES),
        batch=rng.choice((1, 2, 4)),
        tokens=rng.choice((64, 128) if small else (128, 256, 512)),
        per_layer=rng.random() < 0.3,
        dynamic=rng.random() < 0.2,
    )


class _Block(nn.Module):
    def __init__(self, step: Step, kind: str) -> None:
        super().__init__()
        d = step.width
        self.step, self.kind = step, kind
        self.norm = {"layernorm": nn.LayerNorm(d), "rmsnorm": nn.RMSNorm(d), "none": nn.Identity()}[step.norm]
        if kind == "attention":
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, d, bias=False)
        else:
            self.up = nn.Linear(d, step.hidden * (2 if kind == "swiglu" else 1), bias=kind == "mlp")
            self.down = nn.Linear(step.hidden, d, bias=kind == "mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "attention":
            b, t, d = h.shape
            q, k, v = self.qkv(h).view(b, t, 3, self.step.heads, d // self.step.heads).permute(2, 0, 3, 1, 4)
            if self.step.seed % 2:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
                y = scores.softmax(-1) @ v
            y = self.out(y.transpose(1, 2).reshape(b, t, d))
        elif self.kind == "swiglu":
            gate, up = self.up(h).chunk(2, dim=-1)
            y = self.down(F.silu(gate) * up)
        else:
            y = self.down(getattr(F, self.step.activation)(self.up(h)))
        if self.step.residual:
            y = x + y
        return y * torch.sigmoid(y) if self.step.gated else y


class Model(nn.Module):
    """The step's model: its blocks, an embedding first and a head last where drawn."""

    def __init__(self, step: Step, vocab: int = 512) -> None:
        super().__init__()
        self.step = step
        self.embed = nn.Embedding(vocab, step.width) if step.embedding else None
        self.blocks = nn.ModuleList(_Block(step, kind) for kind in step.blocks)
        self.head = nn.Linear(step.width, vocab, bias=False) if step.loss == "cross_entropy" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


def _loss(step: Step, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if step.loss == "sum":
        return out.sum()
    if step.loss == "meansq":
        return out.square().mean()
    if step.loss == "mse":
        return F.mse_loss(out, target)
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _batch(step: Step, tokens: int, device: str, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step.seed + tokens)
    if step.embedding:
        x = torch.randint(0, vocab, (step.batch, tokens), generator=g).to(device)
    else:
        x = torch.randn(step.batch, tokens, step.width, generator=g).to(device).requires_grad_(step.input_grad)
    if step.loss == "cross_entropy":
        target = torch.randint(0, vocab, (step.batch, tokens), generator=g).to(device)
    else:
        target = torch.randn(step.batch, tokens, step.width, generator=g).to(device)
    return x, target


@dataclasses.dataclass
class Measured:
    """One step's rows: each row's measured peak (bytes), and the peak the budget's plans
    predicted (Inductor's accounting where it priced them, else the fx model's; the largest
    over the step's graphs), by row name (``none``, ``stock 0.3``, ``budget 0.3``)."""

    step: Step
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    planned: dict[str, int] = dataclasses.field(default_factory=dict)
    withdrawn: dict[str, int] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def _knob(row: str) -> Iterator[None]:
    if row == "none":
        yield
        return
    kind, fraction = row.split()
    if kind == "stock":
        torch_patches.unapply()
        try:
            with torch._functorch.config.patch(activation_memory_budget=float(fraction)):
                yield
        finally:
            torch_patches.apply()
    else:
        with torch_patches.config.patch(activation_memory_budget=float(fraction)):
            yield


def measure(
    step: Step, fractions: tuple[float, ...] = (0.5, 0.3, 0.1), device: str = "cpu", kinds: tuple[str, ...] = ("none", "stock", "budget")
) -> Measured:
    """Every row of ``step`` (module docstring), in this process; ``kinds``: which rows
    (``none``, ``stock``, ``budget``).  ``torch_patches`` must be applied."""
    from torch_patches.testing._internal.common_saved_tensors_hooks import peak_bytes, saved_tensor_records

    out = Measured(step)
    rows = ["none"] * ("none" in kinds) + [f"{kind} {f:g}" for f in fractions for kind in ("stock", "budget") if kind in kinds]
    lengths = (step.tokens, step.tokens - step.tokens // 4) if step.dynamic else (step.tokens,)
    for row in rows:
        torch._dynamo.reset()
        torch.manual_seed(step.seed)
        model = Model(step).to(device)
        if step.per_layer:
            for block in model.blocks:
                block.compile()
            run = model
        else:
            run = torch.compile(model)
        batches = [_batch(step, n, device) for n in lengths]

        def one(x: torch.Tensor, target: torch.Tensor) -> None:
            _loss(step, run(x), target).backward()
            model.zero_grad(set_to_none=True)
            if x.grad is not None:
                x.grad = None

        with _knob(row), saved_tensor_records() as found:
            for x, target in batches:
                one(x, target)
            x, target = batches[-1]
            one(x, target)
            out.peaks[row] = peak_bytes(lambda: one(x, target), device)
        plans = [p for g in found for p in g.plans]
        if plans:
            out.planned[row] = max((p.accounted_peak_bytes or p.predicted_peak_bytes or 0) for p in plans)
            out.withdrawn[row] = sum("withdrawn" in p.accounting for p in plans)
    return out


def _above(a: int, b: int) -> bool:
    return a > b + max(SLACK * b, SLACK_BYTES)


def violations(m: Measured) -> list[str]:
    """The promise's breaches in ``m``, in words (empty: it holds), among the rows it has."""
    found = []
    none = m.peaks.get("none")
    fractions = sorted((float(r.split()[1]) for r in m.peaks if r.startswith("budget")), reverse=True)
    for f in fractions:
        ours, stock = m.peaks[f"budget {f:g}"], m.peaks.get(f"stock {f:g}")
        if none is not None and _above(ours, none):
            found.append(f"budget({f:g}) peaks at {ours} B, above no budget's {none} B")
        if stock is not None and _above(ours, stock):
            found.append(f"budget({f:g}) peaks at {ours} B, above stock's {f:g} ({stock} B)")
    for looser, tighter in zip(fractions, fractions[1:]):
        a, b = m.peaks[f"budget {looser:g}"], m.peaks[f"budget {tighter:g}"]
        if _above(b, a):
            found.append(f"budget({tighter:g}) peaks at {b} B, above budget({looser:g})'s {a} B")
    return found


def as_json(m: Measured) -> dict[str, Any]:
    return {
        "step": dataclasses.asdict(m.step),
        "describe": m.step.describe(),
        "peaks": m.peaks,
        "planned": m.planned,
        "withdrawn": m.withdrawn,
        "violations": violations(m),
    }
