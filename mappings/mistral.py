"""Mistral (``MistralForCausalLM``) as vLLM builds it: Llama's modules and forward (vLLM's
``MistralForCausalLM`` is its ``LlamaForCausalLM``), so Llama's mapping (``llama.py``), sliding
window included."""

from transformers import MistralConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims


def tiny_config() -> PretrainedConfig:
    """Mistral: untied unembedding; no sliding window (transformers' default is 4096)."""
    return MistralConfig(
        **rotary_dims(), rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False
    )


MAPPING = llama.MAPPING.member("MistralForCausalLM", tiny_configs={"mistral": tiny_config})
