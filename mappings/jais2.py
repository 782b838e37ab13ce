"""Jais 2 (``Jais2ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): LayerNorms with biases, rotary attention with biases on
every projection, an ungated MLP with biases (``up_proj``, ``down_proj``), untied unembedding.
"""

import dataclasses

from transformers import Jais2Config, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.mappings.llama import LAYER


def tiny_config() -> PretrainedConfig:
    return Jais2Config(**rotary_dims(), head_dim=32, layer_norm_eps=1e-5)


#: Llama's checkpoint names, with LayerNorms (and their biases) and no gate.
WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    normalization="LN",
    eps="layer_norm_eps",
    W_gate=None,
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_b="model.norm.bias",
)

MAPPING = transformers_backend_mapping(
    "Jais2ForCausalLM",
    details=Details(eps="layer_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"jais2": tiny_config},
)
