#!/bin/bash
# bench/harvest.py's GPU preset (Qwen3-8B's shape, dummy bf16 weights) on the GPU machine: one
# engine's `vlens cache` against `vlens cache --ray` with one worker on the same GPU, what Ray
# costs. Its arguments are bench/harvest.py's. Writes harvest.json and harvest.log under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-harvest-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
source "$root/tools/gpu/gpu_ray_setup.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 "$root/bench/harvest.py" --preset gpu --out "$OUT/harvest.json" --work /tmp/harvest \
  "$@" 2>&1 | tee "$OUT/harvest.log"
