"""SmolLM3 (``SmolLM3ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): Llama's block, with no rotary positions on the layers
``config.no_rope_layers`` marks 0 (NoPE): there ``hook_rot_q``/``hook_rot_k`` are q and k as they
are, as HuggingFace's attention uses them.
"""

from transformers import PretrainedConfig, SmolLM3Config

from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.testing import EOS_ID, rotary_dims
from vlens.weights import WeightNames

LAYER = "model.layers.{layer}"
ATTN, MLP = f"{LAYER}.self_attn", f"{LAYER}.mlp"


def tiny_config() -> PretrainedConfig:
    """SmolLM3: the middle layer without rotary, tied unembedding."""
    return SmolLM3Config(
        **rotary_dims(), rms_norm_eps=1e-6, no_rope_layers=[1, 0, 1], pad_token_id=EOS_ID
    )


WEIGHTS = WeightNames(
    normalization="RMS",
    eps="rms_norm_eps",
    W_E="model.embed_tokens.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    W_O=f"{ATTN}.o_proj.weight",
    W_in=f"{MLP}.up_proj.weight",
    W_gate=f"{MLP}.gate_proj.weight",
    W_out=f"{MLP}.down_proj.weight",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln_final_w="model.norm.weight",
    W_U=("lm_head.weight", "model.embed_tokens.weight"),
)

MAPPING = transformers_backend_mapping(
    "SmolLM3ForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"smollm3": tiny_config},
)
