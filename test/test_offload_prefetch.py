"""CPU offload across graphs compiled apart: reloads that start a graph ahead (issue 48).

Each block compiled on its own, as FSDP2 and torchtitan compile decoder layers, under
``cpu_offload()``:

* the order of the copies (``torch_patches.hooks.offload.copy_log``): the reloads of block
  ``i - 1`` are started while block ``i``'s backward runs, and block ``i - 1``'s own
  ``reload_start`` takes them; only the first block of the backward starts its own;
* ``config.offload_prefetch_graphs`` (0: none ahead; 2: two graphs ahead) and
  ``config.offload_prefetch_bytes``;
* gradients equal to no hooks, bit for bit (the copies are exact);
* steps (100 in the slow tier) that end every way a training loop ends one (an exception in the backward,
  ``retain_graph=True`` and a second backward, gradient accumulation, an eval forward under
  ``no_grad``, activation checkpointing around a compiled block, a backward that stops
  early) hold no more memory at the end than at the start, and leave no copy in flight;
* an HF Llama compiled layer by layer, called as the bench calls it.
"""

from __future__ import annotations

import contextlib
import gc
import unittest
import unittest.mock
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.test_case import run_tests
from torch.utils.checkpoint import checkpoint

import torch_patches.config as tp_config
from torch_patches._functorch._aot_autograd.saved_tensor_records import RECOMPUTED
from torch_patches.hooks import budget, cpu_offload, offload as offload_ops
from torch_patches.testing import CPU_RATES, TestCase, copy_engine_everywhere, instantiate_device_type_tests, saved_tensor_records


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return x + self.down(F.gelu(h) * h.sigmoid())


def blocks(device: str, n: int = 4, dim: int = 16) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Block(dim) for _ in range(n)).to(device)


def run(compiled: list[Any], x: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """The blocks one after the other; the output and each block's backward node."""
    nodes = []
    for block in compiled:
        x = block(x)
        nodes.append(x.grad_fn)
    return x, nodes


def held_bytes(device: str) -> Any:
    """A function giving the bytes allocated on ``device`` since this was called, net of
    frees (CUDA: the caching allocator's allocated bytes against those at the call, which
    count whatever the process held before; CPU: counted from the allocator's events)."""
    if torch.device(device).type == "cuda":

        def allocated() -> int:
            # What is let go at a time of its own, not the step's, is let go first on both
            # sides of the count: cycles (an exception's traceback holds a step's frames) and
            # the sources of finished copies out, which the next offload or reload drops.
            gc.collect()
            offload_ops._release_copied(torch.device(device), keep=0)
            torch.cuda.synchronize(device)
            return torch.cuda.memory_allocated(device)

        start = allocated()
        return lambda: allocated() - start
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()

    def now(stop: bool = False) -> int:
        from torch._C._profiler import _EventType

        prof.__exit__(None, None, None)
        total, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                total += event.extra_fields.alloc_size
            stack.extend(event.children)
        return total

    return now


class TestReloadsAhead(TestCase):
    def compiled(self, model: torch.nn.ModuleList, backend: str) -> list[Any]:
        return [torch.compile(b, backend=backend, fullgraph=True) for b in model]

    def order(self, device: str, backend: str, n: int = 4) -> tuple[list[tuple[str, int, str]], list[torch.Tensor]]:
        """One step under cpu_offload(): the copy log with nodes named by block, and the
        weights' gradients."""
        model = blocks(device, n)
        compiled = self.compiled(model, backend)
        x = torch.randn(8, 16, device=device, requires_grad=True)
        with offload_ops.copy_log() as log:
            with torch.autograd.graph.saved_tensors_hooks(*cpu_offload(pin_memory=False)):
                out, nodes = run(compiled, x)
            out.sum().backward()
        names = {id(node): f"block{i}" for i, node in enumerate(nodes)}
        named = [(event, tensor, names.get(id(node), "forward" if node is None else "other")) for event, tensor, node in log]
        return named, [p.grad for p in model.parameters()]

    def assert_ahead(self, log: list[tuple[str, int, str]], n: int, ahead: int = 1) -> None:
        """Every block's reloads but the last block's are started ahead, by the block
        ``ahead`` places after it at most, and taken and waited for by its own backward."""
        offloaded = [t for event, t, _ in log if event == "offload"]
        self.assertTrue(offloaded)
        # A tensor belongs to the block whose backward waits for it (one wait each).
        waits = [(t, where) for event, t, where in log if event == "wait"]
        self.assertEqual(sorted(t for t, _ in waits), sorted(offloaded))
        block_of = dict(waits)
        self.assertEqual(set(block_of.values()), {f"block{i}" for i in range(n)})
        for event, t, where in log:
            if event == "offload":
                self.assertEqual(where, "forward")
            elif event == "prefetch":
                issued_by = int(where.removeprefix("block"))
                owner = int(block_of[t].removeprefix("block"))
                self.assertIn(issued_by - owner, range(1, ahead + 1), (event, t, where))
            elif event in ("take", "wait"):
                self.assertEqual(where, block_of[t], (event, t, where))
            elif event == "start":  # only the first graph of the backward starts its own
                self.assertEqual(where, f"block{n - 1}", (event, t, where))
        prefetched = {t for event, t, _ in log if event == "prefetch"}
        taken = {t for event, t, _ in log if event == "take"}
        self.assertEqual(prefetched, taken)
        self.assertEqual(prefetched, {t for t in offloaded if block_of[t] != f"block{n - 1}"})
        # Started before the block that needs them begins its backward: every prefetch of a
        # block's tensors comes before that block's first take.
        for t in prefetched:
            first_take = next(i for i, (e, u, _) in enumerate(log) if e == "take" and block_of[u] == block_of[t])
            self.assertLess(next(i for i, (e, u, _) in enumerate(log) if e == "prefetch" and u == t), first_take)

    def test_reloads_start_a_graph_ahead(self, device: str) -> None:
        reference = None
        for backend in ("aot_eager", "inductor"):
            with self.subTest(backend=backend):
                torch._dynamo.reset()
                log, grads = self.order(device, backend)
                self.assert_ahead(log, 4)
                self.assertEqual(len(offload_ops._in_flight), 0)
                if reference is None:  # no hooks, same blocks
                    torch._dynamo.reset()
                    model = blocks(device)
                    out, _ = run(self.compiled(model, backend), torch.randn(8, 16, device=device, requires_grad=True))
                    out.sum().backward()
                    reference = [p.grad for p in model.parameters()]
                self.assertGradsEqual(grads, reference, exact=backend == "aot_eager", atol=1e-6, rtol=1e-5)

    def test_how_far_ahead(self, device: str) -> None:
        with tp_config.patch(offload_prefetch_graphs=0):
            log, _ = self.order(device, "aot_eager")
        self.assertEqual({e for e, _, _ in log}, {"offload", "start", "wait"})
        torch._dynamo.reset()
        with tp_config.patch(offload_prefetch_graphs=2):
            log, _ = self.order(device, "aot_eager")
        self.assert_ahead(log, 4, ahead=2)
        waited_in = {t: w for e, t, w in log if e == "wait"}
        first = [t for e, t, w in log if e == "prefetch" and w == "block3"]
        self.assertEqual({waited_in[t] for t in first}, {"block2", "block1"})
        self.assertEqual(len(first), sum(w in ("block2", "block1") for w in waited_in.values()))
        torch._dynamo.reset()
        # A byte limit below one tensor: each backward starts one reload ahead.
        with tp_config.patch(offload_prefetch_graphs=2, offload_prefetch_bytes=1):
            log, _ = self.order(device, "aot_eager")
        issued = [w for e, _, w in log if e == "prefetch"]
        self.assertEqual(issued, ["block3", "block2", "block1"])

    def test_unusual_endings_hold_nothing(self, device: str) -> None:
        self.check_endings(device, steps=14)  # each ending twice; the slow twin runs 100 steps

    @pytest.mark.slow
    def test_unusual_endings_hold_nothing_100_steps(self, device: str) -> None:
        self.check_endings(device, steps=100)

    @torch._functorch.config.patch(donated_buffer=False)  # retain_graph=True, as stock asks
    def check_endings(self, device: str, steps: int) -> None:
        """``steps`` steps cycling through every way a step ends: the memory held at the end
        is what was held at the start, and no copy is left in flight."""
        model = blocks(device, n=4)
        compiled = self.compiled(model, "aot_eager")
        x = torch.randn(8, 16, device=device)
        params = list(model.parameters())

        def forward(inp: torch.Tensor, checkpointed: bool = False) -> torch.Tensor:
            with torch.autograd.graph.saved_tensors_hooks(*cpu_offload(pin_memory=False)):
                h = inp
                for i, block in enumerate(compiled):
                    if checkpointed and i == 1:
                        h = checkpoint(block, h, use_reentrant=False)
                    else:
                        h = block(h)
            return h

        def plain() -> None:
            forward(x.requires_grad_(False)).sum().backward()

        def raises_midway() -> None:
            # The hook on block 1's output raises after block 2's backward started block 1's
            # reloads: they are left with the graph, which the step then drops.
            with torch.autograd.graph.saved_tensors_hooks(*cpu_offload(pin_memory=False)):
                mid = compiled[1](compiled[0](x))
                mid.register_hook(_raise)
                out = compiled[3](compiled[2](mid))
            with self.assertRaisesRegex(RuntimeError, "boom"):
                out.sum().backward()

        def retained() -> None:
            out = forward(x).sum()
            out.backward(retain_graph=True)
            out.backward()

        def accumulated() -> None:
            for half in x.chunk(2):
                forward(half).sum().backward()

        def evaluated() -> None:
            with torch.no_grad():
                forward(x)

        def checkpointed() -> None:
            forward(x, checkpointed=True).sum().backward()

        def stops_early() -> None:
            with torch.autograd.graph.saved_tensors_hooks(*cpu_offload(pin_memory=False)):
                mid = compiled[1](compiled[0](x.requires_grad_()))
                out = compiled[3](compiled[2](mid))
            # Blocks 3 and 2 run; block 2's backward starts block 1's reloads, which never run.
            (g,) = torch.autograd.grad(out.sum(), mid)
            x.requires_grad_(False)

        endings = [plain, raises_midway, retained, accumulated, evaluated, checkpointed, stops_early]
        for ending in endings:  # compile every variant first
            ending()
        for p in params:
            p.grad = None
        held = held_bytes(device)
        for step in range(steps):
            endings[step % len(endings)]()
            for p in params:
                p.grad = None
            self.assertEqual(len(offload_ops._in_flight), 0, f"step {step}: {endings[step % len(endings)].__name__}")
        self.assertEqual(held(), 0)


def _raise(grad: torch.Tensor) -> None:
    raise RuntimeError("boom")


class TestReloadsAheadLlama(TestCase):
    def test_llama_compiled_per_layer(self, device: str) -> None:
        try:
            from torch_patches.testing.models import causal_lm_loss, decoder_layers, hf_llama
        except ImportError:
            raise unittest.SkipTest("needs transformers") from None
        try:
            lm = hf_llama(vocab=256, dim=64, layers=3, heads=2, seq=32).to(device)
        except ImportError:
            raise unittest.SkipTest("needs transformers") from None
        model = causal_lm_loss(lm)
        layers = decoder_layers(lm)
        for layer in layers:
            layer.compile(backend="aot_eager")
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
        model(ids).backward()
        reference = [p.grad.clone() for p in lm.parameters()]
        lm.zero_grad(set_to_none=True)
        with offload_ops.copy_log() as log:
            with torch.autograd.graph.saved_tensors_hooks(*cpu_offload(pin_memory=False)):
                loss = model(ids)
            loss.backward()
        self.assertGradsEqual([p.grad for p in lm.parameters()], reference, exact=True)
        nodes = [n for e, _, n in log if e == "take"]
        issuers = [n for e, _, n in log if e == "prefetch"]
        # Layers 1 and 0 take what layers 2 and 1 started; layer 2 starts its own.
        self.assertEqual(len({id(n) for n in nodes}), 2)
        self.assertEqual(len({id(n) for n in issuers}), 2)
        self.assertTrue(all(id(n) not in {id(m) for m in nodes[:1]} for n in issuers[:1]))
        self.assertEqual(len(offload_ops._in_flight), 0)


#: The machine :class:`TestBudgetPricesReloadsAhead` prices on, whatever the device (the
#: cost model's knobs; CPU's compute defaults): a block's forward (0.27 GFLOP) takes about
#: 1.3 ms, one of its 1 MiB saved tensors about 0.5 ms each way on the link.
MACHINE = dict(CPU_RATES, activation_budget_host_bandwidth=2.0)


class TestBudgetPricesReloadsAhead(TestCase):
    """Each block compiled on its own under ``budget(0.3)``, on a device with a copy engine,
    a copy link slow enough that a block's copies do not hide behind its own compute but
    do behind its neighbours' (its reloads start a graph ahead), and no margin for a faster
    lossy plan: the plan offloads (exact) with the copies hidden, and says so; without
    reloads ahead it compresses.

    The cost model's machine is set whole (:data:`MACHINE`), not left to the device type's
    defaults: the copy link's speed only means something against the compute's, and at the
    CUDA defaults (400 TFLOP/s) a block this size computes in microseconds, which hide no
    copy on a 2 GB/s link, so recomputing is rightly the cheaper exact choice there."""

    def plans(self, device: str, graphs: int) -> tuple[list[Any], list[torch.Tensor]]:
        model = blocks(device, n=3, dim=256)
        compiled = self.compiled_blocks(model)
        x = torch.randn(512, 256, device=device, requires_grad=True)
        knobs = dict(MACHINE, offload_prefetch_graphs=graphs, activation_budget_lossy_margin=0.0)
        with copy_engine_everywhere(), tp_config.patch(**knobs), saved_tensor_records() as found:
            with torch.autograd.graph.saved_tensors_hooks(*budget(0.3)):
                out, _ = run(compiled, x * 1)  # every block's input comes from autograd
            out.sum().backward()
        return [p for c in found for p in c.plans], [p.grad for p in model.parameters()]

    def compiled_blocks(self, model: torch.nn.ModuleList) -> list[Any]:
        return [torch.compile(b, backend="aot_eager") for b in model]

    def test_offload_hidden_by_neighbours_wins_over_lossy(self, device: str) -> None:
        (ahead,), grads = self.plans(device, graphs=1)
        self.assertTrue(ahead.met)
        self.assertEqual(ahead.bounded_at, "forward_end")
        options = set(ahead.options().values())
        self.assertEqual(options - {"keep"}, {"offload"})
        self.assertGreater(ahead.copy_ms, 0)
        self.assertEqual(ahead.copy_exposed_ms, 0)
        # The backward holds the next graph's reloads: as many bytes as this one reloads.
        offloaded = sum(u.device_bytes == 0 and u.option == "offload" for u in ahead.units)
        self.assertGreater(offloaded, 0)
        self.assertEqual(ahead.ahead_bytes, sum(b for b in self.offloaded_bytes(ahead)))
        self.assertIn("hidden by compute, 0.000 ms exposed", ahead.copies())
        torch._dynamo.reset()
        model = blocks(device, n=3, dim=256)
        out, _ = run(self.compiled_blocks(model), torch.randn(512, 256, device=device, requires_grad=True) * 1)
        out.sum().backward()
        self.assertGradsEqual(grads, [p.grad for p in model.parameters()], atol=1e-5, rtol=1e-5)
        torch._dynamo.reset()
        (alone,), _ = self.plans(device, graphs=0)
        self.assertTrue(alone.met)
        self.assertEqual(alone.ahead_bytes, 0)
        self.assertTrue({"int8", "fp8", "fp8+offload", "bf16"} & set(alone.options().values()), alone.options())

    def offloaded_bytes(self, plan: Any) -> list[int]:
        """The full bytes of the storages ``plan`` offloads (their records' sizes)."""
        return [u.copy_bytes for u in plan.units if u.option == "offload"]

    def test_report_shows_the_copies(self, device: str) -> None:
        import torch_patches

        model = blocks(device, n=3, dim=256)
        compiled = self.compiled_blocks(model)
        x = torch.randn(512, 256, device=device, requires_grad=True)

        def step() -> None:
            run(compiled, x * 1)[0].sum().backward()

        knobs = dict(MACHINE, activation_budget_lossy_margin=0.0)
        with copy_engine_everywhere(), tp_config.patch(**knobs):
            report = torch_patches.report(step, budget=0.3)
        table = report.table()
        self.assertIn("budget plans, per graph:", table)
        self.assertRegex(
            table, r"offload copies [0-9.]+ ms: [0-9.]+ ms hidden by compute, 0\.000 ms exposed; \d+ B of the next graph's reloads"
        )


class TestLossInThePlan(TestCase):
    """The logits and their log-softmax, the largest saved tensors of a causal LM step, are
    planned like any other: offload (exact) where the device has a copy engine, and, with
    the head in the same graph, recompute from the last hidden state."""

    def llama(self, device: str) -> tuple[Any, Any, torch.Tensor]:
        try:
            from torch_patches.testing.models import causal_lm_loss, hf_llama

            lm = hf_llama(vocab=2048, dim=64, layers=2, heads=2, seq=64).to(device)
        except ImportError:
            raise unittest.SkipTest("needs transformers") from None
        ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
        return lm, causal_lm_loss(lm), ids

    def plans(self, step: Any, copy_engine: bool = True, options: Any = None) -> list[Any]:
        with copy_engine_everywhere() if copy_engine else contextlib.nullcontext(), saved_tensor_records() as found:
            with torch.autograd.graph.saved_tensors_hooks(*budget(0.3, options)):
                loss = step()
            loss.backward()
        return found

    def test_loss_compiled_on_its_own(self, device: str) -> None:
        # torchtitan's shape: the layers compiled apart, the loss compiled on its own.
        from torch_patches.testing.models import compile_per_layer

        lm, model, ids = self.llama(device)
        compile_per_layer(lm, backend="aot_eager", loss=True)
        found = self.plans(lambda: model(ids))
        logits = [
            (c, p)
            for c in found
            for p in c.plans
            if any(r.shape[-1] == 2048 and r.nbytes >= 2 * 64 * 2048 * 4 for r in c.records if r.name in p.options())
        ]
        self.assertEqual(len(logits), 1, "one graph saves the logits: the loss's")
        compiled, plan = logits[0]
        big = max((r for r in compiled.records if r.name in plan.options()), key=lambda r: r.nbytes)
        self.assertEqual(plan.options()[big.name], "offload")
        self.assertEqual(big.option, "offload")
        self.assertEqual(plan.bounded_at, "forward_end")  # its input, the logits, came from autograd

    @pytest.mark.slow
    def test_head_and_loss_in_one_graph(self, device: str) -> None:
        # Offload where the device has a copy engine.  With recomputation the only option
        # (no copy engine), the plan's floor keeps the log-softmax (rebuilding it at the
        # loss's backward, where the step peaks, holds the logits beside it) and misses the
        # budget; the partitioner's knapsack meets it, within the prediction's margin of
        # the floor's peak, and is taken: the logits are recomputed by the partitioner.
        for copy_engine in (True, False):
            with self.subTest(copy_engine=copy_engine):
                torch._dynamo.reset()
                lm, model, ids = self.llama(device)
                compiled_model = torch.compile(model, backend="aot_eager")
                options = None if copy_engine else ("recompute",)
                (compiled,) = self.plans(lambda: compiled_model(ids), copy_engine, options)
                (plan,) = compiled.plans
                # Under aot_eager the loss saves the log-softmax of the logits (module "lm":
                # the model's forward computes the loss); Inductor's decomposition, the logits.
                logits = max(compiled.records, key=lambda r: r.nbytes)
                self.assertEqual(logits.shape[-1], 2048)
                self.assertIn(logits.module, ("lm", "lm.lm_head"))
                if copy_engine:
                    unit = next(u for u in plan.units if logits.name in u.saved)
                    self.assertEqual(unit.option, "offload")
                else:
                    self.assertEqual((logits.decision, logits.decided_by), (RECOMPUTED, "partitioner"))
                    self.assertIn("knapsack", logits.reason)


instantiate_device_type_tests(TestReloadsAhead, globals())
instantiate_device_type_tests(TestLossInThePlan, globals())
instantiate_device_type_tests(TestBudgetPricesReloadsAhead, globals())
instantiate_device_type_tests(TestReloadsAheadLlama, globals())


if __name__ == "__main__":
    run_tests()
