#!/usr/bin/env bash
# Everything the CUDA path needs checked on a GPU machine, in one command (see ../CONTRIBUTING.md):
#
#   bash benchmarks/gpu_check.sh     # from the repository root, on a machine with CUDA
#
# (On a machine without internet, put an expecttest wheel under .whl/ first.)
# 1. llama: benchmarks/gpu_offload_profile.py --rows llama, a Llama of about 1.2B parameters
#    (batch $LLAMA_BATCH x sequence 2048, fp32, KV cache off), each decoder layer and the loss
#    compiled on their own: no hooks, cpu_offload() (reloads started a graph ahead), budget(0.3),
#    stock's activation_memory_budget 0.3, fp8 + offload, budget(0.5), stock's 0.5, stock full
#    activation checkpointing, cpu_offload() with each layer starting its own reloads, and
#    cpu_offload() with the reloads started ahead bounded to half of a layer's;
# 2. tests: the CUDA variants of every test file (each failure's report is written as it
#    happens, so a run cut by its timeout still shows why);
# 3. tall: mlp8 at 4x the batch (activations dominate, the same compute per copied byte):
#    no hooks, cpu_offload(), fp8 + offload, upstream's activation offloading on one stream;
# 4. table: the same script's --rows table, one process: mlp8 (8192 x 4096, and 4x the batch
#    at 1/4 the width) with no hooks, cpu_offload(), fp8_rowwise + cpu_offload,
#    budget(0.2/0.3/0.5) beside stock's activation_memory_budget, eager save_on_cpu and
#    upstream's activation offloading; the allocator's history of the offloaded step and the
#    generated code's order of offloads and reloads.
# llama takes about three minutes on an H200 (LLAMA_ROWS="no-hooks-llama1b,offload-llama1b" runs
# some of its rows), tests about three and a half (TESTS_K selects some): run them as two calls
# (STAGES=llama, then STAGES=tests) where one command may run at most ten minutes.
# STAGES="table" (say) runs a subset; STAGES="head" the loss head at a 128k vocabulary (two
# sweeps of three rows side by side, each row a fresh process: a few minutes); STAGES="promise"
# the budget's promise over generated steps (benchmarks.budget_promise on CUDA).
# Writes pytest's report, the failures, the tables and their JSON under $OUT (default:
# ./gpu-check).
set -u
OUT="${OUT:-gpu-check}"
STAGES="${STAGES:-llama tests}"
LLAMA_BATCH="${LLAMA_BATCH:-4}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

# expecttest is the one test dependency a CUDA image may lack; installed into a private target
# with the interpreter that runs the tests, so a pip of another Python cannot take the install.
if ! python3 -c "import expecttest" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpu-check-site .whl/expecttest-*.whl \
        && export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"

stage_tests() {
# -v: each test's outcome is written as it ends; the plugin writes each failure's report to
# failures.txt at once: a run cut by its timeout still names them and says why.
cat > /tmp/gpu_check_failures.py <<'PLUGIN'
import os

def pytest_runtest_logreport(report):
    # Once, by the process that runs pytest (under xdist the controller, not the worker).
    if report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(os.environ["GPU_CHECK_FAILURES"], "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
PLUGIN
: > "$OUT/failures.txt"
GPU_CHECK_FAILURES="$OUT/failures.txt" PYTHONPATH="/tmp:$PYTHONPATH" TORCHINDUCTOR_COMPILE_THREADS=1 \
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -v -n "${TESTS_WORKERS:-14}" -p no:cacheprovider \
    -p gpu_check_failures --timeout 240 -rfE --tb=short --durations=15 -k "${TESTS_K:-cuda or CUDA}" test > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest.txt"
grep -E "(FAILED|ERROR) |passed|failed" "$OUT/pytest.txt" | grep -v " PASSED " | tail -20
}

stage_table() {
timeout "${TABLE_TIMEOUT:-240}" python3 benchmarks/gpu_offload_profile.py --rows table --out "$OUT" \
    --json "$OUT/table.json" --order-lines 40 > "$OUT/table.log" 2>&1
echo "table rc=$?" | tee -a "$OUT/table.log"
sed -n '/^history/,$p' "$OUT/profile.txt" | grep -v "^ROW"
}

stage_llama() {
mkdir -p "$OUT/llama"
timeout "${LLAMA_TIMEOUT:-420}" python3 benchmarks/gpu_offload_profile.py --rows "${LLAMA_ROWS:-llama}" --no-code \
    --llama-batch "$LLAMA_BATCH" --out "$OUT/llama" --json "$OUT/llama/llama.json" > "$OUT/llama/llama.log" 2>&1
echo "llama rc=$?"
grep -E "^(variant|no-hooks|budget|stock|offload|fp8)|copies|Error" "$OUT/llama/llama.log" | tail -14
}

stage_tall() {
mkdir -p "$OUT/tall"
timeout "${TALL_TIMEOUT:-150}" python3 benchmarks/gpu_offload_profile.py --rows tall --no-code \
    --out "$OUT/tall" --json "$OUT/tall/tall.json" > "$OUT/tall/tall.log" 2>&1
echo "tall rc=$?"
grep -E "^(variant|no-hooks|upstream|offload|fp8)|Error" "$OUT/tall/tall.log" | tail -6
}

stage_head() {
# The loss head at Llama 3's vocabulary (128,256 tokens; 4 layers x 2048, batch 4 x 2048, fp32):
# no hooks, budget(0.1) and stock's activation_memory_budget 0.1, at HF's default call (the
# chunked head) and at torchtitan's (the loss compiled apart: the head's matmul in another graph).
# The two calls run side by side (each row a fresh process, its peak its own allocator's; the
# step times share the device: HEAD_SERIAL=1 runs them one after the other).
mkdir -p "$OUT/head"
for call in hf_default torchtitan; do
    timeout "${HEAD_TIMEOUT:-240}" python3 -m benchmarks.budget_sweep --models llama --fractions 0.1 --layers 4 \
        --dim 2048 --heads 16 --seq 2048 --batch 4 --vocab 128256 --call "$call" --steps 4 --device cuda --no-offload-rows \
        --json "$OUT/head/$call.json" > "$OUT/head/$call.log" 2>&1 &
    [ -n "${HEAD_SERIAL:-}" ] && wait
done
wait
for call in hf_default torchtitan; do
    echo "head $call:"
    grep -E "^\| 0.1|no hooks|above|planned|Error| llama " "$OUT/head/$call.log"
done
}

stage_promise() {
# The budget's promise on CUDA (issue 78): generated steps (benchmarks.budget_promise), each in a
# fresh process, no budget / stock's knob / budget(F) at 0.5 and 0.1 by max_memory_allocated;
# PROMISE_SEEDS (default 0-23) names them. Prints each step's verdict and the counts.
mkdir -p "$OUT/promise"
timeout "${PROMISE_TIMEOUT:-300}" python3 -m benchmarks.budget_promise --seeds "${PROMISE_SEEDS:-0-23}" --fractions 0.5,0.1 \
    --device cuda --timeout 120 --json "$OUT/promise/promise.json" > "$OUT/promise/promise.log" 2>&1
echo "promise rc=$?"
grep -E "above|FAILED|^\{" "$OUT/promise/promise.log" | tail -12
}

# The stages in the order STAGES names them.
for s in $STAGES; do
    "stage_$s"
done
