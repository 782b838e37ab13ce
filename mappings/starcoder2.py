"""StarCoder2 (``Starcoder2ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): HuggingFace's modules, named by TransformerLens's adapter.

LayerNorms with biases, separate q/k/v projections with biases (fused by vLLM into
``qkv_proj``), an ungated MLP (``c_fc``, ``c_proj``), tied unembedding. The tiny checkpoint has
no sliding window (``sliding_window=None``), as the mapping rebuilds scores with full causal
attention.
"""

import dataclasses

from transformers import PretrainedConfig, Starcoder2Config

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.mappings.llama import LAYER, MLP


def tiny_config() -> PretrainedConfig:
    return Starcoder2Config(**rotary_dims(), norm_epsilon=1e-5, sliding_window=None)


#: Llama's checkpoint names, with LayerNorms (and their biases) and a ``c_fc``/``c_proj`` MLP.
WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    normalization="LN",
    eps="norm_epsilon",
    W_in=f"{MLP}.c_fc.weight",
    b_in=f"{MLP}.c_fc.bias",
    W_gate=None,
    W_out=f"{MLP}.c_proj.weight",
    b_out=f"{MLP}.c_proj.bias",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_b="model.norm.bias",
)

MAPPING = transformers_backend_mapping(
    "Starcoder2ForCausalLM",
    details=Details(eps="norm_epsilon"),
    weights=WEIGHTS,
    tiny_configs={"starcoder2": tiny_config},
)
