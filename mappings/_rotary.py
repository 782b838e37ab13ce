"""Rotary embeddings of vLLM's Transformers backend, computed in the user's process
(:mod:`vlens.mappings._transformers`): HuggingFace's attention interface hands the rotated q and k
to vLLM's kernel through a method no torch hook reaches, so ``attn.hook_rot_q``/``hook_rot_k`` are
q and k rotated again here, by HuggingFace's own rotary embedding and ``apply_rotary_pos_emb`` for
the model type, over each whole sequence."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from transformers import PretrainedConfig

from vlens.names import derived
from vlens.names.mapping import DerivedSpec


@dataclass(frozen=True)
class Rotated:
    """q or k, ``[b, pos, heads, d_head]`` or ``[b, pos, heads·d_head]``, rotated by
    HuggingFace's own rotary embedding and ``apply_rotary_pos_emb`` for ``config``'s model type,
    positions counted from each sequence's start (what the attention interface receives);
    ``layer``: the block, whose type (``config.layer_types``) picks the rotary where the
    embedding keeps one per type (OLMo-3), and which may rotate nothing (SmolLM3's NoPE layers:
    q and k as they are)."""

    config: PretrainedConfig = field(compare=False)
    d_head: int
    layer: int | None = None

    def for_layer(self, layer: int) -> Rotated:
        return dataclasses.replace(self, layer=layer)

    def __call__(self, sources: list[Tensor], batch: derived.Batch) -> Tensor:
        (x,) = sources
        if x.dim() == 3:
            x = rearrange(x, "b p (h d) -> b p h d", d=self.d_head)
        if not uses_rotary(self.config, self.layer):
            return x
        modeling = modeling_module(self.config)
        embedding = rotary_embedding(self.config, modeling).to(x.device)
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        cos, sin = rotary_of(embedding, self.config, self.layer, x.float(), positions)
        heads_first = rearrange(x.float(), "b p h d -> b h p d")
        rotated = rotate_part(modeling, heads_first, cos, sin)
        return rearrange(rotated, "b h p d -> b p h d").to(x.dtype)


def uses_rotary(config: PretrainedConfig, layer: int | None) -> bool:
    """Whether ``layer`` rotates q and k: not SmolLM3's NoPE layers (``no_rope_layers[layer]``
    0)."""
    flags = getattr(config, "no_rope_layers", None)
    return flags is None or layer is None or bool(flags[layer])


def rotary_of(
    embedding: nn.Module, config: PretrainedConfig, layer: int | None, x: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """cos and sin of ``positions`` for ``layer``: its type's where the embedding takes one."""
    if "layer_type" in inspect.signature(embedding.forward).parameters:
        return embedding(x, positions, config.layer_types[layer])
    return embedding(x, positions)


def rotate_part(modeling: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``[b, h, p, d]`` with its first ``cos.shape[-1]`` features rotated by the model
    type's ``apply_rotary_pos_emb`` (the rest as they are: partial rotary, as Phi's attention
    splits it before calling that function and GPT-NeoX's inside it)."""
    width = cos.shape[-1]
    rotated, _ = modeling.apply_rotary_pos_emb(x[..., :width], x[..., :width], cos, sin)
    return torch.cat([rotated, x[..., width:]], dim=-1)


def modeling_module(config: PretrainedConfig) -> Any:
    return importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    )


def rotary_embedding(config: PretrainedConfig, modeling: Any) -> nn.Module:
    """The model type's rotary embedding module (its one ``*RotaryEmbedding`` class)."""
    found = [
        value
        for name, value in vars(modeling).items()
        if name.endswith("RotaryEmbedding") and isinstance(value, type)
        and value.__module__ == modeling.__name__
    ]
    if len(found) != 1:
        raise NotImplementedError(
            f"{modeling.__name__} defines {len(found)} rotary embedding classes, not one: its "
            f"mapping must say which one its attention uses"
        )
    return found[0](config)


def rotated(source: str, config: PretrainedConfig, d_head: int, heads: str = "head") -> DerivedSpec:
    return DerivedSpec((source,), Rotated(config, d_head), f"pos {heads} d_head")
