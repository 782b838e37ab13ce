"""Per-row steering terms on the device, for a compiled graph's steered names and SAEs.

The graph applies each step's steering as data: one row of terms per token row, read from
preallocated buffers (:class:`SteeringBuffers`) that the runtime fills before each step from the
steered requests' own terms, which live on the device in a table per target
(:class:`TermTable`), one row per followed request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

Terms = tuple[Tensor, ...]  # a Steer's add, gain, ablate; an SAESteer's multiplier, offset

#: the terms that change nothing: a Steer's, an SAESteer's
STEER_NEUTRAL = (0.0, 1.0, 0.0)
SAE_NEUTRAL = (1.0, 0.0)


@dataclass
class SteeringBuffers:
    """Per-row steering terms of one name (or compiled SAE), ``[max_tokens, width]`` each,
    neutral by default."""

    terms: tuple[Tensor, ...]
    neutral: tuple[float, ...]
    #: what the last step's rows hold: their rows, which terms each took, and from which
    #: table (reset before a step that needs other terms)
    placed: tuple[np.ndarray, np.ndarray, tuple] | None = None
    dirty: Tensor | None = None  # the same rows on the device
    #: the step (:attr:`StepRows.key`) and the call's revision the rows were placed for:
    #: a step of both again needs nothing, where no steer of the name picks positions
    placed_for: tuple | None = None

    @classmethod
    def allocate(
        cls,
        rows: int,
        width: int,
        device: torch.device,
        dtype: torch.dtype,
        neutral: tuple[float, ...] = STEER_NEUTRAL,
    ) -> SteeringBuffers:
        terms = tuple(
            torch.full((rows, width), value, device=device, dtype=dtype) for value in neutral
        )
        return cls(terms, neutral)

    def holds(self, rows: np.ndarray, sources: np.ndarray, table: tuple | None) -> bool:
        """Whether the rows already hold these terms (a decode step steering the same requests
        in the same rows as the last: nothing to write); ``table``: the terms' table and its
        version."""
        if self.placed is None:
            return not len(rows)
        placed_rows, placed_sources, placed_table = self.placed
        return (
            placed_table == table
            and np.array_equal(placed_rows, rows)
            and np.array_equal(placed_sources, sources)
        )

    def reset(self) -> None:
        if self.dirty is not None:
            for buffer, value in zip(self.terms, self.neutral):
                buffer.index_fill_(0, self.dirty, value)
        self.dirty = self.placed = self.placed_for = None

    def set_rows(self, rows: Tensor, terms: Terms, sources: Tensor) -> None:
        """Row ``rows[i]`` gets the terms of table entry ``sources[i]``."""
        for buffer, table in zip(self.terms, terms):
            buffer.index_copy_(0, rows, table.index_select(0, sources))
        self.dirty = rows


class TermTable:
    """Every followed request's terms for one steering target, on the device, one row each.

    A request's row is written once, when it is followed (one small copy, which does not wait
    for the GPU), and reused by a later request once it finishes: requests that come and go
    (a server) never make the whole table travel again. :attr:`version` changes with every row
    written, so that step rows placed from an older table are placed again."""

    def __init__(self, like: Sequence[Tensor], to_device: Callable[[Tensor], Tensor]) -> None:
        """``like``: the per-row buffers, whose widths, dtypes and device the rows take."""
        self.to_device = to_device
        self.rows: tuple[Tensor, ...] = tuple(
            torch.empty(0, buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
            for buffer in like
        )
        self.free: list[int] = []
        self.used = 0  # rows ever handed out
        self.version = 0

    def add(self, terms: Terms) -> int:
        """A row holding ``terms`` (CPU vectors), and its index."""
        if self.free:
            index = self.free.pop()
        else:
            index = self.used
            self.used += 1
            if index >= len(self.rows[0]):
                self._grow(max(8, 2 * len(self.rows[0])))
        for table, term in zip(self.rows, terms):
            table[index].copy_(self.to_device(term.to(table.dtype)), non_blocking=True)
        self.version += 1
        return index

    def remove(self, index: int) -> None:
        self.free.append(index)

    def _grow(self, capacity: int) -> None:
        grown = []
        for table in self.rows:
            bigger = torch.zeros(capacity, table.shape[1], dtype=table.dtype, device=table.device)
            bigger[: len(table)] = table
            grown.append(bigger)
        self.rows = tuple(grown)
