"""The model's dimensions under TransformerLens's names: what ``model.cfg`` holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from vlens.mapping import ArchitectureMapping


@dataclass(frozen=True)
class ModelConfig:
    """The model's dimensions under TransformerLens's names (``model.cfg``)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    architecture: str
    normalization_type: str | None
    positional_embedding_type: str
    attn_only: bool = False
    final_rms: bool = False

    @classmethod
    def from_hf(
        cls, config: PretrainedConfig, mapping: ArchitectureMapping, names: Sequence[str]
    ) -> ModelConfig:
        n_heads = config.num_attention_heads
        return cls(
            n_layers=config.num_hidden_layers,
            d_model=config.hidden_size,
            n_heads=n_heads,
            n_key_value_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            d_head=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            d_mlp=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            d_vocab=config.vocab_size,
            n_ctx=config.max_position_embeddings,
            architecture=config.architectures[0],
            normalization_type=mapping.weights.normalization if mapping.weights else None,
            positional_embedding_type="standard" if "hook_pos_embed" in names else "rotary",
        )
