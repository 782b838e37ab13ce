#!/bin/bash
# On two GPUs: the tensor-parallel tests (tests/engine/test_tensor_parallel.py: eager and compiled TP=2
# against one eager rank, every name of Llama and Qwen3, steering) and tests/unit/test_shared_tensors.py
# with torch.compile and CUDA graphs on (about 4 minutes), once the parts of tools/README.md are
# in /tmp/vlens-parts; writes the log under $OUT. Its benchmark is
# `bash tools/gpu/bench.sh --tensor-parallel-size 2 --skip eager,hf,transformer_lens`.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-tp-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
export NCCL_NVLS_ENABLE=0  # NVLink multicast (NVLS) stays off
# fp32 parity between compiled and eager: Triton's dots in IEEE precision (see tools/gpu/gpu.sh).
TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-tp \
  VLENS_TEST_ENGINE_ARGS='{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 1073741824}' \
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider \
  "$root/tests/engine/test_tensor_parallel.py" "$root/tests/unit/test_shared_tensors.py" > "$OUT/tests-tp.log" 2>&1
echo "tensor-parallel tests: exit $?"
tail -2 "$OUT/tests-tp.log"
grep -h "^FAILED\|^E " "$OUT/tests-tp.log" | head -20
# RUNNER_CHECK=SECONDS: the compiled Qwen3 tests again under the V1 model runner (whether a
# failure follows the model runner).
if [[ -n "${RUNNER_CHECK:-}" ]]; then
  TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-tp1 VLLM_USE_V2_MODEL_RUNNER=0 \
    VLENS_TEST_ENGINE_ARGS='{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 1073741824}' \
    timeout "$RUNNER_CHECK" python3 -m pytest -q -p no:cacheprovider -k "compiled and qwen3 and not moe" \
    "$root/tests/engine/test_tensor_parallel.py" > "$OUT/tests-tp-v1.log" 2>&1
  echo "compiled Qwen3 tests under the V1 runner: exit $?"
  tail -1 "$OUT/tests-tp-v1.log"
fi
