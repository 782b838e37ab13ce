"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): HuggingFace's modules, named by TransformerLens's adapter.

Attention and MLP in parallel, both reading the block's input through their own LayerNorm
(``input_layernorm``, ``post_attention_layernorm``), so there is no ``hook_resid_mid`` and
``hook_mlp_in`` is the block's input. The joint ``query_key_value`` holds each head's
``[q | k | v]`` side by side (HuggingFace views it ``[pos, heads, 3·d_head]`` and chunks the last
axis). Rotary positions rotate the first ``partial_rotary_factor`` of each head only.
"""

from transformers import GPTNeoXConfig, PretrainedConfig

from vlens.mappings._tiny import MAX_POSITIONS, shared_settings
from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.names.weights import WeightNames

LAYER = "gpt_neox.layers.{layer}"


def tiny_config() -> PretrainedConfig:
    """GPT-NeoX: 4 heads of 32, a quarter of each rotated, untied unembedding."""
    return GPTNeoXConfig(
        **shared_settings(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rotary_pct=0.25,
        layer_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_eps",
    W_E="gpt_neox.embed_in.weight",
    W_QKV=f"{LAYER}.attention.query_key_value.weight",
    b_QKV=f"{LAYER}.attention.query_key_value.bias",
    qkv_per_head=True,
    W_O=f"{LAYER}.attention.dense.weight",
    b_O=f"{LAYER}.attention.dense.bias",
    W_in=f"{LAYER}.mlp.dense_h_to_4h.weight",
    b_in=f"{LAYER}.mlp.dense_h_to_4h.bias",
    W_out=f"{LAYER}.mlp.dense_4h_to_h.weight",
    b_out=f"{LAYER}.mlp.dense_4h_to_h.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_w="gpt_neox.final_layer_norm.weight",
    ln_final_b="gpt_neox.final_layer_norm.bias",
    W_U=("embed_out.weight", "gpt_neox.embed_in.weight"),
)

MAPPING = transformers_backend_mapping(
    "GPTNeoXForCausalLM",
    details=Details(eps="layer_norm_eps", joint_qkv="per_head"),
    weights=WEIGHTS,
    tiny_configs={"gpt_neox": tiny_config},
)
