"""TransformerLens's weight names (``W_E``, ``W_Q``... ``W_U``, norm weights) on a checkpoint: the
model side of TransformerLens's ``ActivationCache`` analysis, read from the checkpoint.

``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``logit_attrs``... are
TransformerLens's own methods: a vlens cache *is* an ``ActivationCache``. What those methods read
from the model (``cfg``, ``blocks[l].attn.W_O``, ``blocks[l].mlp.W_out``, ``W_U``, biases,
``tokens_to_residual_directions``, ``accumulated_bias``) is given here, in TransformerLens's
layouts, from the checkpoint's tensors (vLLM's CPU backend repacks its own copies away), as are
the other weights TransformerLens shows (``W_E``, ``W_Q``..., norm weights), per block, which
:mod:`vlens.hooked.views` stacks and exposes module-like (:mod:`vlens.hooked.weight_views`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from vlens.names.mapping import attention_dimensions
from vlens.names.weights import CheckpointWeights, WeightNames
from vlens.runtime.hooks.split_inputs import Norm


class AnalysisWeights:
    """TransformerLens's weight views of one checkpoint, in its layouts, each tensor loaded on
    first use and kept."""

    def __init__(
        self, weights: CheckpointWeights, names: WeightNames | None, config: Any
    ) -> None:
        self.checkpoint = weights
        self._names = names
        self.config = config
        self.architecture = (getattr(config, "architectures", None) or ["this architecture"])[0]
        self.n_layers = config.num_hidden_layers
        self.n_heads, self.n_kv_heads, self.d_head = attention_dimensions(config)
        self._loaded: dict[tuple[str, int | None], Tensor | None] = {}

    @property
    def names(self) -> WeightNames:
        if self._names is None:
            raise NotImplementedError(
                f"TransformerLens's weight views (W_E, W_Q, W_O, W_U, ...) and the analysis that "
                f"reads them (logit_attrs, decompose_resid with apply_ln, ...) are not available "
                f"for {self.architecture}: its vlens mapping gives no WeightNames"
            )
        return self._names

    def missing(self, view: str) -> NotImplementedError:
        return NotImplementedError(
            f"{view} is not available for {self.architecture}: its vlens mapping names no such "
            f"weight in the checkpoint"
        )

    def get(self, field: str, layer: int | None = None) -> Tensor | None:
        """The checkpoint tensor that ``WeightNames.<field>`` names (for ``layer``), as stored;
        None where the mapping names none or the checkpoint lacks it (a bias-free projection)."""
        key = (field, layer)
        if key not in self._loaded:
            template = getattr(self.names, field)
            name = None if template is None else self._stored(template.format(layer=layer))
            self._loaded[key] = None if name is None else self.checkpoint[name]
        return self._loaded[key]

    def require(self, field: str, layer: int | None = None) -> Tensor:
        """As :meth:`get`, for a weight the model cannot lack."""
        tensor = self.get(field, layer)
        if tensor is not None:
            return tensor
        template = getattr(self.names, field)
        if template is None:
            raise self.missing(field)
        name = template.format(layer=layer)
        raise KeyError(f"{name!r} is not in the checkpoint at {self.checkpoint.folder}")

    def _stored(self, name: str) -> str | None:
        """``name`` as the checkpoint spells it (with or without the optional prefix)."""
        if name in self.checkpoint:
            return name
        prefix = self.names.optional_prefix
        if prefix and name.startswith(prefix) and name[len(prefix) :] in self.checkpoint:
            return name[len(prefix) :]
        return None

    def linear(self, field: str, layer: int | None = None) -> Tensor:
        """A linear weight as ``[in, out]`` (TransformerLens's orientation)."""
        weight = self.require(field, layer)
        if self.names.fused_gate_up and field in ("W_gate", "W_in"):
            weight = weight.chunk(2, dim=1 if self.names.conv1d else 0)[field == "W_in"]
        return weight if self.names.conv1d else weight.T

    def _qkv(self, kind: str, which: str, layer: int) -> Tensor | None:
        """The q, k or v projection's weight (``kind`` "W", ``[in, out]``) or bias (``kind``
        "b", None where absent): its own tensor, or its part of the fused ``[q | k | v]`` one."""
        own, fused = f"{kind}_{which}", f"{kind}_QKV"
        load = self.linear if kind == "W" else self.get
        if getattr(self.names, own) is not None:
            return load(own, layer)
        if getattr(self.names, fused) is None:
            if kind == "W":
                raise self.missing(own)
            return None
        whole = load(fused, layer)
        if whole is None:
            return None
        if self.names.qkv_per_head:
            pattern = "... (head three d) -> three ... (head d)"
            parts = rearrange(whole, pattern, three=3, d=self.d_head)
            return parts["QKV".index(which)]
        widths = [heads * self.d_head for heads in (self.n_heads, self.n_kv_heads, self.n_kv_heads)]
        return whole.split(widths, dim=-1)["QKV".index(which)]

    def qkv_weight(self, which: str, layer: int) -> Float[Tensor, "head d_model d_head"]:
        """``W_Q`` (``n_heads``), ``W_K`` or ``W_V`` (``n_kv_heads``: TransformerLens's bridge
        keeps grouped keys and values grouped)."""
        heads = self.n_heads if which == "Q" else self.n_kv_heads
        return rearrange(self._qkv("W", which, layer), "m (head d) -> head m d", head=heads)

    def qkv_bias(self, which: str, layer: int) -> Float[Tensor, "head d_head"] | None:
        bias = self._qkv("b", which, layer)
        heads = self.n_heads if which == "Q" else self.n_kv_heads
        return None if bias is None else rearrange(bias, "(head d) -> head d", head=heads)

    def output_weight(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        return rearrange(self.linear("W_O", layer), "(head d) m -> head d m", head=self.n_heads)

    @cached_property
    def blocks(self) -> list[BlockWeights]:
        return [BlockWeights(self, layer) for layer in range(self.n_layers)]

    @cached_property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        present = [name for name in self.names.W_U if self._stored(name) is not None]
        if not present:
            raise KeyError(f"none of {self.names.W_U} is in the checkpoint")
        # Both the unembedding and a tied embedding are stored [d_vocab, d_model].
        return self.checkpoint[self._stored(present[0])].T

    @cached_property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        bias = self.get("b_U")
        return torch.zeros(self.W_U.shape[1], dtype=self.W_U.dtype) if bias is None else bias

    @cached_property
    def ln_final(self) -> NormWeights:
        return NormWeights(self, "ln_final_w", "ln_final_b")

    def norm(self, w: str, b: str, layer: int | None = None) -> Norm:
        """The norm whose weight (and LayerNorm's bias) ``WeightNames.<w>`` (``<b>``) name, as
        the model applies it."""
        names = self.names
        centred = names.normalization == "LN"
        return Norm(
            centred=centred,
            eps=names.eps if isinstance(names.eps, float) else getattr(self.config, names.eps),
            weight=self.require(w, layer),
            bias=self.get(b, layer) if centred else None,
            offset=names.norm_offset,
        )

    def output_logits(self, logits: Float[Tensor, "... d_vocab"]) -> Float[Tensor, "... d_vocab"]:
        """``ln_final(x) @ W_U + b_U`` as the model outputs it: divided by
        ``WeightNames.logit_divisor`` and multiplied by ``WeightNames.logit_scale`` where they
        name one, then soft-capped."""
        divisor = self._config_value(self.names.logit_divisor)
        scale = self._config_value(self.names.logit_scale)
        logits = logits if divisor is None else logits / divisor
        return self.soft_capped(logits if scale is None else logits * scale)

    def _config_value(self, attribute: str | None) -> float | None:
        return None if attribute is None else getattr(self.config, attribute, None)

    def soft_capped(self, logits: Float[Tensor, "... d_vocab"]) -> Float[Tensor, "... d_vocab"]:
        """The logits as the model caps them (``WeightNames.logit_soft_cap``), or as they are."""
        attribute = self.names.logit_soft_cap
        cap = None if attribute is None else getattr(self.config, attribute, None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, " d_model"]:
        """The biases added to the residual stream before ``layer`` (and its attention's, with
        ``mlp_input``): what TransformerLens's decompositions count as "bias"."""
        total = torch.zeros(self.config.hidden_size)
        for index in range(layer + (1 if mlp_input else 0)):
            b_o = self.get("b_O", index)
            if b_o is not None:
                total = total + b_o
            b_out = self.get("b_out", index)
            if include_mlp_biases and index < layer and b_out is not None:
                total = total + b_out
        return total


class NormWeights:
    """A norm (``ln1``, ``ln2``, ``ln_final``): its weight ``w``, LayerNorm's bias ``b``, and the
    norm itself when called."""

    def __init__(
        self, analysis: AnalysisWeights, w: str, b: str, layer: int | None = None
    ) -> None:
        self._analysis, self._fields, self._layer = analysis, (w, b), layer

    @property
    def w(self) -> Float[Tensor, " d_model"]:
        return self._analysis.require(self._fields[0], self._layer)

    @property
    def b(self) -> Float[Tensor, " d_model"] | None:
        names = self._analysis.names
        if names.normalization == "RMS":  # as TransformerLens's RMSNorm bridge
            raise AttributeError(f"{self._analysis.architecture}'s RMSNorm has no bias (b)")
        if getattr(names, self._fields[1]) is None:  # a LayerNorm without bias (Cohere's)
            raise AttributeError(f"{self._analysis.architecture}'s LayerNorm has no bias (b)")
        return self._analysis.get(self._fields[1], self._layer)

    def __call__(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self._analysis.norm(*self._fields, self._layer)(x)


class AttentionWeights:
    """One block's attention weights (``blocks[l].attn``); absent biases are None."""

    def __init__(self, analysis: AnalysisWeights, layer: int) -> None:
        self._analysis, self._layer = analysis, layer

    @property
    def W_Q(self) -> Float[Tensor, "head d_model d_head"]:
        return self._analysis.qkv_weight("Q", self._layer)

    @property
    def W_K(self) -> Float[Tensor, "kv_head d_model d_head"]:
        return self._analysis.qkv_weight("K", self._layer)

    @property
    def W_V(self) -> Float[Tensor, "kv_head d_model d_head"]:
        return self._analysis.qkv_weight("V", self._layer)

    @property
    def W_O(self) -> Float[Tensor, "head d_head d_model"]:
        return self._analysis.output_weight(self._layer)

    @property
    def b_Q(self) -> Float[Tensor, "head d_head"] | None:
        return self._analysis.qkv_bias("Q", self._layer)

    @property
    def b_K(self) -> Float[Tensor, "kv_head d_head"] | None:
        return self._analysis.qkv_bias("K", self._layer)

    @property
    def b_V(self) -> Float[Tensor, "kv_head d_head"] | None:
        return self._analysis.qkv_bias("V", self._layer)

    @property
    def b_O(self) -> Float[Tensor, " d_model"] | None:
        return self._analysis.get("b_O", self._layer)


class MlpWeights:
    """One block's MLP weights (``blocks[l].mlp``); ``W_gate`` and absent biases are None where
    the model has none."""

    def __init__(self, analysis: AnalysisWeights, layer: int) -> None:
        self._analysis, self._layer = analysis, layer

    @property
    def W_in(self) -> Float[Tensor, "d_model d_mlp"]:
        return self._analysis.linear("W_in", self._layer)

    @property
    def W_gate(self) -> Float[Tensor, "d_model d_mlp"] | None:
        if self._analysis.names.W_gate is None:
            return None
        return self._analysis.linear("W_gate", self._layer)

    @property
    def W_out(self) -> Float[Tensor, "d_mlp d_model"]:
        return self._analysis.linear("W_out", self._layer)

    @property
    def b_in(self) -> Float[Tensor, " d_mlp"] | None:
        return self._analysis.get("b_in", self._layer)

    @property
    def b_out(self) -> Float[Tensor, " d_model"] | None:
        return self._analysis.get("b_out", self._layer)


class BlockWeights:
    """One block's weights: ``attn``, ``mlp``, ``ln1``, ``ln2``."""

    def __init__(self, analysis: AnalysisWeights, layer: int) -> None:
        self._analysis, self._layer = analysis, layer

    @property
    def attn(self) -> AttentionWeights:
        return AttentionWeights(self._analysis, self._layer)

    @property
    def mlp(self) -> MlpWeights:
        return MlpWeights(self._analysis, self._layer)

    @property
    def ln1(self) -> NormWeights:
        return NormWeights(self._analysis, "ln1_w", "ln1_b", self._layer)

    @property
    def ln2(self) -> NormWeights:
        return NormWeights(self._analysis, "ln2_w", "ln2_b", self._layer)
