"""A call's kept rows written straight into their place in the host's cache, step by step.

Where the call keeps its cache on the host and says how many positions each request can run, the
padded ``[batch, pos, ...]`` tensor of
every kept name is allocated on the host when the name is first kept, and each step's rows are
copied into their final rows as the step ends: no step's rows wait on the device until the call
ends, and nothing is copied again after it (an every-layer generation of 256 requests is 19 GB).
Names written together (a step's rows of every name of one shape, ``[names, rows, ...]``) share
one host tensor ``[names, batch * width + 1, ...]``, so that on a GPU the step's rows of all of
them go over in one set of copies. Where the worker is a process of its own (tensor parallelism),
that host memory is shared with the user's process (:mod:`vlens.runtime.transfer.host_blocks`), so the
user's cache is the very memory the worker filled.

On a GPU the copy runs on a side stream while later steps compute: the step's rows are cloned on
the compute stream (a copy inside the GPU's memory), and the side stream moves the clone into
pinned host memory by the GPU's copy engines, as pitched copies of the requests' runs of rows
(:mod:`vlens.runtime.transfer.pitched_copy`), so the transfer overlaps the next steps and leaves the SMs
to them. At most :data:`IN_FLIGHT` steps' clones wait for their transfer, which bounds the GPU
memory the captures hold whatever the call's size. On the CPU the scatter is the copy.

Two other ways measured slower on an H200 (``docs/NOTES.md``, "Kept rows to the host, one
GPU"): the SMs scattering the rows into the pinned cache through the GPU's view of it (unified
addressing: every layer's generation at 0.84× plain compiled, against 0.94× this way), and
staging each step's rows by DMA
and scattering them on the host into an ordinary cache (0.35×: the host's scatter ran at
~4.5 GB/s inside vLLM, cause not established).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from vlens.runtime.steps.kept_steps import KeptSteps, StepRuns, layout_spans, row_index
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer import host_blocks
from vlens.runtime.transfer.messages import PaddedRows, Span
from vlens.runtime.transfer.pitched_copy import Runs, copy_engines, pitched_copies

#: Steps whose rows may be on their way to the host at once (GPU): the oldest is waited for
#: beyond this.
IN_FLIGHT = 4


@dataclass(frozen=True)
class Slot:
    """Request ``index`` of a call of ``batch`` requests, which runs at most ``positions``; its
    call's cache is memory the user's process maps from this worker's where ``shared``."""

    index: int
    batch: int
    positions: int
    shared: bool = False


@dataclass
class _Transfer:
    """One step's rows on their way to the host: done once ``event`` has passed."""

    event: torch.cuda.Event
    held: list[Tensor] = field(default_factory=list)


class HostStream:
    """Every kept name's ``[batch * width + 1, ...]`` rows on the host, filled as steps end (the
    last row takes what no request holds)."""

    def __init__(self, batch: int, device: torch.device, shared: bool = False) -> None:
        self.batch = batch
        self.device = device
        self.shared = shared  # the host rows are blocks of :mod:`host_blocks`
        self.slots: dict[str, Slot] = {}
        self.width = 0
        self.host: dict[str, Tensor] = {}  # each name's rows: a view of its group's
        self._groups: dict[tuple[str, ...], Tensor] = {}  # names -> their [names, rows, ...]
        self.steps: list[StepRuns] = []  # each step's kept rows, by request index
        self._targets = torch.empty(0, dtype=torch.long)  # the step's rows' host rows (CPU)
        self._runs: Runs | None = None  # the same as runs of rows (GPU)
        self._engines = copy_engines(device) if device.type == "cuda" else None
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._transfers: deque[_Transfer] = deque()

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether rows on ``device`` can be written into host memory as they are computed."""
        return device.type == "cpu" or (
            device.type == "cuda" and copy_engines(device) is not None
        )

    def follow(self, tag: str, slot: Slot) -> None:
        if slot.batch != self.batch:
            raise ValueError(f"request {tag} belongs to a call of {slot.batch}, not {self.batch}")
        if self.host:
            raise RuntimeError(f"request {tag} joined a call whose rows are already being kept")
        self.slots[tag] = slot
        self.width = max(self.width, slot.positions)

    def begin_step(self, keepers: Sequence[RequestRows]) -> None:
        """Start a step whose kept requests are ``keepers``: work out where each of their rows
        goes in the flattened ``[batch * width]`` rows. A row past a request's announced
        positions (with asynchronous scheduling vLLM runs one more forward for a request that
        has just finished) is not part of its cache: it goes nowhere (the spare last row).
        Array operations throughout: a decode step of 256 requests runs this every few
        milliseconds."""
        slots = self.slots
        table = np.array(
            [
                (slot.index, slot.positions, request.first_position, request.stop - request.start)
                for request in keepers
                for slot in (slots[request.tag],)
            ],
            dtype=np.int64,
        ).reshape(len(keepers), 4)
        index, positions, first, lengths = table.T
        room = positions - first  # how many of its rows its slot holds
        self.steps.append(StepRuns(index, np.clip(room, 0, lengths), first))
        within = row_index(np.zeros_like(index), lengths).numpy()  # offset in its request
        targets = np.repeat(index * self.width + first, lengths) + within
        kept = within < np.repeat(room, lengths)
        if self._side is None:
            targets[~kept] = self.batch * self.width
            self._targets = torch.from_numpy(targets)
        else:
            self._runs = Runs.of(targets, kept)
            self._transfers.append(_Transfer(torch.cuda.Event()))

    def write(self, names: Sequence[str], rows: Sequence[Tensor]) -> None:
        """Scatter one step's ``rows[i]`` of ``names[i]`` (tensors the caller no longer
        changes, or, on the CPU, ones read before the next step). On a GPU ``rows`` is one
        ``[names, step rows, ...]`` tensor: its names go over together."""
        together = tuple(names)
        if together not in self._groups and not any(name in self.host for name in names):
            self._allocate(together, rows[0])
        if together in self._groups:
            self._copy(self._groups[together], rows)
            return
        for name, name_rows in zip(names, rows):  # the call's names changed between steps
            if name not in self.host:
                self._allocate((name,), name_rows)
            self._copy(self.host[name][None], name_rows[None])

    def end_step(self) -> None:
        """Mark the step's transfers, and wait for the oldest beyond :data:`IN_FLIGHT`."""
        if self._side is None:
            return
        self._transfers[-1].event.record(self._side)
        while len(self._transfers) > IN_FLIGHT:
            self._transfers.popleft().event.synchronize()

    def take(
        self, tags: Sequence[str], kept_names: Mapping[str, frozenset[str]]
    ) -> dict[str, PaddedRows]:
        """Every kept name as :class:`PaddedRows` whose request ``i`` is ``tags[i]``; zero where
        a request kept nothing (padding, a name it does not keep, rows vLLM replaced)."""
        if self._side is not None:
            self._side.synchronize()
            self._transfers.clear()
        order = [self.slots[tag].index for tag in tags]
        index_of = {tag: self.slots[tag].index for tag in self.slots}
        taken: dict[str, PaddedRows] = {}
        layouts: dict[frozenset[int], tuple[int, list[list[Span]]]] = {}  # names share steps
        runs = StepRuns.joined(self.steps)
        for name, host in self.host.items():
            keepers = frozenset(index_of[tag] for tag in tags if name in kept_names.get(tag, ()))
            if not keepers:
                continue
            if keepers not in layouts:
                layouts[keepers] = layout_spans(runs, keepers, self.batch)
            width, spans = layouts[keepers]
            padded = host[:-1].view(self.batch, self.width, *host.shape[1:])
            _zero_outside(padded, spans)
            values = padded[:, :width]
            if order != list(range(self.batch)):
                values = values[torch.tensor(order)]
                spans = [spans[index] for index in order]
            elif width < self.width:  # every request stopped early: a tensor of its own
                values = values.contiguous()
            taken[name] = PaddedRows(values, spans)
        return taken

    def _copy(self, host: Tensor, rows: Sequence[Tensor]) -> None:
        """This step's ``rows`` of the names of ``host`` (``[names, batch * width + 1, ...]``)."""
        if self._side is None:
            for name_host, name_rows in zip(host, rows):
                name_host.index_copy_(0, self._targets, name_rows)
            return
        assert self._engines is not None and self._runs is not None
        assert isinstance(rows, Tensor), "on a GPU a step's rows come as one tensor"
        row_bytes = rows[0, 0].numel() * rows.element_size()
        copies = pitched_copies(self._runs, rows.shape[0], rows.shape[1], host.shape[1],
                                row_bytes, self._engines.max_pitch)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        self._engines.run(host, rows, copies, self._side)
        self._transfers[-1].held.append(rows)

    def end_call(self) -> None:
        """The call is over: its host rows are the user's (or free again)."""
        if self.shared:
            host_blocks.pool().end_call(list(self._groups.values()))

    def _allocate(self, names: tuple[str, ...], rows: Tensor) -> None:
        """The host rows of ``names`` (each like ``rows``), allocated in the step (vLLM's
        inference mode) as ordinary tensors: they become the user's cache. On a GPU they are
        page-locked, for the copy engines to fill while later steps run."""
        shape = (len(names), self.batch * self.width + 1, *rows.shape[1:])  # and the spare row
        on_gpu = self._side is not None
        with torch.inference_mode(False):
            if self.shared:
                host = host_blocks.pool().take(shape, rows.dtype, register=on_gpu)
            else:
                host = torch.empty(shape, dtype=rows.dtype, pin_memory=on_gpu)
        self._groups[names] = host
        for name, name_rows in zip(names, host):
            self.host[name] = name_rows


class StepStage:
    """One step's rows of names read one by one as sites fire (the default engine's hook sites on
    a GPU), gathered on the GPU into one ``[names, rows, ...]`` tensor per shape, so that the
    step's names go to the host together as the step ends: one set of copies and one
    synchronisation of the side stream a step, not one per name (36 for every layer of
    Qwen3-8B). Each tensor is sized by the last step's count of names of its shape, and grown
    within a step where more come."""

    def __init__(self) -> None:
        self._counts: dict[tuple, int] = {}  # names of each (shape, dtype) in the last step
        self._names: dict[tuple, list[str]] = {}
        self._rows: dict[tuple, Tensor] = {}

    def add(self, name: str, value: Tensor, selection: slice | Tensor) -> None:
        """``name``'s rows ``selection`` of the whole step's ``value``."""
        key = (tuple(value.shape[1:]), value.dtype)
        names = self._names.setdefault(key, [])
        staged = self._rows.get(key)
        count = len(names)
        if staged is None or count == staged.shape[0]:
            rows = (selection.stop - selection.start if isinstance(selection, slice)
                    else len(selection))
            size = max(self._counts.get(key, 1), 2 * count)
            grown = torch.empty((size, rows, *key[0]), dtype=value.dtype, device=value.device)
            if staged is not None:
                grown[:count].copy_(staged)
            self._rows[key] = staged = grown
        if isinstance(selection, slice):
            staged[count].copy_(value[selection])
        else:
            torch.index_select(value, 0, selection, out=staged[count])
        names.append(name)

    def write(self, stream: HostStream) -> None:
        """The step's staged rows into ``stream``, one tensor per shape; the stage is empty
        after."""
        for key, names in self._names.items():
            self._counts[key] = len(names)
            stream.write(names, self._rows[key][: len(names)])
        self.clear()

    def clear(self) -> None:
        """Drop what is staged (a call ended inside its step)."""
        self._names.clear()
        self._rows.clear()


def joined(
    stream: HostStream | None, tag: str, slot: Slot | None, device: torch.device, others: bool
) -> HostStream | None:
    """The stream of a call once request ``tag`` joined it (None: its rows wait on the device,
    in :class:`~vlens.runtime.steps.kept_steps.KeptSteps`): a ``slot`` where its call keeps its
    cache on the host and rows on ``device`` can be written there as steps end. A call's
    requests all have slots or none do; ``others``: requests already followed without one."""
    if slot is None or not HostStream.available(device):
        if stream is not None:
            raise RuntimeError(f"request {tag} has no slot, the call's others had one")
        return None
    if stream is None:
        if others:
            raise RuntimeError(f"request {tag} has a slot, the call's others had none")
        stream = HostStream(slot.batch, device, slot.shared)
    stream.follow(tag, slot)
    return stream


def taken(
    stream: HostStream | None, kept: KeptSteps, tags: Sequence[str],
    kept_names: Mapping[str, frozenset[str]], device: str,
) -> dict[str, PaddedRows]:
    """The finished requests' kept rows, on ``device``: from the host's cache where the call's
    rows streamed there, else laid out from the steps kept on the device."""
    if stream is None:
        return kept.take(tags, kept_names, device)
    if device != "cpu":
        raise ValueError(f"this call's rows went to the host, not to {device}")
    return stream.take(tags, kept_names)


def _zero_outside(padded: Tensor, spans: Sequence[Sequence[Span]]) -> None:
    """Zero each request's positions that none of its ``spans`` covers."""
    width = padded.shape[1]
    for index, runs in enumerate(spans):
        position = 0
        for first, length in sorted(runs):
            if first > position:
                padded[index, position:first] = 0
            position = max(position, first + length)
        if position < width:
            padded[index, position:] = 0
