#!/usr/bin/env bash
# Everything the CUDA path needs checked on a GPU machine, in one command (see ../CONTRIBUTING.md):
#
#   bash benchmarks/gpu_check.sh     # from the repository root, on a machine with CUDA
#
# (On a machine without internet, put an expecttest wheel under .whl/ first.)
# 1. the CUDA variants of the offload, numerics and placement suites;
# 2. the offload benchmark on inductor (mlp8 at the default GPU sizes: no hooks, cpu_offload and
#    fp8_rowwise+cpu_offload, eager hooks against ours), side by side in one invocation;
# 3. the activation-memory budget rows (budget(F), stock activation_memory_budget=F, uniform
#    fp8 + offload) on mlp8, inductor.
# The three stages take about eight minutes on an H100/H200; STAGES="tests offload" runs a subset.
# Writes pytest's report, the bench tables and their JSON under $OUT (default: ./gpu-check).
set -u
OUT="${OUT:-gpu-check}"
STAGES="${STAGES:-tests offload budget}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."

# expecttest is the one test dependency a CUDA image may lack; installed into a private target
# with the interpreter that runs the tests, so a pip of another Python cannot take the install.
if ! python -c "import expecttest" 2>/dev/null; then
    python -m pip install -q --no-index --no-deps --target "$OUT/.site" .whl/expecttest-*.whl \
        && export PYTHONPATH="$OUT/.site${PYTHONPATH:+:$PYTHONPATH}"
fi
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"

stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if stage tests; then
timeout 300 python -m pytest -q -x -k "cuda or CUDA" \
    test/test_offload.py test/test_hooks_library.py test/test_inline_numerics.py test/test_budget.py \
    > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest.txt"
tail -3 "$OUT/pytest.txt"
fi

if stage offload; then
timeout 280 python -m torch_patches bench --device cuda --models mlp8 --backends inductor \
    --hooks cpu_offload,fp8_rowwise+cpu_offload --modes eager-hooks,ours \
    --json "$OUT/bench-offload.json" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" | tee -a "$OUT/bench.txt"
tail -12 "$OUT/bench.txt"
fi

if stage budget; then
timeout 280 python -m torch_patches bench --device cuda --models mlp8 --backends inductor \
    --hooks fp8_rowwise+cpu_offload --modes ours --budget 0.3,0.5,0.7 --json "$OUT/bench-budget.json" \
    > "$OUT/bench-budget.txt" 2>&1
echo "bench budget rc=$?" | tee -a "$OUT/bench-budget.txt"
tail -20 "$OUT/bench-budget.txt"
fi
rm -rf "$OUT/.site"
