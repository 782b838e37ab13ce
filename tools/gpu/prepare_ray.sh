#!/bin/bash
# Here (no GPU), from the project root, after prepare.sh and prepare_gpu.sh: adds folders after the
# last .gpuK with Ray Data 2.60 and what it needs, as wheels for the GPU machine's Python 3.12 (the
# Ray wheel in parts of at most 40 MiB, ray.whl.part.NN, joined by gpu_ray_setup.sh), so that
# `vlens cache --ray` and bench/harvest.py run there. Each folder stays under 58 MiB.
set -euo pipefail
root=$(pwd)
stage=${VLENS_GPU_STAGE:-/tmp/vlens-gpu-stage}/ray
rm -rf "$stage" && mkdir -p "$stage/wheels" "$stage/parts"
pip download -q -d "$stage/wheels" "ray[data]==2.60.0" --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any
ray=$(ls "$stage"/wheels/ray-2.60.0-*.whl)
basename "$ray" > "$stage/parts/ray.whl.name"
split -b 40M -d -a 2 "$ray" "$stage/parts/ray.whl.part."
rm "$ray"
for k in $(ls -d "$root"/.gpu[0-9]* | sed 's/.*\.gpu//' | sort -n); do  # this script's, remade
  if ls "$root/.gpu$k" | grep -qE '^ray\.whl'; then rm -rf "$root/.gpu$k"; fi
done
n=$(ls -d "$root"/.gpu[0-9]* | sed 's/.*\.gpu//' | sort -n | tail -1)
python3 - "$stage" "$root" "$n" <<'PY'
import os, shutil, sys
stage, root, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
files = [os.path.join(stage, d, f) for d in ("parts", "wheels")
         for f in sorted(os.listdir(os.path.join(stage, d)))]
cap, bins = 58 * 2**20, []
for f in sorted(files, key=os.path.getsize, reverse=True):
    size = os.path.getsize(f)
    target = next((b for b in bins if b[0] + size <= cap), None)
    if target is None:
        target = [0, []]
        bins.append(target)
    target[0] += size
    target[1].append(f)
for i, (_, fs) in enumerate(bins, last + 1):
    folder = os.path.join(root, f".gpu{i}")
    os.makedirs(folder)
    for f in fs:
        shutil.copy(f, folder)
PY
du -sh "$root"/.gpu[0-9]*
