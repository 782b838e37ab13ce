#!/bin/bash
# Here (no GPU), from the project root, after `bash ../shared/gpu/prepare.sh`: writes one more
# folder after prepare.sh's last (.gpu8 after .gpu7) with what vlens needs on the GPU machine
# beyond vLLM: transformer_lens 4.3 and the packages its import needs that the machine's image
# lacks (wheels, which the parts' install.sh installs with vLLM's), and the tiny test checkpoints
# (tiny.tar, with tiny_cuda.py's DeepSeek ones). Then carry every .gpuK folder as
# ../shared/gpu/README.md says, and run tools/gpu/gpu.sh, gpu_deepseek.sh, gpu_graph.sh or
# bench.sh in the calls right after.
set -euo pipefail
root=$(pwd)
here=$(cd "$(dirname "$0")" && pwd)
n=$(ls -d "$root"/.gpu[0-9]* | sed 's/.*\.gpu//' | sort -n | tail -1)
ours="$root/.gpu$((n + 1))"
if [[ -f $root/.gpu$n/tiny.tar ]]; then ours="$root/.gpu$n"; fi  # made before: remake it
rm -rf "$ours" && mkdir -p "$ours"
stage=${VLENS_GPU_STAGE:-/tmp/vlens-gpu-stage}/extra
mkdir -p "$stage"
plat="--only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any"
pip download -q --no-deps -d "$stage" $plat transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 beartype==0.23.1 typeguard==4.6.1 fancy-einsum==0.0.3 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0  # pytest: the graph tier's tests
cp "$stage"/*.whl "$ours"/
python3 -c "from vlens.testing import ARCHS, tiny_model; [tiny_model(a) for a in ARCHS]"
python3 "$here/tiny_cuda.py"  # DeepSeek with MLA dimensions CUDA's kernels accept
cache=${VLENS_CACHE:-$HOME/.cache/vlens}
tar cf "$ours/tiny.tar" -C "$cache" tiny
du -sh "$ours"
