"""Where the device memory of an offloaded step goes, and the GPU table of offload and budget rows.

    python benchmarks/gpu_offload_profile.py --out DIR                # CUDA: the diagnosis rows
    python benchmarks/gpu_offload_profile.py --rows table --out DIR   # the GPU table (gpu_check.sh)
    python benchmarks/gpu_offload_profile.py --device cpu --small     # a dry run of the script

Rows (``ROWS``; sets of them in ``ROW_SETS``: ``diagnose``, ``table``, ``llama``) run in one
process, each compiled afresh. Per row: the step's peak above the resident state
(``max_memory_allocated``), the allocator's ``active`` peak above it (blocks freed but not yet
reusable count there: a copy stream still reading them) and its ``reserved`` peak, the bytes
the autograd graph holds for backward per device after the forward, and the median step
time; ratios are against the same model's no-hooks row. Models: mlp8 at the GPU sizes
(``--batch`` x ``--dim``, 8 blocks, fp32: weight gradients are 0.38x of its no-hooks peak, a
floor no activation technique goes below), the same at 4x the batch and 1/4 the width
(``-wide``: activations dominate, little compute to hide copies behind), at 4x the batch and
the same width (``-tall``: activations dominate, the same compute per copied byte), and a
Llama of about 1.2B parameters at sequence 2048 with each decoder layer compiled on its own.
Upstream's activation offloading runs with its separate stream and on one stream. For the
``offload`` row also:

* the allocator's history over one warm step (``torch.cuda.memory._record_memory_history``):
  the blocks alive at the peak, largest first, each with the frames that allocated it (the
  generated forward or backward code and its line, or the op of ours that allocated it),
  and the bytes alive at the peak by where they were allocated;
* the generated code of the forward and backward (``DIR/fw.py``, ``DIR/bw.py``) and the order
  of its offload / free / reload lines.

For every row that offloads, on CUDA, one more step under the profiler: the device time of its
host<->device copies, of its kernels, and how much of the copies ran while a kernel ran
(``copy_overlap``: what the copy engine hid behind compute, and what it left exposed).

On the CPU the device columns are empty (there is no CUDA allocator to read); the dry run
checks the script, the rows and the code listing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import torch_patches
import torch_patches.hooks
from torch_patches.bench import Case
from torch_patches.bench.measure import saved_bytes_by_device
from torch_patches.hooks import chain, cpu_offload, fp8_rowwise
from torch_patches.testing import saved_tensor_records
from torch_patches.testing.models import build_model, causal_lm_loss, compile_per_layer, hf_llama

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration: a model, a backend, hooks (or none) and config overrides."""

    name: str
    model: str = "mlp8"  # mlp8 (--batch x --dim), mlp8-wide (4x the batch, 1/4 the width), mlp8-tall (4x the batch), llama1b
    backend: str = "inductor"  # or aot_eager, or eager (not compiled)
    hooks: Any = None  # a factory of the (pack, unpack) pair, or None
    inductor: tuple[tuple[str, Any], ...] = ()
    functorch: tuple[tuple[str, Any], ...] = ()
    joint_pass: Any = None  # an inductor joint_custom_pre_pass (upstream's offload marks nodes)
    patches: tuple[tuple[str, Any], ...] = ()  # torch_patches.config overrides
    checkpoint: bool = False  # stock activation checkpointing of every decoder layer (llama1b)


def _budget(f: float) -> Any:
    return lambda: torch_patches.hooks.budget(f)


def _save_on_cpu() -> Any:
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    return ctx.pack_hook, ctx.unpack_hook


def _mark_all_for_offload(graph: Any) -> None:
    """Upstream's activation offloading offloads the saved tensors marked ``should_offload``
    (its config calls it a testing knob): mark every node; its ``can_offload`` filters."""
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True


_UPSTREAM_OFFLOAD = (
    ("enable_activation_offloading", True),
    ("activation_offload_separate_stream", True),
    ("activation_offload_sink_wait", True),
    ("activation_reload_prefetch", True),
)


def _rows(model: str, suffix: str = "") -> list[Row]:
    return [
        Row(f"no-hooks{suffix}", model),
        Row(f"offload{suffix}", model, hooks=cpu_offload),
        Row(f"fp8+offload{suffix}", model, hooks=lambda: chain(fp8_rowwise(), cpu_offload())),
    ]


ROWS: dict[str, Row] = {
    r.name: r
    for r in [
        *_rows("mlp8"),
        Row("offload-no-reorder", hooks=cpu_offload, inductor=(("reorder_for_peak_memory", False),)),
        Row("offload-aot-eager", backend="aot_eager", hooks=cpu_offload),
        *(Row(f"budget-{f}", hooks=_budget(f)) for f in (0.2, 0.3, 0.5)),
        *(Row(f"stock-amb-{f}", functorch=(("activation_memory_budget", f),)) for f in (0.2, 0.3, 0.5)),
        Row("save_on_cpu-eager-hooks", hooks=_save_on_cpu),
        Row("upstream-offload", functorch=_UPSTREAM_OFFLOAD, joint_pass=_mark_all_for_offload),
        Row("upstream-offload-one-stream", functorch=_UPSTREAM_OFFLOAD[:1], joint_pass=_mark_all_for_offload),
        *_rows("mlp8-wide", "-wide"),
        Row("budget-0.3-wide", "mlp8-wide", hooks=_budget(0.3)),
        Row("stock-amb-0.3-wide", "mlp8-wide", functorch=(("activation_memory_budget", 0.3),)),
        *_rows("mlp8-tall", "-tall"),
        Row("upstream-offload-one-stream-tall", "mlp8-tall", functorch=_UPSTREAM_OFFLOAD[:1], joint_pass=_mark_all_for_offload),
        # In the order of what the targets read first (a run cut by its timeout
        # keeps the first rows).
        Row("no-hooks-llama1b", "llama1b"),
        Row("offload-llama1b", "llama1b", hooks=cpu_offload),
        Row("budget-0.3-llama1b", "llama1b", hooks=_budget(0.3)),
        Row("stock-amb-0.3-llama1b", "llama1b", functorch=(("activation_memory_budget", 0.3),)),
        Row("fp8+offload-llama1b", "llama1b", hooks=lambda: chain(fp8_rowwise(), cpu_offload())),
        Row("budget-0.5-llama1b", "llama1b", hooks=_budget(0.5)),
        Row("stock-amb-0.5-llama1b", "llama1b", functorch=(("activation_memory_budget", 0.5),)),
        Row("stock-full-ac-llama1b", "llama1b", checkpoint=True),
        # The same offload with each layer's reloads started by its own backward.
        Row("offload-no-prefetch-llama1b", "llama1b", hooks=cpu_offload, patches=(("offload_prefetch_graphs", 0),)),
        # The reloads started ahead bounded to half of what a layer saves (1344 MiB): the
        # first of the next layer's reloads ahead, the rest by its own backward.
        Row("offload-ahead-half-layer-llama1b", "llama1b", hooks=cpu_offload, patches=(("offload_prefetch_bytes", 672 << 20),)),
    ]
}

#: Named sets of rows (``--rows``): the diagnosis of the offload path, the GPU table.
ROW_SETS = {
    "diagnose": "no-hooks,offload,offload-no-reorder,offload-aot-eager,fp8+offload",
    "table": ",".join(r for r in ROWS if r not in ("offload-no-reorder", "offload-aot-eager") and not r.endswith(("-llama1b", "-tall"))),
    "tall": ",".join(r for r in ROWS if r.endswith("-tall")),
    "llama": ",".join(r for r in ROWS if r.endswith("-llama1b")),
}


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _hidden(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float:
    """The time of the (merged) ``copies`` during which some (merged) kernel ran."""
    hidden, j = 0.0, 0
    for a, b in copies:
        while j < len(kernels) and kernels[j][1] <= a:
            j += 1
        k = j
        while k < len(kernels) and kernels[k][0] < b:
            hidden += min(b, kernels[k][1]) - max(a, kernels[k][0])
            k += 1
    return hidden


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, float]:
    """The copies of one step against its kernels, from the profiler's Chrome trace events.

    Times in ms of device time: ``copy_ms`` host<->device copies (device-to-device ones are
    kernels' work, not the copy engine's), ``kernel_ms`` kernels, ``copy_hidden_ms`` the copies'
    time while some kernel ran, ``copy_exposed_ms`` the rest (also per direction:
    ``offload_exposed_ms`` device to host, ``reload_exposed_ms`` host to device), ``span_ms``
    first to last event.
    """

    def spans(cat: str, *names: str) -> list[tuple[float, float]]:
        return _merged(
            [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == cat and any(n in e.get("name", "") for n in names)]
        )

    copies, kernels = spans("gpu_memcpy", "DtoH", "HtoD"), spans("kernel", "")
    hidden = _hidden(copies, kernels)
    copy_us = sum(b - a for a, b in copies)
    out = {
        "copy_ms": round(copy_us / 1e3, 3),
        "kernel_ms": round(sum(b - a for a, b in kernels) / 1e3, 3),
        "copy_hidden_ms": round(hidden / 1e3, 3),
        "copy_exposed_ms": round((copy_us - hidden) / 1e3, 3),
    }
    for label, direction in (("offload", "DtoH"), ("reload", "HtoD")):
        one = spans("gpu_memcpy", direction)
        out[f"{label}_exposed_ms"] = round((sum(b - a for a, b in one) - _hidden(one, kernels)) / 1e3, 3)
    both = copies + kernels
    out["span_ms"] = round((max(b for _, b in both) - min(a for a, _ in both)) / 1e3, 3) if both else 0.0
    return out


def profiled_copies(step: Any, sync: Any) -> dict[str, float]:
    """One step under the profiler (CPU and CUDA activities): :func:`copy_overlap` of its trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return copy_overlap(json.load(f)["traceEvents"])


def frames_of(entry: dict[str, Any]) -> list[str]:
    """The frames worth reading of one allocator trace entry: generated code and ours."""
    keep = []
    for f in entry.get("frames", ()):
        name = f.get("filename", "")
        if "torchinductor" in name or "torch_patches" in name or name.endswith("gpu_offload_profile.py"):
            keep.append(f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}")
    return keep[:4]


def origin(frames: list[str], code_files: dict[str, str]) -> str:
    for f in frames:
        base = f.split(":")[0]
        for label, path in code_files.items():
            if os.path.basename(path) == base:
                return label
        if base == "offload.py":
            return f"offload.py {f.split()[-1]}"
    return frames[0] if frames else "(no frame of ours or of generated code)"


def analyse_history(snapshot: dict[str, Any], code_files: dict[str, str], log: Any) -> None:
    """Print the blocks alive at the peak of the recorded step."""
    traces = snapshot.get("device_traces", [[]])
    trace = traces[torch.cuda.current_device()] if traces else []
    live: dict[int, dict[str, Any]] = {}
    current = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    actions = collections.Counter(e["action"] for e in trace)
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = {**e, "index": i}
            current += e["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif e["action"] == "free_requested":
            if live.pop(e["addr"], None) is not None:
                current -= e["size"]
    log(
        f"history: {len(trace)} entries {dict(actions)}; peak of the step's own allocations "
        f"{peak / MiB:.0f} MiB at entry {max((b['index'] for b in at_peak.values()), default=-1)}"
    )
    by_origin: dict[str, int] = collections.Counter()
    blocks = sorted(at_peak.values(), key=lambda b: -b["size"])
    for b in blocks:
        by_origin[origin(frames_of(b), code_files)] += b["size"]
    log("alive at the peak, by where allocated:")
    for k, n in sorted(by_origin.items(), key=lambda kv: -kv[1]):
        log(f"  {n / MiB:9.0f} MiB  {k}")
    log("largest blocks alive at the peak (size, stream, allocated at entry, frames):")
    for b in blocks[:16]:
        log(f"  {b['size'] / MiB:7.0f} MiB s{b.get('stream')} #{b['index']}  " + " <- ".join(frames_of(b)))
    # The frees that came late: blocks freed (requested) within the step, with the distance
    # (entries) between their alloc and free, the offloaded ones first.
    streams = collections.Counter(e.get("stream") for e in trace if e["action"] == "alloc")
    log(f"allocations by stream: {dict(streams)}")


ORDER_RE = re.compile(r"saved_tensors_hooks\.(offload|reload_start|reload_wait)|^del |extern_kernels\.|\.run\(|^return|= empty_strided")


def code_order(code: str, limit: int) -> list[str]:
    """The lines of the generated ``call`` that place, free and reload saved tensors."""
    body = code[code.index("def call(") :] if "def call(" in code else code
    out = []
    for line in body.splitlines():
        s = line.strip()
        if ORDER_RE.search(s) and not s.startswith(("assert", "#")):
            out.append(s[:140])
        if s.startswith("return"):
            break
    if len(out) > limit:
        out = out[: limit // 2] + [f"... ({len(out) - limit} lines)"] + out[-limit // 2 :]
    return out


def build(row: Row, args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and its input for ``row`` on ``args.device``."""
    torch.manual_seed(0)
    if row.model == "llama1b":
        # About 1.2B parameters: Llama-style, 16 layers of width 2048, MLP 8192, vocab 32000.
        vocab, dim, layers, heads, mlp = (512, 128, 2, 4, 256) if args.small else (32000, 2048, 16, 32, 8192)
        with torch.device(args.device):  # initialised where it runs: 1.2B parameters are slow to fill on a CPU
            model = causal_lm_loss(hf_llama(vocab=vocab, dim=dim, layers=layers, heads=heads, seq=args.llama_seq, mlp_dim=mlp))
        ids = torch.randint(0, vocab, (args.llama_batch, args.llama_seq), generator=torch.Generator().manual_seed(0))
        return model.to(args.device), ids.to(args.device)
    batch, dim = {"mlp8-wide": (args.batch * 4, args.dim // 4), "mlp8-tall": (args.batch * 4, args.dim)}.get(
        row.model, (args.batch, args.dim)
    )
    case = Case(model="mlp8", device=args.device, batch=batch, dim=dim, blocks=args.blocks)
    model = build_model(case).to(args.device)
    return model, torch.randn(batch, dim, device=args.device, requires_grad=True)


def plans_of(compiled: Any) -> list[dict[str, Any]]:
    """The budget plans of the compiled graphs (one per graph): what each planned."""
    return [
        {
            "met": p.met,
            "bounds": p.bounds,
            "preference": p.preference,
            "planned_x": round(p.planned_bytes / max(p.baseline_bytes, 1), 3),
            "peak_x": round(p.peak_bytes / max(p.baseline_bytes, 1), 3),
            "options": dict(collections.Counter(u.option for u in p.units)),
            "copy_ms": round(p.copy_ms, 3),
            "copy_exposed_ms": round(p.copy_exposed_ms, 3),
            "ahead_MiB": round(p.ahead_bytes / MiB, 1),
        }
        for c in compiled
        for p in c.plans
    ]


def captured_code(step: Any, name: str, args: argparse.Namespace, log: Any) -> dict[str, str]:
    """Run ``step`` (its first: it compiles), write the generated forward and backward under
    ``args.out`` and log their order of offloads, frees and reloads; the files written."""
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(step)
    files = {}
    for label, code in zip(("forward", "backward"), codes):
        path = os.path.join(args.out, "fw.py" if label == "forward" else "bw.py")
        with open(path, "w") as f:
            f.write(code)
        files[label] = os.path.basename(path)
        log(f"[{name}] generated {label} ({len(code)} chars), its offload/free/reload order:")
        for line in code_order(code, args.order_lines):
            log(f"    {line}")
    return files


def run_row(name: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    row = ROWS[name]
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    cuda = args.device.startswith("cuda")
    model, x = build(row, args)
    hooks = row.hooks() if row.hooks is not None else None
    if row.backend == "eager":
        fn = model
    elif row.model == "llama1b":
        # Each decoder layer compiled on its own, as FSDP2 / torchtitan compile: one graph
        # (compiled once, reused by the 16 layers), and the loss on its own; embedding and
        # head stay eager.  Full activation checkpointing: HF's, around every layer.
        if row.checkpoint:
            model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        compile_per_layer(model.lm, backend=row.backend, loss=True)
        fn = model
    else:
        fn = torch.compile(model, backend=row.backend)
    state = [*model.parameters(), x]
    held: dict[str, int] = {}

    def step(measure: bool = False) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
        with ctx:
            y = fn(x)
        if measure:
            held.update(saved_bytes_by_device(y, state))
        y.sum().backward()
        y = None
        x.grad = None
        for p in model.parameters():
            p.grad = None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    out: dict[str, Any] = {"variant": name}
    inductor_cfg = dict(row.inductor)
    if row.joint_pass is not None:
        inductor_cfg["joint_custom_pre_pass"] = row.joint_pass
    with inductor_config.patch(inductor_cfg), functorch_config.patch(dict(row.functorch)), torch_patches.config.patch(dict(row.patches)):
        t0 = time.perf_counter()
        if row.backend == "inductor" and name == "offload" and args.code:
            out["code_files"] = captured_code(step, name, args, log)
        else:
            with saved_tensor_records() as compiled:
                step()
            out["plans"] = plans_of(compiled)
        sync()
        out["compile_s"] = time.perf_counter() - t0
        step(measure=True)
        sync()
        out["held_for_backward_MiB"] = {k: round(v / MiB, 1) for k, v in held.items()}
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            record = name == "offload" and args.history
            if record:
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        step()
        sync()
        if cuda:
            stats = torch.cuda.memory_stats()
            out["peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / MiB
            out["active_peak_MiB"] = (stats["active_bytes.all.peak"] - base) / MiB
            out["reserved_peak_MiB"] = stats["reserved_bytes.all.peak"] / MiB
            if record:
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                if args.snapshot:
                    import pickle

                    with open(os.path.join(args.out, "offload-snapshot.pickle"), "wb") as f:
                        pickle.dump(snapshot, f)
                analyse_history(snapshot, out.get("code_files", {}), log)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        out["step_ms"] = 1e3 * statistics.median(times)
        if cuda and "offload" in name:
            c = out["copy_overlap"] = profiled_copies(step, sync)
            log(
                f"[{name}] copies {c['copy_ms']:.1f} ms of device time, {c['copy_hidden_ms']:.1f} ms of it while a kernel ran, "
                f"{c['copy_exposed_ms']:.1f} ms exposed ({c['offload_exposed_ms']:.1f} out, {c['reload_exposed_ms']:.1f} back); kernels {c['kernel_ms']:.1f} ms; step span {c['span_ms']:.1f} ms"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu-offload-profile")
    p.add_argument("--small", action="store_true", help="batch 256 x dim 64, 4 blocks (a dry run)")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", default="diagnose", help=f"row names, or a set: {', '.join(ROW_SETS)} (default: diagnose)")
    p.add_argument("--llama-batch", type=int, default=2)
    p.add_argument("--llama-seq", type=int, default=2048)
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--no-code", dest="code", action="store_false", help="do not capture the generated code")
    p.add_argument("--order-lines", type=int, default=70)
    p.add_argument("--no-history", dest="history", action="store_false")
    p.add_argument("--snapshot", action="store_true", help="also write the allocator snapshot (pickle)")
    args = p.parse_args(argv)
    if args.small:
        args.batch, args.dim, args.blocks, args.llama_seq = 256, 64, 4, 64
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "profile.txt"), "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")

    torch_patches.apply()
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    log(f"torch {torch.__version__}, {dev}; mlp8 batch {args.batch} x dim {args.dim}, {args.blocks} blocks, fp32")
    rows = []
    names = [n for part in args.rows.split(",") for n in ROW_SETS.get(part, part).split(",")]
    for name in names:
        try:
            row = run_row(name, args, log)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:400]}
        rows.append(row)
        log(f"ROW {row}")
    if args.json:
        with open(args.json, "w") as f:
            # Paths of this run (its output folder) stay out: the file is a result to keep.
            kept = {k: v for k, v in vars(args).items() if k not in ("out", "json")}
            json.dump({"torch": torch.__version__, "device": dev, "args": kept, "rows": rows}, f, indent=1, default=str)
    log(f"{'variant':<24} {'peak MiB':>9} {'x':>5} {'active':>7} {'reserved':>9} {'step ms':>8} {'x':>5}  held for backward")
    for r in rows:
        if "error" in r:
            log(f"{r['variant']:<24} error: {r['error']}")
            continue
        # Ratios against the no-hooks row of the same model.
        suffix = next((s for s in ("-wide", "-tall", "-llama1b") if r["variant"].endswith(s)), "")
        ref = next((b for b in rows if b["variant"] == f"no-hooks{suffix}" and "step_ms" in b), {})
        base, base_t = ref.get("peak_MiB"), ref.get("step_ms")
        pk, t = r.get("peak_MiB"), r["step_ms"]
        log(
            f"{r['variant']:<24} {pk if pk is not None else float('nan'):9.0f} "
            f"{pk / base if pk is not None and base else float('nan'):5.2f} "
            f"{r.get('active_peak_MiB', float('nan')):7.0f} {r.get('reserved_peak_MiB', float('nan')):9.0f} "
            f"{t:8.1f} {t / base_t if base_t else float('nan'):5.2f}  {r['held_for_backward_MiB']}"
        )
    logf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
