#!/bin/bash
# Here (no GPU), from the project root, after `bash ../shared/gpu/prepare.sh`: adds to the last
# .gpuN folder what vlens needs on the GPU machine beyond vLLM: transformer_lens 4.3 and the
# packages its import needs that the machine's image lacks (wheels, which the parts' install.sh
# installs with vLLM's), and the tiny test checkpoints (tiny.tar: built here, where they are
# cached already). Then carry .gpu1 ... .gpuN as ../shared/gpu/README.md says, and run
# parity/gpu.sh or bench/gpu.sh in the calls right after.
set -euo pipefail
root=$(pwd)
last=$(ls -d "$root"/.gpu[0-9]* | sort -V | tail -1)
stage=${VLENS_GPU_STAGE:-/tmp/vlens-gpu-stage}/extra
mkdir -p "$stage"
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
pip download -q --no-deps -d "$stage" $plat transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 beartype==0.23.1 typeguard==4.6.1 fancy-einsum==0.0.3
cp "$stage"/*.whl "$last"/
python3 -c "from vlens.testing import ARCHS, tiny_model; [tiny_model(a) for a in ARCHS]"
cache=${VLENS_CACHE:-$HOME/.cache/vlens}
tar cf "$last/tiny.tar" -C "$cache" tiny
du -sh "$last"
