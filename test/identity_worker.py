"""Training steps with identity kinds' hooks, in a fresh process (cache claims).

    python test/identity_worker.py '{"kind": "module_attr", "value": 2.0}'
    python test/identity_worker.py '{"runs": [{"kind": "closure", "value": 1.0, "cache_dir": "D1"}, ...]}'

For each run: sets the kind's hidden dependency to ``value`` (test/identity_deps.py), runs
one Inductor step with the hooks (Dynamo reset, counters cleared, compile caches in the
run's ``cache_dir`` where given), and prints one JSON line: AOTAutograd cache counters and
gradients. Runs in one process share only what the C++ compiler built (the kernels of
``fn``); each run's graphs are looked up in, and saved to, its own cache directory.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import identity_deps  # noqa: E402
import torch  # noqa: E402

# upstream: not exported
import torch_patches  # noqa: E402


def fn(x):
    return x.sin().exp().cos()


def run(spec):
    from torch._dynamo.utils import counters

    if "cache_dir" in spec:  # read by Inductor's and AOTAutograd's caches at each lookup
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = spec["cache_dir"]
    torch._dynamo.reset()
    counters.clear()
    kind = identity_deps.KINDS[spec["kind"]]
    identity_deps.set_all(1.0)
    kind.set(spec["value"])
    x = torch.linspace(-1, 1, 32).view(4, 8).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(*kind.hooks()):
        torch.compile(fn, backend=spec.get("backend", "inductor"))(x).sum().backward()
    print(json.dumps({"aot": dict(counters["aot_autograd"]), "grad": x.grad.flatten().tolist()}), flush=True)


def main():
    spec = json.loads(sys.argv[1])
    # upstream: not exported
    torch_patches.apply()
    torch._functorch.config.saved_tensors_hooks_filtering_mode = "all"
    for one in spec.get("runs", [spec]):
        run(one)


if __name__ == "__main__":
    main()
