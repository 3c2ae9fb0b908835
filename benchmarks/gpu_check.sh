#!/usr/bin/env bash
# Everything the CUDA path needs checked on a GPU machine, in one command (see ../CONTRIBUTING.md):
#
#   bash benchmarks/gpu_check.sh     # from the repository root, on a machine with CUDA
#
# (On a machine without internet, put an expecttest wheel under .whl/ first.)
# 1. the CUDA variants of the offload, numerics and placement suites;
# 2. the offload benchmark on inductor (mlp8 and the transformer block, all offload rows)
#    at the default GPU sizes, side by side in one invocation;
# 3. the activation-memory budget rows (budget(F), stock activation_memory_budget=F, uniform
#    fp8 + offload) on mlp8, inductor.
# Writes pytest's report, the bench table and its JSON under $OUT (default: ./gpu-check).
set -u
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

python -c "import expecttest" 2>/dev/null || pip install -q --no-index .whl/expecttest-*.whl
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"

timeout 300 python -m pytest -q -x -k "cuda or CUDA" \
    test/test_offload.py test/test_hooks_library.py test/test_inline_numerics.py test/test_budget.py \
    > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest.txt"
tail -3 "$OUT/pytest.txt"

timeout 280 python -m torch_patches bench --device cuda --models mlp8,transformer --backends inductor \
    --hooks fp8_rowwise,cpu_offload,fp8_rowwise+cpu_offload --json "$OUT/bench-offload.json" \
    > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" | tee -a "$OUT/bench.txt"
tail -40 "$OUT/bench.txt"

timeout 280 python -m torch_patches bench --device cuda --models mlp8 --backends inductor \
    --hooks fp8_rowwise+cpu_offload --modes ours --budget 0.3,0.5,0.7 --json "$OUT/bench-budget.json" \
    > "$OUT/bench-budget.txt" 2>&1
echo "bench budget rc=$?" | tee -a "$OUT/bench-budget.txt"
tail -20 "$OUT/bench-budget.txt"
