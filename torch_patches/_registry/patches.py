"""Every patch torch_patches applies, in dependency (and upstream-stack) order.

Fingerprints (``fingerprints.json``) are of the upstream definitions each patch was
written against (its target plus ``depends_on``), per torch release.  Record a new
release's with ``python -m tools.fingerprints --root SITE_PACKAGES --version X.Y --write``
only after re-reading the upstream change (see CONTRIBUTING.md).
"""

from __future__ import annotations

from torch_patches._registry.fingerprints import recorded as _fp
from torch_patches._registry.records import Effect, Patch, UpstreamForm

PR_150032 = "https://github.com/pytorch/pytorch/pull/150032"
_BLOB = "https://github.com/pytorch/pytorch/blob/v2.13.0/"

_GC = "torch._functorch._aot_autograd.graph_compile"
_RW = "torch._functorch._aot_autograd.runtime_wrappers"
_AU = "torch._functorch._aot_autograd.utils"
_AC = "torch._functorch._aot_autograd.autograd_cache"
_OG = "torch._dynamo.output_graph"
_GU = "torch._dynamo.guards"
_UD = "torch._dynamo.variables.user_defined"
_CM = "torch._dynamo.variables.ctx_manager"
_IW = "torch._inductor.codegen.wrapper"
_TP = "torch_patches."


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="aot.saved_tensors_hooks_are_inlineable",
        target=f"{_AU}:saved_tensors_hooks_are_inlineable",
        replacement=f"{_TP}_functorch._aot_autograd.utils:saved_tensors_hooks_are_inlineable",
        summary="[aotd] Accept marked plain-function saved tensors hooks as inlineable",
        upstream=f"{_BLOB}torch/_functorch/_aot_autograd/utils.py",
        retire_when="upstream accepts traceable non-GraphModule hooks (an opt-in marker)",
        fingerprints=_fp("aot.saved_tensors_hooks_are_inlineable"),
        issue=4,
        tests=("test/test_hooks_library.py", "test/test_inline_numerics.py", "test/test_upstream_ports.py"),
        measured=(
            "plain Python functions marked `inlineable` are traced into the graphs like "
            "GraphModule hooks: `bf16()` as marked functions gives the same peak as its GraphModule form "
            "(benchmarks/README.md, mlp8 `ours` rows use them)"
        ),
        risk=(
            "the marker is a promise of purity; a marked hook that breaks it is refused by the "
            "contract checks at trace time (error under fullgraph=True, else eager with a warning)"
        ),
    ),
    Patch(
        name="dynamo.install_saved_tensors_hooks_subgraphs",
        target=f"{_OG}:OutputGraph.maybe_install_saved_tensors_hooks_subgraphs",
        replacement=f"{_TP}_dynamo.output_graph:maybe_install_saved_tensors_hooks_subgraphs",
        summary="[dynamo] Key saved tensors hooks subgraphs on hook content (user_cache_hash), log why hooks stay eager",
        upstream=f"{_BLOB}torch/_dynamo/output_graph.py",
        retire_when="upstream installs hook subgraphs with their own root and records plain-function hooks",
        fingerprints=_fp("dynamo.install_saved_tensors_hooks_subgraphs"),
        depends_on=(f"{_OG}:OutputGraph.install_subgraph", f"{_OG}:OutputGraph.add_graph_finalizer"),
        after=("aot.saved_tensors_hooks_are_inlineable",),
        issue=4,
        tests=("test/test_compile_cache.py",),
        measured=(
            "the compile caches key inlined hooks by content: a fresh process with the same "
            "hooks hits AOTAutogradCache and the FX graph cache, a changed hook misses (test_compile_cache, "
            "test_hook_identity across processes)"
        ),
        risk=(
            "a hook whose behaviour depends on what the walk cannot see must say so with "
            "`cache_hash`; what cannot be keyed bypasses the caches (never a stale hit)"
        ),
    ),
    Patch(
        name="dynamo.guard_saved_tensors_hooks_by_content",
        target=f"{_GU}:GuardBuilder.AUTOGRAD_SAVED_TENSORS_HOOKS",
        replacement=f"{_TP}_dynamo.guards:AUTOGRAD_SAVED_TENSORS_HOOKS",
        summary="[dynamo] Guard saved tensors hooks on content, not id()",
        upstream=f"{_BLOB}torch/_dynamo/guards.py",
        retire_when="upstream guards saved tensors hooks by content (recreated identical hooks hit)",
        fingerprints=_fp("dynamo.guard_saved_tensors_hooks_by_content"),
        after=("dynamo.install_saved_tensors_hooks_subgraphs",),
        issue=4,
        tests=("test/test_hook_guards.py",),
        measured=(
            "hooks recreated every step (the usual `with saved_tensors_hooks(*bf16())`) compile "
            "once instead of once per step; 50 steps, 1 frame (test_hook_identity)"
        ),
        risk=(
            "the content guard walks the hooks at every call (about 110 us for a two-line pair); a "
            "hook the walk cannot key falls back to eager hooks"
        ),
    ),
    Patch(
        name="dynamo.lift_saved_tensors_hook_inputs",
        target="torch._dynamo.symbolic_convert:InstructionTranslator.__init__",
        replacement=f"{_TP}_dynamo.symbolic_convert:make_init",
        wraps=True,
        summary="[dynamo] Lift the tensors ambient saved tensors hooks read as graph inputs (guarded by metadata)",
        upstream=f"{_BLOB}torch/_dynamo/symbolic_convert.py",
        retire_when="upstream passes tensors that inlined saved tensors hooks read as runtime graph inputs",
        fingerprints=_fp("dynamo.lift_saved_tensors_hook_inputs"),
        depends_on=(f"{_OG}:OutputGraph.install_global", f"{_OG}:OutputGraph.install_global_unsafe"),
        after=("dynamo.guard_saved_tensors_hooks_by_content",),
        issue=27,
        tests=("test/test_hook_inputs.py",),
        measured=(
            "a delayed scale updated in place every step compiles once over 50 updates, where "
            "it recompiled per update; `bf16_scaled` row: 1.6 ms/step vs eager hooks 3.3 ms (CPU, "
            "benchmarks/results/bf16-scaled.md)"
        ),
        risk=(
            "a lifted tensor changed in place between forward and backward: ambient hooks read it "
            "as of the backward (eager semantics), in-region hooks raise autograd's in-place error"
        ),
    ),
    Patch(
        name="dynamo.saved_tensors_hooks_in_region",
        target=f"{_UD}:UserDefinedClassVariable.call_function",
        replacement=f"{_TP}_dynamo.variables.user_defined:make_call_function",
        wraps=True,
        summary="[dynamo] Trace saved_tensors_hooks entered inside a compiled region as scopes",
        upstream=f"{_BLOB}torch/_dynamo/variables/user_defined.py",
        retire_when="upstream Dynamo traces saved_tensors_hooks(pack, unpack) inside a region (no graph break)",
        fingerprints=_fp("dynamo.saved_tensors_hooks_in_region"),
        depends_on=(
            f"{_CM}:ContextWrappingVariable.set_cleanup_hook",
            f"{_CM}:ContextWrappingVariable.exit",
            f"{_CM}:FxTracebackAnnotateVariable.enter",
            f"{_OG}:OutputGraph.install_subgraph",
        ),
        after=("dynamo.guard_saved_tensors_hooks_by_content",),
        issue=5,
        tests=("test/test_inscope_hooks.py", "test/test_compile_cache.py"),
        measured=(
            "`with saved_tensors_hooks(...)` inside a compiled function is traced "
            "(fullgraph=True works) and placed per scope, where stock torch graph-breaks"
        ),
        risk="only marked or GraphModule hooks are traced in a region; others graph-break as before",
    ),
    Patch(
        name="aot.inline_saved_tensors_hooks",
        target=f"{_GC}:maybe_inline_graph_saved_tensors_hooks",
        replacement=f"{_TP}_functorch._aot_autograd.graph_compile:maybe_inline_graph_saved_tensors_hooks",
        summary="[aotd] Place inlined saved tensors hooks at use: pack after last fw use, unpack before first bw use",
        upstream=PR_150032,
        retire_when="upstream places inlined pack/unpack at the saved tensor's uses (not epilogue/prologue)",
        fingerprints=_fp("aot.inline_saved_tensors_hooks"),
        depends_on=(
            f"{_GC}:_aot_stage2a_partition",
            f"{_GC}:collect_fw_donated_buffer_idxs",
            f"{_GC}:_saved_tensor_hook_context",
            "torch._functorch.partitioners:_extract_fwd_bwd_modules",
        ),
        after=("aot.saved_tensors_hooks_are_inlineable",),
        issue=4,
        tests=("test/test_inline_placement.py", "test/test_inline_numerics.py", "test/test_offload.py", "test/test_upstream_ports.py"),
        measured=(
            "packs after each saved tensor's last forward use and unpacks before its first "
            "backward use: mlp8 peak 0.60x (bf16) and 0.44x (fp8) of no hooks under aot_eager on an H100, where "
            "stock inlining gives 1.00x; under Inductor 0.57x / 0.50x at 1.00x step time (benchmarks/README.md, "
            "Latest results). Default numerics allowlist: eval loss within run noise over 300 steps, 3 seeds "
            "(Convergence table)"
        ),
        risk=(
            "replaces upstream's epilogue/prologue inlining: graphs with saved tensors hooks change "
            "shape (goldens in test_saved_tensors_hooks_placement pin them); lossy hooks reach only tensors the "
            "numerics allowlist accepts"
        ),
    ),
    Patch(
        name="aot.budget_exact_recompute_first",
        target="torch._functorch.partitioners:choose_saved_values_set",
        replacement=f"{_TP}_functorch.partitioners:make_choose_saved_values_set",
        wraps=True,
        summary="[partitioner] Under an activation-memory budget pair, take the partitioner's cheap "
        "exact recomputation when it meets the budget; else leave the joint graph for the inliner to "
        "weigh the partitioner's knapsack at the fraction against the plan",
        upstream=f"{_BLOB}torch/_functorch/partitioners.py",
        retire_when="upstream's activation_memory_budget composes with saved tensors hooks that plan storage",
        fingerprints=_fp("aot.budget_exact_recompute_first"),
        after=("aot.inline_saved_tensors_hooks",),
        issue=25,
        tests=("test/test_budget.py", "test/test_donated_inputs.py"),
        measured=(
            "`budget(F)` peaks at 0.39x (Llama, F=0.3) where stock `activation_memory_budget` "
            "gives 0.79x, at 1.06x vs 1.19x step time (CPU, benchmarks/results/convergence.md, budget against "
            "stock)"
        ),
        risk="only under a budget pair; outside it the partitioner runs as before",
    ),
    Patch(
        name="aot.runtime_hooks_not_disabled_by_type",
        target=f"{_RW}:_should_disable_saved_tensors_hooks",
        replacement=f"{_TP}_functorch._aot_autograd.runtime_wrappers:_should_disable_saved_tensors_hooks",
        summary="[aotd] Decide runtime saved tensors hooks per compiled graph, not by hook type",
        upstream=f"{_BLOB}torch/_functorch/_aot_autograd/runtime_wrappers.py",
        retire_when="upstream records per compiled graph whether its hooks were inlined",
        fingerprints=_fp("aot.runtime_hooks_not_disabled_by_type"),
        after=("aot.inline_saved_tensors_hooks",),
        issue=4,
        tests=("test/test_hook_contract.py", "test/test_upstream_ports.py"),
        measured=(
            "graphs that inlined their hooks and graphs that did not coexist in one step (a "
            "graph break between them) without running any hook twice or never"
        ),
        risk=(
            "the runtime wrapper reads the inliner's per-graph decision from the compiled graph; a "
            "graph compiled without inlining keeps running the hooks as eager hooks, as before"
        ),
    ),
    Patch(
        name="aot.runtime_saved_tensors_hooks_context",
        target=f"{_RW}:_create_runtime_wrapper",
        replacement=f"{_TP}_functorch._aot_autograd.runtime_wrappers:make_create_runtime_wrapper",
        wraps=True,
        summary="[aotd] Disable inlined hooks at runtime; run eager hooks under the hook contract",
        upstream=f"{_BLOB}torch/_functorch/_aot_autograd/runtime_wrappers.py",
        retire_when="upstream keeps masks/indices away from eager hooks and validates unpack results",
        fingerprints=_fp("aot.runtime_saved_tensors_hooks_context"),
        depends_on=(
            f"{_RW}:_disable_saved_tensors_hooks",
            f"{_RW}:_AnalyzeCustomOpInputOutputMode.__torch_dispatch__",
        ),
        after=("aot.runtime_hooks_not_disabled_by_type",),
        issue=9,
        tests=("test/test_hook_contract.py",),
        measured=(
            "inlined hooks no longer also run as eager hooks at runtime; a hook that falls back "
            "runs under the hook contract (dtype, shape, device checked; strides restored)"
        ),
        risk="the contract check adds a comparison per unpacked tensor for hooks that stay eager",
    ),
    Patch(
        name="aot.autograd_cache_skip_eager_fallback",
        target=f"{_AC}:AOTAutogradCache.save",
        replacement=f"{_TP}_functorch._aot_autograd.autograd_cache:make_save",
        wraps=True,
        summary="[aotd] Do not cache graphs whose saved tensors hooks fell back to eager",
        upstream=f"{_BLOB}torch/_functorch/_aot_autograd/autograd_cache.py",
        retire_when="upstream records in the cache entry whether saved tensors hooks were inlined",
        fingerprints=_fp("aot.autograd_cache_skip_eager_fallback"),
        after=("aot.inline_saved_tensors_hooks",),
        issue=6,
        tests=("test/test_compile_cache.py",),
        measured=(
            "a graph whose hooks fell back to eager is not written to AOTAutogradCache (a later process would load it without its hooks)"
        ),
        risk="fewer cache hits for graphs whose hooks fell back",
    ),
    Patch(
        name="inductor.incoming_gradients_freeable",
        target="torch._inductor.utils:is_nonfreeable_buffers",
        replacement=f"{_TP}_inductor.utils:make_is_nonfreeable_buffers",
        wraps=True,
        summary="[inductor] Count a boxed backward's incoming gradients as freed at their last use in the peak-memory model",
        upstream=f"{_BLOB}torch/_inductor/utils.py",
        retire_when="Inductor's peak-memory model frees the incoming gradients of a backward whose inputs are boxed",
        fingerprints=_fp("inductor.incoming_gradients_freeable"),
        depends_on=("torch._inductor.memory:get_freeable_input_buf",),
        after=("aot.budget_exact_recompute_first",),
        issue=57,
        tests=("test/test_incoming_gradients.py", "test/test_compile_cache.py"),
        measured=(
            "torchtitan's call (the loss compiled apart), Llama 2 x 256 at a 32,768 vocabulary, batch 2 x 512, "
            "`budget(0.5)`: the body's backward reads the logits' gradient (128 MiB) first instead of last, a step "
            "peak of 174.4 MiB where it was 201.8 MiB (0.60x of no hooks, planned 0.61x; was 0.69x); CPU, torch 2.13 "
            "(benchmarks/results/loss-head.md)"
        ),
        risk=(
            "Inductor's reorder and its realize heuristic count a top-level backward's incoming gradients as "
            "freeable: where the caller keeps a gradient alive (a retained `grad_output`) the estimate is low by "
            "that tensor, as for any buffer the caller holds; forward graphs, subgraphs and torch before 2.13 (where autograd "
            "holds the gradients to the backward's end, `BackwardCFunction.apply_boxed` absent) are as before"
        ),
    ),
    Patch(
        name="inductor.free_without_reuse",
        target=f"{_IW}:PythonWrapperCodegen.codegen_free",
        replacement=f"{_TP}_inductor.codegen.wrapper:make_codegen_free",
        wraps=True,
        summary="[inductor] Free, but never reuse, buffers an op still reads asynchronously",
        upstream=f"{_BLOB}torch/_inductor/codegen/wrapper.py",
        retire_when="Inductor can mark a buffer as not reusable without keeping it alive to the end of the graph",
        fingerprints=_fp("inductor.free_without_reuse"),
        depends_on=(f"{_IW}:PythonWrapperCodegen.can_reuse", f"{_IW}:FreeLine.codegen"),
        issue=7,
        tests=("test/test_offload.py",),
        area="offload",
        measured=(
            "none until a lowering marks a buffer (the offload lowering's commit); a marked "
            "buffer is freed at its last use and never handed to another buffer while a side-stream copy reads it"
        ),
        risk=(
            "a buffer freed without reuse raises the allocator's footprint by that buffer until the "
            "copy ends; only for buffers marked by the offload lowering"
        ),
    ),
    Patch(
        name="inductor.no_inplace_reuse",
        target=f"{_IW}:PythonWrapperCodegen.can_reuse",
        replacement=f"{_TP}_inductor.codegen.wrapper:make_can_reuse",
        wraps=True,
        summary="[inductor] No in-place reuse of buffers an op still reads asynchronously",
        upstream=f"{_BLOB}torch/_inductor/codegen/wrapper.py",
        retire_when="Inductor can mark a buffer as not reusable without keeping it alive to the end of the graph",
        fingerprints=_fp("inductor.no_inplace_reuse"),
        depends_on=("torch._inductor.scheduler:BaseSchedulerNode.decide_inplace_update",),
        after=("inductor.free_without_reuse",),
        issue=7,
        tests=("test/test_offload.py",),
        area="offload",
        measured=("none until a lowering marks a buffer; then no kernel writes in place into a buffer an async copy still reads"),
        risk="only for buffers marked by the offload lowering",
    ),
    Patch(
        name="inductor.offload_order_kept",
        target="torch._inductor.memory:reorder_for_peak_memory",
        replacement=f"{_TP}_inductor.memory:make_reorder_for_peak_memory",
        wraps=True,
        summary="[inductor] Keep the order of graphs holding offload ops in reorder_for_peak_memory",
        upstream=f"{_BLOB}torch/_inductor/memory.py",
        retire_when="Inductor's peak-memory model counts host buffers apart and sees the device memory an op "
        "allocates for a later op's output",
        fingerprints=_fp("inductor.offload_order_kept"),
        depends_on=("torch._inductor.scheduler:Scheduler._init",),
        after=("inductor.no_inplace_reuse",),
        issue=39,
        tests=("test/test_offload.py",),
        area="offload",
        measured=(
            "none until a graph holds the offload ops; then `reorder_for_peak_memory` keeps its "
            "order (it plans, and logs only the baseline's estimate); on an H100 the inlined `cpu_offload()` "
            "peak went from 1.00x to 0.55x of no hooks at 1.05x step time (benchmarks/results/gpu-check.md)"
        ),
        risk=(
            "graphs holding offload ops lose Inductor's peak-memory reordering of their other nodes; the inliner's placement stands for it"
        ),
    ),
    Patch(
        name="inductor.fx_graph_cache_keys_offload_code",
        target="torch._inductor.codecache:FxGraphHashDetails.__init__",
        replacement=f"{_TP}_inductor.codecache:make_fx_graph_hash_details_init",
        wraps=True,
        summary="[inductor] Key the FX graph cache of graphs whose code the saved-tensor patches change (offload ops, freed incoming gradients)",
        upstream=f"{_BLOB}torch/_inductor/codecache.py",
        retire_when="the offload ops' lowering and order, and the incoming gradients' rule, are torch's own source, which torch_key() digests",
        fingerprints=_fp("inductor.fx_graph_cache_keys_offload_code"),
        depends_on=("torch._inductor.codecache:compiled_fx_graph_hash",),
        after=("inductor.offload_order_kept",),
        issue=50,
        tests=("test/test_compile_cache.py", "test/test_offload.py"),
        measured=(
            "none upstream, where the offload ops' lowering and order are torch's source and "
            "`torch_key()` digests them; in the patch set, a process of another release misses Inductor's cache "
            "for graphs holding the offload ops (2 misses where it took 2 stale hits for `cpu_offload()`) and "
            "still hits for the others; a backward graph compiled where its incoming gradients are freed at their "
            "last use misses the entries of a process where they are not"
        ),
        risk=(
            "one walk of each graph's nodes while its key is made; only graphs holding the offload ops and "
            "backward graphs reading incoming gradients (where their rule is applied) change keys: those miss "
            "entries a process without the patch set wrote, once"
        ),
    ),
)


#: Global effects of ``apply()`` that are not attribute replacements, installed after the
#: patches (in this order) and undone by ``unapply()`` where torch allows it.
EFFECTS: tuple[Effect, ...] = (
    Effect(
        name="logging.torch_patches_artifact",
        install=f"{_TP}_logging:install_artifact",
        summary="register the torch_patches logging artifact (TORCH_LOGS=torch_patches)",
        inert="torch._logging cannot unregister an artifact; once unapplied nothing logs to it",
        upstream=UpstreamForm(
            home="torch._logging._registrations",
            form=f"{_TP}_logging:registration",
            title="[logging] Register the saved_tensors_hooks artifact",
        ),
        tests=("test/test_logging.py", "test/test_select.py"),
        measured=(
            '`TORCH_LOGS="saved_tensors_hooks"` is accepted; the artifact logs from the '
            "inliner's commit on (one record line per saved tensor, the graphs after inlining)"
        ),
        risk="one more artifact name; off by default",
    ),
    Effect(
        name="aot.side_effect_probe",
        install=f"{_TP}_functorch._aot_autograd.hook_audit:install",
        summary="a Python audit hook recording the I/O a hook attempts while it is traced, and counting "
        "assignments to functions' code and defaults (the hook identities' watches)",
        inert="audit hooks cannot be removed (PEP 578); it records only in a thread tracing a hook, and "
        "only a function's code or defaults being assigned moves its counter",
        upstream_lazy="the tracer and the hook identities' watches add the audit hook at first use (hook_audit.install)",
    ),
    Effect(
        name="inductor.offload_lowering",
        install=f"{_TP}_inductor.lowering:install_inductor_lowering",
        summary="Inductor lowering of saved_tensors_hooks::offload that frees, never reuses, the buffer it copies "
        "(importing torch_patches.hooks.offload registers the torch_patches custom ops)",
        area="offload",
        upstream=UpstreamForm(
            home="torch._inductor.lowering",
            form=f"{_TP}_inductor.lowering:upstream_form",
            title="[inductor] Lower saved_tensors_hooks::offload: free its input without reuse",
            after=("inductor.offload_order_kept",),
        ),
        tests=("test/test_offload.py",),
        measured=(
            "Inductor-compiled graphs with `cpu_offload()` free each offloaded buffer without "
            "reuse (`test_inductor_frees_offloaded_buffers_without_reuse` reads the generated code)"
        ),
        risk=(
            "importing Inductor's lowerings imports the offload ops' module (it defines the op); a "
            "buffer freed without reuse stays allocated until its copy ends"
        ),
    ),
)
