#!/bin/bash
# DeepSeek V2/V3 (MLA + MoE) on CUDA, in bf16: the part of tools/gpu/gpu.sh that the CPU test
# checkpoints cannot do there. vLLM 0.26 on CUDA has no MLA attention backend in fp32, and its
# MLA prefill (FlashAttention) accepts only DeepSeek's own head dimensions, so this uses
# tools/gpu/tiny_cuda.py's checkpoints (qk_nope 128, rope 64, v 128; built and carried in tiny.tar.part.NN
# by tools/gpu/prepare_gpu.sh). Both model runners side by side; tables in $OUT/tables-ds.md.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/vlens-gpu-out}
mkdir -p "$OUT"
[[ -n ${VLENS_CACHE:-} ]] || source "$here/gpu_setup.sh" || exit 1
export PARITY_THREADS=6
models="$VLENS_CACHE/tiny/deepseek_v3-mla128-seed0 $VLENS_CACHE/tiny/deepseek_v2-mla128-seed0"
for v2 in 1 0; do
  (TRITON_CACHE_DIR=/tmp/triton-ds$v2 VLLM_USE_V2_MODEL_RUNNER=$v2 \
    timeout "${PARITY_TIMEOUT:-300}" python3 -m vlens.parity.gpu $models --dtype bfloat16 --isolation \
    --json "$OUT/parity-ds-runner$v2.json" > "/tmp/parity-ds-runner$v2.log" 2>&1
   echo "DeepSeek, VLLM_USE_V2_MODEL_RUNNER=$v2: exit $?") &
done
wait
cat /tmp/parity-ds-runner1.log /tmp/parity-ds-runner0.log > "$OUT/parity-ds.log"
grep -h "^\[parity\]" "$OUT/parity-ds.log"
python3 -m vlens.parity.gpu --report $(ls "$OUT"/parity-ds-runner*.json) > "$OUT/tables-ds.md"
head -c 4000 "$OUT/tables-ds.md"
