#!/bin/bash
# The compiled engine's tests on CUDA (tests/engine/test_compiled.py, tests/engine/test_steering.py,
# tests/unit/test_kept_steps.py) under both model runners side by side, with torch.compile and CUDA
# graphs on (about 4 minutes), on the GPU machine once the parts of tools/README.md are in
# /tmp/vlens-parts; writes each runner's log under $OUT. Its benchmark is
# `bash tools/gpu/bench.sh --skip eager,hf,transformer_lens`.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-graph-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
# fp32 parity between compiled and eager: Triton's dots in IEEE precision (see tools/gpu/gpu.sh).
for v2 in 1 0; do
  (VLLM_USE_V2_MODEL_RUNNER=$v2 TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-graph$v2 \
    VLENS_TEST_ENGINE_ARGS='{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 1073741824}' timeout "${TEST_TIMEOUT:-300}" \
    python3 -m pytest -q -p no:cacheprovider "$root/tests/engine/test_compiled.py" \
    "$root/tests/engine/test_steering.py" "$root/tests/unit/test_kept_steps.py" > "$OUT/tests-runner$v2.log" 2>&1
   echo "compiled engine tests, VLLM_USE_V2_MODEL_RUNNER=$v2: exit $?"; tail -2 "$OUT/tests-runner$v2.log") &
done
wait
grep -h "^FAILED\|^E " "$OUT"/tests-runner*.log | head -20
