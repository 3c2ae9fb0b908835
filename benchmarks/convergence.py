"""Convergence benchmark: does a memory saving train the same model?

``python -m benchmarks.convergence`` trains small language models (Hugging Face Llama
and GPT-2 built from configs: random init, no download) as byte-level models (vocabulary
256; ``--vocab`` widens the embedding, the head and the logits) on real English text that Python itself ships (the documentation topics of
``pydoc_data``), with AdamW, a linear warm-up and a cosine decay, for each *row* (no hooks,
a ready-made hook, a budget, stock ``activation_memory_budget``...) and each seed.  A seed
fixes the initial weights and the sequence of training batches, so the rows of one seed
differ only in how the saved tensors are stored.  Eval loss is measured on held-out text
(the last tenth of the corpus, never trained on) with the plain model, without hooks.

The table reports, per model and row: the final train loss (mean of the last tenth of the
steps), the eval loss, and its change against the compiled run without hooks of the same
seed, as a mean over seeds with the spread (min and max); the peak memory of one step and
the median step time, as ratios against the same reference.  One run's final loss moves by
about 1.5% under any bf16-sized perturbation of its arithmetic, so compare means over
seeds.  With matplotlib installed (``pip install -e ".[bench]"``) the loss curves are
written as a PNG (:mod:`benchmarks.convergence_report`).

Each row runs in a subprocess of its own (its own compile cache, torch_patches applied or
not), compiling once for all its seeds: the model object is reused and re-initialised.

Rows (``--rows``, comma separated):
  eager            no hooks, not compiled
  compiled         no hooks, ``torch.compile`` (the reference of every ratio)
  NAME             a ready-made hook of ``torch_patches.hooks`` (``bf16``, ``fp8_rowwise``,
                   ``int8_rowwise``), compiled, inlined by torch_patches
  NAME:all         the same hook without its numerics allowlist (``where=None``)
  NAME(k=v,...)    the hook with these arguments (``fp8_rowwise(block_size=32)``;
                   ``otherwise=bf16`` names another hook, ``dtype=torch.float8_e5m2`` a
                   torch attribute)
  eager+NAME       the hook as eager hooks on the uncompiled model
  offload          ``torch_patches.hooks.cpu_offload()``, compiled (exact; on CUDA it frees
                   device memory, on the CPU it copies)
  fp8+offload      ``chain(fp8_rowwise(), cpu_offload())``, compiled
  budget:F         ``torch_patches.hooks.budget(F)``, compiled
  amb:F            stock ``torch._functorch.config.activation_memory_budget = F``, compiled,
                   torch_patches not applied
  chunked_by_hand  no hooks, the loss written by hand in 8 chunks of tokens under
                   ``checkpoint`` (``models.chunked_by_hand_loss``), the whole step compiled,
                   torch_patches not applied: the reference a chunked head is held to
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from typing import Any

from benchmarks import worker_env
from benchmarks.convergence_report import format_table, plot, summarize
from torch_patches.testing.models import CALLS, LANGUAGE_MODELS, LOSSES, causal_lm_loss, chunked_by_hand_loss, compile_per_layer

#: The rows of a default run.
DEFAULT_ROWS = ("compiled", "bf16", "int8_rowwise", "fp8_rowwise", "budget:0.5", "amb:0.5")
#: The ready-made hooks a row may name.
HOOKS = ("bf16", "fp8_rowwise", "int8_rowwise")


def _offload() -> Any:
    from torch_patches.hooks import cpu_offload

    return cpu_offload()


def _fp8_offload() -> Any:
    from torch_patches.hooks import chain, cpu_offload, fp8_rowwise

    return chain(fp8_rowwise(), cpu_offload())


#: The offload rows, by name: their hooks.
OFFLOAD_ROWS = {"offload": _offload, "fp8+offload": _fp8_offload}
VOCAB = 256  # bytes
#: The models a run may name (Hugging Face, built from configs).
MODELS = LANGUAGE_MODELS


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run's shape: the model, its size, the data and the schedule."""

    model: str = "llama"
    layers: int = 2
    dim: int = 128
    heads: int = 4
    seq: int = 128
    batch: int = 4
    steps: int = 150
    lr: float = 2e-3
    warmup: float = 0.1  # fraction of the steps
    final_lr: float = 0.1  # fraction of lr at the end of the cosine
    weight_decay: float = 0.1
    clip: float = 1.0
    backend: str = "aot_eager"
    device: str = "cpu"
    eval_every: int = 50
    eval_batches: int = 8
    #: The models' vocabulary; the text is bytes (ids below 256), so a larger one only
    #: widens the embedding, the head and the logits (what a real tokenizer's would cost).
    vocab: int = VOCAB
    #: What one ``torch.compile`` covers: the whole model, or each decoder layer on its own
    #: and the loss on its own (``"layer"``, as FSDP2 and torchtitan compile; embedding and
    #: head eager).
    compile_per: str = "model"
    #: ``torch_patches.config.activation_budget_bounds`` for the ``budget:F`` rows.
    budget_bounds: str = "auto"
    #: How the model is called (``models.CALLS``): ``"bench"``, the loss computed inside
    #: what is compiled with HF's KV cache off; ``"hf_default"``, as HF Trainer calls it
    #: (``labels=``, the cache at its default: on), the HF model itself compiled (whole
    #: model), its logits and cache returned beside the loss and dropped by the caller.
    call: str = "bench"
    #: HF's ``gradient_checkpointing_enable()`` on the model (its default, non-reentrant), as
    #: HF Trainer's ``gradient_checkpointing=True`` calls it.
    gradient_checkpointing: bool = False
    #: A PEFT LoRA fine-tune: adapters of this rank on every linear layer but the head (PEFT's
    #: ``target_modules="all-linear"``, alpha twice the rank), the base model frozen; 0: every
    #: parameter trained.
    lora: int = 0
    #: The loss on the logits (``models.LOSSES``): ``"ce"`` the next-token cross-entropy;
    #: label smoothing, a z-loss, DPO's, GRPO's, or a KL to a teacher's logits (``"kl"``: a
    #: second model of the same config, frozen, its logits computed in the step).
    loss: str = "ce"
    #: The batches' lengths (:data:`LENGTHS`): ``"fixed"``, every batch ``seq`` tokens;
    #: ``"pad"``, as a pad-to-longest collator makes them (HF Trainer's and TRL's default):
    #: the steps cycle through :data:`PAD_LENGTHS` of ``seq`` (512, 448, 384, 320 at 512),
    #: the second length recompiling with a symbolic length; each length's warm peak is
    #: measured once every length has run.
    lengths: str = "fixed"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}: choose from {sorted(MODELS)}")
        if self.steps < 1 or self.batch < 1 or self.seq < 2:
            raise ValueError("steps and batch must be >= 1, seq >= 2")
        if self.vocab < VOCAB:
            raise ValueError(f"vocab must be at least {VOCAB} (the text is bytes), got {self.vocab}")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}: choose from {LOSSES}")
        if self.compile_per not in ("model", "layer"):
            raise ValueError(f"compile_per must be 'model' or 'layer', got {self.compile_per!r}")
        if self.call not in CALLS:
            raise ValueError(f"call must be one of {CALLS}, got {self.call!r}")
        if self.lora < 0:
            raise ValueError(f"lora is a rank (0: no adapters), got {self.lora}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {LENGTHS}, got {self.lengths!r}")


#: How the batches' lengths run (:attr:`TrainConfig.lengths`).
LENGTHS = ("fixed", "pad")
#: The lengths a pad-to-longest run cycles through, as fractions of ``seq``.
PAD_LENGTHS = (1.0, 0.875, 0.75, 0.625)


def step_lengths(cfg: TrainConfig) -> tuple[int, ...]:
    """The lengths a run's batches cycle through (:attr:`TrainConfig.lengths`)."""
    return (cfg.seq,) if cfg.lengths == "fixed" else tuple(max(2, round(cfg.seq * f)) for f in PAD_LENGTHS)


# --------------------------------------------------------------------------- data


def corpus() -> bytes:
    """Real English text shipped with Python: the documentation topics of ``pydoc_data``
    (about 460 KB), or, where a distribution leaves that out, the docstrings of the
    standard library's modules."""
    try:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    except ImportError:  # pragma: no cover - a Python without pydoc_data
        import importlib
        import pkgutil

        parts = []
        for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
            if info.name.startswith("_") or "test" in info.name:
                continue
            with contextlib.suppress(Exception):
                doc = importlib.import_module(info.name).__doc__
                if doc:
                    parts.append(doc)
        text = "\n\n".join(parts)
    return text.encode("utf-8")


def splits() -> tuple[Any, Any]:
    """``(train, eval)`` byte tensors: the last tenth of the corpus is held out."""
    import torch

    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    cut = len(data) * 9 // 10
    return data[:cut], data[cut:]


def train_batches(data: Any, cfg: TrainConfig, seed: int) -> Any:
    """The seed's training batches: ``(steps, batch, seq)`` windows at random offsets."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + seed)
    starts = torch.randint(0, len(data) - cfg.seq, (cfg.steps, cfg.batch), generator=gen)
    return data[starts[..., None] + torch.arange(cfg.seq)]


def eval_batches(data: Any, cfg: TrainConfig) -> Any:
    """Fixed held-out batches (the same for every row and seed), evenly spaced."""
    import torch

    n = cfg.eval_batches * cfg.batch
    starts = torch.linspace(0, len(data) - cfg.seq - 1, n).long()
    return data[starts[:, None] + torch.arange(cfg.seq)].view(cfg.eval_batches, cfg.batch, cfg.seq)


# ------------------------------------------------------------------------- models


def build(cfg: TrainConfig) -> Any:
    """The model of ``cfg`` (:mod:`torch_patches.testing.models`): a module mapping token ids to
    the mean next-token loss."""
    try:
        lm = MODELS[cfg.model](vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq)
    except ImportError as e:
        raise RuntimeError('benchmarks.convergence needs transformers: pip install -e ".[models]"') from e
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    if cfg.lora:
        try:
            import peft
        except ImportError as e:
            raise RuntimeError('a LoRA fine-tune needs peft: pip install -e ".[bench]"') from e
        config = peft.LoraConfig(r=cfg.lora, lora_alpha=2 * cfg.lora, target_modules="all-linear")
        lm = peft.get_peft_model(lm, config)
    teacher = None
    if cfg.loss == "kl":
        teacher = (
            MODELS[cfg.model](vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq).eval().requires_grad_(False)
        )
    return causal_lm_loss(lm, cfg.call, cfg.loss, teacher)


# ---------------------------------------------------------------------------- rows


@dataclasses.dataclass(frozen=True)
class Row:
    """How one row stores its saved tensors (parsed from its name, see the module)."""

    name: str
    compiled: bool
    hook: str | None = None  # a torch_patches.hooks factory
    kwargs: tuple[tuple[str, Any], ...] = ()  # its arguments
    where_all: bool = False  # the hook with where=None
    budget: float | None = None  # torch_patches.hooks.budget(F)
    amb: float | None = None  # stock activation_memory_budget
    by_hand: bool = False  # the loss chunked by hand (models.chunked_by_hand_loss)

    @property
    def applies_patches(self) -> bool:
        return self.compiled and self.amb is None and not self.by_hand

    @staticmethod
    def parse(name: str) -> Row:
        if name in ("eager", "compiled"):
            return Row(name, compiled=name == "compiled")
        if name == "chunked_by_hand":
            return Row(name, compiled=True, by_hand=True)
        if name in OFFLOAD_ROWS:
            return Row(name, compiled=True, hook=name)
        if name.startswith(("budget:", "amb:")):
            kind, _, value = name.partition(":")
            fraction = float(value)
            if not 0 < fraction <= 1:
                raise ValueError(f"row {name!r}: a budget is a fraction in (0, 1]")
            return Row(name, compiled=True, **{kind: fraction})
        import re

        match = re.fullmatch(r"(eager\+)?(\w+)(?:\((.*)\))?(:all)?", name)
        if match is None or match.group(2) not in HOOKS:
            raise ValueError(f"unknown row {name!r} (module docstring of benchmarks.convergence)")
        kwargs = []
        for item in filter(None, (match.group(3) or "").split(",")):
            key, _, value = item.partition("=")
            kwargs.append((key.strip(), _argument(value.strip())))
        return Row(name, compiled=match.group(1) is None, hook=match.group(2), kwargs=tuple(kwargs), where_all=match.group(4) is not None)

    def hooks(self) -> tuple[Any, Any] | None:
        import torch

        import torch_patches.hooks as library

        if self.budget is not None:
            return library.budget(self.budget)
        if self.hook is None:
            return None
        if self.hook in OFFLOAD_ROWS:
            return OFFLOAD_ROWS[self.hook]()

        def value(v: Any) -> Any:
            if isinstance(v, str) and v in HOOKS:
                return getattr(library, v)()
            if isinstance(v, str) and v.startswith("torch."):
                return getattr(torch, v.removeprefix("torch."))
            return v

        kwargs = {k: value(v) for k, v in self.kwargs}
        if self.where_all:
            kwargs["where"] = None
        return getattr(library, self.hook)(**kwargs)


def _argument(text: str) -> Any:
    """A row argument: a hook name, ``torch.<attribute>`` (a dtype), or a Python literal."""
    import ast

    if text in HOOKS or (text.startswith("torch.") and text.removeprefix("torch.").isidentifier()):
        return text
    return ast.literal_eval(text)


# ------------------------------------------------------------------------ training


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup`` of the steps, then a cosine to ``final_lr * lr``."""
    warm = max(1, round(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.final_lr + (1 - cfg.final_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


def run_row(cfg: TrainConfig, row: Row, seeds: Iterable[int], allowlist: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``row`` for every seed in this process (torch_patches applied as the row asks);
    returns losses, eval curve, peak bytes of one step and step times per seed."""
    import torch
    import torch._functorch.config as functorch_config

    import torch_patches
    from torch_patches.testing import saved_tensor_records

    if row.applies_patches:
        torch_patches.apply()
    else:
        torch_patches.unapply()
    train, held_out = splits()
    evals = eval_batches(held_out, cfg)
    train, evals = train.to(cfg.device), evals.to(cfg.device)
    torch.manual_seed(0)
    model = build(cfg).to(cfg.device)
    if row.by_hand:
        model = chunked_by_hand_loss(model.lm)
    hooks = row.hooks()
    configs = contextlib.ExitStack()
    if allowlist:
        configs.enter_context(torch_patches.config.patch(numerics_allowlist=allowlist))
    if row.amb is not None:
        configs.enter_context(functorch_config.patch(activation_memory_budget=row.amb))
    if row.budget is not None:
        configs.enter_context(torch_patches.config.patch(activation_budget_bounds=cfg.budget_bounds))
    fn = model
    if row.by_hand:
        fn = torch.compile(model, backend=cfg.backend)
    elif row.compiled and cfg.compile_per == "layer":
        compile_per_layer(model.lm, backend=cfg.backend, loss=True)
    elif row.compiled and cfg.call == "hf_default":
        model.lm.compile(backend=cfg.backend)  # the HF model's graph returns logits and cache
    elif row.compiled and cfg.call == "torchtitan":
        model.lm.compile(backend=cfg.backend)  # the body's graph returns the logits
        model.loss_fn = torch.compile(model.loss_fn, backend=cfg.backend)  # the loss compiled apart
    elif row.compiled:
        fn = torch.compile(model, backend=cfg.backend)
    params = [p for p in model.parameters() if p.requires_grad]

    def forward(ids: Any) -> Any:
        ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
        with ctx:
            return fn(ids)

    def eval_loss() -> float:
        with torch.no_grad():
            return statistics.fmean(model(ids).item() for ids in evals)

    out: dict[str, Any] = {"row": row.name, "seeds": {}, "warnings": [], "plans": []}
    with configs, warnings.catch_warnings(record=True) as caught, saved_tensor_records() as compiled:
        warnings.simplefilter("always")
        for seed in seeds:
            torch.manual_seed(seed)
            fresh = build(cfg)
            model.load_state_dict(fresh.state_dict())
            del fresh
            batches = train_batches(train, cfg, seed)
            opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
            losses, times, curve = [], [], [(0, eval_loss())]
            peaks: dict[str, int] | None = None
            lengths = step_lengths(cfg)
            for step in range(cfg.steps):
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, cfg)
                ids = batches[step][..., : lengths[step % len(lengths)]]
                if step == max(2, len(lengths)) and peaks is None:  # warm (every length compiled), apart from the timing
                    peaks = _length_peaks(lambda n: forward(batches[step][..., :n]).backward(), lengths, opt, cfg.device)
                start = time.perf_counter()
                loss = forward(ids)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())  # waits for the device: the step's time is its time there too
                times.append(time.perf_counter() - start)
                if not math.isfinite(losses[-1]):
                    break
                if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                    curve.append((step + 1, eval_loss()))
            out["seeds"][str(seed)] = {
                "train": losses,
                "eval": curve,
                "peak_bytes": max(peaks.values()) if peaks else None,
                # Each length's warm peak (one entry for fixed lengths).
                "peaks_by_length": peaks,
                "step_ms": 1000 * statistics.median(times[3:] or times),
                # The first step's time: its compile (a fresh process, its own cache) and run.
                "first_step_s": times[0] if times else None,
                # The step whose loss was not finite (training stopped there), or None.
                "diverged_at": len(losses) - 1 if not math.isfinite(losses[-1]) else None,
            }
    out["warnings"] = sorted({str(w.message) for w in caught if "torch_patches" in str(w.message)})
    # The budget plans of the compiled graphs (the first compile's: one per graph).
    out["plans"] = [{**plan_row(p), "compile_id": c.compile_id} for c in compiled for p in c.plans]
    return out


def _length_peaks(step: Any, lengths: tuple[int, ...], opt: Any, device: str) -> dict[str, int]:
    """The peak of one step (``step(n)``: forward and backward at length ``n``) at each of
    ``lengths``, the gradients dropped after each."""
    from torch_patches.testing import peak_bytes

    peaks = {}
    for n in lengths:
        peaks[str(n)] = peak_bytes(lambda: step(n), device)
        opt.zero_grad(set_to_none=True)
    return peaks


def plan_row(plan: Any) -> dict[str, Any]:
    """A budget plan's summary as JSON: its fields but the units, and how many storages took
    each option."""
    row = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "units"}
    row["options"] = dict(collections.Counter(u.option for u in plan.units))
    return row


def run_in_subprocess(
    cfg: TrainConfig, row: str, seeds: list[int], allowlist: dict[str, Any] | None = None, timeout: float = 7200
) -> dict[str, Any]:
    env = worker_env()
    payload = json.dumps({"cfg": dataclasses.asdict(cfg), "row": row, "seeds": seeds, "allowlist": allowlist})
    with tempfile.TemporaryDirectory(prefix="torch_patches_train_") as cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # every row compiles with its own cache
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.convergence", "--worker", payload],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
        return {"row": row, "error": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- CLI


def split_rows(text: str) -> list[str]:
    """``--rows`` split at the commas outside parentheses."""
    rows, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            rows.append(current)
            current = ""
        else:
            current += ch
    return [r.strip() for r in [*rows, current] if r.strip()]


def _flag(text: str) -> bool:
    """A boolean option's value: 1/true/yes or 0/false/no."""
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma list (see the module docstring)")
    parser.add_argument("--seeds", default="0,1,2")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if field.name != "model":
            value = getattr(defaults, field.name)
            kind = _flag if isinstance(value, bool) else type(value)
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=value)
    parser.add_argument(
        "--allowlist",
        type=json.loads,
        default=None,
        help="entries over the numerics allowlist (JSON, as torch_patches.config.numerics_allowlist)",
    )
    parser.add_argument("--json", default="bench-results/train.json")
    parser.add_argument("--png", default="bench-results/train.png")
    args = parser.parse_args(argv)

    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(run_row(TrainConfig(**job["cfg"]), Row.parse(job["row"]), job["seeds"], job.get("allowlist"))))
        return 0

    import torch

    rows = split_rows(args.rows)
    for r in rows:
        Row.parse(r)  # bad names fail before anything runs
    if "compiled" not in rows:
        rows.insert(0, "compiled")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "model"}
    configs = [TrainConfig(model=m, **sizes) for m in args.models.split(",") if m]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; seeds {seeds}; "
        f"{sizes['steps']} steps of {sizes['batch']} x {sizes['seq']} bytes; backend {sizes['backend']}",
        flush=True,
    )
    all_results = []
    for cfg in configs:
        results = []
        for row in rows:
            start = time.time()
            results.append(run_in_subprocess(cfg, row, seeds, args.allowlist))
            print(f"  {cfg.model} {row}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
        all_results.append(results)
        print(f"\n{cfg.model}: {cfg.layers} layers, hidden {cfg.dim}, {cfg.heads} heads")
        print(format_table(cfg, summarize(results)), flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {"torch": torch.__version__, "seeds": seeds, "configs": [dataclasses.asdict(c) for c in configs], "results": all_results}, f
        )
    print(f"\nresults written to {args.json}")
    if plot(configs, all_results, args.png):
        print(f"eval-loss differences written to {args.png}")
    else:
        print('no loss curves: matplotlib is not installed (pip install -e ".[bench]")')
    failed = any("error" in r for results in all_results for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
