"""SmolLM3 (``SmolLM3ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): Llama's block, with no rotary positions on the layers
``config.no_rope_layers`` marks 0 (NoPE): there ``hook_rot_q``/``hook_rot_k`` are q and k as they
are, as HuggingFace's attention uses them.
"""

from transformers import PretrainedConfig, SmolLM3Config

from vlens.mappings import llama
from vlens.mappings._tiny import EOS_ID, rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping


def tiny_config() -> PretrainedConfig:
    """SmolLM3: the middle layer without rotary, tied unembedding."""
    return SmolLM3Config(
        **rotary_dims(), rms_norm_eps=1e-6, no_rope_layers=[1, 0, 1], pad_token_id=EOS_ID
    )


#: Llama's checkpoint names.
WEIGHTS = llama.WEIGHTS

MAPPING = transformers_backend_mapping(
    "SmolLM3ForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"smollm3": tiny_config},
)
