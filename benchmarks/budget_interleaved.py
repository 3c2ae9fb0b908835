"""Step time of an activation-memory budget against uniform fp8, interleaved in one process.

Both rows are compiled (Inductor) in the same process and their steps alternate (ABBA
order), so the slow phases of a shared machine fall on both alike; the per-process spread
that dominates ``budget_repeats.py`` (fresh processes) is gone.  Prints the median step of
each row and the ratios of the medians and of the fastest steps.

    python -m benchmarks.budget_interleaved llama 0.53 30
    python -m benchmarks.budget_interleaved transformer 0.3 30
"""

import statistics
import sys
import time
import warnings

import torch

import torch_patches
from benchmarks import interleaved_times
from torch_patches.bench import Case
from torch_patches.hooks import budget, fp8_rowwise
from torch_patches.testing.models import build_model, example_input


def main(model_name: str, fraction: float, steps: int) -> None:
    torch_patches.apply()
    warnings.simplefilter("ignore")  # an unreachable budget warns once per compile
    extra = {"blocks": 4} if model_name == "llama" else {}
    case = Case(model=model_name, device="cpu", batch=2048, dim=128, **extra)
    torch.manual_seed(0)
    model = build_model(case)
    x = example_input(case)
    if x.is_floating_point():
        x.requires_grad_(True)
    rows = {"uniform fp8_rowwise()": fp8_rowwise(), f"budget({fraction})": budget(fraction)}
    compiled = {name: torch.compile(model, backend="inductor") for name in rows}

    def step(name: str) -> float:
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(*rows[name]):
            out = compiled[name](x)
        (out if out.dim() == 0 else out.sum()).backward()
        elapsed = time.perf_counter() - start
        for p in model.parameters():
            p.grad = None
        x.grad = None
        return elapsed

    order = list(rows)
    times = interleaved_times(step, order, steps)
    uniform, planned = (times[name] for name in order)
    for name, t in times.items():
        print(f"{name}: median step {1000 * statistics.median(t):.1f} ms, fastest {1000 * min(t):.1f} ms")
    print(
        f"{model_name}: budget / uniform = {statistics.median(planned) / statistics.median(uniform):.3f} "
        f"(fastest steps: {min(planned) / min(uniform):.3f}), {steps} steps each"
    )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 30)
