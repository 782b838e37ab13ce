"""Ernie 4.5 (``Ernie4_5ForCausalLM``) as vLLM builds it: Llama's modules and forward (vLLM's
``Ernie4_5ForCausalLM`` is its ``LlamaForCausalLM``), so Llama's mapping (``llama.py``).

Its rotary embedding rotates interleaved pairs of features (vLLM sets ``is_neox_style=False`` on
each layer's ``rotary_emb``) instead of the two halves of a head; ``hook_rot_q``/``hook_rot_k``
are read where ``attn`` receives them, after that rotation, so the mapping is Llama's. The
HuggingFace reference rotates with Ernie's own ``apply_rotary_pos_emb`` (``parity/hf_decoder.py``).
"""

from transformers import Ernie4_5Config, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims


def tiny_config() -> PretrainedConfig:
    """Ernie 4.5: tied embeddings, no biases and rope_theta 500000, as in ERNIE-4.5-0.3B.

    The rope base differs from the other tiny models' on purpose: vLLM shares one rotary
    embedding between every layer and model with the same rotary parameters (``get_rope``'s
    process-wide cache) and Ernie's constructor switches that shared object to interleaved
    rotation, which would also change a Llama built with the same parameters in the process."""
    settings = {**rotary_dims(), "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    return Ernie4_5Config(
        **settings, head_dim=32, rms_norm_eps=1e-5, use_bias=False, pad_token_id=None,
        tie_word_embeddings=True,
    )


MAPPING = llama.MAPPING.member(
    "Ernie4_5ForCausalLM",
    tiny_configs={"ernie4_5": tiny_config},
    hf_recorder="hf_decoder",
)
