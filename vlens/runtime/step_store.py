"""Kept rows of whole engine steps, split per request only when the requests finish.

Copying each request's rows out of every step (one small tensor per request, name and step) is
what made capture slow at large batches: 256 requests × 36 layers × 128 decode steps is 1.2 M
copies. Instead a step's rows of one name are copied once, for every request that keeps them, with
a note of whose rows they are (*segments*); when the requests finish, each name's steps are joined
and moved once, and each request's run of positions is a slice (a prefill) or one gather (its
decode rows) of that.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Run = tuple[int, Tensor]  # (first position, rows)


@dataclass(frozen=True)
class Segment:
    """``length`` rows of request ``tag``, from sequence position ``first_position`` on."""

    tag: str
    length: int
    first_position: int


class StepStore:
    """Each name's kept rows, step after step, with whose rows they are."""

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[list[Segment], Tensor]]] = defaultdict(list)

    def add(self, name: str, segments: list[Segment], rows: Tensor) -> None:
        """One step's rows of ``name``: the segments' rows, one after the other."""
        self.entries[name].append((segments, rows))

    def take(
        self, tags: Sequence[str], keeps: Mapping[str, frozenset[str]], device: str
    ) -> dict[str, dict[str, list[Run]]]:
        """For each of ``tags``, the rows of each name it keeps (``keeps[tag]``), on ``device``:
        ``[(first_position, rows), ...]``, one entry per run of consecutive positions."""
        wanted = set(tags)
        result: dict[str, dict[str, list[Run]]] = {tag: {} for tag in tags}
        for name, steps in self.entries.items():
            if not any(name in keeps.get(tag, ()) for tag in tags):
                continue
            pieces: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
            start = 0
            for segments, _ in steps:
                for segment in segments:
                    if segment.tag in wanted:
                        pieces[segment.tag].append((start, segment.length, segment.first_position))
                    start += segment.length
            joined = torch.cat([rows for _, rows in steps]).to(device)
            for tag, own in pieces.items():
                if name in keeps.get(tag, ()):
                    result[tag][name] = [(position, take(joined)) for position, take in _runs(own)]
        return result

    def clear(self) -> None:
        self.entries.clear()


def _runs(pieces: list[tuple[int, int, int]]) -> list[tuple[int, Callable[[Tensor], Tensor]]]:
    """Pieces ``(start, length, position)`` in step order → per run of consecutive positions,
    its first position and how to take its rows from the joined steps."""
    runs: list[tuple[int, list[tuple[int, int]]]] = []
    end = None
    for start, length, position in pieces:
        if position == end:
            runs[-1][1].append((start, length))
        else:
            runs.append((position, [(start, length)]))
        end = position + length
    return [(position, _taker(spans)) for position, spans in runs]


def _taker(spans: list[tuple[int, int]]) -> Callable[[Tensor], Tensor]:
    if len(spans) == 1:
        start, length = spans[0]
        return lambda joined: joined[start : start + length]
    index = torch.cat([torch.arange(start, start + length) for start, length in spans])
    return lambda joined: joined.index_select(0, index.to(joined.device))


def copy_rows(value: Tensor, spans: Sequence[tuple[int, int]]) -> Tensor:
    """Rows ``start:stop`` of each span of a whole step's ``value``, one after the other, as a
    tensor of their own: one slice copy when they are consecutive, else one gather."""
    rows = [row for start, stop in spans for row in range(start, stop)]
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return value[first : first + len(rows)].clone()
    return value.index_select(0, torch.tensor(rows).to(value.device))
