"""Seed-OSS (``SeedOssForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): a Llama-shaped block (RMSNorms, gated MLP, grouped keys)
with biases on q, k and v, none on the output projection.
"""

from transformers import PretrainedConfig, SeedOssConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping


def tiny_config() -> PretrainedConfig:
    return SeedOssConfig(**rotary_dims(), head_dim=32, rms_norm_eps=1e-6)


#: Llama's checkpoint names (the q/k/v biases are in the checkpoint).
WEIGHTS = llama.WEIGHTS

MAPPING = transformers_backend_mapping(
    "SeedOssForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"seed_oss": tiny_config},
)
