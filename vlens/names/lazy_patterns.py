"""Attention scores and patterns built when they are first read, not when a call finishes.

One layer's scores or pattern hold ``heads × pos × pos`` values per request: at 2,000 tokens,
16 MB per head in float32, where everything else a cache holds grows with the number of positions
alone. A :class:`LazyAttention` keeps what they are rebuilt from (the rotated q and k, linear in
the prompt) and builds the value on demand: request by request and a block of query rows at a
time, straight into the preallocated result, so building one costs about its own size plus a few
blocks of temporaries.

The arithmetic is the worker's explicit attention (:mod:`vlens.runtime.attention.arithmetic`):
``q·kᵀ·scale`` in float32, soft-capped and windowed where the layer is, causally masked, rounded
to q's dtype, then (pattern) a float32 softmax. Padding follows TransformerLens's layout of a
padded batch: the scores of padding keys are -inf and padding query rows hold ``q·kᵀ`` of the
padding rows of q over the real keys; a pattern is zero at padding keys and padding queries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from vlens.runtime.attention.arithmetic import causal_scores, softmax_pattern

Stage = Literal["scores", "pattern"]

#: A block of query rows holds at least this many bytes of float32 scores (or 1/32 of the
#: request's value, where that is more): small next to the value built, large enough to keep the
#: matrix products efficient.
BLOCK_BYTES = 4 * 2**20
BLOCKS_PER_VALUE = 32


@dataclass(frozen=True)
class LazyAttention:
    """One layer's attention scores or pattern for a padded batch, built when read.

    ``q`` ``[batch, pos, head, d]`` and ``k`` ``[batch, pos, kv_head, d]`` are the rotated query and
    key (query head ``h`` reads key head ``h // (head / kv_head)``); ``lengths`` are each request's
    real positions. ``formed[i]``, where not None, is request ``i``'s value as the worker formed it
    for hook functions (a leading box of the request's value, ``[head, pos_i, pos_i]``): it
    replaces the rebuilt one, as :func:`vlens.names.derived.with_formed` does for eager names.
    Without ``batched`` the value has no batch axis (a batch of one, its axis removed).
    ``soft_cap``, ``window`` and ``alibi``: the layer's attention-logit soft cap, sliding window
    and ALiBi slopes, if any (:func:`~vlens.runtime.attention.arithmetic.causal_scores`).
    """

    stage: Stage
    q: Float[Tensor, "batch pos head d"]
    k: Float[Tensor, "batch pos kv_head d"]
    scale: float
    lengths: tuple[int, ...]
    formed: tuple[Tensor | None, ...]
    batched: bool = True
    soft_cap: float | None = None
    window: int | None = None
    alibi: tuple[float, ...] | None = None
    #: where a request's padding goes: after its positions, or before them (both axes)
    padding_side: str = "right"
    #: each head's attention-sink logit, where the layer has sinks (GPT-OSS): the pattern's
    #: softmax counts it in its denominator (:func:`~vlens.runtime.attention.arithmetic.softmax_pattern`)
    sinks: Tensor | None = None

    def build(self) -> Tensor:
        """The whole value, ``[batch, head, pos, pos]`` (``[head, pos, pos]`` unbatched)."""
        batch, positions, heads = self.q.shape[:3]
        value = self.q.new_empty(batch, heads, positions, positions)
        for index in range(batch):
            self._fill(value[index], index)
            shift = positions - self.lengths[index]
            if self.padding_side == "left" and shift:
                value[index] = value[index].roll((shift, shift), dims=(1, 2))
        return value if self.batched else value[0]

    def build_request(self, index: int) -> Tensor:
        """Request ``index``'s value over its own positions, ``[head, pos_i, pos_i]``: what
        :meth:`build` holds there, without building the other requests or the padding."""
        length = self.lengths[index]
        value = self.q.new_empty(self.q.shape[2], length, length)
        self._fill(value, index)
        return value

    def softmaxed(self) -> LazyAttention:
        """The pattern of these scores (the worker forms both together, so formed scores never
        come without their formed pattern: the pattern's own formed values replace them)."""
        return dataclasses.replace(self, stage="pattern", formed=(None,) * len(self.lengths))

    def padded_on(self, side: str) -> LazyAttention:
        """The same value, padded on ``side`` when built."""
        return dataclasses.replace(self, padding_side=side)

    def with_formed(self, formed: Sequence[Tensor | None]) -> LazyAttention:
        return dataclasses.replace(self, formed=tuple(formed))

    def to(self, device: str | torch.device) -> LazyAttention:
        """The same value, built on ``device``."""
        formed = tuple(None if part is None else part.to(device) for part in self.formed)
        sinks = None if self.sinks is None else self.sinks.to(device)
        return dataclasses.replace(
            self, q=self.q.to(device), k=self.k.to(device), formed=formed, sinks=sinks
        )

    def select(self, indices: Tensor) -> LazyAttention:
        """The requests at ``indices`` (1-d), or one request without a batch axis (0-d)."""
        kept = indices.reshape(-1).tolist()
        return dataclasses.replace(
            self,
            q=self.q[kept],
            k=self.k[kept],
            lengths=tuple(self.lengths[i] for i in kept),
            formed=tuple(self.formed[i] for i in kept),
            batched=indices.ndim > 0,
        )

    def _fill(self, value: Float[Tensor, "head q k"], index: int) -> None:
        """Write request ``index``'s value into ``value``, whose query rows past the request's
        length (if any) are padding rows."""
        length = self.lengths[index]
        rows = value.shape[1]
        q, k = self.q[index, :rows], self.k[index, :length]
        value[:, :, length:] = float("-inf") if self.stage == "scores" else 0.0
        if self.stage == "pattern":
            value[:, length:, :length] = 0.0
        last = length if self.stage == "pattern" else rows
        for block in query_blocks(length, last, value.shape[0]):
            scores = causal_scores(
                q[block], k, self.scale, block.start,
                soft_cap=self.soft_cap, window=self.window, alibi=self.alibi,
            ).to(value.dtype)
            if self.stage == "pattern":
                scores = softmax_pattern(scores, self.sinks)
            value[:, block, :length] = scores
        part = self.formed[index]
        if part is not None:
            value[tuple(slice(0, size) for size in part.shape)] = part.to(value.device)


def query_blocks(length: int, rows: int, heads: int) -> Iterator[slice]:
    """Blocks of query rows ``0..rows-1`` for a request of ``length`` real positions: the same
    blocks over its real rows whether or not padding rows follow (so a request's value is the same
    built alone or in its batch), then the padding rows."""
    row_bytes = heads * max(length, 1) * 4
    size = max(1, BLOCK_BYTES // row_bytes, -(-length // BLOCKS_PER_VALUE))
    for start in range(0, length, size):
        yield slice(start, min(start + size, length))
    for start in range(length, rows, size):
        yield slice(start, min(start + size, rows))
