"""Plan how each saved tensor is stored to fit an activation memory budget.

Used by the inliner (``inline_phases.inline``) for saved tensors whose hooks are a
:func:`torch_patches.hooks.budget` pair.  The partitioner has chosen what the graph saves
(and what it recomputes: ``torch._functorch.config.activation_memory_budget`` runs first
and this plan covers what it left saved); this module chooses, per saved tensor, one of

* ``keep``: saved as it is;
* ``bf16``: ``torch_patches.hooks.bf16`` (float32/float64 only);
* ``fp8``: ``torch_patches.hooks.fp8_rowwise`` (e4m3fn, one float32 scale per row);
* ``offload``: ``torch_patches.hooks.cpu_offload`` (CUDA tensors only);
* ``fp8+offload``: both, chained;
* ``recompute``: not saved; the backward recomputes it with the forward's own ops from
  tensors the graph saves anyway (kept exact: the plan pins them to ``keep``) and inputs
  the caller keeps (parameters, buffers, leaves).  At most :data:`RECOMPUTE_MAX_NODES`
  ops, none random or mutating; exact, so offered whatever ``numerics_safe`` says;
  only to a saved tensor that is the one reader of its storage,

so that the bytes the saved tensors hold on their device fit the budget at every point from
the forward's end through the backward, at the least estimated time.  A saved storage is
held in its stored form until its first backward use and at full size from there to its
last (:class:`Span`), so the backward's first uses are where it can peak; bounding only the
forward's end would let a plan be "met" while the backward rebuilds a tensor beside
everything not used yet.  That is for a graph that is its step.  A graph that is one of
several (an input of it produced by autograd: blocks compiled one by one, graph breaks)
holds its stored bytes while the other graphs run, and one graph's backward runs at a
time: its budget bounds its forward's end, and its backward's points may hold up to what it
saves without hooks (:attr:`~.planner.GraphFacts.bounds`, ``config.activation_budget_bounds``;
:attr:`Plan.backward_bytes`).  Lossy options are offered only for tensors
:func:`~torch_patches.hooks.select.numerics_safe` accepts.

Cost model (:mod:`.cost_model`, recompute's in :mod:`.recompute`; every figure from the
graph's metadata and config knobs, no measurement, so the plan is a pure function of the
graph, the budget and the config, all of which key the compiled graph):

* device bytes at the end of the forward: keep ``n*s`` (``n`` elements of ``s`` bytes),
  bf16 ``2n``, fp8 ``n + 4r`` (``r`` rows), offload 0, fp8+offload 0;
* time: memory traffic over ``activation_budget_memory_bandwidth`` plus a fixed cost per
  kernel (``activation_budget_kernel_overhead_us``).  bf16 moves ``2ns + 4n`` bytes (pack
  and unpack) in 2 kernels; fp8 ``3ns + 2n + 8r`` (an amax pass, the quantisation, the
  dequantisation) in 3.  Offload copies ``ns`` bytes each way at
  ``activation_budget_host_bandwidth``; only the part of each copy that the compute
  around it cannot cover counts: the device-to-host copy overlaps the forward compute after
  the tensor's last forward use, the host-to-device copy the compute of the
  ``reload_prefetch_distance`` backward nodes before its first use; in a graph that is one of
  several whose reloads start a graph ahead (``config.offload_prefetch_graphs``), the
  neighbouring graphs' compute (each tensor its bytes' share of the graph's own compute, the
  neighbours costing what it costs), and its backward holds the next graph's reloads
  (:attr:`Plan.ahead_bytes`).  Compute per node is
  ``max(flops / activation_budget_flops, bytes / memory bandwidth)`` with flops from
  ``torch.utils.flop_counter``'s formulas.  Recompute costs the compute of its ops (views
  are free) plus a kernel each.

Solver (:mod:`.solver`, pure: no torch, no fx): the multiple-choice knapsack's greedy over
each tensor's lower convex hull of (bytes, time): starting from keep everywhere, repeatedly
take the step that saves bytes at the least time per byte (ties: more bytes first, then
graph order) until the saved bytes fit the budget (:func:`solve`).  The constraint at a
point of the backward is a knapsack over the storages first used after it, so the
constraints nest; :func:`fit` meets them from the last point to the forward's end, one
greedy carried from point to point (each adds the storages first used after it) over the
bytes held per point (a segment tree): about linear in the storages.  Deterministic.
Recompute couples tensors: taking it pins the saved tensors it reads to ``keep`` (undoing
what they saved), so its step is re-priced when it comes up (a lazy greedy) and dropped
when it would no longer save bytes; its ops allocate bytes besides the tensor they rebuild,
counted at its first use, and a step that would raise a point over the budget is refused.
Where no recompute option pins another storage, the plan is fitted exactly instead
(:func:`exact_fit`, a dynamic programme over the same nested constraints keeping the
Pareto front of stored bytes, peak and time; the greedy where it would keep too many
partial plans): on the bench models' plans the greedy met the same budgets at up to 10%
more estimated time.  Recompute is the fallback: the plan is fitted with the storage
options only, and only when that cannot meet the budget again with recompute too.  If
neither meets it, the plan is the floor: the greedy against a budget of 0 bytes brings
every point as low as the options take it (with and without recompute, the lower peak
taken), the same plan for every budget below the floor, so a tighter budget never plans a
higher peak; the warning and the summary (``floor_bytes``, ``floor_holders``) say what
holds it: storages in use at full size there, those kept exact and why, those already at
their fewest bytes, and what cannot be hooked.

Modules:

* :mod:`.planner` (the glue): :func:`plan` per budget pair, :func:`fit_plans` and
  :func:`apply_plans` for a graph pair's facts (:class:`GraphFacts`, built once; the partition choice's :class:`PartitionTerms` on them), :func:`option_hooks`, :func:`backward_span`;
* :mod:`.partition_choice`: :func:`~.partition_choice.choose_partition`, which partition an
  ambient budget plans (the partitioner's offer weighed against the plan; imported by the
  inliner's driver, not here: it reads the records and the inliner's trial);
* :mod:`.summary`: :func:`summarize` (a fitted plan into its ``BudgetPlanSummary``, the floor's
  warning and what holds it);
* :mod:`.cost_model`: :class:`Rates`, :func:`options_for`, :func:`lossy_tolerance`, the
  compute per node (``_node_ms``, ``_flops``), :func:`windows` (offload overlap),
  :func:`graph_compute_ms`;
* :mod:`.solver`: :class:`Option`, :data:`LOSS`, :class:`Span`, :class:`Choice`,
  :class:`Plan`, :func:`lower_hull`, :func:`solve`, :func:`fit` (by name from
  :data:`SOLVERS`: ``"greedy"`` is :func:`greedy_fit`);
* :mod:`.exact`: :func:`exact_fit` and :func:`exact_or_greedy_fit` (the planner's
  ``SOLVER``);
* :mod:`.recompute`: :class:`Recipe`, :func:`recompute_recipe`, :func:`recompute_ms`,
  :func:`with_recipes`, :func:`recipe_transient_bytes`, :data:`RECOMPUTE_MAX_NODES`.
"""

from torch_patches._functorch._aot_autograd.activation_budget.cost_model import (
    Rates,
    graph_compute_ms,
    lossy_tolerance,
    options_for,
    windows,
)
from torch_patches._functorch._aot_autograd.activation_budget.exact import exact_fit, exact_or_greedy_fit
from torch_patches._functorch._aot_autograd.activation_budget.planner import (
    SOLVER,
    GraphFacts,
    PartitionTerms,
    apply_plans,
    backward_span,
    fit_plans,
    option_hooks,
    plan,
)
from torch_patches._functorch._aot_autograd.activation_budget.recompute import (
    RECOMPUTE_MAX_NODES,
    Recipe,
    recipe_transient_bytes,
    recompute_ms,
    recompute_recipe,
    with_recipes,
)
from torch_patches._functorch._aot_autograd.activation_budget.solver import (
    KEEP,
    LOSS,
    RECOMPUTE,
    SOLVERS,
    Choice,
    Option,
    Plan,
    Span,
    fit,
    greedy_fit,
    lower_hull,
    solve,
)
from torch_patches._functorch._aot_autograd.activation_budget.summary import summarize

__all__ = [
    "KEEP",
    "LOSS",
    "RECOMPUTE",
    "RECOMPUTE_MAX_NODES",
    "SOLVER",
    "SOLVERS",
    "Choice",
    "GraphFacts",
    "Option",
    "PartitionTerms",
    "Plan",
    "Rates",
    "Recipe",
    "Span",
    "apply_plans",
    "backward_span",
    "exact_fit",
    "exact_or_greedy_fit",
    "fit",
    "fit_plans",
    "graph_compute_ms",
    "greedy_fit",
    "summarize",
    "lossy_tolerance",
    "lower_hull",
    "option_hooks",
    "options_for",
    "plan",
    "recipe_transient_bytes",
    "recompute_ms",
    "recompute_recipe",
    "solve",
    "windows",
    "with_recipes",
]
