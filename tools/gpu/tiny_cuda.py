"""Tiny DeepSeek checkpoints that vLLM 0.26 can run on CUDA (``python tools/gpu/tiny_cuda.py``).

The CPU test checkpoints (``vlens.testing.tiny``) give MLA ``qk_nope_head_dim = v_head_dim = 32``;
vLLM 0.26 on CUDA has no MLA prefill backend for those dimensions (FlashAttention's MLA prefill
wants DeepSeek's own 128 / 64 / 128), and no MLA backend at all in fp32. These are the same
recipe with DeepSeek's head dimensions, for bf16 parity on the GPU: folders
``$VLENS_CACHE/tiny/deepseek_v3-mla128-seed0`` and ``deepseek_v2-mla128-seed0`` (``build(name,
init_std=0.02)``: the same drawn with another init, in ``...-seed0-std0.02``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from vlens.mappings._tiny import INIT_STD
from vlens.testing import tiny as testing

NAMES = {
    "deepseek_v3-mla128": (True, DeepseekV3Config),
    "deepseek_v2-mla128": (False, DeepseekV2Config),
}


def build(name: str, seed: int = 0, init_std: float | None = None) -> Path:
    """The folder of the tiny checkpoint ``name`` (one of ``NAMES``), building it on first use;
    ``init_std`` as in :func:`vlens.testing.tiny.tiny_model` (a variant in its own folder)."""
    v3, config_class = NAMES[name]
    target = testing.cache_root() / "tiny" / f"{name}-seed{seed}{testing.init_tag(init_std)}"
    if target.is_dir():
        return target
    values = testing.CONFIG_BUILDERS["deepseek_v3" if v3 else "deepseek_v2"]().to_dict()
    values.update(qk_nope_head_dim=128, v_head_dim=128)
    values.update(initializer_range=INIT_STD if init_std is None else init_std)
    values.pop("qk_head_dim", None)
    config = config_class(**values)

    def write(folder: Path) -> None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        testing._jitter_constant_tensors(model)
        model.save_pretrained(folder)
        testing.build_tokenizer().save_pretrained(folder)

    testing._build_atomically(target, write)
    return target


if __name__ == "__main__":
    for name in sys.argv[1:] or NAMES:
        print(build(name))
