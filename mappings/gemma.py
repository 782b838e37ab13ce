"""Gemma (``GemmaForCausalLM``, the first generation) as vLLM builds it: Llama's modules and
fused residual (``llama.py``) with Gemma's numerics, none of which changes where a name is read:

- every norm is ``GemmaRMSNorm``, scaling by ``1 + weight`` (``hook_normalized`` is before the
  weight);
- the MLP is ``gelu_tanh(gate) · up`` (vLLM uses the tanh approximation unless the config's
  ``hidden_activation`` says ``gelu``);
- the embedding is multiplied by ``√d_model`` outside ``embed_tokens``
  (``GemmaModel.embed_input_ids``): ``hook_embed`` is that product, as in TransformerLens's bridge
  and HuggingFace (whose embedding module scales).

Attention is plain causal attention scaled by ``head_dim^-½``, as Llama's, so hooks on scores,
patterns and per-head results run explicitly as there.
"""

import dataclasses

from transformers import GemmaConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.gemma2 import scaled_embedding
from vlens.names.mapping import Spec


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    return {**llama.hook_specs(config), "hook_embed": scaled_embedding(config)}


def tiny_config() -> PretrainedConfig:
    """Gemma: tied embeddings, head_dim 32 (Gemma's default is 256)."""
    return GemmaConfig(
        **rotary_dims(),
        head_dim=32,
        rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )


MAPPING = llama.MAPPING.member(
    "GemmaForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"gemma": tiny_config},
    weights=dataclasses.replace(llama.WEIGHTS, norm_offset=1.0),
    compiled_graph=True,
    unavailable=None,
)
