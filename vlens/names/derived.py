"""Names computed in the user's process, once every row of every request is in.

vLLM never forms attention scores, and per-head results need ``W_O``, which vLLM's CPU backend
repacks away. These names are computed from other names (their *sources*, captured like any name)
over the padded batch ``[batch, pos, ...]``, with checkpoint weights where needed. Attention scores
and patterns, which grow with the square of the prompt, are built only when read
(:mod:`vlens.names.lazy_patterns`).

Where hook functions made the worker form one of them for some requests (attention computed
explicitly at a hooked layer, :mod:`vlens.runtime.attention.explicit`), those requests' values are the
worker's, as the hooks left them (:func:`with_formed`): TransformerLens caches a value after
its hooks ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from einops import einsum, rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor

from vlens.names.lazy_patterns import LazyAttention
from vlens.names.weights import CheckpointWeights
from vlens.runtime.attention.arithmetic import per_head_results

#: What a derived name's computation gives: a tensor, or (:class:`BuiltOnRead`) a value built when
#: it is read.
Value = Tensor | LazyAttention


@dataclass(frozen=True)
class Batch:
    """What a derived name may use besides its sources (all on the cache's device)."""

    mask: Bool[Tensor, "batch pos"]
    weights: WeightsOn
    sampled: Int[Tensor, "batch new_pos"]  # each request's sampled tokens, zero-padded
    lengths: tuple[int, ...]  # each request's real positions (``mask``'s rows, as host ints)


@dataclass(frozen=True)
class WeightsOn:
    """Checkpoint weights read from disk, handed out on ``device``."""

    weights: CheckpointWeights
    device: torch.device

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def __getitem__(self, name: str) -> Tensor:
        return self.weights[name].to(self.device)


class Compute(Protocol):
    def __call__(self, sources: list[Value], batch: Batch) -> Value: ...

    def for_layer(self, layer: int) -> Compute: ...


class SameForEveryLayer:
    """A computation with nothing layer-specific in it."""

    def for_layer(self, layer: int) -> SameForEveryLayer:
        return self


@dataclass(frozen=True)
class SampledTokens(SameForEveryLayer):
    """The token each step sampled for each request, as the engine returned it."""

    def __call__(self, sources: list[Tensor], batch: Batch) -> Int[Tensor, "b new_pos"]:
        return batch.sampled


class BuiltOnRead(SameForEveryLayer):
    """A computation whose value grows with the square of the prompt: it returns a
    :class:`~vlens.names.lazy_patterns.LazyAttention`, which the cache builds when the name is read."""


@dataclass(frozen=True)
class AttentionScores(BuiltOnRead):
    """``q·kᵀ · scale`` per head, causal and padding positions at -inf (TransformerLens's
    ``hook_attn_scores``). Sources: rotated q ``[b, q, H, d]`` and k ``[b, k, Hkv, d]``; grouped
    key heads are shared by ``H / Hkv`` consecutive query heads. ``soft_cap``: scores become
    ``soft_cap·tanh(scores / soft_cap)`` before masking; ``window``: a sliding window of that many
    keys (the query's own included); ``alibi``: each head's ALiBi slope times the key's position
    added — each as the layer's attention applies it, if it does."""

    scale: float
    soft_cap: float | None = None
    window: int | None = None
    alibi: tuple[float, ...] | None = None

    def __call__(self, sources: list[Tensor], batch: Batch) -> LazyAttention:
        q, k = sources
        formed = (None,) * len(batch.lengths)
        return LazyAttention(
            "scores", q, k, self.scale, batch.lengths, formed,
            soft_cap=self.soft_cap, window=self.window, alibi=self.alibi,
        )


@dataclass(frozen=True)
class Softmax(BuiltOnRead):
    """The attention pattern from the scores; rows of padding positions are all zero."""

    def __call__(self, sources: list[LazyAttention], batch: Batch) -> LazyAttention:
        (scores,) = sources
        return scores.softmaxed()


@dataclass(frozen=True)
class HeadResults:
    """Each head's output after ``W_O`` (no bias): ``z[h] @ W_O[h]``, with ``W_O`` the checkpoint's
    ``[d_model, H·d_head]`` output projection ``weight_name``."""

    weight_name: str

    def for_layer(self, layer: int) -> HeadResults:
        return HeadResults(self.weight_name.format(layer=layer))

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b pos head d_model"]:
        (z,) = sources
        return batched_head_results(z, batch.weights[self.weight_name].T)


@dataclass(frozen=True)
class Conv1DHeadResults:
    """:class:`HeadResults` for a checkpoint that stores ``W_O`` as a Conv1D, ``[H·d_head,
    d_model]`` (GPT-2): the transpose of a Linear's weight. ``weight_names`` are tried in order,
    the first one the checkpoint has is used (GPT-2 checkpoints name tensors with or without the
    ``transformer.`` prefix)."""

    weight_names: tuple[str, ...]

    def for_layer(self, layer: int) -> Conv1DHeadResults:
        return Conv1DHeadResults(tuple(name.format(layer=layer) for name in self.weight_names))

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b pos head d_model"]:
        (z,) = sources
        name = next((n for n in self.weight_names if n in batch.weights), self.weight_names[0])
        return batched_head_results(z, batch.weights[name])


def batched_head_results(
    z: Float[Tensor, "b pos head d_head"], weight: Float[Tensor, "heads_d_head d_model"]
) -> Float[Tensor, "b pos head d_model"]:
    """Each head's output through ``weight`` (``W_O`` as ``[H·d_head, d_model]``), for a padded
    batch: the worker's own arithmetic (:func:`~vlens.runtime.attention.arithmetic.per_head_results`),
    so that a result computed after the call equals one computed for a hook."""
    return per_head_results(z.flatten(0, 1), weight).unflatten(0, z.shape[:2]).to(z.dtype)


def with_formed(value: Value, formed: Sequence[Tensor | None]) -> Value:
    """``value`` (``[batch, ...]``, padded) with request ``i``'s part replaced by ``formed[i]``
    where the worker formed it: TransformerLens's layout without the batch axis, covering the
    request's positions (a leading box of the padded value, e.g. ``[head, pos_i, pos_i]``)."""
    if all(part is None for part in formed):
        return value
    if isinstance(value, LazyAttention):
        return value.with_formed(formed)
    value = value.clone()
    for index, part in enumerate(formed):
        if part is not None:
            box = tuple(slice(0, size) for size in part.shape)
            value[index][box] = part.to(value.device, value.dtype)
    return value


# ---- multi-head latent attention (DeepSeek-V2/V3) -----------------------------------------------


def latent_up_projection(
    latent: Float[Tensor, "b pos rank"], weight: Float[Tensor, "out rank"], heads: int
) -> Float[Tensor, "b pos head d"]:
    """MLA's ``kv_b_proj`` applied to the kv latent, per head: ``[k_nope | v]`` for every head."""
    w = rearrange(weight, "(h d) r -> h d r", h=heads)
    return einsum(latent.float(), w.float(), "b p r, h d r -> b p h d")


@dataclass(frozen=True)
class LatentKeys:
    """MLA's per-head keys ``[k_nope | k_pe]``: ``k_nope`` is ``kv_b_proj``'s key rows (checkpoint
    weight ``weight_name``, ``[H·(d_nope + d_v), kv_lora_rank]``) applied to the kv latent;
    ``k_pe``, the rope part (``[b, p, d_rope]``, rotated or not), is one for all heads. vLLM's
    decode kernel absorbs ``kv_b_proj`` into the query and never forms these keys, so they are
    rebuilt here. Sources: the kv latent, then ``k_pe``."""

    weight_name: str
    heads: int
    d_nope: int

    def for_layer(self, layer: int) -> LatentKeys:
        return LatentKeys(self.weight_name.format(layer=layer), self.heads, self.d_nope)

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b pos head d_qk"]:
        latent, k_pe = sources
        kv = latent_up_projection(latent, batch.weights[self.weight_name], self.heads)
        k_pe = repeat(k_pe.float(), "b p d -> b p h d", h=self.heads)
        return torch.cat([kv[..., : self.d_nope], k_pe], dim=-1).to(latent.dtype)


@dataclass(frozen=True)
class LatentValues:
    """MLA's per-head values: ``kv_b_proj``'s value rows applied to the kv latent (see
    :class:`LatentKeys`). Source: the kv latent."""

    weight_name: str
    heads: int
    d_nope: int

    def for_layer(self, layer: int) -> LatentValues:
        return LatentValues(self.weight_name.format(layer=layer), self.heads, self.d_nope)

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b pos head d_v"]:
        (latent,) = sources
        kv = latent_up_projection(latent, batch.weights[self.weight_name], self.heads)
        return kv[..., self.d_nope :].to(latent.dtype)


# ---- mixture-of-experts routing (DeepSeek-V2/V3) ------------------------------------------------


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek's router, as vLLM runs it (``grouped_topk``), from the router logits:

    1. scores = ``softmax(logits)`` (V2) or ``sigmoid(logits)`` (V3);
    2. selection scores = scores + ``e_score_correction_bias`` when the model has one (V3,
       ``topk_method="noaux_tc"``; checkpoint tensor ``bias_name``), else the scores;
    3. experts fall in ``n_group`` equal groups, each rated by its best selection score (no bias)
       or the sum of its two best (bias); only the ``topk_group`` best groups stay eligible;
    4. the ``top_k`` eligible experts with the best selection scores are chosen, best first;
    5. their weights are their scores (never the bias), divided by their sum if ``renormalize``
       (``norm_topk_prob``), times ``scaling`` (``routed_scaling_factor``).

    So ``mlp_out = shared_out + Σ_k weights[k] · expert[indices[k]](x)``.
    """

    top_k: int
    n_group: int
    topk_group: int
    scoring: str
    renormalize: bool
    scaling: float
    bias_name: str | None

    def for_layer(self, layer: int) -> GroupedTopK:
        bias_name = None if self.bias_name is None else self.bias_name.format(layer=layer)
        return GroupedTopK(
            self.top_k, self.n_group, self.topk_group, self.scoring, self.renormalize,
            self.scaling, bias_name,
        )

    def __call__(
        self, logits: Float[Tensor, "b pos expert"], batch: Batch
    ) -> tuple[Float[Tensor, "b pos top_k"], Tensor]:
        """Weights and (int64) indices, ``[b, pos, top_k]`` each, zero at padding positions."""
        logits = logits.float()
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise ValueError(f"unsupported router scoring function {self.scoring!r}")
        if self.bias_name is None:
            selection = scores
            groups = rearrange(selection, "b p (g e) -> b p g e", g=self.n_group).amax(dim=-1)
        else:
            selection = scores + batch.weights[self.bias_name].float()
            grouped = rearrange(selection, "b p (g e) -> b p g e", g=self.n_group)
            groups = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = groups.topk(self.topk_group, dim=-1).indices
        eligible = torch.zeros_like(groups, dtype=torch.bool).scatter(-1, best_groups, True)
        eligible = repeat(eligible, "b p g -> b p (g e)", e=scores.shape[-1] // self.n_group)
        indices = selection.masked_fill(~eligible, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        padding = ~batch.mask[..., None]
        return (weights * self.scaling).masked_fill(padding, 0.0), indices.masked_fill(padding, 0)


@dataclass(frozen=True)
class ExpertWeights:
    """The weight of each chosen routed expert in the MoE sum (see :class:`GroupedTopK`)."""

    router: GroupedTopK

    def for_layer(self, layer: int) -> ExpertWeights:
        return ExpertWeights(self.router.for_layer(layer))

    def __call__(self, sources: list[Tensor], batch: Batch) -> Float[Tensor, "b pos top_k"]:
        return self.router(sources[0], batch)[0]


@dataclass(frozen=True)
class ExpertIndices:
    """The chosen routed experts, best selection score first (see :class:`GroupedTopK`)."""

    router: GroupedTopK

    def for_layer(self, layer: int) -> ExpertIndices:
        return ExpertIndices(self.router.for_layer(layer))

    def __call__(self, sources: list[Tensor], batch: Batch) -> Tensor:
        """``[b, pos, top_k]``, int64."""
        return self.router(sources[0], batch)[1]


@dataclass(frozen=True)
class Difference(SameForEveryLayer):
    """The first source minus the second (a sum's other term, e.g. routed = MoE out − shared)."""

    def __call__(self, sources: list[Tensor], batch: Batch) -> Tensor:
        whole, part = sources
        return whole - part
