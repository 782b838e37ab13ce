"""Arcee (``ArceeForCausalLM``, AFM) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): a Llama-shaped block whose MLP is ungated (``up_proj``,
ReLU², ``down_proj``).
"""

import dataclasses

from transformers import ArceeConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping


def tiny_config() -> PretrainedConfig:
    return ArceeConfig(**rotary_dims(), head_dim=32, rms_norm_eps=1e-5)


#: Llama's checkpoint names, without a gate (an up/down MLP).
WEIGHTS = dataclasses.replace(llama.WEIGHTS, W_gate=None)

MAPPING = transformers_backend_mapping(
    "ArceeForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"arcee": tiny_config},
)
