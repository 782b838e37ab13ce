#!/bin/bash
# Test files of the suite on the GPU, as they are, once the parts of tools/README.md are in
# /tmp/vlens-parts:  bash tools/gpu/gpu_tests.sh tests/engine/test_batch_hooks.py ...
# fp32 runs with Triton's dot products in IEEE precision (TRITON_F32_DEFAULT=ieee), as the parity
# tolerances need; the references (HuggingFace, TransformerLens's bridge) run on the CPU. TEST_K
# selects tests, TEST_TIMEOUT bounds the run (seconds), TEST_ENGINE_ARGS (JSON) adds engine
# arguments. Writes tests.log (and its summary, summary.txt) under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-tests-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
files=("$@")
TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-tests \
  VLENS_TEST_ENGINE_ARGS=${TEST_ENGINE_ARGS:-'{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 1073741824}'} \
  timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q -p no:cacheprovider -rfEs \
  "${files[@]/#/$root/}" ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
echo "exit $?" | tee "$OUT/summary.txt"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tests.log" | tail -40 | tee -a "$OUT/summary.txt"
