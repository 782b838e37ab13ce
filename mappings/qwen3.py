"""Qwen3 (``Qwen3ForCausalLM``) as vLLM builds it, in TransformerLens names.

Qwen3's decoder layer is Llama's (same fused residual, same module names: see ``llama.py``). Its
attention adds a per-head RMSNorm on q and k (``self_attn.q_norm``, ``self_attn.k_norm``) between
``qkv_proj`` and the rotary embedding.
"""

from transformers import PretrainedConfig

from vlens.mapping import ArchitectureMapping, HookSpec
from vlens.mappings import llama


def hook_specs(config: PretrainedConfig) -> dict[str, HookSpec]:
    return llama.hook_specs(config)


MAPPING = ArchitectureMapping(architectures=("Qwen3ForCausalLM",), hook_specs=hook_specs)
