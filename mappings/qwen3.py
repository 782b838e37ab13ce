"""Qwen3 (``Qwen3ForCausalLM``) as vLLM builds it, in TransformerLens names.

Qwen3's decoder layer is Llama's (same fused residual, same module names: see ``llama.py``). Its
attention adds a per-head RMSNorm on q and k between ``qkv_proj`` and the rotary embedding::

    q, k, v = qkv_proj(hidden)[0].split(...)
    q = q_norm(q.view(pos, H, d_head))      # attn.hook_q_normed
    k = k_norm(k.view(pos, Hkv, d_head))    # attn.hook_k_normed
    q, k = rotary_emb(positions, q, k)      # attn.hook_rot_q, attn.hook_rot_k

``hook_q`` / ``hook_k`` stay the projections before the norm, as in TransformerLens; the normed
values are heads-first (``[batch, head, pos, d_head]``), as TransformerLens's bridge gives them.
"""

from transformers import PretrainedConfig, Qwen3Config

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, per_head_norms
from vlens.names.mapping import Spec, inserted_before


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    specs = llama.hook_specs(config)
    return inserted_before(specs, f"{BLOCK}.attn.hook_rot_q", per_head_norms(config))


def tiny_config() -> PretrainedConfig:
    """Qwen3: QK-norm, untied unembedding, head_dim given explicitly as Qwen3 reads it."""
    return Qwen3Config(**rotary_dims(), head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False)


MAPPING = llama.MAPPING.member(
    "Qwen3ForCausalLM", hook_specs=hook_specs, tiny_configs={"qwen3": tiny_config}
)
