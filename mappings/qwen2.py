"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``) as vLLM builds them: Llama's modules and forward
(``llama.py``) with biases on the q, k and v projections, which ``qkv_proj``'s output includes
and the weight views read (``b_Q``, ``b_K``, ``b_V``)."""

from transformers import PretrainedConfig, Qwen2Config

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims


def tiny_config() -> PretrainedConfig:
    """Qwen2: q/k/v biases (always on), tied embeddings as in Qwen2.5's small models."""
    return Qwen2Config(**rotary_dims(), rms_norm_eps=1e-6, tie_word_embeddings=True)


MAPPING = llama.MAPPING.member("Qwen2ForCausalLM", tiny_configs={"qwen2": tiny_config})
