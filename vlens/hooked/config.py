"""The model's dimensions under TransformerLens's names: what ``model.cfg`` holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from vlens.names.mapping import ArchitectureMapping, attention_dimensions
from vlens.runtime.transfer.messages import PaddingSide

PADDING_SIDES: tuple[PaddingSide, ...] = ("left", "right")

#: ``cfg.n_ctx`` where the config states no context length (BLOOM's ALiBi has no position table):
#: what vLLM then assumes, and TransformerLens's BLOOM ``n_ctx``.
UNSTATED_CONTEXT = 2048

#: Model types whose attention adds ALiBi biases (``cfg.positional_embedding_type = "alibi"``).
ALIBI_MODEL_TYPES = frozenset({"bloom"})


def tokenizer_bos_eos(tokenizer: PreTrainedTokenizerBase) -> tuple[bool, bool]:
    """Whether ``tokenizer`` puts BOS in front of a text by itself, and EOS after it: what
    TransformerLens records as ``cfg.tokenizer_prepends_bos`` / ``tokenizer_appends_eos``
    (read off the ids of ``"a"``; a leading CLS counts as BOS)."""
    ids = tokenizer.encode("a")
    leading = {tokenizer.bos_token_id, getattr(tokenizer, "cls_token_id", None)} - {None}
    prepends = len(ids) > 1 and ids[0] in leading
    eos = tokenizer.eos_token_id
    appends = len(ids) > 1 and eos is not None and ids[-1] == eos
    return prepends, appends


#: Architectures whose TransformerLens 4.3 adapter sets ``cfg.default_prepend_bos = False``
#: (``transformer_lens/model_bridge/supported_architectures/*.py``): strings get no BOS unless
#: asked. Every other architecture defaults to ``True``, TransformerLens's default, even where
#: the model was not trained with BOS (attention heads rest on position 0).
NO_BOS_ARCHITECTURES = frozenset({
    "BloomForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "ExaoneForCausalLM",
    "Exaone4ForCausalLM", "GPTNeoXForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
    "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM", "MiniMaxM2ForCausalLM",
    "MPTForCausalLM", "MptForCausalLM", "PhiForCausalLM", "PhiMoEForCausalLM",
    "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "RecurrentGemmaForCausalLM", "SeedOssForCausalLM", "SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM",
})


def default_prepend_bos_for(architecture: str) -> bool:
    """TransformerLens's ``cfg.default_prepend_bos`` for a HuggingFace architecture."""
    return architecture not in NO_BOS_ARCHITECTURES


@dataclass(frozen=True)
class ModelConfig:
    """The model's dimensions under TransformerLens's names (``model.cfg``), and the
    tokenization settings of ``HookedTransformerConfig`` that :mod:`vlens.hooked.tokens` follows.

    ``default_prepend_bos``: whether strings start with BOS when a call does not say
    (``prepend_bos=None``); TransformerLens's per-architecture default
    (:func:`default_prepend_bos_for`) unless given at load. ``default_padding_side``: where
    batches of strings are padded by default. ``device``: where values are handed to the user
    (tokens from ``to_tokens``, caches and logits by default): the CPU, wherever the engine runs.
    ``tokenizer_prepends_bos`` / ``tokenizer_appends_eos``: what the model's tokenizer does by
    itself, as TransformerLens computes it (True for a tokenizer prepared as TransformerLens's,
    :func:`vlens.hooked.tokens.prepare_tokenizer`; TransformerLens's default True when no tokenizer was
    given). The token methods ask the tokenizer itself what it does, not these two fields.
    """

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
    default_prepend_bos: bool = True
    default_padding_side: Literal["left", "right"] = "right"
    device: str = "cpu"
    tokenizer_prepends_bos: bool = True
    tokenizer_appends_eos: bool = False

    @classmethod
    def from_hf(
        cls,
        config: PretrainedConfig,
        mapping: ArchitectureMapping,
        names: Sequence[str],
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        default_prepend_bos: bool | None = None,
        default_padding_side: Literal["left", "right"] | None = None,
        device: str = "cpu",
    ) -> ModelConfig:
        """``model.cfg`` for a checkpoint. ``tokenizer``: the model's tokenizer, whose BOS/EOS
        behaviour and padding side are recorded. ``default_prepend_bos`` (None: the
        architecture's TransformerLens default) and ``default_padding_side`` (None: the
        tokenizer's ``padding_side``, else "right") as TransformerLens's ``from_pretrained``."""
        n_heads, n_kv_heads, d_head = attention_dimensions(config)
        architecture = config.architectures[0]
        if default_padding_side is None:
            side = getattr(tokenizer, "padding_side", None)
            default_padding_side = side if side in PADDING_SIDES else "right"
        if default_padding_side not in PADDING_SIDES:
            raise ValueError(
                f"default_padding_side must be 'left' or 'right', not {default_padding_side!r}"
            )
        if default_prepend_bos is None:
            default_prepend_bos = default_prepend_bos_for(architecture)
        prepends, appends = (True, False) if tokenizer is None else tokenizer_bos_eos(tokenizer)
        return cls(
            n_layers=config.num_hidden_layers,
            d_model=config.hidden_size,
            n_heads=n_heads,
            n_key_value_heads=n_kv_heads,
            d_head=d_head,
            d_mlp=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            d_vocab=config.vocab_size,
            n_ctx=getattr(config, "max_position_embeddings", None) or UNSTATED_CONTEXT,
            architecture=architecture,
            normalization_type=mapping.weights.normalization if mapping.weights else None,
            positional_embedding_type=(
                "standard" if "hook_pos_embed" in names
                else "alibi" if config.model_type in ALIBI_MODEL_TYPES
                else "rotary"
            ),
            default_prepend_bos=bool(default_prepend_bos),
            default_padding_side=default_padding_side,
            device=str(device),
            tokenizer_prepends_bos=prepends,
            tokenizer_appends_eos=appends,
        )
