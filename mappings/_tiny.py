"""What the mapping files' tiny test configs share (``ArchitectureMapping.tiny_configs``).

Each mapping file declares the tiny random checkpoints that prove it; these are the sizes they
share, the smallest that vLLM's CPU kernels accept (head_dim 32 or 96; MLA needs
``kv_lora_rank=512`` and ``qk_rope_head_dim=64``; fused MoE needs ``hidden_size % 32 == 0``), and
the tokenizer's vocabulary that :mod:`vlens.testing.tiny` trains for every one of them.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB_SIZE = 512
BOS_ID, EOS_ID = 0, 1  # the tokenizer's trainer assigns special tokens the first ids, in order
MAX_POSITIONS = 512

# Large enough that attention patterns are far from uniform and logits far from flat
# (0.02, the usual default, gives near-uniform attention at d_model=128).
INIT_STD = 0.1


def shared_settings() -> dict[str, Any]:
    """What every tiny config shares: the tokenizer's vocabulary and special tokens, and the
    init's standard deviation."""
    return {
        "vocab_size": VOCAB_SIZE,
        "initializer_range": INIT_STD,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def rotary_dims() -> dict[str, Any]:
    """What the tiny Llama-family configs share: sizes vLLM's CPU kernels accept, GQA (4 query
    heads of 32, 2 key/value heads), three layers, rotary positions."""
    return {
        **shared_settings(),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def architecture_of(config: PretrainedConfig) -> str:
    """The HuggingFace class a tiny config stands for: its ``architectures`` where set, else the
    causal-LM class transformers registers for its ``model_type`` (what ``save_pretrained``
    writes)."""
    if config.architectures:
        return config.architectures[0]
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]
