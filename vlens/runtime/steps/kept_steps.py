"""Kept rows of whole engine steps, laid out as the padded batch only when the requests finish.

Copying each request's rows out of every step (one small tensor per request, name and step) is
what made capture slow at large batches: 256 requests × 36 layers × 128 decode steps is 1.2 M
copies. Instead a step's rows of one name are copied once, for every request that keeps them, with
a note of whose rows they are (*segments*). When the requests finish, each name's steps are
scattered, on the device that computed them, straight into the ``[batch, pos, ...]`` layout that
the cache is made of (one index copy), and moved once to where the user wants them: the host gets
one transfer per name into pinned memory and never copies the values again.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.messages import Chunk, PaddedRows, Span


class Segment(NamedTuple):
    """``length`` rows of request ``tag``, from sequence position ``first_position`` on."""

    tag: str
    length: int
    first_position: int


class StepRuns(NamedTuple):
    """Steps' kept rows as arrays, in step order: ``length[k]`` rows of request index
    ``request[k]`` from position ``first[k]`` on (:class:`Segment` by index, for many steps)."""

    request: np.ndarray
    length: np.ndarray
    first: np.ndarray

    @classmethod
    def joined(cls, steps: Sequence[StepRuns]) -> StepRuns:
        if not steps:
            empty = np.empty(0, dtype=np.int64)
            return cls(empty, empty, empty)
        return cls(*(np.concatenate(part) for part in zip(*steps)))


class KeptSteps:
    """Each name's kept rows, step after step, with whose rows they are.

    Each request's own runs of rows are noted too (which step, where in it), so that a server,
    which takes one finished request at a time out of the steps of every request still running,
    reads only that request's rows rather than laying out every step's; and a step is dropped
    once every request with rows in it is forgotten."""

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[list[Segment], Tensor]]] = defaultdict(list)
        #: tag -> its runs, in step order: (the step's segments' id, offset in it, first
        #: position, length)
        self._runs: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
        #: a step's segments' id -> how many of them belong to requests not yet forgotten
        self._live: dict[int, int] = {}
        self._dead: set[int] = set()  # steps no request needs, still in ``entries``

    def add(self, name: str, segments: list[Segment], rows: Tensor) -> None:
        """One step's rows of ``name``: the segments' rows, one after the other. Names read in
        the same step may share one ``segments`` list (its layout is then worked out once)."""
        self.entries[name].append((segments, rows))
        step = id(segments)
        if not segments:  # nobody's rows: nothing will ever take it
            self._dead.add(step)
        elif step not in self._live:
            self._live[step] = len(segments)
            offset = 0
            for segment in segments:
                self._runs[segment.tag].append(
                    (step, offset, segment.first_position, segment.length)
                )
                offset += segment.length

    def take(
        self, tags: Sequence[str], kept_names: Mapping[str, frozenset[str]], device: str
    ) -> dict[str, PaddedRows]:
        """Every name some of ``tags`` keep (``kept_names[tag]``), as :class:`PaddedRows` on
        ``device`` whose request ``i`` is ``tags[i]``."""
        destination = torch.device(device)
        first = next((steps[0][1] for steps in self.entries.values()), None)
        side = None
        if first is not None and first.is_cuda and destination.type == "cpu":
            side = _copy_stream(first.device)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if 2 * len(tags) <= len(self._runs):  # a few requests out of many: their runs only
                taken = self._take_runs(tags, kept_names, destination)
            else:
                taken = self._take_steps(tags, kept_names, destination)
        if side is not None:
            side.synchronize()  # the pinned copies of :func:`_moved`
        return taken

    def _take_steps(
        self, tags: Sequence[str], kept_names: Mapping[str, frozenset[str]],
        destination: torch.device,
    ) -> dict[str, PaddedRows]:
        """:meth:`take` from every step held, each name's steps laid out at once."""
        index_of = {tag: index for index, tag in enumerate(tags)}
        layouts: dict[tuple, _Layout] = {}
        taken: dict[str, PaddedRows] = {}
        for name, steps in self.entries.items():
            keepers = frozenset(index_of[tag] for tag in tags if name in kept_names.get(tag, ()))
            if not keepers:
                continue
            key = (tuple(id(segments) for segments, _ in steps), keepers)
            if key not in layouts:
                layouts[key] = _Layout.of(steps, index_of, keepers, len(tags))
            layout = layouts[key]
            taken[name] = PaddedRows(layout.scatter(steps, destination), layout.spans)
        return taken

    def _take_runs(
        self, tags: Sequence[str], kept_names: Mapping[str, frozenset[str]],
        destination: torch.device,
    ) -> dict[str, PaddedRows]:
        """:meth:`take` from the requests' own runs."""
        taken: dict[str, PaddedRows] = {}
        names = sorted(set().union(*(kept_names.get(tag, frozenset()) for tag in tags)))
        for name in names:
            rows_of = {id(segments): rows for segments, rows in self.entries.get(name, ())}
            pieces: list[Tensor] = []
            requests: list[int] = []
            lengths: list[int] = []
            firsts: list[int] = []
            for index, tag in enumerate(tags):
                if name not in kept_names.get(tag, ()):
                    continue
                for step, offset, first, length in self._runs.get(tag, ()):
                    if step in rows_of:
                        pieces.append(rows_of[step][offset : offset + length])
                        requests.append(index)
                        lengths.append(length)
                        firsts.append(first)
            if not pieces:
                continue
            runs = StepRuns(*(np.array(v, dtype=np.int64) for v in (requests, lengths, firsts)))
            keepers = frozenset(requests)
            held = _HeldRows.of_runs(runs, keepers, len(tags))
            layout = _Layout(
                len(tags), held.width,
                None if held.whole else row_index(held.start, held.length),
                row_index(held.request * held.width + held.first, held.length),
                held.spans(len(tags)),
            )
            taken[name] = PaddedRows(
                layout.scatter([(None, piece) for piece in pieces], destination), layout.spans
            )
        return taken

    def clear(self) -> None:
        self.entries.clear()
        self._runs.clear()
        self._live.clear()
        self._dead.clear()

    def forget(self, tags: Sequence[str]) -> None:
        """Forget these requests, and the steps no request left needs: where requests keep
        arriving (a server) they never empty, and finished requests' steps would
        otherwise stay. Dropping dead steps walks every name's steps, so it waits until they
        are a quarter of the steps held."""
        for tag in tags:
            for step, *_ in self._runs.pop(tag, ()):
                self._live[step] -= 1
                if not self._live[step]:
                    del self._live[step]
                    self._dead.add(step)
        if 4 * len(self._dead) < len(self._live) + len(self._dead):
            return
        for name, steps in list(self.entries.items()):
            live = [step for step in steps if id(step[0]) not in self._dead]
            if live:
                self.entries[name] = live
            else:
                del self.entries[name]
        self._dead.clear()


@dataclass
class _Layout:
    """Where the kept rows of a series of steps go in the padded batch: ``source`` picks them
    from the joined steps (None: all of them, in order) and ``target`` says which row of the
    flattened ``[batch * width, ...]`` batch each becomes."""

    batch: int
    width: int
    source: Tensor | None
    target: Tensor
    spans: list[list[Span]]

    @classmethod
    def of(
        cls,
        steps: Sequence[tuple[Sequence[Segment], Tensor]],
        index_of: Mapping[str, int],
        keepers: frozenset[int],
        batch: int,
    ) -> _Layout:
        """Worked out with array operations: a generation of 256 requests has ~33,000
        segments per name."""
        held = _HeldRows.of([segments for segments, _ in steps], index_of, keepers, batch)
        source = None if held.whole else row_index(held.start, held.length)
        target = row_index(held.request * held.width + held.first, held.length)
        return cls(batch, held.width, source, target, held.spans(batch))

    def scatter(self, steps: Sequence[tuple[object, Tensor]], device: torch.device) -> Tensor:
        """The padded ``[batch, width, ...]`` batch of these steps' rows, on ``device``."""
        rows = [step_rows for _, step_rows in steps]
        trailing = rows[0].shape[1:]
        shape = (self.batch * self.width, *trailing)
        filled = all(spans == [(0, self.width)] for spans in self.spans)
        padded = rows[0].new_empty(shape) if filled else rows[0].new_zeros(shape)
        if self.source is None and not rows[0].is_cuda:
            # on the host each pass over the values counts: each step straight to its rows
            offset = 0
            for step_rows in rows:
                padded.index_copy_(0, self.target[offset : offset + len(step_rows)], step_rows)
                offset += len(step_rows)
        else:  # on a GPU: one join and one scatter instead of a launch per step
            joined = rows[0] if len(rows) == 1 else torch.cat(rows)
            if self.source is not None:
                joined = joined.index_select(0, self.source.to(joined.device))
            padded.index_copy_(0, self.target.to(joined.device), joined)
        return _moved(padded.view(self.batch, self.width, *trailing), device)


@dataclass
class _HeldRows:
    """The kept runs of a series of steps that no later step replaced: run ``k`` is
    ``length[k]`` rows of request ``request[k]`` from position ``first[k]``, rows
    ``start[k]:start[k] + length[k]`` of the joined steps. ``whole``: every row of the steps."""

    request: np.ndarray
    first: np.ndarray
    length: np.ndarray
    start: np.ndarray
    whole: bool

    @classmethod
    def of(
        cls,
        steps: Sequence[Sequence[Segment]],
        index_of: Mapping[str, int],
        keepers: frozenset[int],
        batch: int,
    ) -> _HeldRows:
        requests: list[int] = []
        lengths: list[int] = []
        firsts: list[int] = []
        for segments in steps:
            if segments:
                tags, step_lengths, step_firsts = zip(*segments)
                requests += [index_of.get(tag, batch) for tag in tags]
                lengths += step_lengths
                firsts += step_firsts
        runs = StepRuns(*(np.array(v, dtype=np.int64) for v in (requests, lengths, firsts)))
        return cls.of_runs(runs, keepers, batch)

    @classmethod
    def of_runs(cls, runs: StepRuns, keepers: frozenset[int], batch: int) -> _HeldRows:
        """The same from the steps' segments joined in step order (a request index of
        ``batch``: none of the call's)."""
        request, length, first = runs
        start = np.cumsum(length) - length
        kept = np.zeros(batch + 1, dtype=bool)
        kept[list(keepers)] = True
        wanted = kept[request]
        request, first, start = request[wanted], first[wanted], start[wanted]
        held = _still_held(request, first, length[wanted])
        whole = wanted.all() and bool((held == length[wanted]).all())
        rest = held > 0
        return cls(request[rest], first[rest], held[rest], start[rest], whole)

    @property
    def width(self) -> int:
        return int((self.first + self.length).max(initial=0))

    def spans(self, batch: int) -> list[list[Span]]:
        return _spans(self.request, self.first, self.length, batch)


def layout_spans(
    runs: StepRuns, keepers: frozenset[int], batch: int
) -> tuple[int, list[list[Span]]]:
    """The padded width and each request's runs of positions that the ``keepers``' rows of these
    steps fill (rows a later step replaced left out), as :class:`KeptSteps` lays them out."""
    held = _HeldRows.of_runs(runs, keepers, batch)
    return held.width, held.spans(batch)


def _still_held(request: np.ndarray, first: np.ndarray, length: np.ndarray) -> np.ndarray:
    """How many leading rows of each segment (in step order) no later segment replaces.

    vLLM recomputes a preempted request from an earlier position (its start, without prefix
    caching): a segment of a request starting at position ``p`` replaces every row of that
    request kept before at ``p`` or after. A segment's rows are consecutive positions, so what
    stays of it is a prefix: the rows before the earliest start of the request's later segments.
    """
    if len(request) == 0:
        return length
    # Grouped by request (ascending), each group latest step first: an exclusive running minimum
    # of the starts is then the earliest later start. Adding ``request * bound`` keeps groups
    # apart: every start of a group before (a higher request) lies above the group's own.
    bound = int((first + length).max()) + 1
    order = np.lexsort((np.arange(len(request)), request))[::-1]
    offset = request[order] * bound
    earliest = np.minimum.accumulate(first[order] + offset)
    later_start = np.empty_like(earliest)
    later_start[0] = np.iinfo(np.int64).max
    later_start[1:] = earliest[:-1]
    cut = np.empty_like(first)
    cut[order] = np.minimum(later_start - offset, bound)  # ``bound``: nothing later
    return np.clip(cut - first, 0, length)


def row_index(starts: np.ndarray, lengths: np.ndarray) -> Tensor:
    """Rows ``start .. start + length - 1`` of each ``(start, length)``, one after the other."""
    before = np.cumsum(lengths) - lengths
    within = np.arange(int(lengths.sum())) - np.repeat(before, lengths)
    return torch.from_numpy(np.repeat(starts, lengths) + within)


def _spans(
    request: np.ndarray, first: np.ndarray, length: np.ndarray, batch: int
) -> list[list[Span]]:
    """Each request's runs of consecutive positions, from its pieces in any order."""
    order = np.lexsort((first, request))
    request, first, length = request[order], first[order], length[order]
    new_run = np.ones(len(request), dtype=bool)
    new_run[1:] = (request[1:] != request[:-1]) | (first[1:] != first[:-1] + length[:-1])
    starts = np.flatnonzero(new_run)
    run_lengths = np.add.reduceat(length, starts) if len(starts) else length
    spans: list[list[Span]] = [[] for _ in range(batch)]
    for owner, run_first, run_length in zip(
        request[starts].tolist(), first[starts].tolist(), run_lengths.tolist()
    ):
        spans[owner].append((run_first, run_length))
    return spans


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that takes finished requests' rows off a GPU. The steps that wrote them are
    done (their requests' last tokens came back, copied after them on the compute stream), so
    the copies need not wait for whatever steps the compute stream has queued since, as a
    ``torch.cuda.synchronize()`` would (under vLLM's asynchronous scheduling, the next step): a
    server takes each capturing request's rows while others run."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device)
    return _copy_streams[device]


def _moved(value: Tensor, device: torch.device) -> Tensor:
    """``value`` on ``device``; from a GPU to the host through pinned memory, without waiting
    (:meth:`KeptSteps.take` waits once for all names)."""
    if value.device.type == device.type and device.index in (None, value.device.index):
        return value
    if value.is_cuda and device.type == "cpu":
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return host.copy_(value, non_blocking=True)
    return value.to(device)


def kept_rows(
    requests: Sequence[RequestRows], device: torch.device
) -> tuple[slice | Tensor, list[Segment]]:
    """Where these requests' rows lie in a step (:func:`row_selection`) and whose they are: worked
    out once per step and shared by every name read in it."""
    selection = row_selection([(r.start, r.stop) for r in requests], device)
    return selection, segments_of(requests)


def segments_of(requests: Sequence[RequestRows]) -> list[Segment]:
    """Whose a step's kept rows are, request after request (see :func:`kept_rows`)."""
    return [Segment(r.tag, r.stop - r.start, r.first_position) for r in requests]


def row_selection(spans: Sequence[tuple[int, int]], device: torch.device) -> slice | Tensor:
    """Rows ``start:stop`` of each span, one after the other: a slice when they are consecutive,
    else an index on ``device``. Worked out once per step, used for every name of the step."""
    first, last = spans[0][0], spans[-1][1]
    if all(stop == next_start for (_, stop), (next_start, _) in zip(spans, spans[1:])):
        return slice(first, last)
    starts, stops = np.array(spans, dtype=np.int64).T
    return row_index(starts, stops - starts).to(device)


def copy_rows(value: Tensor, selection: slice | Tensor) -> Tensor:
    """The selected rows of a whole step's ``value``, as a tensor of their own."""
    if isinstance(selection, slice):
        return value[selection].clone()
    return value.index_select(0, selection)


def add_chunk(chunks: list[Chunk], chunk: Chunk) -> None:
    """Add one step's rows of a request to its ``chunks`` (in position order, none
    overlapping). Rows held at ``chunk``'s positions or after are dropped first: vLLM recomputes
    a preempted request from an earlier position, and the new rows replace the old."""
    while chunks and chunks[-1].first_position >= chunk.first_position:
        chunks.pop()
    if chunks:
        last = chunks[-1]
        before = chunk.first_position - last.first_position  # the rows before the new ones
        if before < len(last.value):
            chunks[-1] = Chunk(last.first_position, last.value[:before])
    chunks.append(chunk)
