"""Saved activation inputs donated to the backward that computes their gradient.

A graph compiled apart from the one before it (torchtitan's loss compiled apart from the
model, each decoder layer compiled on its own) takes an activation as an input, saves it,
and its backward computes that input's gradient, a tensor of the same size.  Stock Inductor
never writes into a graph input (upstream's donated buffers, ``bw_donated_idxs``, are only
saved *intermediates*), so the input and its gradient are held at once: for the loss compiled
apart at a 64k vocabulary, the logits and their gradient are that call's peak (two tokens x
vocabulary tensors where one would do).

The caller usually drops its own reference before the backward (torchtitan's loop deletes
the logits once the loss is made), but only the runtime knows.  So the rewrite is in two
halves, one per graph:

* forward: the saved tensor is ``saved_tensors_hooks::save_apart(x)``, a tensor of its own
  over ``x``'s storage (``detach``: its version counter shared), so that what autograd saves
  is not the caller's tensor object;
* backward: it is read through ``saved_tensors_hooks::owned_or_copy(x)``, which returns ``x``
  itself where nothing but this saved tensor holds the storage and autograd will not run
  this backward again (``retain_graph`` / ``create_graph`` off), and a copy otherwise.

To Inductor the second op's output is an intermediate like any other: where the kernel that
computes the gradient reads it for the last time it writes the gradient over it in place
(its buffer reuse).  When the caller still holds the input (HF returns the logits) the copy
takes the gradient instead: the memory is stock's, at the cost of one copy.

Only under an activation-memory budget (a plan of ours decided the graph's saved tensors)
and ``config.donate_activation_inputs``; never under CUDA graphs (their pools own the
storage).  Which saved inputs qualify is :func:`donatable` (compile time, pure fx); the per
call cost is one storage use count and one autograd query.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx

from torch_patches import config
from torch_patches._functorch._aot_autograd import activation_inputs as act_inputs
from torch_patches._functorch._aot_autograd.utils import graph_outputs, nbytes_of

__all__ = ["describe", "donatable", "donate", "owned_or_copy", "save_apart"]

UPSTREAM_MODULE = "torch._functorch._aot_autograd.donated_inputs"

# ``save_apart`` returns an alias of its input and says so.  ``owned_or_copy`` does not, on
# purpose: to Inductor its output is a buffer of its own, which it may write over in place
# (``torch.library.custom_op``, whose outputs must never alias inputs, cannot declare it).
# AOTAutograd checks custom ops' aliasing at a compiled graph's first forward call only.
# Both are opaque to Inductor (fallback kernels); they are registered at the module's end
# (:func:`_register`), once ``owned_or_copy``'s kernel is defined.
_lib = torch.library.Library("saved_tensors_hooks", "FRAGMENT")


def _apart(x: torch.Tensor) -> torch.Tensor:
    """A tensor of its own over ``x``'s storage, sharing its version counter (autograd still
    sees the caller's in-place changes) but not a view (no reference to ``x``): ``detach``,
    whose ``ADInplaceOrView`` kernel shares the counter; that key is put back for it, since a
    kernel runs below it (a dispatch mode, such as AOTAutograd's check of a graph's first
    call, runs it with the key excluded)."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        return x.detach()


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)


def _register(lib: torch.library.Library) -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    """Define both ops in ``lib`` with their kernels and fake kernels; the two overloads."""
    lib.define("save_apart(Tensor(a) x) -> Tensor(a)")
    lib.define("owned_or_copy(Tensor x) -> Tensor")
    lib.impl("save_apart", _apart, "CompositeExplicitAutograd")
    lib.impl("owned_or_copy", _owned_or_copy, "CompositeExplicitAutograd")
    torch.library.register_fake("saved_tensors_hooks::save_apart", torch.ops.aten.alias.default, lib=lib)
    torch.library.register_fake("saved_tensors_hooks::owned_or_copy", _like, lib=lib)
    ops = torch.ops.saved_tensors_hooks
    return ops.save_apart.default, ops.owned_or_copy.default


def _under_cudagraphs() -> bool:
    try:
        from torch._inductor import config as inductor_config

        return bool(inductor_config.triton.cudagraphs)
    except (ImportError, AttributeError):  # pragma: no cover - Inductor always has it
        return False


def donatable(
    fw_g: fx.Graph,
    bw_g: fx.Graph,
    saved: Sequence[fx.Node],
    bw_inputs: Mapping[str, fx.Node],
    inputs: Mapping[fx.Node, str | None],
) -> dict[fx.Node, fx.Node]:
    """Saved tensor (a forward placeholder) -> its backward input, for each saved graph input
    the backward may write its gradient over: an activation (``inputs[ph] is None``:
    :func:`.activation_inputs.activation_inputs`), saved itself and once (no other saved
    tensor shares its storage), whose gradient the backward returns with its dtype and size.
    Empty where ``config.donate_activation_inputs`` is off or CUDA graphs are on."""
    if not config.donate_activation_inputs or _under_cudagraphs():
        return {}
    placeholders = fw_g.find_nodes(op="placeholder")
    grads = list(graph_outputs(bw_g))
    if len(grads) != len(placeholders):
        return {}
    roots: dict[fx.Node, int] = {}
    for s in saved:
        root = act_inputs.storage_root(s)
        roots[root] = roots.get(root, 0) + 1
    out = {}
    for s in saved:
        if s.op != "placeholder" or roots[s] != 1 or inputs.get(s, "") is not None or s.name not in bw_inputs:
            continue
        val, grad = s.meta.get("val"), grads[placeholders.index(s)]
        gval = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if (
            isinstance(val, torch.Tensor)
            and isinstance(gval, torch.Tensor)
            and val.dtype == gval.dtype
            and val.shape == gval.shape
            and val.is_floating_point()
        ):
            out[s] = bw_inputs[s.name]
    return out


def describe(node: fx.Node) -> str:
    """A donated saved input in words, for the plan's summary, the log and ``report()``."""
    return f"saved input {node.name} ({nbytes_of(node)} B): its gradient written over it in the backward where the caller dropped it"


def donate(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int, donated: Mapping[fx.Node, fx.Node]) -> None:
    """Rewrite both graphs for ``donated`` (:func:`donatable`'s): the forward saves each
    through :data:`save_apart`, the backward reads it through :data:`owned_or_copy`, placed
    right before its first reader."""
    if not donated:
        return
    fw_g, bw_g = fw_module.graph, bw_module.graph
    output = next(iter(reversed(fw_g.nodes)))
    outs = list(output.args[0])
    for i in range(num_fwd_outputs, len(outs)):
        if outs[i] in donated:
            with fw_g.inserting_before(output):
                apart = fw_g.call_function(save_apart, (outs[i],))
            apart.meta["val"] = outs[i].meta["val"]
            outs[i] = apart
    output.args = (tuple(outs), *output.args[1:])
    order = {n: i for i, n in enumerate(bw_g.nodes)}
    for ph in donated.values():
        if not ph.users:
            continue
        first = min(ph.users, key=order.__getitem__)
        with bw_g.inserting_before(first):
            owned = bw_g.call_function(owned_or_copy, (ph,))
        owned.meta["val"] = ph.meta["val"]
        ph.replace_all_uses_with(owned, delete_user_cb=lambda user: user is not owned)
    fw_g.lint()
    bw_g.lint()
    fw_module.recompile()
    bw_module.recompile()


# ===================================================================== per compiled call


def _owned_or_copy(x: torch.Tensor) -> torch.Tensor:
    """``owned_or_copy``'s kernel, once per donated input per backward: ``x`` where its
    storage has two references, ``x``'s and the temporary storage object's (a third is the
    caller's tensor, a view of it, or another saved tensor over it), and autograd will not
    run this backward again; else a copy."""
    only_ours = torch._C._storage_Use_Count(x.untyped_storage()._cdata) == 2
    if only_ours and not torch._C._autograd._get_current_graph_task_keep_graph():
        return x
    return x.clone()


save_apart, owned_or_copy = _register(_lib)
