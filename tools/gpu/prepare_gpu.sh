#!/bin/bash
# Here (no GPU), from the project root, after `bash ../shared/gpu/prepare.sh`: writes one more
# folder after prepare.sh's last (.gpu8 after .gpu7) with what vlens needs on the GPU machine beyond
# vLLM: transformer_lens 4.3 and the packages its import needs that the machine's image lacks, and
# those vLLM's OpenAI server needs (wheels, which the parts' install.sh installs with vLLM's), and
# the tiny test checkpoints of every architecture the mapping files declare (with tiny_cuda.py's
# DeepSeek ones) as one tar in parts of at most 50 MiB, tiny.tar.part.NN, spread over that folder
# and as many more as they need, so that each folder with the project beside it stays under 64 MiB.
# Then every .gpuK folder's files go to /tmp/vlens-parts on the GPU machine (tools/README.md), and
# the scripts of tools/gpu/ run there.
set -euo pipefail
root=$(pwd)
here=$(cd "$(dirname "$0")" && pwd)
folders() { ls -d "$root"/.gpu[0-9]* | sed 's/.*\.gpu//' | sort -n; }
for k in $(folders); do  # folders this script made before (its wheels, tiny parts): remake them
  if ls "$root/.gpu$k" | grep -qE '^(transformer_lens-|tiny\.tar)'; then rm -rf "$root/.gpu$k"; fi
done
n=$(folders | tail -1)
ours="$root/.gpu$((n + 1))"
mkdir -p "$ours"
stage=${VLENS_GPU_STAGE:-/tmp/vlens-gpu-stage}/extra
mkdir -p "$stage"
plat="--only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any"
pip download -q --no-deps -d "$stage" $plat transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 beartype==0.23.1 typeguard==4.6.1 fancy-einsum==0.0.3 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 \
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
# pytest: the compiled engine's tests; the last three: what vLLM 0.26's OpenAI server imports beyond
# prepare.sh's wheels (vlens serve, tools/gpu/gpu_serve.sh)
cp "$stage"/*.whl "$ours"/
python3 -c "from vlens.testing.tiny import ARCHS, tiny_model; [tiny_model(a) for a in ARCHS]"
python3 "$here/tiny_cuda.py"  # DeepSeek with MLA dimensions CUDA's kernels accept
cache=${VLENS_CACHE:-$HOME/.cache/vlens}
rm -f "$stage"/tiny.tar*
tar cf "$stage/tiny.tar" -C "$cache" tiny
split -b 50M -d -a 2 "$stage/tiny.tar" "$stage/tiny.tar.part."
k=$((n + 1))
for part in "$stage"/tiny.tar.part.*; do  # the first part joins the wheels, each other its own
  mkdir -p "$root/.gpu$k" && cp "$part" "$root/.gpu$k/" && k=$((k + 1))
done
du -sh "$root"/.gpu[0-9]*
