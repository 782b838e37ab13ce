#!/bin/bash
# bench/run.py's GPU preset (Qwen3-8B's shape, dummy bf16 weights) with --profile, on the GPU
# machine once the parts of tools/README.md are in /tmp/vlens-parts; its own arguments are
# bench/run.py's options (--skip, --reps, --timeouts, --tensor-parallel-size, --executor). Every
# worker takes about 8 minutes (the vlens engine's workloads, then the compiled engine, then
# HuggingFace). Writes results.md, results.json, profile.txt and bench.log under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-bench-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 "$root/bench/run.py" --preset gpu --out "$OUT" --profile "$@" 2>&1 | tee "$OUT/bench.log" \
  | grep -E "^\[bench\]|^\||Error|error" || true
