"""The weights TransformerLens's cache analysis and users read off a ``HookedTransformer``
(``model.W_U``, ``model.blocks[3].attn.W_O``...), from the checkpoint
(:mod:`vlens.names.weight_views`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from vlens.engine.checkpoint import Checkpoint
from vlens.names.weight_views import BlockWeights, NormWeights


class WeightViews:
    """Mixed into :class:`~vlens.HookedVLLM`: the attributes TransformerLens's cache analysis and
    users read off a ``HookedTransformer`` (``model.W_U``, ``model.blocks[3].attn.W_O``, ...)."""

    checkpoint: Checkpoint
    tokenizer: Any
    to_single_token: Callable[[str], int]  # from vlens.hooked.tokens.TokenMethods, mixed in beside

    @property
    def blocks(self) -> list[BlockWeights]:
        return self.checkpoint.analysis.blocks

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.checkpoint.analysis.W_U

    @property
    def ln_final(self) -> NormWeights:
        """The final norm: ``model.ln_final(x)`` applies it; ``.w`` (``.b``) its weight (bias)."""
        return self.checkpoint.analysis.ln_final

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        return self.checkpoint.analysis.b_U

    @property
    def W_O(self) -> Float[Tensor, "layer head d_head d_model"]:
        return torch.stack([block.attn.W_O for block in self.blocks])

    @property
    def W_out(self) -> Float[Tensor, "layer d_mlp d_model"]:
        return torch.stack([block.mlp.W_out for block in self.blocks])

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, " d_model"]:
        return self.checkpoint.analysis.accumulated_bias(layer, mlp_input, include_mlp_biases)

    def tokens_to_residual_directions(
        self, tokens: str | int | Tensor
    ) -> Float[Tensor, "... d_model"]:
        """The unembedding columns of ``tokens``: the directions their logits read."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return rearrange(self.W_U[:, tokens], "d_model ... -> ... d_model")
        return self.W_U[:, int(tokens)]
