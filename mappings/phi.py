"""Phi (``PhiForCausalLM``, Phi-1/1.5/2) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): HuggingFace's modules, named by TransformerLens's adapter.

Attention and MLP in parallel on one LayerNorm's output (``input_layernorm``): no ``ln2``,
``hook_resid_mid`` or ``hook_mlp_in``, as in TransformerLens. Rotary positions on the first
``partial_rotary_factor`` of each head; ``dense`` is the output projection; the unembedding has a
bias (``b_U``), which the logits include.
"""

from transformers import PhiConfig, PretrainedConfig

from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.names.weights import WeightNames

LAYER = "model.layers.{layer}"


def tiny_config() -> PretrainedConfig:
    """Phi: half of each head rotated, untied unembedding with a bias."""
    return PhiConfig(
        **rotary_dims(), partial_rotary_factor=0.5, layer_norm_eps=1e-5, tie_word_embeddings=False
    )


WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_eps",
    W_E="model.embed_tokens.weight",
    W_Q=f"{LAYER}.self_attn.q_proj.weight",
    W_K=f"{LAYER}.self_attn.k_proj.weight",
    W_V=f"{LAYER}.self_attn.v_proj.weight",
    b_Q=f"{LAYER}.self_attn.q_proj.bias",
    b_K=f"{LAYER}.self_attn.k_proj.bias",
    b_V=f"{LAYER}.self_attn.v_proj.bias",
    W_O=f"{LAYER}.self_attn.dense.weight",
    b_O=f"{LAYER}.self_attn.dense.bias",
    W_in=f"{LAYER}.mlp.fc1.weight",
    b_in=f"{LAYER}.mlp.fc1.bias",
    W_out=f"{LAYER}.mlp.fc2.weight",
    b_out=f"{LAYER}.mlp.fc2.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln_final_w="model.final_layernorm.weight",
    ln_final_b="model.final_layernorm.bias",
    W_U=("lm_head.weight",),
    b_U="lm_head.bias",
)

MAPPING = transformers_backend_mapping(
    "PhiForCausalLM",
    details=Details(eps="layer_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"phi": tiny_config},
)
