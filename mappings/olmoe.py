"""OLMoE (``OlmoeForCausalLM``) as vLLM builds it: Llama's decoder layer (``llama.py``) with q/k
norms over the whole projection and a mixture of experts as every layer's MLP
(``model.layers.{layer}.mlp``, see ``_moe.py``). Attention::

    q, k, v = qkv_proj(hidden)[0].split(...)
    q = q_norm(q)                  # RMSNorm over all H·d_head channels at once (not per head):
    k = k_norm(k)                  #   attn.hook_q_normed / hook_k_normed [pos, H·d_head]
    q, k = rotary_emb(positions, q, k)

``hook_q`` / ``hook_k`` stay the projections before the norm, as in TransformerLens; the normed
values keep the norm's own layout, ``[pos, H·d_head]`` (``[pos, Hkv·d_head]`` for k), as
TransformerLens's bridge gives them (Qwen3's per-head norms give them per head). vLLM never
renormalizes OLMoE's routing (it ignores ``norm_topk_prob``): each chosen expert weighs its softmax
probability over all experts.

vLLM builds every OLMoE norm with ``eps=1e-5`` whatever ``rms_norm_eps`` says; checkpoints with
another ``rms_norm_eps`` differ from HuggingFace by that.
"""

from transformers import OlmoeConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._moe import SoftmaxTopK, moe_member, with_experts
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import ATTN, BLOCK, MLP
from vlens.names.mapping import Spec, inserted_before, leaving


def router(config: PretrainedConfig) -> SoftmaxTopK:
    """The routing vLLM builds for ``OlmoeMoE`` (``renormalize=False`` whatever the config)."""
    return SoftmaxTopK(top_k=config.num_experts_per_tok, renormalize=False)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    specs = llama.hook_specs(config)
    normed = {
        f"{BLOCK}.attn.hook_q_normed": leaving(f"{ATTN}.q_norm", shape="pos heads_d_head"),
        f"{BLOCK}.attn.hook_k_normed": leaving(f"{ATTN}.k_norm", shape="pos kv_heads_d_head"),
    }
    return with_experts(inserted_before(specs, f"{BLOCK}.attn.hook_rot_q", normed), MLP, router(config))


def tiny_config() -> PretrainedConfig:
    """OLMoE: 4 experts of 64 (``intermediate_size``), top-2, not renormalized; the eps vLLM
    hard-codes."""
    return OlmoeConfig(
        **{**rotary_dims(), "intermediate_size": 64},
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


MAPPING = moe_member(
    llama.MAPPING,
    "OlmoeForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"olmoe": tiny_config},
)
