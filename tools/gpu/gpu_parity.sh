#!/bin/bash
# Parity of chosen tiny models on CUDA, once the parts of tools/README.md are in /tmp/vlens-parts:
# `ARCHS="gemma2 gpt_neox" bash tools/gpu/gpu_parity.sh`. bf16 under both model runners and fp32
# (Triton's fp32 dots in IEEE precision, as gpu.sh) under the V2 runner, the three side by side,
# each stopped after PARITY_TIMEOUT seconds (the JSON keeps every model finished by then). Writes
# the JSON of each run, parity.log and tables.md under $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/vlens-gpu-out}
mkdir -p "$OUT"
source "$here/gpu_setup.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
limit=${PARITY_TIMEOUT:-400}
archs=${ARCHS:?name the tiny models, e.g. ARCHS="gemma2 mistral"}
export PARITY_THREADS=5
run() {  # name, runner, dtype
  TRITON_CACHE_DIR=/tmp/triton-$1 TRITON_F32_DEFAULT=ieee VLLM_USE_V2_MODEL_RUNNER=$2 \
    timeout "$limit" python3 -m vlens.parity.gpu $archs --dtype "$3" --json "$OUT/parity-$1.json" \
    > "/tmp/parity-$1.log" 2>&1
  echo "$1: exit $?"
}
run bf16-runner1 1 bfloat16 &
run bf16-runner0 0 bfloat16 &
run fp32-runner1 1 float32 &
wait
cat /tmp/parity-bf16-runner1.log /tmp/parity-bf16-runner0.log /tmp/parity-fp32-runner1.log \
  > "$OUT/parity.log"
grep -h "^\[parity\]" "$OUT/parity.log"
python3 -m vlens.parity.gpu --report $(ls "$OUT"/parity-*.json 2>/dev/null) --detail $archs \
  > "$OUT/tables.md"
head -c 5000 "$OUT/tables.md"
