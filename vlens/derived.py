"""Names computed in the user's process, once every row of every request is in.

vLLM never forms attention scores, and per-head results need ``W_O``, which vLLM's CPU backend
repacks away. These names are computed from other names (their *sources*, captured like any name)
over the padded batch ``[batch, pos, ...]``, with checkpoint weights where needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from einops import einsum, rearrange, repeat
from jaxtyping import Bool, Float
from torch import Tensor

from vlens.weights import CheckpointWeights


@dataclass(frozen=True)
class Batch:
    """What a derived name may use besides its sources."""

    mask: Bool[Tensor, "batch pos"]
    weights: CheckpointWeights


class Compute(Protocol):
    def __call__(self, sources: list[Tensor], batch: Batch) -> Tensor: ...

    def for_layer(self, layer: int) -> Compute: ...


class SameForEveryLayer:
    """A computation with nothing layer-specific in it."""

    def for_layer(self, layer: int) -> SameForEveryLayer:
        return self


@dataclass(frozen=True)
class AttentionScores(SameForEveryLayer):
    """``q·kᵀ · scale`` per head, causal and padding positions at -inf (TransformerLens's
    ``hook_attn_scores``). Sources: rotated q ``[b, q, H, d]`` and k ``[b, k, Hkv, d]``; grouped
    key heads are shared by ``H / Hkv`` consecutive query heads."""

    scale: float

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b head q k"]:
        q, k = sources
        group = q.shape[2] // k.shape[2]
        k = repeat(k, "b k kv d -> b k (kv group) d", group=group)
        scores = einsum(q.float(), k.float(), "b q h d, b k h d -> b h q k") * self.scale
        n = q.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        visible = causal[None, None] & batch.mask[:, None, None, :]
        return scores.masked_fill(~visible, float("-inf")).to(q.dtype)


@dataclass(frozen=True)
class Softmax(SameForEveryLayer):
    """The attention pattern from the scores; rows of padding positions are all zero."""

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b head q k"]:
        (scores,) = sources
        pattern = scores.float().softmax(dim=-1).nan_to_num(0.0)
        return pattern.masked_fill(~batch.mask[:, None, :, None], 0.0).to(scores.dtype)


@dataclass(frozen=True)
class HeadResults:
    """Each head's output after ``W_O`` (no bias): ``z[h] @ W_O[h]``, with ``W_O`` the checkpoint's
    ``[d_model, H·d_head]`` output projection ``weight_name``."""

    weight_name: str

    def for_layer(self, layer: int) -> HeadResults:
        return HeadResults(self.weight_name.format(layer=layer))

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b pos head d_model"]:
        (z,) = sources
        w_o = rearrange(batch.weights[self.weight_name], "m (h d) -> h d m", h=z.shape[2])
        return einsum(z.float(), w_o.float(), "b p h d, h d m -> b p h m").to(z.dtype)
