#!/bin/bash
# Sourced on the GPU machine by gpu.sh, gpu_parity.sh, gpu_deepseek.sh, gpu_graph.sh, gpu_tp.sh,
# gpu_scale.sh, gpu_host_copy.sh, gpu_serve.sh and bench.sh:
# installs what the machine lacks and sets the environment. Expects /tmp/vlens-parts to hold the
# files of every .gpuK folder (tools/README.md): vLLM 0.26.0 in parts, its dependencies, and what
# prepare_gpu.sh adds (transformer_lens and its import-time dependencies, pytest and vLLM's API
# server's dependencies as wheels, tiny checkpoints as tiny.tar.part.NN).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
parts=/tmp/vlens-parts
if [[ -n ${VLENS_GPU_READY:-} ]]; then  # a shell that sourced this already: its scripts share it
  cd /tmp && return 0
fi
bash "$parts/install.sh" || return 1
# vlens as installed: mappings/ and parity/ are vlens.mappings and vlens.parity (pyproject.toml).
rm -rf /tmp/vlens-pkg && mkdir -p /tmp/vlens-pkg
cp -r "$root/vlens" /tmp/vlens-pkg/vlens
cp -r "$root/mappings" /tmp/vlens-pkg/vlens/mappings
cp -r "$root/parity" /tmp/vlens-pkg/vlens/parity
# Its entry points (vlens serve's endpoint plugin) as a dist-info folder on the path, which is
# where importlib.metadata finds them.
python3 - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
info = Path(f"/tmp/vlens-pkg/vlens-{project['version']}.dist-info")
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vlens\nVersion: {project['version']}\n")
groups = project.get("entry-points", {}) | {"console_scripts": project.get("scripts", {})}
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n"
    for group, points in groups.items()))
EOF
if compgen -G "$parts/tiny.tar.part.*" > /dev/null && [[ ! -d /tmp/vlens-cache/tiny ]]; then
  mkdir -p /tmp/vlens-cache && cat "$parts"/tiny.tar.part.* | tar xf - -C /tmp/vlens-cache
fi
export VLENS_CACHE=/tmp/vlens-cache
export PYTHONPATH=/tmp/vlens-pkg:/tmp/vlens-site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
if ! python3 -c "import transformer_lens" 2>/tmp/vlens-tl-import.log; then
  # transformer_lens imports `datasets` at import time only for dataset utilities vlens never
  # calls; if the carried `datasets` does not import on this image, stand in for it.
  tail -3 /tmp/vlens-tl-import.log
  echo "transformer_lens does not import: putting a stand-in for datasets first on the path"
  stub=/tmp/vlens-stub/datasets && mkdir -p $stub
  printf 'def load_dataset(*a, **k):\n    raise RuntimeError("datasets stand-in")\n' > $stub/load.py
  echo 'from datasets.load import load_dataset' > $stub/__init__.py
  echo 'class Dataset: pass' > $stub/arrow_dataset.py
  echo 'class IterableDataset: pass' > $stub/iterable_dataset.py
  export PYTHONPATH=/tmp/vlens-stub:$PYTHONPATH
fi
cd /tmp  # not the checkout: its vlens/ lacks vlens.mappings and vlens.parity
python3 -c "import vllm, torch, transformer_lens, vlens
print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" || return 1
export VLENS_GPU_READY=1
