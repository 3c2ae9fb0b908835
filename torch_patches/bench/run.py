"""Running the bench's rows: the hooks each mode uses (:func:`make_hooks`), one case measured
in this process (:func:`run_case`, the ``--worker`` of a subprocess) or in a fresh
subprocess (:func:`run_in_subprocess`), the rows of an invocation (:func:`cases_for`) and all
of them in turn (:func:`run_all`). What each mode and column means: :mod:`torch_patches.bench`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch_patches.bench.case import BUDGET_MODES, MODES, Case
from torch_patches.bench.decisions import recording_decisions
from torch_patches.bench.measure import block_working_set, proc_status, recording_pack, saved_bytes, tensor_bytes
from torch_patches.bench.report import add_ratios
from torch_patches.testing.models import blocks_of, build_model, example_input

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
    if case.hook == "bf16_scaled" and case.mode not in ("ours", "eager-hooks", "no-hooks", "stock-budget"):
        return "a GraphModule form would bake the scale in (modes ours, eager-hooks)"
    if case.mode == "stock-inline" and case.hook in _NO_STOCK_INLINE:
        return "no GraphModule form (cpu_offload's pack reads x.stride() into a list)"
    return None


# ----------------------------------------------------------------------- hooks


def cast_hooks(dtype: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    def pack(x: Any) -> Any:
        return (x.dtype, x.to(dtype))

    def unpack(packed: Any) -> Any:
        orig_dtype, t = packed
        return t.to(orig_dtype)

    return pack, unpack


class DelayedScale:
    """``--hooks bf16_scaled``: a bf16 pair with a delayed scale, a tensor the loop updates in
    place after every step (as delayed-scaling fp8 does). With torch_patches the hooks are
    inlineable and the scale is a runtime input of the graphs (no recompile per update); the
    row beside ``bf16`` shows what reading it costs per step (guards and inputs)."""

    def __init__(self, device: str) -> None:
        import torch

        self.scale = torch.ones((), device=device)

    def hooks(self, case: Case) -> tuple[Any, Any]:
        import torch

        def pack(x: Any) -> Any:
            return (x * self.scale).to(torch.bfloat16)

        def unpack(p: Any) -> Any:
            return p.to(torch.float32) / self.scale

        if case.mode == "ours":
            from torch_patches.hooks import inlineable

            return inlineable(pack, unpack)
        if case.mode == "eager-hooks":
            return pack, unpack
        raise ValueError("bf16_scaled runs in modes ours and eager-hooks (a GraphModule would bake the scale in)")

    def update(self) -> None:
        import torch

        with torch.no_grad():
            self.scale.mul_(0.999).add_(0.002)


def _stock_offload_hooks(device: Any) -> tuple[Any, Any]:
    import torch
    import torch.fx

    import torch_patches.hooks.offload  # noqa: F401 - registers torch.ops.saved_tensors_hooks

    def pack(x: Any) -> Any:
        return torch.ops.saved_tensors_hooks.offload(x, True)

    def unpack(cpu: Any) -> Any:
        ops = torch.ops.saved_tensors_hooks
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
        pack, unpack = cast_hooks(torch.bfloat16)
    elif case.hook == "fp8":
        pack, unpack = cast_hooks(torch.float8_e4m3fn)
    elif case.hook.removesuffix(ALL_SUFFIX) in (*LIBRARY_HOOKS, *COMPOSED_HOOKS):
        # Ready-made hooks (marked inlineable): "ours" inlines them as they are; without
        # torch_patches applied (the other modes) marked functions stay Python hooks.
        # NAME:all is the hook without its numerics-safe selection (where=None).
        name = case.hook.removesuffix(ALL_SUFFIX)
        select_all = name != case.hook
        names = COMPOSED_HOOKS.get(name, (name,))
        pack, unpack = library.chain(
            *(getattr(library, n)(where=None) if select_all and n in LOSSY_HOOKS else getattr(library, n)() for n in names)
        )
        if case.mode == "ours":
            return pack, unpack
    else:
        raise ValueError(f"unknown hook {case.hook!r}")
    if case.mode == "eager-hooks":
        return pack, unpack
    return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)


def run_case(case: Case) -> dict[str, Any]:
    """Measure one case in this process."""
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
    scaled = DelayedScale(case.device) if case.hook == "bf16_scaled" and case.mode not in ("no-hooks", "stock-budget") else None
    hooks = scaled.hooks(case) if scaled is not None else make_hooks(case)
    configs = _configs(case)
    counter = torch._dynamo.testing.CompileCounterWithBackend(case.backend)
    fn = torch.compile(model, backend=counter) if case.backend != "eager" else model
    state = (*model.parameters(), *model.buffers(), x)

    def step(measure_saved: bool = False) -> int | None:
        """One training step; with ``measure_saved``, the bytes held for backward (or None)."""
        active, packed = hooks, []
        if measure_saved and hooks and case.mode == "eager-hooks":
            # Runtime hooks: the walk would unpack; count what pack returned instead.
            active = (recording_pack(hooks[0], packed), hooks[1])
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
        if scaled is not None:
            scaled.update()
        return saved

    cuda = case.device.startswith("cuda")
    with configs:
        decisions, compile_s, saved, peak, times = _measure(step, cuda, case.steps)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    budget_row = _budget_row(case, model, x, decisions, peak, grad_bytes) if case.mode == "budget" else {}
    return {
        "case": dataclasses.asdict(case),
        "label": case.label,
        "peak_bytes": peak,
        "step_s": statistics.median(times),
        "step_min_s": min(times),
        "compile_s": compile_s,
        "frames_compiled": counter.frame_count if case.backend != "eager" else 0,
        # Saved tensors a selective hook (numerics_safe...) left uncompressed, per step.
        "kept_bytes": decisions.kept_bytes if case.mode == "ours" else None,
        # Bytes the autograd graph holds for backward after one forward (saved_bytes).
        "saved_bytes": saved,
        "grad_bytes": grad_bytes,
        # The budget planner's predicted saved bytes (its log lines; None: no line logged).
        "plan_bytes": decisions.planned if case.mode == "budget" and decisions.plan_graphs else None,
        **budget_row,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
    }


def _configs(case: Case) -> contextlib.ExitStack:
    """The configs a case runs under (entered by the caller)."""
    configs = contextlib.ExitStack()
    if case.backend == "inductor":
        import torch._inductor.config as inductor_config

        configs.enter_context(inductor_config.patch(reorder_for_peak_memory=case.reorder_for_peak_memory))
    if case.mode == "stock-budget":
        import torch._functorch.config as functorch_config

        configs.enter_context(functorch_config.patch(activation_memory_budget=case.budget))
    return configs


def _measure(step: Callable[..., int | None], cuda: bool, steps: int) -> tuple[Any, float, int | None, int, list[float]]:
    """Run a case's steps: (the inliner's decisions while compiling, compile seconds, bytes
    held for backward, peak bytes of one step, each timed step's seconds)."""
    import gc

    import torch

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    with recording_decisions() as decisions:
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
        base = proc_status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    step()
    sync()
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = proc_status("VmHWM") - base
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return decisions, compile_s, saved, peak, times


def _budget_row(case: Case, model: Any, x: Any, decisions: Any, peak: int, grad_bytes: int) -> dict[str, Any]:
    """A budget case's plan beside what it measured (the floor: what the plan cannot lower)."""
    block_ws = block_working_set(model, x, blocks_of(model, case))
    return {
        "plan_graphs": decisions.plan_graphs,
        "plan_saved_bytes": decisions.saved,
        "plan_budget_bytes": decisions.budget,
        "block_ws_bytes": block_ws,
        "floor_bytes": peak - (grad_bytes + decisions.planned + block_ws) if decisions.plan_graphs else None,
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
            [sys.executable, "-m", "torch_patches", "bench", "--worker", json.dumps(dataclasses.asdict(case))],
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


def run_all(cases: list[Case], *, progress: bool = True) -> list[dict[str, Any]]:
    results = []
    start = time.perf_counter()
    for i, case in enumerate(cases):
        if progress:
            done = int(20 * i / len(cases))
            print(
                f"\r[{'#' * done}{'.' * (20 - done)}] {i}/{len(cases)} {case.label:50s} {time.perf_counter() - start:6.0f}s",
                end="",
                file=sys.stderr,
                flush=True,
            )
        results.append(run_in_subprocess(case))
    if progress:
        print(f"\r[{'#' * 20}] {len(cases)}/{len(cases)} done in {time.perf_counter() - start:.0f}s" + " " * 50, file=sys.stderr)
    add_ratios(results)
    return results
