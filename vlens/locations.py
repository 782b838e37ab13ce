"""Where a value lives in vLLM's module tree: the leaf vocabulary shared by mapping files (the
user's side) and the worker runtime (inside vLLM). It imports nothing of vlens, so a vLLM worker
process loads it without the user-facing facade."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

Event = Literal["input", "output", "sampled"]


@dataclass(frozen=True)
class Site:
    """A place in vLLM's module tree: the call's arguments (``input``) or its result (``output``)
    in the forward, or the result of a module called once per step to sample (``sampled``: one
    row per request that samples a token)."""

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
    slice of every part side by side. Values without it are whole on every rank."""

    dim: int
    parts: tuple[int, ...]


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
