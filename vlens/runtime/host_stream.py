"""A call's kept rows written straight into their place in the host's cache, step by step.

Where the user's process shares the worker's memory (one rank, the cache on the host) and the
call says how many positions each request can run, the padded ``[batch, pos, ...]`` tensor of
every kept name is allocated on the host when the name is first kept, and each step's rows are
copied into their final rows as the step ends: no step's rows wait on the device until the call
ends, and nothing is copied again after it (an every-layer generation of 256 requests is 19 GB).

On a GPU the copy runs on a side stream while later steps compute: the step's rows are cloned on
the compute stream (a copy inside the GPU's memory), and the side stream scatters the clone into
pinned host memory through the GPU's view of it (unified addressing), so the transfer overlaps
the next steps. At most :data:`IN_FLIGHT` steps' clones wait for their transfer, which bounds
the GPU memory the captures hold whatever the call's size. On the CPU the scatter is the copy.

The alternative that leaves the SMs alone, staging each step's rows in pinned blocks by DMA and
scattering them on the host into an ordinary (pageable) cache, was faster in isolation
(``bench/host_copy.py``: 0.98× against this path's 0.94× of the GPU's plain speed) but held
every-layer generation inside vLLM to 0.34× plain compiled, with host threads and with vLLM's
own thread doing the scatter alike (``bench/RESULTS.md``, 2026-12-01).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from vlens.runtime.layout import RequestRows
from vlens.runtime.messages import PaddedRows, Span
from vlens.runtime.step_store import Segment, layout_spans, row_index

#: Steps whose rows may be on their way to the host at once (GPU): the oldest is waited for
#: beyond this.
IN_FLIGHT = 4


@dataclass(frozen=True)
class Slot:
    """Request ``index`` of a call of ``batch`` requests, which runs at most ``positions``."""

    index: int
    batch: int
    positions: int


@dataclass
class _Transfer:
    """One step's rows on their way to the host: done once ``event`` has passed."""

    event: torch.cuda.Event
    held: list[Tensor] = field(default_factory=list)


class HostStream:
    """Every kept name's ``[batch * width, ...]`` rows on the host, filled as steps end."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self.slots: dict[str, Slot] = {}
        self.width = 0
        self.host: dict[str, Tensor] = {}
        self._writable: dict[str, Tensor] = {}  # what the scatter writes: the GPU's view on CUDA
        self.steps: list[list[Segment]] = []
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._transfers: deque[_Transfer] = deque()

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether rows on ``device`` can be written into host memory as they are computed."""
        return device.type == "cpu" or (device.type == "cuda" and _cuda_view_op() is not None)

    def follow(self, tag: str, slot: Slot) -> None:
        if slot.batch != self.batch:
            raise ValueError(f"request {tag} belongs to a call of {slot.batch}, not {self.batch}")
        if self.host:
            raise RuntimeError(f"request {tag} joined a call whose rows are already being kept")
        self.slots[tag] = slot
        self.width = max(self.width, slot.positions)

    def begin_step(self, keepers: Sequence[RequestRows]) -> Tensor:
        """Start a step whose kept requests are ``keepers``: where each of their rows goes in
        the flattened ``[batch * width]`` rows. A row past a request's announced positions (with
        asynchronous scheduling vLLM runs one more forward for a request that has just finished)
        is not part of its cache: it goes to a spare row past the batch."""
        starts = np.empty(len(keepers), dtype=np.int64)  # each request's first target row
        lengths = np.empty(len(keepers), dtype=np.int64)
        room = np.empty(len(keepers), dtype=np.int64)  # how many of its rows it holds
        segments = []
        for at, request in enumerate(keepers):
            slot = self.slots[request.tag]
            starts[at] = slot.index * self.width + request.first_position
            lengths[at] = request.stop - request.start
            room[at] = slot.positions - request.first_position
            held = int(min(max(room[at], 0), lengths[at]))
            segments.append(Segment(request.tag, held, request.first_position))
        self.steps.append(segments)
        within = row_index(np.zeros_like(starts), lengths)  # each row's offset in its request
        targets = torch.from_numpy(np.repeat(starts, lengths)) + within
        targets[within >= torch.from_numpy(np.repeat(room, lengths))] = self.batch * self.width
        if self._side is None:
            return targets
        self._transfers.append(_Transfer(torch.cuda.Event()))
        return targets.pin_memory().to(self.device, non_blocking=True)

    def write(self, name: str, rows: Tensor, targets: Tensor) -> None:
        """Scatter one step's ``rows`` of ``name`` (a tensor the caller no longer changes, or, on
        the CPU, one read before the next step) to ``targets``."""
        if name not in self.host:
            self._allocate(name, rows)
        if self._side is None:
            self.host[name].index_copy_(0, targets, rows)
            return
        transfer = self._transfers[-1]
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._writable[name].index_copy_(0, targets, rows)
        transfer.held += [rows, targets]

    def end_step(self) -> None:
        """Mark the step's transfers, and wait for the oldest beyond :data:`IN_FLIGHT`."""
        if self._side is None:
            return
        self._transfers[-1].event.record(self._side)
        while len(self._transfers) > IN_FLIGHT:
            self._transfers.popleft().event.synchronize()

    def take(
        self, tags: Sequence[str], keeps: Mapping[str, frozenset[str]]
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
        for name, host in self.host.items():
            keepers = frozenset(index_of[tag] for tag in tags if name in keeps.get(tag, ()))
            if not keepers:
                continue
            if keepers not in layouts:
                layouts[keepers] = layout_spans(self.steps, index_of, keepers, self.batch)
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

    def _allocate(self, name: str, rows: Tensor) -> None:
        """The host rows of ``name``, allocated in the step (vLLM's inference mode) as ordinary
        tensors: they become the user's cache."""
        shape = (self.batch * self.width + 1, *rows.shape[1:])  # and the spare row
        pinned = self._side is not None
        with torch.inference_mode(False):
            host = torch.empty(shape, dtype=rows.dtype, pin_memory=pinned)
        self.host[name] = host
        if pinned:
            self._writable[name] = _cuda_view_op()(host)


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


def _cuda_view_op():
    """vLLM's operator giving a CUDA tensor over pinned host memory (unified addressing), or None
    where this build of vLLM has none."""
    try:
        return torch.ops._C.get_cuda_view_from_cpu_tensor
    except (AttributeError, RuntimeError):
        return None
