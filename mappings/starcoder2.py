"""StarCoder2 (``Starcoder2ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): HuggingFace's modules, named by TransformerLens's adapter.

LayerNorms with biases, separate q/k/v projections with biases (fused by vLLM into
``qkv_proj``), an ungated MLP (``c_fc``, ``c_proj``), tied unembedding. The tiny checkpoint has
no sliding window (``sliding_window=None``), as the mapping rebuilds scores with full causal
attention.
"""

from transformers import PretrainedConfig, Starcoder2Config

from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.testing import rotary_dims
from vlens.weights import WeightNames

LAYER = "model.layers.{layer}"
ATTN, MLP = f"{LAYER}.self_attn", f"{LAYER}.mlp"


def tiny_config() -> PretrainedConfig:
    return Starcoder2Config(**rotary_dims(), norm_epsilon=1e-5, sliding_window=None)


WEIGHTS = WeightNames(
    normalization="LN",
    eps="norm_epsilon",
    W_E="model.embed_tokens.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    b_Q=f"{ATTN}.q_proj.bias",
    b_K=f"{ATTN}.k_proj.bias",
    b_V=f"{ATTN}.v_proj.bias",
    W_O=f"{ATTN}.o_proj.weight",
    b_O=f"{ATTN}.o_proj.bias",
    W_in=f"{MLP}.c_fc.weight",
    b_in=f"{MLP}.c_fc.bias",
    W_out=f"{MLP}.c_proj.weight",
    b_out=f"{MLP}.c_proj.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_w="model.norm.weight",
    ln_final_b="model.norm.bias",
    W_U=("lm_head.weight", "model.embed_tokens.weight"),
)

MAPPING = transformers_backend_mapping(
    "Starcoder2ForCausalLM",
    details=Details(eps="norm_epsilon"),
    weights=WEIGHTS,
    tiny_configs={"starcoder2": tiny_config},
)
