"""Seed-OSS (``SeedOssForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): a Llama-shaped block (RMSNorms, gated MLP, grouped keys)
with biases on q, k and v, none on the output projection.
"""

from transformers import PretrainedConfig, SeedOssConfig

from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.testing import rotary_dims
from vlens.weights import WeightNames

LAYER = "model.layers.{layer}"
ATTN, MLP = f"{LAYER}.self_attn", f"{LAYER}.mlp"


def tiny_config() -> PretrainedConfig:
    return SeedOssConfig(**rotary_dims(), head_dim=32, rms_norm_eps=1e-6)


WEIGHTS = WeightNames(
    normalization="RMS",
    eps="rms_norm_eps",
    W_E="model.embed_tokens.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    b_Q=f"{ATTN}.q_proj.bias",
    b_K=f"{ATTN}.k_proj.bias",
    b_V=f"{ATTN}.v_proj.bias",
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
    "SeedOssForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"seed_oss": tiny_config},
)
