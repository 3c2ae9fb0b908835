"""A boxed backward's incoming gradients in Inductor's peak-memory model
(``torch_patches/_inductor/utils.py``).

From torch 2.13 autograd hands a compiled backward its gradients in a list the backward
empties, and Inductor's code frees each after its last reader: Inductor's peak-memory model
(``reorder_for_peak_memory``) counts them so.  (An FX graph cache entry of a backward compiled
that way is never served to a process that counts them otherwise: test_compile_cache.py.)
"""

from __future__ import annotations

import types
import unittest
from unittest import mock

import torch
from torch._dynamo.test_case import run_tests

import torch_patches
from torch_patches._functorch._aot_autograd.utils import incoming_gradients_boxed
from torch_patches.testing import TestCase, graph_caches_off, instantiate_device_type_tests

BOXED = incoming_gradients_boxed()


class TestIncomingGradientsFreed(TestCase):
    def test_only_a_top_level_backwards_incoming_gradients(self) -> None:
        from torch._inductor import utils
        from torch._inductor.virtualized import V

        def nonfreeable(dep: str, **graph: object) -> bool:
            with V.set_graph_handler(types.SimpleNamespace(**{"name": None, "is_backward": True, **graph})):
                return utils.is_nonfreeable_buffers(types.SimpleNamespace(name=dep))

        # Before torch 2.13 autograd holds the gradients until the backward returns: as upstream.
        self.assertEqual(nonfreeable("tangents_1"), not BOXED)
        self.assertTrue(nonfreeable("primals_1"))  # parameters and inputs the caller holds
        self.assertTrue(nonfreeable("arg0_1"))
        self.assertFalse(nonfreeable("buf0"))
        self.assertTrue(nonfreeable("tangents_1", is_backward=False))
        self.assertTrue(nonfreeable("subgraph_0_tangents_1", name="subgraph_0"))  # its parent holds it
        torch_patches.unapply()
        self.assertTrue(nonfreeable("tangents_1"))


@unittest.skipUnless(BOXED, "autograd boxes a compiled backward's gradients from torch 2.13")
class TestReorderCountsThemFreed(TestCase):
    def test_the_backwards_model_frees_its_incoming_gradient(self, device: str) -> None:
        from torch._inductor import memory

        seen: list[tuple[bool, list[str]]] = []
        original = memory.get_freeable_input_buf

        def record(nodes, graph_inputs):  # noqa: ANN001, ANN202 - Inductor's signature
            from torch._inductor.virtualized import V

            found = original(nodes, graph_inputs)
            seen.append((V.graph.is_backward, sorted(found)))
            return found

        x = torch.randn(64, 32, device=device, requires_grad=True)
        w = torch.randn(32, 128, device=device, requires_grad=True)
        fn = torch.compile(lambda x, w: torch.relu(x @ w) * 2, backend="inductor")
        with graph_caches_off(), mock.patch.object(memory, "get_freeable_input_buf", record):
            fn(x, w).backward(torch.ones(64, 128, device=device))
        backward = [names for is_backward, names in seen if is_backward]
        forward = [names for is_backward, names in seen if not is_backward]
        self.assertTrue(backward and any(n.startswith("tangents") for n in backward[0]), seen)
        self.assertTrue(forward and not any(n.startswith(("primals", "tangents")) for n in forward[0]), seen)


instantiate_device_type_tests(TestReorderCountsThemFreed, globals())

if __name__ == "__main__":
    run_tests()
