"""The model side of TransformerLens's ``ActivationCache`` analysis, read from the checkpoint.

``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``logit_attrs``... are
TransformerLens's own methods: a vlens cache *is* an ``ActivationCache``. What those methods read
from the model (``cfg``, ``blocks[l].attn.W_O``, ``blocks[l].mlp.W_out``, ``W_U``, biases,
``tokens_to_residual_directions``, ``accumulated_bias``) is given here, in TransformerLens's
layouts, from the checkpoint's tensors (vLLM's CPU backend repacks its own copies away).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from vlens.weights import CheckpointWeights, WeightNames


@dataclass(frozen=True)
class AttentionWeights:
    W_O: Float[Tensor, "head d_head d_model"]
    b_O: Float[Tensor, "d_model"] | None


@dataclass(frozen=True)
class MlpWeights:
    W_out: Float[Tensor, "d_mlp d_model"]
    b_out: Float[Tensor, "d_mlp"] | None


@dataclass(frozen=True)
class BlockWeights:
    attn: AttentionWeights
    mlp: MlpWeights


class AnalysisWeights:
    """TransformerLens's weight views of one checkpoint, loaded on first use."""

    def __init__(
        self, weights: CheckpointWeights, names: WeightNames | None, config: Any, n_heads: int
    ) -> None:
        self.checkpoint = weights
        self._names = names
        self.config = config
        self.n_layers = config.num_hidden_layers
        self.n_heads = n_heads

    @property
    def names(self) -> WeightNames:
        if self._names is None:
            raise NotImplementedError(
                "TransformerLens's weight-based analysis (W_O, W_U, logit_attrs, ...) does not "
                "apply to this architecture's mapping (no WeightNames in its mappings/ file)"
            )
        return self._names

    def _linear(self, name: str) -> Tensor:
        """A linear weight as ``[in, out]`` (TransformerLens's orientation)."""
        weight = self.checkpoint[name]
        return weight if self.names.conv1d else weight.T

    def _optional(self, name: str | None, layer: int | None = None) -> Tensor | None:
        if name is None:
            return None
        name = name if layer is None else name.format(layer=layer)
        return self.checkpoint[name] if name in self.checkpoint else None

    @cached_property
    def blocks(self) -> list[BlockWeights]:
        names = self.names
        blocks = []
        for layer in range(self.n_layers):
            w_o = self._linear(names.W_O.format(layer=layer))
            attn = AttentionWeights(
                rearrange(w_o, "(head d) m -> head d m", head=self.n_heads),
                self._optional(names.b_O, layer),
            )
            mlp = MlpWeights(
                self._linear(names.W_out.format(layer=layer)), self._optional(names.b_out, layer)
            )
            blocks.append(BlockWeights(attn, mlp))
        return blocks

    @cached_property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        present = [name for name in self.names.W_U if name in self.checkpoint]
        if not present:
            raise KeyError(f"none of {self.names.W_U} is in the checkpoint")
        # Both the unembedding and a tied embedding are stored [d_vocab, d_model].
        return self.checkpoint[present[0]].T

    @cached_property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        bias = self._optional(self.names.b_U)
        return torch.zeros(self.W_U.shape[1]) if bias is None else bias

    def ln_final(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """The final norm with its weight (and bias), as the model applies it."""
        names = self.names
        eps = getattr(self.config, names.eps)
        x = x.float()
        if names.normalization == "LN":
            x = x - x.mean(-1, keepdim=True)
        normalized = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        out = normalized * self.checkpoint[names.ln_final_w].float()
        bias = self._optional(names.ln_final_b)
        return out if bias is None else out + bias

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, "d_model"]:
        """The biases added to the residual stream before ``layer`` (and its attention's, with
        ``mlp_input``): what TransformerLens's decompositions count as "bias"."""
        total = torch.zeros(self.W_U.shape[0])
        for index in range(layer + (1 if mlp_input else 0)):
            block = self.blocks[index]
            if block.attn.b_O is not None:
                total = total + block.attn.b_O
            if include_mlp_biases and index < layer and block.mlp.b_out is not None:
                total = total + block.mlp.b_out
        return total


class WeightViews:
    """Mixed into :class:`~vlens.HookedVLLM`: the attributes TransformerLens's cache analysis and
    users read off a ``HookedTransformer`` (``model.W_U``, ``model.blocks[3].attn.W_O``, ...)."""

    analysis: AnalysisWeights
    tokenizer: Any

    @property
    def blocks(self) -> list[BlockWeights]:
        return self.analysis.blocks

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.analysis.W_U

    def ln_final(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.analysis.ln_final(x)

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        return self.analysis.b_U

    @property
    def W_O(self) -> Float[Tensor, "layer head d_head d_model"]:
        return torch.stack([block.attn.W_O for block in self.blocks])

    @property
    def W_out(self) -> Float[Tensor, "layer d_mlp d_model"]:
        return torch.stack([block.mlp.W_out for block in self.blocks])

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, "d_model"]:
        return self.analysis.accumulated_bias(layer, mlp_input, include_mlp_biases)

    def to_single_token(self, string: str) -> int:
        ids = self.tokenizer(string, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens, not one: {ids}")
        return ids[0]

    def tokens_to_residual_directions(
        self, tokens: str | int | Tensor
    ) -> Float[Tensor, "... d_model"]:
        """The unembedding columns of ``tokens``: the directions their logits read."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return rearrange(self.W_U[:, tokens], "d_model ... -> ... d_model")
        return self.W_U[:, int(tokens)]
