"""Training steps in a fresh process, for the compile-cache tests.

    python test/cache_worker.py '{"hook": "gm", "scale": 2.0, "backend": "inductor", ...}'
    python test/cache_worker.py '{"runs": [{"hook": "gm", ..., "cache_dir": "D1"}, ...]}'

Prints one JSON line per step: the AOTAutograd and Inductor cache counters, and the
gradients. Steps of one process run one after the other (Dynamo reset, counters cleared,
config restored, compile caches in the step's ``cache_dir`` where given): they share only
what the C++ compiler built.
"""

import json
import os
import subprocess
import sys
import warnings

import torch
import torch.fx

import torch_patches
from torch_patches import hooks
from torch_patches.bench.measure import saved_bytes
from torch_patches.hooks import cache_hash, inlineable
from torch_patches.testing import hook_warnings


def leaf_scale(x, s):
    # An opaque leaf: symbolic_trace records a call to it, not what it does.
    return x * s


torch.fx.wrap("leaf_scale")


def _tensor_scaled(scale):
    """bf16 hooks reading ``scale``, a tensor (its value is an input of the graphs, not
    part of the hooks' identity)."""

    def pack(x):
        return (x * scale).to(torch.bfloat16)

    def unpack(x):
        return x.to(torch.float32) / scale

    return inlineable(pack, unpack)


def build_hooks(spec):
    scale = spec["scale"]
    if spec.get("tensor_scale"):  # a tensor the hooks read: a runtime input of the graphs
        return _tensor_scaled(torch.tensor(scale))

    def pack(x):
        if spec.get("untraceable"):
            scale_now = float(x.abs().max().item()) * 0 + scale  # .item(): cannot be traced
        else:
            scale_now = scale
        return (x * scale_now).to(torch.bfloat16)

    def unpack(x):
        return x.to(torch.float32) / scale

    def leaf_pack(x):
        return leaf_scale(x, scale).to(torch.bfloat16)

    if spec["hook"] == "gm":
        return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)
    if spec["hook"] == "marked":
        return inlineable(pack, unpack)
    if spec["hook"] == "cpu_offload":
        return hooks.cpu_offload(pin_memory=False)
    if spec["hook"] == "fp8_rowwise+cpu_offload":
        return hooks.chain(hooks.fp8_rowwise(), hooks.cpu_offload(pin_memory=False))
    if spec["hook"] == "budget":
        return hooks.budget(spec["budget"])
    if spec["hook"] == "leaf":
        if spec.get("leaf_hash"):
            cache_hash(spec["leaf_hash"])(leaf_scale)
        return torch.fx.symbolic_trace(leaf_pack), torch.fx.symbolic_trace(unpack)
    raise ValueError(spec["hook"])


def model(x, w):
    return torch.nn.functional.linear(x, w).sin().cos()


def mlp(x, w):
    # What a budget plans: relu's output, read by the second matmul's backward.
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w)), w)


HOOKS = None  # for "in_region": the hooks entered inside the compiled function


def model_in_region(x, w):
    with torch.autograd.graph.saved_tensors_hooks(*HOOKS):
        return model(x, w)


def run(spec):
    from torch._dynamo.utils import counters

    from torch_patches import config

    if "cache_dir" in spec:  # read by Inductor's and AOTAutograd's caches at each lookup
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = spec["cache_dir"]
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, 8, generator=gen, requires_grad=True)
    inp = x * 1 if spec.get("non_leaf") else x  # "non_leaf": an input autograd produced
    global HOOKS
    with warnings.catch_warnings(record=True) as caught, config.patch(spec.get("config", {})):
        warnings.simplefilter("always")
        if spec.get("in_region"):
            HOOKS = build_hooks(spec)
            out = torch.compile(model_in_region, backend=spec["backend"], fullgraph=True)(inp, w)
        elif spec["hook"] == "none":  # e.g. config.activation_memory_budget
            out = torch.compile(mlp, backend=spec["backend"])(inp, w)
        elif spec["hook"] == "budget":
            with torch.autograd.graph.saved_tensors_hooks(*build_hooks(spec)):
                out = torch.compile(mlp, backend=spec["backend"])(inp, w)
        else:
            with torch.autograd.graph.saved_tensors_hooks(*build_hooks(spec)):
                out = torch.compile(model, backend=spec["backend"])(inp, w)
        # What the forward left for the backward (the plan's storage): bytes, inputs excluded.
        saved = saved_bytes(out, exclude=(x, inp, w))
        out.sum().backward()
    print(
        json.dumps(
            {
                "aot": dict(counters["aot_autograd"]),
                "inductor": {k: v for k, v in counters["inductor"].items() if "fxgraph" in k},
                "grads": [x.grad.flatten().tolist(), w.grad.flatten().tolist()],
                "saved_bytes": saved,
                "warnings": hook_warnings(caught),
            }
        ),
        flush=True,
    )


def main():
    spec = json.loads(sys.argv[1])
    torch_patches.apply()
    for one in spec.get("runs", [spec]):
        run(one)


def run_in_one_fresh_process(runs, package_root=None):
    """Run the steps ``runs`` ((spec, cache dir) each) one after the other in one fresh
    process: (the finished process, their JSON lines with the gradients as 8x8 tensors, or
    None if it failed).  ``package_root``: a directory holding another ``torch_patches``
    (another release of the patch set), imported instead of this one."""
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    spec = {"runs": [dict(s, cache_dir=d) for s, d in runs]}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), json.dumps(spec)], capture_output=True, text=True, env=env, timeout=900
    )
    if proc.returncode != 0:
        return proc, None
    results = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(runs) :]]
    for result in results:
        result["grads"] = [torch.tensor(g).view(8, 8) for g in result["grads"]]
    return proc, results


if __name__ == "__main__":
    main()
