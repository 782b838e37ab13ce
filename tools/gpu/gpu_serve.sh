#!/bin/bash
# On one H200: bench/serve.py's compiled-engine row (plain compiled `vllm serve` against
# `vlens serve --compiled-steering`, every request with its own vector) on Qwen3-8B's shape with
# dummy bf16 weights, once the parts of tools/README.md are in /tmp/vlens-parts (about 5 minutes:
# two server starts, each compiling). Writes serve.md and the servers' logs under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-serve-out}
mkdir -p "$OUT/logs"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout "${SERVE_TIMEOUT:-540}" python3 "$root/bench/serve.py" --shape qwen3-8b --modes compiled \
  --dtype bfloat16 --clients 64 --requests 4 --prompt-tokens 128 --new-tokens 128 --reps 3 \
  --kv-cache-memory-bytes 0 --extra "--gpu-memory-utilization 0.85" \
  --out "$OUT/serve.md" --logs "$OUT/logs" "$@" 2>&1 | tee "$OUT/serve.log" | grep -E "^\[serve|^\||rror" || true
for log in "$OUT"/logs/*.log; do echo "== $log"; grep -E "Error|error|Traceback" "$log" | head -5; done
