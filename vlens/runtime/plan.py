"""What the user's process asks of the workers for one request: per site, the names to read,
in forward order, each with the user's hook functions to run and whether to keep the value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from vlens.mapping import Site
from vlens.readers import Reader
from vlens.steering import Steer

HookFunction = Callable[[Tensor, Any], Tensor | None]


@dataclass(frozen=True)
class NamePlan:
    """One canonical name at one site: ``hooks`` run first (they may edit), then, if ``keep``,
    the (possibly edited) value is captured for the cache."""

    name: str
    read: Reader
    arrange: str | None
    hooks: tuple[HookFunction, ...]
    keep: bool


@dataclass(frozen=True)
class RequestPlan:
    """Everything one request (``index`` in the user's call) wants, grouped by site; on a
    compiled engine, also the traced names it keeps (``graph_keep``) and its ``steering``."""

    index: int
    sites: dict[Site, tuple[NamePlan, ...]]
    graph_keep: frozenset[str] = field(default_factory=frozenset)
    steering: tuple[Steer, ...] = ()

    def kept_names(self) -> frozenset[str]:
        """The names read at sites that this request keeps for its cache."""
        return frozenset(name.name for names in self.sites.values() for name in names if name.keep)
