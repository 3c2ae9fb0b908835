"""Backends that record the AOT graphs they compile, and the stable text of those graphs.

* :class:`AotEagerAndRecordGraphs` / :class:`InductorAndRecordGraphs` are backends that
  record the AOT forward and backward graphs (after hook inlining) on the aot_eager and
  inductor paths, with the AOT inputs named by the Dynamo input they stand for.
* :func:`graph_caches_off` compiles every graph again (for tests that read what a compile
  does), with the kernels' own cache left on.
* :func:`normalize_graph` turns a graph into stable text (comments, file paths and device
  indices removed; ``# pack(x)`` / ``# unpack(x)`` marks on the nodes the inliner
  inserted): the tests' goldens (``torch_patches.testing._internal.common_saved_tensors_hooks``) and what
  ``python -m torch_patches demo`` prints.

Nothing here needs more than torch: the demo runs it with only the base install, without
the test-only packages the test harness needs (``expecttest`` through
``torch._dynamo.test_case``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo.testing
import torch.fx as fx

# ------------------------------------------------------------------ graph capture


class AotEagerAndRecordGraphs:
    """aot_eager backend that records the Dynamo graph and the AOT fw/bw graphs.

    It is ``backend="aot_eager"`` itself (min-cut partitioner, inference input mutations
    kept) with recording compilers, so goldens show what users of that backend run.
    """

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.fw_graphs: list[fx.GraphModule] = []
        self.bw_graphs: list[fx.GraphModule] = []
        #: Per forward graph, AOTAutograd's ``bw_donated_idxs`` (the saved tensors the
        #: backward may reuse), from the compilation's ``ViewAndMutationMeta``.
        self.bw_donated_idxs: list[list[int] | None] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.debugging import aot_eager
        from torch._guards import TracingContext

        self.graphs.append(gm)
        roles = _RoleNamer(gm)

        def fw_compiler(g: fx.GraphModule, _: Any) -> Callable[..., Any]:
            context = TracingContext.try_get()
            meta = getattr(context, "fw_metadata", None)
            donated = getattr(meta, "bw_donated_idxs", None)
            self.bw_donated_idxs.append(None if donated is None else list(donated))
            self.fw_graphs.append(roles.mark(g, backward=False))
            return make_boxed_func(g.forward)

        def bw_compiler(g: fx.GraphModule, _: Any) -> Callable[..., Any]:
            self.bw_graphs.append(roles.mark(g, backward=True))
            return make_boxed_func(g.forward)

        return aot_eager(gm, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler)


class InductorAndRecordGraphs:
    """inductor backend that records the AOT fw/bw graphs Inductor is given.

    ``fw_graphs``/``bw_graphs`` hold copies taken before Inductor's own passes run. The
    graph caches are off while it compiles (:func:`graph_caches_off`): a hit would skip the
    graphs it records.

    ``kernels=False``, for a test that reads the graphs and not what Inductor makes of them:
    everything up to them is Inductor's path (its decompositions and partitioner, the
    inliner), then each graph runs as it is, without Inductor's passes, lowering and kernels
    (on a CPU, each kernel is a build of the C++ compiler, about half a second).
    """

    def __init__(self, *, kernels: bool = True) -> None:
        self.kernels = kernels
        self.graphs: list[fx.GraphModule] = []
        self.fw_graphs: list[fx.GraphModule] = []
        self.bw_graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from functorch.compile import make_boxed_func
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        self.graphs.append(gm)
        roles = _RoleNamer(gm)

        def inner_compile(g: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
            backward = bool(kwargs.get("is_backward"))
            copy = roles.mark(fx.GraphModule(g, _copy_graph(g.graph)), backward=backward)
            (self.bw_graphs if backward else self.fw_graphs).append(copy)
            if not self.kernels:
                return make_boxed_func(g.forward)
            return compile_fx_inner(g, inputs, **kwargs)

        # A cache hit would skip inner_compile and record nothing.
        with graph_caches_off():
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)


@contextlib.contextmanager
def graph_caches_off() -> Iterator[None]:
    """Compile every graph again: AOTAutograd's cache and Inductor's FX graph cache off, so
    that a test sees the partitioner, the inliner, the planner and Inductor's passes run
    (a hit, warm from an earlier test or run, skips them all). Inductor's kernel cache stays
    on: a kernel built before, by the same source and flags, is loaded rather than built
    again, which changes nothing a test reads (``force_disable_caches`` would compile every
    kernel afresh in a new directory, a second of the C++ compiler each)."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


#: ``gm.meta`` key of the recorders: {"names": primals name -> role, "order": roles in the
#: forward's primals order, "backward": bool}.
ROLES_META = "saved_tensors_hooks_primal_roles"


class _RoleNamer:
    """Names the AOT graphs' ``primals_N`` by the Dynamo input they stand for (``x``, ``w``).

    Dynamo orders graph inputs differently across torch releases (2.15 puts some before
    others), which renumbers ``primals_N`` and reorders the backward's gradients; named by
    role, one golden text serves every release.
    """

    def __init__(self, dynamo_gm: fx.GraphModule) -> None:
        self.inputs = [re.sub(r"^l_|_$", "", n.name) for n in dynamo_gm.graph.find_nodes(op="placeholder")]
        self.roles: dict[str, Any] | None = None

    def mark(self, g: fx.GraphModule, *, backward: bool) -> fx.GraphModule:
        if not backward:
            names: dict[str, str] = {}
            order: list[str] = []
            for node in g.graph.find_nodes(op="placeholder"):
                idx = getattr(node.meta.get("desc"), "idx", None)
                if not node.name.startswith("primals_") or not isinstance(idx, int) or idx >= len(self.inputs):
                    names = {}
                    break  # not a plain graph input (tokens, subclass parts): keep numbers
                names[node.name] = self.inputs[idx]
                order.append(self.inputs[idx])
            if len(set(names.values())) != len(names):
                names = {}
            self.roles = {"names": names, "order": order if names else []}
        if self.roles is not None and self.roles["names"]:
            g.meta[ROLES_META] = {**self.roles, "backward": backward}
        return g


def _split_params(params: str) -> list[str]:
    return re.findall(r'\w+(?:: "[^"]*")?', params)


def _name_primals(text: str, names: dict[str, str]) -> str:
    # Also inside names derived from a primal (``primals_3_packed``).
    return re.sub(r"(?<![\w])primals_\d+(?![0-9])", lambda m: f"primals_{names[m.group(0)]}" if m.group(0) in names else m.group(0), text)


def name_primals_by_role(text: str, gm: fx.GraphModule) -> str:
    """``primals_N`` in ``text`` (a record's name, a log line) named as :func:`normalize_graph`
    names them in ``gm``, a graph a recording backend kept: ``primals_w`` on every release."""
    roles = gm.meta.get(ROLES_META)
    return _name_primals(text, roles["names"]) if roles else text


def _apply_roles(text: str, roles: dict[str, Any]) -> str:
    text = _name_primals(text, roles["names"])
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(\s*def forward\(self, )(.*)(\):)$", line)
        if m:
            params = _split_params(m.group(2))
            slots = [j for j, p in enumerate(params) if p.startswith("primals_")]
            ordered = sorted((params[j] for j in slots), key=lambda p: p.split(":")[0])
            for j, p in zip(slots, ordered):
                params[j] = p
            lines[i] = f"{m.group(1)}{', '.join(params)}{m.group(3)}"
    order: list[str] = roles["order"]
    if roles["backward"] and order:
        for i in range(len(lines) - 1, -1, -1):
            m = re.match(r"(\s*return \()(.*)(\))$", lines[i])
            if m:
                outs = [o.strip() for o in m.group(2).split(",") if o.strip()]
                if len(outs) == len(order):  # one gradient per forward input
                    by_role = dict(zip(order, outs))
                    lines[i] = f"{m.group(1)}{', '.join(by_role[r] for r in sorted(order))}{m.group(3)}"
                break
    return "\n".join(lines)


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for old, copied in env.items():
        copied.meta = dict(old.meta)
    return new


# ---------------------------------------------------------------- normalisation

_DEVICE_RE = re.compile(r"device\(type='(cpu|cuda)'(, index=\d+)?\)")
_DEVICE_STR_RE = re.compile(r"device = '(cpu|cuda)(:\d+)?'")


def hook_nodes(gm: fx.GraphModule) -> dict[str, dict[str, str]]:
    """name -> {"role", "saved", "hook"} for every node an inliner inserted."""
    from torch_patches._functorch._aot_autograd.graph_surgery import HOOK_META

    return {n.name: n.meta[HOOK_META] for n in gm.graph.nodes if HOOK_META in n.meta}


def normalize_graph(gm: fx.GraphModule, *, mark_hooks: bool = True) -> str:
    """Stable text of a graph module for goldens.

    Comments and blank lines (file paths, stack traces) are dropped, device types and indices are
    replaced by ``DEVICE``, and with ``mark_hooks`` every node the inliner inserted ends
    with ``# pack(saved)`` / ``# unpack(saved)``.
    """
    text = torch._dynamo.testing.normalize_gm(gm.print_readable(print_output=False))
    # Blank lines separate nodes with different stack traces: noise for goldens.
    text = "\n".join(line for line in text.splitlines() if line.strip())
    text = _DEVICE_RE.sub("device(type='DEVICE')", text)
    text = _DEVICE_STR_RE.sub("device = 'DEVICE'", text)
    if mark_hooks:
        marks = hook_nodes(gm)
        lines = []
        for line in text.splitlines():
            m = re.match(r"\s+(\w+)(?::| =)", line)
            if m and m.group(1) in marks:
                info = marks[m.group(1)]
                line = f"{line}  # {info['role']}({info['saved']})"
                if info["hook"] != "ambient":  # in-graph scope: say which
                    line += " " + info["hook"].removeprefix("saved_tensors_hooks_")
            lines.append(line)
        text = "\n".join(lines)
    roles = gm.meta.get(ROLES_META)
    if roles is not None:  # an AOT graph from our recorders: names independent of release
        text = _apply_roles(text, roles)
        if roles["backward"]:
            text = _renumber(text)
    return text


_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?!\w)")


def _renumber(text: str) -> str:
    """Number a backward graph's nodes per name stem in definition order (``mul``,
    ``mul_1``...): upstream numbers the nodes it creates there differently across releases.
    Inputs keep their names (the forward's saved names), comments are left alone."""
    defined = re.findall(r'^\s+(\w+)(?::\s*"[^"]*")?\s*=\s', text, flags=re.M)
    signature = text.split("\n", 2)[1] if "\n" in text else ""
    inputs = set(re.findall(r"\w+(?=:)", signature))  # kept: the forward's saved names
    counts: dict[str, int] = {}
    mapping: dict[str, str] = {}
    for name in dict.fromkeys(defined):
        stem = re.sub(r"_\d+$", "", name)
        n = counts.get(stem, 0)
        while (new := stem if n == 0 else f"{stem}_{n}") in inputs:
            n += 1
        counts[stem] = n + 1
        mapping[name] = new

    def rename(line: str) -> str:
        code, sep, comment = line.partition("  # ")
        return _NAME.sub(lambda m: mapping.get(m.group(0), m.group(0)), code) + sep + comment

    return "\n".join(rename(line) for line in text.splitlines())
