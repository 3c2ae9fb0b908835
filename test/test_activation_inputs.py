"""Activations that enter a compiled graph as inputs are hooked where packing frees them.

Under per-block compilation (FSDP2), DDP's graph splits and graph breaks, a graph's input
activation (and the views of it a ``linear`` saves) used to be filtered out as a graph input
and kept in full precision. Now they are packed when they are non-leaf activations, not
parameters/buffers, not mutated, not aliased by an output, and every saved tensor sharing
their storage is packed too (``torch_patches/_functorch/_aot_autograd/activation_inputs.py``).
The distributed tests run two gloo ranks on CPU (test/dist_worker.py).
"""

import json
import os
import subprocess
import sys
import unittest

import pytest
import torch
import torch.nn as nn
from torch._dynamo.test_case import run_tests

from torch_patches import config as tp_config
from torch_patches._functorch._aot_autograd.activation_inputs import partially_hooked, storage_root
from torch_patches.hooks import bf16
from torch_patches.testing import (
    AotEagerAndRecordGraphs,
    TestCase,
    hook_nodes,
    instantiate_device_type_tests,
)


class Block(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class TestActivationInputs(TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def compile_block(self, device, x, hooks, fn=None):
        """One step of ``fn`` (a Block by default) compiled alone: the names of the saved
        tensors it packed, each with the graph input it reads (None if none), and the
        forward graph's placeholders with their shapes."""
        fn = fn or Block().to(device)
        rec = AotEagerAndRecordGraphs()
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = torch.compile(fn, backend=rec, fullgraph=True)(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().pow(2).sum().backward()
        fw = rec.fw_graphs[0]
        nodes = {n.name: n for n in fw.graph.nodes}
        placeholders = {n.name: tuple(n.meta["val"].shape) for n in fw.graph.find_nodes(op="placeholder")}
        hooked = {}
        for meta in hook_nodes(fw).values():
            root = storage_root(nodes[meta["saved"]]) if meta["saved"] in nodes else None
            hooked[meta["saved"]] = root.name if root is not None and root.op == "placeholder" else None
        return hooked, placeholders

    def activation(self, device, shape=(4, 32, 64)):
        base = torch.randn(shape, device=device, requires_grad=True)
        return base * 1.0  # non-leaf, as a previous block's output

    def test_non_leaf_input_is_packed_parameters_are_not(self, device):
        x = self.activation(device)
        hooked, placeholders = self.compile_block(device, x, bf16())
        # Dynamo orders inputs differently across releases: find x by its shape.
        (x_name,) = [name for name, shape in placeholders.items() if shape == tuple(x.shape)]
        self.assertIn(x_name, hooked.values(), hooked)
        self.assertEqual(set(hooked.values()) - {None}, {x_name}, hooked)  # no parameter
        torch._dynamo.reset()
        with tp_config.patch(hook_activation_inputs=False):
            before, _ = self.compile_block(device, self.activation(device), bf16())
        self.assertEqual(set(before.values()), {None}, before)
        self.assertLess(set(before), set(hooked))

    def test_what_is_not_packed(self, device):
        def saves_input(x):
            return (x * x).sum(-1)

        def returns_view(x):
            return (x * x).sum(-1), x.view(-1)

        def mutates(x):
            x.mul_(2)  # after a save, eager itself would refuse the backward
            return (x * x).sum(-1)

        cases = {
            "leaf": (saves_input, torch.randn(8, 64, device=device, requires_grad=True)),
            "aliased by an output": (returns_view, self.activation(device, (8, 64))),
            "mutated": (mutates, self.activation(device, (8, 64))),
            "knob off": (saves_input, self.activation(device, (8, 64))),
        }
        for name, (fn, x) in cases.items():
            with self.subTest(name):
                torch._dynamo.reset()
                with tp_config.patch(hook_activation_inputs=name != "knob off"):
                    hooked, _ = self.compile_block(device, x, bf16(where=None), fn=fn)
                self.assertEqual(hooked, {}, name)
        torch._dynamo.reset()
        hooked, placeholders = self.compile_block(device, self.activation(device, (8, 64)), bf16(where=None), fn=saves_input)
        (x_name,) = placeholders
        self.assertEqual(hooked, {x_name: x_name})

    def test_partly_hooked_storage_is_left_alone(self, device):
        # The partitioner saves a graph input and recomputes its views, so a graph that
        # saves both is built by hand: x saved as itself and as a view, the view refused.
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        v = graph.call_function(torch.ops.aten.view.default, (x, [-1]))
        y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        graph.output((y, x, v))
        why = partially_hooked([x, v], hooked=[x], inputs={x: None})
        self.assertEqual(list(why), [x])
        self.assertRegex(why[x], r"shares graph input x's storage with view\w*, which stays unhooked")
        self.assertEqual(partially_hooked([x, v], hooked=[x, v], inputs={x: None}), {})
        # Not an activation input (a leaf, say): upstream's rule, nothing to say here.
        self.assertEqual(partially_hooked([x, v], hooked=[x], inputs={x: "a leaf"}), {})

    def test_gradients_match_eager_hooks(self, device):
        # Three blocks compiled one by one: each block's input is the previous one's output.
        blocks = [Block().to(device) for _ in range(3)]
        compiled = [torch.compile(b, backend="aot_eager") for b in blocks]
        base = torch.randn(4, 32, 64, device=device, requires_grad=True)

        def step(bs):
            for b in blocks:
                b.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(*bf16(where=None)):
                h = base * 1.0
                for b in bs:
                    h = b(h)
                h.pow(2).mean().backward()
            return [p.grad.clone() for b in blocks for p in b.parameters()]

        eager, ours = step(blocks), step(compiled)
        for e, o in zip(eager, ours):
            self.assertEqual(o, e, atol=1e-4, rtol=1e-3)


WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def _distributed_available():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    return None


@pytest.mark.slow
@unittest.skipIf(_distributed_available() is not None, str(_distributed_available()))
class TestDistributed(TestCase):
    """FSDP2 per-block compile and DDP + compile on 2 gloo ranks, bf16() hooks."""

    def run_worker(self, mode, backend):
        proc = subprocess.run(
            [sys.executable, WORKER, json.dumps({"mode": mode, "backend": backend})],
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def check(self, mode, backend):
        ranks = self.run_worker(mode, backend)

        def err(run, ref):
            got, want = ranks[0][run]["grads"], ranks[0][ref]["grads"]
            return max(((torch.tensor(g) - torch.tensor(w)).norm() / torch.tensor(w).norm()).item() for g, w in zip(got, want))

        # The harness: the distributed eager step is the single-process one.
        self.assertLess(err("eager", "reference_eager"), 1e-5)
        self.assertLess(err("nohooks", "reference_nohooks"), 1e-5)
        # Compiled gradients are as close to no hooks as eager hooks' are (or closer: the
        # compiled graphs never pack parameters).
        self.assertLessEqual(err("compiled", "reference_nohooks"), 1.5 * err("eager", "reference_nohooks"))
        for rank in ranks:
            alive = {run: rank[run]["alive"] for run in ("nohooks", "eager", "compiled", "compiled_noinputs")}
            self.assertLessEqual(alive["compiled"], 1.05 * alive["eager"], alive)
            self.assertLess(alive["compiled"], alive["compiled_noinputs"], (alive, rank["compiled"]["inputs"]))
            self.assertLess(alive["eager"], 0.75 * alive["nohooks"], alive)
        return ranks

    def test_fsdp2_per_block_compile_aot_eager(self):
        self.check("fsdp", "aot_eager")

    def test_fsdp2_per_block_compile_inductor(self):
        self.check("fsdp", "inductor")

    def test_ddp_graph_split_aot_eager(self):
        ranks = self.check("ddp", "aot_eager")
        self.assertGreaterEqual(ranks[0]["compiled"]["graphs"], 2)  # DDP split the graph


instantiate_device_type_tests(TestActivationInputs, globals())


if __name__ == "__main__":
    run_tests()
