"""Peak-memory and step-time benchmark of saved-tensor hooks under torch.compile.

Every case runs in its own subprocess (an empty compile cache directory of its own, so
``compile s`` is a cold compile; clean memory accounting),
and all cases of one invocation are reported side by side, as ratios against the
no-hooks row of the same model and backend.

Rows (``mode``):
  no-hooks      the compiled model, no saved-tensor hooks
  eager-hooks   the same hooks as plain Python functions: they run at runtime on the
                compiled graph's saved tensors (eager semantics)
  stock-inline  GraphModule hooks inlined by stock torch (torch_patches not applied)
  ours          GraphModule hooks inlined by torch_patches (placed at use)
  budget        ``--budget F``: torch_patches applied, hooks ``torch_patches.hooks.budget(F)``
                (the activation-memory budget planner; hook column ``budget F``)
  stock-budget  ``--budget F``: torch_patches not applied, no hooks, stock torch's
                ``torch._functorch.config.activation_memory_budget = F`` (min-cut
                rematerialization, which aot_eager and inductor both partition with) set
                around compilation and steps (hook column ``amb F``)

Peak memory: on CUDA ``max_memory_allocated`` above the pre-step base; on CPU the RSS
high-water mark of one step above the pre-step RSS (``/proc/self/clear_refs`` = 5 resets
it; workers run with ``MALLOC_MMAP_THRESHOLD_`` fixed so large tensors are mmap-backed
and freed memory really leaves the RSS).

``kept MiB`` (rows ``ours``): bytes of saved tensors a selective hook left uncompressed
(the lossy hooks' ``numerics_safe`` default: RoPE angles, statistics...), per step, from
the inliner's log. ``--models llama`` is Hugging Face Llama built from a config (hidden
``--dim``, ``--blocks`` layers, 256-token sequences, ``--batch`` tokens per step).

``step ms``: median of ``--steps`` steps; ``peak x`` / ``time x``: against the no-hooks row
of the same model and backend (budget rows included).

``saved MiB``: the bytes the autograd graph holds for backward at the end of the forward of
one (untimed, warm) step, counted exactly, not from the RSS (:func:`saved_bytes`): the graph
is walked from the output's ``grad_fn`` through ``next_functions``; a compiled function's
backward node (an autograd.Function ctx) gives ``saved_tensors`` and the tensors it keeps as
attributes (AOT's ``_tensors_no_vc_check``), any other node its ``_saved_*`` tensors. Each
storage counts once; the model's parameters, buffers and the input are left out. Hooks
inlined into a compiled graph (``ours``, ``stock-inline``, ``budget``) save their packed
tensors there, so the walk sees what is really kept. Runtime hooks (``eager-hooks``) hide
their packed values from the walk (reading a saved tensor would unpack it), so that row
counts the tensors in what ``pack`` returned during that forward instead. Host memory
(``cpu_offload``) counts too.

``plan MiB`` (rows ``budget``): the planner's predicted saved bytes, summed over the
``budget plan (...)`` lines the inliner logs for the compile's graphs. ``floor MiB`` (rows
``budget``): ``peak - (parameter-gradient bytes + plan + largest block working set)``, what
the peak holds beyond the part a budget cannot remove (the gradients) or chose to keep (the
plan) and the one block whose backward runs at a time. The block working set is a formula
over exact counts, not a measured peak: each block (the ``Sequential``'s children, Llama's
decoder layers) is run once eagerly, without hooks, on the input it gets in the model; its
set is the bytes it saves for backward (:func:`saved_bytes`, its parameters and its input
left out: the plan holds its input) plus the bytes of its output (the incoming gradient) and
of its differentiable input (the outgoing gradient). The largest over blocks is used. It is
an estimate with known errors both ways: the tensors of that block the plan keeps are counted
in both the plan and the set (high: the floor can come out negative), the gradients of
intermediates inside the block are not counted (low). A floor near zero or below means the
peak is explained by those three terms. ``-`` when the compile logged no plan line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any


MODES = ("no-hooks", "eager-hooks", "stock-inline", "ours")
#: Rows ``--budget F`` adds (one pair per fraction F), beside ``MODES``.
BUDGET_MODES = ("budget", "stock-budget")

#: torch_patches.hooks factories the benchmark can run (besides the plain bf16/fp8 casts).
LIBRARY_HOOKS = ("fp8_rowwise", "int8_rowwise", "cpu_offload")

#: Composed library hooks: name -> factory names, chained with ``torch_patches.hooks.chain``.
COMPOSED_HOOKS = {"fp8_rowwise+cpu_offload": ("fp8_rowwise", "cpu_offload")}
#: Library hooks that select with ``where`` (``numerics_safe`` by default).
LOSSY_HOOKS = ("fp8_rowwise", "int8_rowwise")
#: ``--hooks fp8_rowwise:all``: the hook with ``where=None`` (every saved tensor it sees).
ALL_SUFFIX = ":all"

#: Composed hooks stock inlining cannot take: cpu_offload's pack reads ``x.stride()`` into a
#: list (to restore strides), which ``fx.symbolic_trace`` cannot turn into a GraphModule.
_NO_STOCK_INLINE = {"fp8_rowwise+cpu_offload"}


def skip_reason(case: Case) -> str | None:
    """Why a case is not run (shown in the table), or None."""
    if case.mode == "stock-inline" and case.hook in _NO_STOCK_INLINE:
        return "no GraphModule form (cpu_offload's pack reads x.stride() into a list)"
    return None


@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "mlp8"
    backend: str = "aot_eager"
    hook: str = "bf16"
    mode: str = "ours"
    device: str = "cpu"
    batch: int = 2048
    dim: int = 128
    blocks: int = 8
    steps: int = 5
    reorder_for_peak_memory: bool = True
    #: Modes ``budget`` / ``stock-budget``: the activation-memory budget, a fraction in (0, 1]
    #: of the bytes the compiled graph saves without hooks. None for every other mode.
    budget: float | None = None

    def __post_init__(self) -> None:
        if (self.mode in BUDGET_MODES) != (self.budget is not None):
            raise ValueError(
                f"mode {self.mode!r} with budget={self.budget!r}: "
                f"a budget goes with, and only with, modes {BUDGET_MODES}"
            )
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget!r}")

    @property
    def label(self) -> str:
        return f"{self.model} {self.backend} {hook_column(dataclasses.asdict(self))} {self.mode}"


def hook_column(case: dict[str, Any]) -> str:
    """The ``hook`` column of a case (as a dict: results hold cases as JSON)."""
    mode = case["mode"]
    if mode == "budget":
        return f"budget {case['budget']:g}"
    if mode == "stock-budget":
        return f"amb {case['budget']:g}"
    return "-" if mode == "no-hooks" else case["hook"]


# ---------------------------------------------------------------------- models


def build_model(case: Case) -> Any:
    import torch

    d = case.dim

    class Block(torch.nn.Module):
        # A thin MLP block whose saved activations dominate memory.
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(d, 2 * d, bias=False)
            self.down = torch.nn.Linear(2 * d, d, bias=False)

        def forward(self, x: Any) -> Any:
            h = self.up(x)
            h = torch.nn.functional.gelu(h) * h.sigmoid()
            return x + self.down(h)

    class TransformerBlock(torch.nn.Module):
        def __init__(self, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.norm1 = torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
            self.proj = torch.nn.Linear(d, d, bias=False)
            self.norm2 = torch.nn.LayerNorm(d)
            self.mlp = Block()

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.norm2(x))

    if case.model == "llama":
        return _llama(case)
    if case.model == "mlp8":
        return torch.nn.Sequential(*[Block() for _ in range(case.blocks)])
    if case.model == "transformer":
        return torch.nn.Sequential(*[TransformerBlock() for _ in range(case.blocks)])
    raise ValueError(f"unknown model {case.model!r}")


#: Tokens per sequence of the llama model (its RoPE angles reach this).
_LLAMA_SEQ = 256
_LLAMA_VOCAB = 4096


def _llama(case: Case) -> Any:
    """Hugging Face Llama from a config (random init, no download; needs transformers):
    hidden ``dim``, ``blocks`` layers, RoPE, SDPA. Called with token ids, returns the loss."""
    import torch

    try:
        import transformers
    except ImportError as e:
        raise RuntimeError('--models llama needs transformers: pip install -e ".[models]"') from e
    cfg = transformers.LlamaConfig(
        vocab_size=_LLAMA_VOCAB, hidden_size=case.dim, intermediate_size=2 * case.dim,
        num_hidden_layers=case.blocks, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=_LLAMA_SEQ, attn_implementation="sdpa",
    )

    class LlamaLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(cfg)

        def forward(self, ids: Any) -> Any:
            return self.model(input_ids=ids, labels=ids).loss

    return LlamaLoss()


def example_input(case: Case) -> Any:
    import torch

    if case.model == "llama":
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, _LLAMA_VOCAB, (max(case.batch // _LLAMA_SEQ, 1), _LLAMA_SEQ), generator=gen)
        return ids.to(case.device)
    if case.model == "transformer":
        seq = 128
        return torch.randn(max(case.batch // seq, 1), seq, case.dim, device=case.device)
    return torch.randn(case.batch, case.dim, device=case.device)


# ----------------------------------------------------------------------- hooks


def _cast_hooks(dtype: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    def pack(x: Any) -> Any:
        return (x.dtype, x.to(dtype))

    def unpack(packed: Any) -> Any:
        orig_dtype, t = packed
        return t.to(orig_dtype)

    return pack, unpack


def _stock_offload_hooks(device: Any) -> tuple[Any, Any]:
    import torch
    import torch.fx

    import torch_patches.hooks.offload  # noqa: F401 - registers torch.ops.torch_patches

    def pack(x: Any) -> Any:
        return torch.ops.torch_patches.offload(x, True)

    def unpack(cpu: Any) -> Any:
        ops = torch.ops.torch_patches
        return ops.reload_wait(ops.reload_start(cpu, device), cpu, device)

    return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)


def make_hooks(case: Case) -> tuple[Any, Any] | None:
    import torch
    import torch.fx

    if case.mode in ("no-hooks", "stock-budget"):
        return None
    import torch_patches.hooks as library

    if case.mode == "budget":
        budget = getattr(library, "budget", None)
        if budget is None:
            raise RuntimeError("mode budget needs torch_patches.hooks.budget (the activation-memory budget planner)")
        return budget(case.budget)

    if case.hook == "cpu_offload" and case.mode == "stock-inline":
        # The same ops as GraphModules, for stock inlining (which places every offload at
        # the forward's end and every reload at the backward's start).
        return _stock_offload_hooks(torch.device(case.device))
    if case.hook == "bf16":
        pack, unpack = _cast_hooks(torch.bfloat16)
    elif case.hook == "fp8":
        pack, unpack = _cast_hooks(torch.float8_e4m3fn)
    elif case.hook.removesuffix(ALL_SUFFIX) in (*LIBRARY_HOOKS, *COMPOSED_HOOKS):
        # Ready-made hooks (marked inlineable): "ours" inlines them as they are; without
        # torch_patches applied (the other modes) marked functions stay Python hooks.
        # NAME:all is the hook without its numerics-safe selection (where=None).
        name = case.hook.removesuffix(ALL_SUFFIX)
        select_all = name != case.hook
        names = COMPOSED_HOOKS.get(name, (name,))
        pack, unpack = library.chain(
            *(
                getattr(library, n)(where=None) if select_all and n in LOSSY_HOOKS else getattr(library, n)()
                for n in names
            )
        )
        if case.mode == "ours":
            return pack, unpack
    else:
        raise ValueError(f"unknown hook {case.hook!r}")
    if case.mode == "eager-hooks":
        return pack, unpack
    return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)


# ---------------------------------------------------------------- measurement


def _proc_status(field: str) -> int:
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


def saved_bytes(output: Any, exclude: Iterable[Any] = ()) -> int:
    """Bytes the autograd graph behind ``output`` (a tensor or a nested container of them)
    holds for backward, counted exactly: every node reachable from the outputs' ``grad_fn``
    through ``next_functions``, the tensors it saved (:func:`saved_tensors_of`), each
    storage once, without the storages of ``exclude`` (parameters, inputs). Call it after
    the forward and before backward."""
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
    return tensor_bytes(saved, exclude)


def _recording_pack(pack: Callable[[Any], Any], packed: list[Any]) -> Callable[[Any], Any]:
    """``pack`` that also appends what it returns to ``packed`` (runtime hooks only)."""

    def recording_pack(x: Any) -> Any:
        out = pack(x)
        packed.append(out)
        return out

    return recording_pack


def blocks_of(model: Any, case: Case) -> list[Any]:
    """The repeated blocks of a bench model: the Sequential's children, Llama's decoder layers."""
    if case.model == "llama":
        return list(model.model.model.layers)
    return list(model)


def block_working_set(model: Any, x: Any, blocks: list[Any]) -> int:
    """Largest working set of one block's backward, from exact counts (module docstring):
    for each block run eagerly (no hooks) on the input it gets in ``model(x)``, the bytes it
    saves for backward (its parameters, buffers and inputs left out) + its output (incoming
    gradient) + its differentiable inputs (outgoing gradient)."""
    import torch
    import torch.utils._pytree as pytree

    inputs: dict[int, tuple[Any, Any]] = {}

    def capture(i: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            inputs.setdefault(i, pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (args, kwargs)
            ))

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


class _LogLines(logging.Handler):
    """Base of handlers that read the inliner's lines on the ``torch_patches`` artifact log
    (``torch._functorch._aot_autograd.graph_compile``) while compiling."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    @classmethod
    @contextlib.contextmanager
    def recording(cls) -> Any:
        from torch_patches import _logging as tp_logging

        logger = tp_logging.artifact_logger("torch._functorch._aot_autograd.graph_compile")
        handler, level = cls(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            yield handler
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)


class _KeptBytes(_LogLines):
    """Sums the bytes of saved tensors the inliner reports as "not selected" while compiling
    (producer, bytes and reason per saved tensor)."""

    _LINE = re.compile(r", (\d+) B, [^)]*\) left unhooked: not selected by")

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def emit(self, record: logging.LogRecord) -> None:
        m = self._LINE.search(record.getMessage())
        if m:
            self.total += int(m.group(1))


class _BudgetPlan(_LogLines):
    """Sums the budget planner's summary lines, one per planned graph: planned (predicted
    saved) bytes, saved bytes without hooks, budget bytes."""

    _LINE = re.compile(r"budget plan \(([^)]*)\): (\d+) B planned of (\d+) B saved, budget (\d+) B")

    def __init__(self) -> None:
        super().__init__()
        self.graphs = 0
        self.planned = self.saved = self.budget = 0

    def emit(self, record: logging.LogRecord) -> None:
        m = self._LINE.search(record.getMessage())
        if m:
            self.graphs += 1
            self.planned += int(m.group(2))
            self.saved += int(m.group(3))
            self.budget += int(m.group(4))


def run_case(case: Case) -> dict[str, Any]:
    """Measure one case in this process."""
    import contextlib
    import gc

    import torch
    import torch._dynamo.testing

    import torch_patches

    if case.mode in ("ours", "budget"):
        torch_patches.apply()
    else:
        torch_patches.unapply()
    torch.manual_seed(0)
    model = build_model(case).to(case.device)
    x = example_input(case)
    if x.is_floating_point():
        x.requires_grad_(True)
    hooks = make_hooks(case)
    configs = contextlib.ExitStack()
    if case.backend == "inductor":
        import torch._inductor.config as inductor_config

        configs.enter_context(inductor_config.patch(reorder_for_peak_memory=case.reorder_for_peak_memory))
    if case.mode == "stock-budget":
        import torch._functorch.config as functorch_config

        configs.enter_context(functorch_config.patch(activation_memory_budget=case.budget))
    counter = torch._dynamo.testing.CompileCounterWithBackend(case.backend)
    fn = torch.compile(model, backend=counter) if case.backend != "eager" else model
    state = (*model.parameters(), *model.buffers(), x)

    def step(measure_saved: bool = False) -> int | None:
        """One training step; with ``measure_saved``, the bytes held for backward (or None)."""
        active, packed = hooks, []
        if measure_saved and hooks and case.mode == "eager-hooks":
            # Runtime hooks: the walk would unpack; count what pack returned instead.
            active = (_recording_pack(hooks[0], packed), hooks[1])
        ctx = torch.autograd.graph.saved_tensors_hooks(*active) if active else contextlib.nullcontext()
        with ctx:
            y = fn(x)
        saved = None
        if measure_saved:
            saved = tensor_bytes(packed, state) if active is not hooks else saved_bytes(y, state)
            packed.clear()
        y.sum().backward()
        x.grad = None
        for p in model.parameters():
            p.grad = None
        return saved

    cuda = case.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with configs:
        t0 = time.perf_counter()
        with _KeptBytes.recording() as kept, _BudgetPlan.recording() as plan:
            step()
        sync()
        compile_s = time.perf_counter() - t0
        saved = step(measure_saved=True)
        sync()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            base = _proc_status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        step()
        sync()
        if cuda:
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = _proc_status("VmHWM") - base
        times = []
        for _ in range(case.steps):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    budget_row = {}
    if case.mode == "budget":
        block_ws = block_working_set(model, x, blocks_of(model, case))
        budget_row = {
            "plan_graphs": plan.graphs,
            "plan_saved_bytes": plan.saved,
            "plan_budget_bytes": plan.budget,
            "block_ws_bytes": block_ws,
            "floor_bytes": peak - (grad_bytes + plan.planned + block_ws) if plan.graphs else None,
        }
    return {
        "case": dataclasses.asdict(case),
        "label": case.label,
        "peak_bytes": peak,
        "step_s": statistics.median(times),
        "step_min_s": min(times),
        "compile_s": compile_s,
        "frames_compiled": counter.frame_count if case.backend != "eager" else 0,
        # Saved tensors a selective hook (numerics_safe...) left uncompressed, per step.
        "kept_bytes": kept.total if case.mode == "ours" else None,
        # Bytes the autograd graph holds for backward after one forward (saved_bytes).
        "saved_bytes": saved,
        "grad_bytes": grad_bytes,
        # The budget planner's predicted saved bytes (its log lines; None: no line logged).
        "plan_bytes": plan.planned if case.mode == "budget" and plan.graphs else None,
        **budget_row,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
    }


def run_in_subprocess(case: Case, timeout: float = 900) -> dict[str, Any]:
    reason = skip_reason(case)
    if reason is not None:
        return {"case": dataclasses.asdict(case), "label": case.label, "skipped": reason}
    env = dict(os.environ)
    # Fixed mmap threshold: large tensors are mmap-backed and their memory really
    # leaves the RSS when freed (glibc's dynamic threshold would keep it).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory(prefix="torch_patches_bench_") as cache_dir:
        # A compile cache of its own: every row compiles cold, so `compile s` compares
        # compilers, not what an earlier row or run left on disk.
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
        proc = subprocess.run(
            [sys.executable, "-m", "torch_patches.bench", "--worker", json.dumps(dataclasses.asdict(case))],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    if proc.returncode != 0:
        return {"case": dataclasses.asdict(case), "label": case.label, "error": _exception_line(proc.stderr)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _exception_line(stderr: str) -> list[str]:
    """The worker's exception (``AssertionError: ...``), not the hint torch prints after it."""
    lines = stderr.strip().splitlines()
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Unsupported)\b.*:", line):
            return [line]
    return lines[-1:]


def cases_for(
    *,
    models: Iterable[str],
    backends: Iterable[str],
    hooks: Iterable[str],
    modes: Iterable[str] = MODES,
    budgets: Iterable[float] = (),
    **common: Any,
) -> list[Case]:
    """No-hooks, then every hook x mode, then (``budgets``) a budget and a stock-budget row
    per fraction, for each model and backend."""
    modes, budgets = list(modes), list(budgets)
    out = []
    for model in models:
        for backend in backends:
            out.append(Case(model=model, backend=backend, mode="no-hooks", **common))
            for hook in hooks:
                for mode in modes:
                    if mode != "no-hooks":
                        out.append(Case(model=model, backend=backend, hook=hook, mode=mode, **common))
            for budget in budgets:
                for mode in BUDGET_MODES:
                    out.append(Case(model=model, backend=backend, hook="-", mode=mode, budget=budget, **common))
    return out


def add_ratios(results: list[dict[str, Any]]) -> None:
    base = {}
    for r in results:
        c = r["case"]
        if c["mode"] == "no-hooks" and "error" not in r and "skipped" not in r:
            base[(c["model"], c["backend"])] = r
    for r in results:
        b = base.get((r["case"]["model"], r["case"]["backend"]))
        if b is None or "error" in r or "skipped" in r:
            continue
        r["peak_ratio"] = r["peak_bytes"] / max(b["peak_bytes"], 1)
        r["time_ratio"] = r["step_s"] / b["step_s"]
        r["time_ratio_min"] = r["step_min_s"] / b["step_min_s"]


def _mib(n: int | None, width: int) -> str:
    return f"{'-':>{width}s}" if n is None else f"{n / 2**20:{width}.2f}"


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'model':12s} {'backend':9s} {'hook':23s} {'mode':13s} {'peak MiB':>9s} {'peak x':>7s} "
        f"{'step ms':>9s} {'time x':>7s} {'min x':>7s} {'frames':>6s} {'kept MiB':>8s} {'compile s':>9s} "
        f"{'saved MiB':>9s} {'plan MiB':>8s} {'floor MiB':>9s}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c = r["case"]
        hook = hook_column(c)
        if "error" in r:
            lines.append(f"{c['model']:12s} {c['backend']:9s} {hook:23s} {c['mode']:13s} ERROR {r['error']}")
            continue
        if "skipped" in r:
            lines.append(f"{c['model']:12s} {c['backend']:9s} {hook:23s} {c['mode']:13s} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{c['model']:12s} {c['backend']:9s} {hook:23s} {c['mode']:13s} "
            f"{r['peak_bytes'] / 2**20:9.1f} {r.get('peak_ratio', float('nan')):7.2f} "
            f"{r['step_s'] * 1e3:9.1f} {r.get('time_ratio', float('nan')):7.2f} "
            f"{r.get('time_ratio_min', float('nan')):7.2f} {r['frames_compiled']:6d} "
            f"{_mib(r.get('kept_bytes'), 8)} "
            f"{r.get('compile_s', float('nan')):9.2f} "
            f"{_mib(r.get('saved_bytes'), 9)} {_mib(r.get('plan_bytes'), 8)} {_mib(r.get('floor_bytes'), 9)}"
        )
    return "\n".join(lines)


def run_all(cases: list[Case], *, progress: bool = True) -> list[dict[str, Any]]:
    results = []
    start = time.perf_counter()
    for i, case in enumerate(cases):
        if progress:
            done = int(20 * i / len(cases))
            print(
                f"\r[{'#' * done}{'.' * (20 - done)}] {i}/{len(cases)} {case.label:50s} "
                f"{time.perf_counter() - start:6.0f}s",
                end="",
                file=sys.stderr,
                flush=True,
            )
        results.append(run_in_subprocess(case))
    if progress:
        print(f"\r[{'#' * 20}] {len(cases)}/{len(cases)} done in {time.perf_counter() - start:.0f}s" + " " * 50, file=sys.stderr)
    add_ratios(results)
    return results


def _fractions(text: str) -> tuple[float, ...]:
    """``--budget``: comma-separated fractions in (0, 1]."""
    import argparse

    try:
        values = tuple(float(v) for v in text.split(",") if v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"budgets are fractions in (0, 1], got {bad}")
    return values


def main(argv: list[str] | None = None) -> int:
    import argparse

    if "--train" in (sys.argv[1:] if argv is None else argv):
        from torch_patches import convergence

        return convergence.main(argv)

    parser = argparse.ArgumentParser(prog="python -m torch_patches bench", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--models", default="mlp8", help="comma list: mlp8, transformer, llama (HF config; needs transformers)"
    )
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument(
        "--hooks",
        default="bf16,fp8",
        help="bf16, fp8, torch_patches.hooks names (fp8_rowwise, int8_rowwise, cpu_offload) "
        "or fp8_rowwise+cpu_offload (chained); NAME:all for a lossy library hook without its numerics-safe selection",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--budget",
        type=_fractions,
        default=(),
        help="comma list of activation-memory budgets in (0, 1], e.g. 0.3,0.5,0.7: adds a budget row "
        "(torch_patches.hooks.budget(F)) and a stock-budget row (activation_memory_budget=F) per fraction",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-reorder", action="store_true", help="inductor: reorder_for_peak_memory=False")
    parser.add_argument("--small", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--json", default="bench-results/bench.json", help="where to write results")
    args = parser.parse_args(argv)

    if args.worker:
        result = run_case(Case(**json.loads(args.worker)))
        print(json.dumps(result))
        return 0

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        batch, dim = 8192, 4096
    else:
        batch, dim = 2048, 128
    if args.small:
        batch, dim = 256, 32
    common = dict(
        device=device,
        batch=args.batch or batch,
        dim=args.dim or dim,
        blocks=args.blocks,
        steps=args.steps,
        reorder_for_peak_memory=not args.no_reorder,
    )
    cases = cases_for(
        models=args.models.split(","),
        backends=args.backends.split(","),
        hooks=[h for h in args.hooks.split(",") if h],  # --hooks "": no hook rows
        modes=args.modes.split(","),
        budgets=args.budget,
        **common,
    )
    results = run_all(cases)
    table = format_table(results)
    print(f"torch {torch.__version__}, device {device}, batch {common['batch']}, dim {common['dim']}, blocks {args.blocks}")
    print(table)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"common": common, "results": results}, f, indent=2)
    print(f"results written to {args.json}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
