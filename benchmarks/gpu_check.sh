#!/usr/bin/env bash
# Everything the CUDA path needs checked on a GPU machine, in one command (see ../CONTRIBUTING.md):
#
#   bash benchmarks/gpu_check.sh     # from the repository root, on a machine with CUDA
#
# (On a machine without internet, put an expecttest wheel under .whl/ first.)
# 1. tests: the CUDA variants of the offload, budget, hook-library and numerics suites;
# 2. table: benchmarks/gpu_offload_profile.py --rows table, one process: mlp8 (8192 x 4096, and
#    4x the batch at 1/4 the width) with no hooks, cpu_offload(), fp8_rowwise + cpu_offload,
#    budget(0.2/0.3/0.5) beside stock's activation_memory_budget, eager save_on_cpu and
#    upstream's activation offloading; the allocator's history of the offloaded step and the
#    generated code's order of offloads and reloads;
# 3. llama: the same script's --rows llama, a Llama of about 1.2B parameters (sequence
#    2048), each decoder layer compiled on its own: no hooks, budget(0.3), stock 0.3,
#    cpu_offload().
# About ten minutes on an H100 (the CUDA tests about five); STAGES="table llama" runs a subset.
# Writes pytest's report, the tables and their JSON under $OUT (default: ./gpu-check).
set -u
OUT="${OUT:-gpu-check}"
STAGES="${STAGES:-tests table llama}"
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
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"

stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if stage tests; then
# -v: each test's outcome is written as it ends, so a run cut by its timeout still names them.
timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 120 -rfE --tb=short \
    -k "cuda or CUDA" test/test_offload.py test/test_budget.py test/test_hooks_library.py \
    test/test_inline_numerics.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest.txt"
grep -E "(FAILED|ERROR) |passed|failed" "$OUT/pytest.txt" | grep -v " PASSED " | tail -20
fi

if stage table; then
timeout "${TABLE_TIMEOUT:-240}" python3 benchmarks/gpu_offload_profile.py --rows table --out "$OUT" \
    --json "$OUT/table.json" --order-lines 40 > "$OUT/table.log" 2>&1
echo "table rc=$?" | tee -a "$OUT/table.log"
sed -n '/^history/,$p' "$OUT/profile.txt" | grep -v "^ROW"
fi

if stage llama; then
mkdir -p "$OUT/llama"
timeout "${LLAMA_TIMEOUT:-300}" python3 benchmarks/gpu_offload_profile.py --rows llama --no-code \
    --out "$OUT/llama" --json "$OUT/llama/llama.json" > /tmp/gpu-check-llama.log 2>&1
echo "llama rc=$?"
grep -E "^(variant|no-hooks|budget|stock|offload)|Error" /tmp/gpu-check-llama.log | tail -8
fi
