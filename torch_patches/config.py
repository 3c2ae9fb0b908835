"""Knobs for torch_patches, in torch's config-module style.

Use like any torch config module::

    import torch_patches.config as tp_config

    tp_config.unpack_prefetch_distance = 2            # global
    with tp_config.patch(hooked_saved_tensor_dtypes="all"):   # scoped (tests)
        ...

Every knob is part of the identity of inlined hooks: the guard of a compiled frame and the
AOTAutograd cache key hold a snapshot of the whole config (``config_key`` in
``torch_patches/_functorch/_aot_autograd/hook_identity.py``), for hooks around the compiled call and hooks entered
inside it alike, so changing any knob recompiles and misses the cache once.
"""

import sys
import typing

from torch.utils._config_module import Config, install_config_module

# What apply() does when the upstream function a patch was written against no longer
# matches its recorded fingerprint. "error" (default): refuse, patch nothing.
# "warn": apply anyway and warn once per patch -- for experiments on new torch builds.
fingerprint_drift: str = Config(default="error", env_name_force="TORCH_PATCHES_FINGERPRINT_DRIFT")

# Where inlined saved-tensor hooks are placed in the AOT graphs.
#  "use" (default): each pack right after its saved tensor's last forward use, each
#      unpack right before the saved tensor's first backward use, so the full-size
#      tensor is freed early in the forward and materialised late in the backward.
#  "boundary": upstream's placement (all packs at the forward epilogue, all unpacks at
#      the backward prologue). Kept for comparison and benchmarks.
hook_placement: str = "use"

# How many backward nodes before its first use an unpack is issued (0 = right before).
# A distance > 0 lets a reload (CPU offload) overlap with the compute before it.
unpack_prefetch_distance: int = 0

# How many backward nodes before its first use a *reload* is started: unpack graphs that
# call torch.ops.saved_tensors_hooks.reload_start (cpu_offload(), chains ending in it) have
# their reload_start nodes (and what they depend on) placed
# max(unpack_prefetch_distance, reload_prefetch_distance) nodes before the first use, and
# the rest (reload_wait onwards) right before it, so the host-to-device copy overlaps the
# compute in between. Larger: more overlap, but the reloaded tensor occupies device
# memory earlier. Every other hook ignores it.
reload_prefetch_distance: int = 4

# cpu_offload() on CUDA: how many device-to-host copies of a device may still be running on
# its copy stream when the next offload is issued. Beyond that, the compute stream waits
# for the oldest copy (an event; the host never blocks) and its device memory goes back to
# the caching allocator; a copy found finished gives its memory back with no wait and does
# not count. More: the compute runs further ahead of the copies, and that many offloaded
# tensors stay on the device meanwhile. 0: each offload waits for its own copy.
offload_copies_in_flight: int = 2

# cpu_offload() across graphs compiled apart (each decoder layer on its own, as FSDP2 and
# torchtitan compile): when a graph's backward starts, the reloads of the next
# offload_prefetch_graphs graphs autograd runs after it (found along autograd's edges) start
# on the copy stream, so they overlap this graph's backward compute instead of waiting for
# their own graph to begin. A reload started ahead holds its device memory from then on.
# 0: each graph starts its own reloads, inside its backward (reload_prefetch_distance).
offload_prefetch_graphs: int = 1

# At most this many bytes of reloads started ahead by one graph's backward (None: as many
# as offload_prefetch_graphs graphs reload).
offload_prefetch_bytes: int | None = None

# Which saved tensors user hooks see, inlined or not.
#  "float" (default): floating-point (and complex) saved tensors only. Masks, indices
#      and other integer/bool tensors are saved as they are; the compiler's partitioner
#      saves such tensors where eager autograd would not, and a hook written for
#      activations (x * 2, x.to(bf16)...) would silently corrupt them.
#  "all": every saved tensor, as eager autograd would pass them.
hooked_saved_tensor_dtypes: str = "float"

# Hook saved graph inputs that are activations: non-leaf tensors produced by autograd
# before the graph (the block input under per-block compilation, FSDP2, DDP's graph
# splits, graph breaks), not parameters or buffers, not mutated, not aliased by an output,
# when every saved tensor sharing their storage is hooked too, so packing frees them.
# Upstream's "donated" filtering mode leaves every graph input alone; eager hooks pack
# them. False: upstream's rule.
hook_activation_inputs: bool = True

# Check that what unpack returns has the saved tensor's dtype, shape and device (and
# strides, for inlined hooks). A mismatch is an error naming the hook and the tensor.
validate_unpack: bool = True

# The ready-made lossy hooks (bf16, fp8_rowwise, int8_rowwise and chains holding them)
# and the budget planner compress only what torch_patches.hooks.numerics_safe accepts: a
# saved tensor every backward reader of which has an entry on the numerics allowlist
# (torch_patches/hooks/numerics.py) for the argument it reads it as; unknown ops, statistics
# (log-sum-exp, mean, rstd) and tensors too small to pay stay exact. False: compress every
# saved tensor they see.
lossy_hooks_numerics_safe: bool = True

# Entries added to (or overriding) the numerics allowlist: {"namespace::op" or
# "namespace::op.overload": {"argument name" or "*": "fp8" | "int8" | "bf16" | "exact"}},
# the lossiest storage an error of that argument tolerates where it meets a gradient.
# torch_patches.hooks.tolerate(op, *args, storage=...) adds one.
numerics_allowlist: dict = {}

# numerics_safe also leaves saved tensors smaller than this many bytes uncompressed.
lossy_min_bytes: int = 0

# Activation memory budget for every compiled graph that runs without other saved-tensors
# hooks: a float in (0, 1] (a fraction of the bytes the graph saves for the backward
# without hooks) or an int (bytes per graph). The inliner then plans, per saved tensor,
# keep / bf16 / fp8 / CPU offload / fp8 + offload at the least estimated time
# (torch_patches.hooks.budget, which is the same as a hook pair, also inside a compiled
# region). None: no budget.
activation_memory_budget: float | int | None = None

# The budget plan's cost model (README, "Activation memory budget"). None: a default for
# the saved tensors' device type (CPU / CUDA).
# Device memory bandwidth, GB/s (defaults 20 / 2000).
activation_budget_memory_bandwidth: float | None = None
# Host link bandwidth for offload, GB/s (default: torch._functorch.config.activation_offload_cpu_gpu_bw,
# 50 on torch 2.11, which has no such knob).
activation_budget_host_bandwidth: float | None = None
# Compute throughput, TFLOP/s, to estimate how much compute hides a copy (0.2 / 400).
activation_budget_flops: float | None = None
# Fixed cost of one kernel, microseconds (2 / 5).
activation_budget_kernel_overhead_us: float | None = None
# Under a budget (a fraction) around the compiled call or in config, ask torch's partitioner
# for its cheap exact recomputation first (its more aggressive min-cut: fusible chains it
# recomputes without its bans); when that alone saves at most the budget's fraction of the
# default partition's activation bytes, the graph is partitioned that way and nothing is
# compressed (torch_patches/_functorch/partitioners.py). Where the plan over the default
# partition then sits at its floor, or meets the budget only with lossy storage, the
# partitioner's knapsack at the fraction (activation_memory_budget's own) is weighed against
# it: taken where it holds less than the floor, or where it is exact and costs at most the
# lossy plan's time plus activation_budget_lossy_margin; where it holds less but costs more,
# the plan is fitted under what it holds (the knapsack taken where the plan cannot reach it
# faster). False: neither; the plan starts from the default partition.
activation_budget_partitioner_recompute: bool = True
# Among plans that meet the budget, the plan prefers exact options (keep, offload,
# recompute) to bf16 and bf16 to fp8, unless a lossier plan is estimated faster by more
# than this fraction of the graph's estimated compute time.
activation_budget_lossy_margin: float = 0.05
# How a budget prices a partition's step peak (activation_budget/inductor_accounting.py).
#  "auto" (default): by Inductor's own accounting (its lowering, scheduler and memory
#      estimate) where Inductor compiles the graph, and the budget's graphs are held at or
#      below no budget's and stock's knapsack's (activation_budget/ceiling.py); elsewhere
#      by the fx model.  "fx": the fx model everywhere, no ceiling.
activation_budget_accounting: str = "auto"
# The looser fractions a budget's graphs are also held against, with Inductor's accounting
# (activation_budget/ceiling.py): stock's knapsack at each of these above the budget's own
# fraction, beside it at that fraction, the partitioner's cheap recomputation and the default
# partition.  Stock's knapsack peaks higher at some tighter fractions than at looser ones;
# holding budget(F) to what a looser knob gives keeps a tighter budget from peaking above a
# looser one at these fractions.  Each distinct partition is priced once, at compile time.
activation_budget_ceiling_fractions: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

# Under an activation memory budget (ambient, around the compiled call or in config), compute
# a language model's loss head (the LM head's matmul, an optional soft-cap / upcast / scale,
# cross_entropy with a mean or sum) in chunks of tokens, exactly: the (tokens x vocabulary)
# log-probabilities are never saved and their gradient never made whole; each chunk's logits
# are saved tensors of their own, which the plan keeps, offloads or recomputes
# (torch_patches/_functorch/_aot_autograd/loss_head.py).
#  "auto" (default): where the head's float32 logits hold at least chunked_loss_head_min_bytes.
#  "on": every head the pattern matches, under a budget. "off": never.
chunked_loss_head: str = "auto"
chunked_loss_head_min_bytes: int = 32 * 1024 * 1024
# The most chunks a head is cut into (the budget sets how many: about 2 / F for a fraction F).
chunked_loss_head_max_chunks: int = 16
# Where the model returns its logits (HF's default call), the chunked head's backward reads
# them again (saved whole: no extra matmul, but the tokens x vocabulary logits held from the
# forward to the backward) under a budget of at least this fraction; below it (or under a
# budget in bytes), each chunk's logits are recomputed from the hidden states and the head's
# weight (one more matmul of the head, nothing of tokens x vocabulary saved). Default 1.0:
# recomputed under every budget, so that the step's peak stays at or below stock's
# activation_memory_budget (whose knapsack rebuilds the head there too).
chunked_loss_head_keep_logits_from: float = 1.0

# Under an activation memory budget, a saved graph input that is an activation (see
# hook_activation_inputs) and whose gradient the backward computes, same dtype and size
# (the logits of a loss compiled apart, as torchtitan compiles it; a block's input under
# per-block compilation), is handed to the backward to write the gradient over: at each
# call, where nothing else holds its storage (the caller dropped it) and autograd will not
# run the backward again (no retain_graph / create_graph); a copy of it otherwise. The input
# and its gradient are then never held at once. Not under CUDA graphs.
# (torch_patches/_functorch/_aot_autograd/donated_inputs.py). False: never.
donate_activation_inputs: bool = True
# Which points of a compiled graph an activation memory budget bounds.
#  "auto" (default): a graph that takes an activation autograd produced before it (a
#      non-leaf input that requires grad: each block compiled on its own, as FSDP2 and
#      torchtitan do, or a graph break) is one of several graphs of its step: the budget
#      bounds what it holds at its forward's end, while the rest of the step runs, and its
#      backward may hold up to what it saves without hooks (one graph's backward at a time).
#      Any other graph is its whole step: the budget bounds every point of its backward.
#  "every_point": every point of every graph's backward.
#  "forward_end": the forward's end of every graph.
activation_budget_bounds: str = "auto"

# When a hook cannot be inlined (untraceable) and the compile is not fullgraph:
#  "warn" (default): keep eager hook semantics for that graph, with one warning.
#  "error": raise, as under fullgraph=True.
untraceable_hook: str = "warn"

# When the inliner, the budget planner or the graph rewrite fails on a graph with an error of
# its own (not the user's: a hook contract violation or a bad knob still raises), that graph
# runs as stock torch runs it (the partition untouched, the ambient hooks as Python hooks),
# with one SavedTensorsHookWarning naming the hooks, the graph and the error; it is not cached.
# False: raise the error itself (to debug it).
internal_error_fallback: bool = True


if typing.TYPE_CHECKING:  # what install_config_module adds (get_hash, patch...); not a knob
    from torch.utils._config_typing import *  # noqa: F403

install_config_module(sys.modules[__name__])
