"""Where a value lives in vLLM's module tree: the leaf vocabulary shared by mapping files (the
user's side) and the worker runtime (inside vLLM). It imports nothing of vlens, so a vLLM worker
process loads it without the user-facing facade."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

Event = Literal["input", "output", "call", "sampled"]


@dataclass(frozen=True)
class Site:
    """A place in vLLM's module tree: the call's arguments (``input``) or its result (``output``)
    in the forward, both (``call``: where a compiled graph computes a layer's attention in
    Python), or the result of a module called once per step to sample (``sampled``: one row per
    request that samples a token)."""

    path: str
    event: Event

    def for_layer(self, layer: int) -> Site:
        return dataclasses.replace(self, path=self.path.format(layer=layer))


class SiteCall(Protocol):
    """What a reader sees: one module call, narrowed to the rows of one request.

    Every accessor returns a view into vLLM's own tensors, so an in-place change reaches the model.
    """

    @property
    def model(self) -> torch.nn.Module: ...

    def argument(self, index: int, name: str, shards: Split | None = None) -> Any: ...

    def raw_argument(self, index: int, keyword: str | None) -> Any: ...

    def output(self, element: int | None, shards: Split | None = None) -> Any: ...

    def assign_argument(self, index: int, name: str, new: Any, shards: Split | None = None) -> None: ...

    def assign_output(self, element: int | None, new: Any, shards: Split | None = None) -> None: ...


@dataclass(frozen=True)
class Shards:
    """How vLLM splits a value over tensor-parallel ranks: along ``dim``, each of the fused
    ``parts`` (their whole widths, e.g. ``[q | k | v]``) split evenly, each rank holding its
    slice of every part side by side, except the parts numbered in ``replicated``, which every
    rank holds whole (Falcon's one key/value head, which vLLM gives every rank). Values without
    it are whole on every rank."""

    dim: int
    parts: tuple[int, ...]
    replicated: tuple[int, ...] = ()


@dataclass(frozen=True)
class PartialSums:
    """Each rank holds a partial sum of the value (a row-parallel projection whose results vLLM
    adds over the ranks later, e.g. Qwen2-MoE's shared expert): whole once summed."""


#: How a value is spread over tensor-parallel ranks, where it is not whole on every rank.
Split = Shards | PartialSums


@dataclass(frozen=True)
class Argument:
    """An argument of the call, found by keyword or else by position (``shards``: how it is
    split over tensor-parallel ranks, if it is)."""

    index: int
    name: str
    shards: Split | None = None


AttentionStage = Literal["scores", "pattern", "result"]


@dataclass(frozen=True)
class ExplicitAttention:
    """What computing one layer's attention explicitly in the worker needs, where vLLM's kernel
    would otherwise run (so that hooks on its scores, pattern and per-head results see and edit
    the real values).

    ``kernel`` is vLLM's attention module, called with the rotated ``query``
    ``[pos, heads·d_head]``, ``key`` ``[pos, kv_heads·d_head]`` and ``value``
    ``[pos, kv_heads·d_head_v]``; it returns z, ``[pos, heads·d_head_v]``. Query head ``h`` reads key/value head ``h // (heads / kv_heads)``.
    ``scale`` multiplies ``q·k``. ``projection`` is the module applying ``W_O`` (and ``b_O``) to z,
    called with it as ``projection_input``; element ``projection_element`` of its result is the
    attention output. The attention is causal, with no sliding window or soft cap: an
    architecture with either does not declare it. ``alibi``: each query head's ALiBi slope, where
    the attention adds that bias (BLOOM; see
    :func:`~vlens.runtime.attention.arithmetic.causal_scores`).
    """

    kernel: str
    projection: str
    heads: int
    kv_heads: int
    d_head: int
    scale: float
    # vLLM's ``Attention.forward(query, key, value)``
    query: Argument = Argument(0, "query")
    key: Argument = Argument(1, "key")
    value: Argument = Argument(2, "value")
    d_head_v: int | None = None  # None: d_head
    projection_input: Argument = Argument(0, "input_")
    projection_element: int | None = 0
    alibi: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.heads} query heads cannot share {self.kv_heads} key/value heads evenly"
            )

    def module_of(self, stage: AttentionStage) -> str:
        """The module after which ``stage`` is formed: the kernel (scores, pattern), or the
        output projection (per-head results)."""
        return self.projection if stage == "result" else self.kernel

    @property
    def value_width(self) -> int:
        return self.d_head if self.d_head_v is None else self.d_head_v

    def for_layer(self, layer: int) -> ExplicitAttention:
        return dataclasses.replace(
            self,
            kernel=self.kernel.format(layer=layer),
            projection=self.projection.format(layer=layer),
        )
