"""Jais 2 (``Jais2ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): LayerNorms with biases, rotary attention with biases on
every projection, an ungated MLP with biases (``up_proj``, ``down_proj``), untied unembedding.
"""

from transformers import Jais2Config, PretrainedConfig

from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.testing import rotary_dims
from vlens.weights import WeightNames

LAYER = "model.layers.{layer}"
ATTN, MLP = f"{LAYER}.self_attn", f"{LAYER}.mlp"


def tiny_config() -> PretrainedConfig:
    return Jais2Config(**rotary_dims(), head_dim=32, layer_norm_eps=1e-5)


WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_eps",
    W_E="model.embed_tokens.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    b_Q=f"{ATTN}.q_proj.bias",
    b_K=f"{ATTN}.k_proj.bias",
    b_V=f"{ATTN}.v_proj.bias",
    W_O=f"{ATTN}.o_proj.weight",
    b_O=f"{ATTN}.o_proj.bias",
    W_in=f"{MLP}.up_proj.weight",
    b_in=f"{MLP}.up_proj.bias",
    W_out=f"{MLP}.down_proj.weight",
    b_out=f"{MLP}.down_proj.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_w="model.norm.weight",
    ln_final_b="model.norm.bias",
    W_U=("lm_head.weight", "model.embed_tokens.weight"),
)

MAPPING = transformers_backend_mapping(
    "Jais2ForCausalLM",
    details=Details(eps="layer_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"jais2": tiny_config},
)
