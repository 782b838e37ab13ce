"""A step's kept rows copied from the GPU into their places in host memory by its copy engines.

A step keeps ``n`` rows of each of ``G`` names, side by side in one ``[G, n, ...]`` tensor on the
GPU, and every row has its place in the host's ``[G, R, ...]`` rows. A request's rows in a step
are consecutive positions, so they form *runs*: consecutive rows that stay consecutive on the
host. A pitched copy (``cudaMemcpy2DAsync``) moves ``height`` equal pieces, each at a fixed stride
from the last, in one call and without the SMs; a step's runs go over in one of two ways,
whichever takes fewer calls:

- one copy per run, its pieces the run of every name (the names' stride apart);
- one copy per name and *series*: equally long runs, one after the other among the step's rows
  and each at the same distance from the last on the host (a decode step whose requests all
  stand at one position, a prefill of equally long prompts).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

#: ``cudaMemcpyDeviceToHost`` and ``cudaDevAttrMaxPitch`` of the CUDA runtime's enums.
_DEVICE_TO_HOST = 2
_MAX_PITCH_ATTRIBUTE = 11


@dataclass(frozen=True)
class Runs:
    """Run ``k``: ``length[k]`` rows from row ``source[k]`` of the step's rows, to the host's
    rows from ``target[k]`` on."""

    source: np.ndarray
    target: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, targets: np.ndarray, kept: np.ndarray) -> Runs:
        """The runs of the step's rows where ``kept``, row ``i`` going to host row
        ``targets[i]``."""
        rows = np.flatnonzero(kept)
        placed = targets[rows]
        starts = np.ones(len(rows), dtype=bool)
        starts[1:] = (rows[1:] != rows[:-1] + 1) | (placed[1:] != placed[:-1] + 1)
        first = np.flatnonzero(starts)
        length = np.diff(np.append(first, len(rows)))
        return cls(rows[first], placed[first], length)

    def __len__(self) -> int:
        return len(self.length)


class Copy(NamedTuple):
    """One pitched copy, in bytes from the starts of the host's and the step's rows: ``height``
    pieces of ``width`` bytes, each ``target_pitch`` / ``source_pitch`` after the last."""

    target: int
    target_pitch: int
    source: int
    source_pitch: int
    width: int
    height: int


class Series(NamedTuple):
    """``count`` runs of ``length`` rows, consecutive among the step's rows from ``source``,
    the host's from ``target`` on, each ``step`` rows after the last."""

    source: int
    target: int
    length: int
    step: int
    count: int


def pitched_copies(
    runs: Runs, names: int, step_rows: int, host_rows: int, row_bytes: int, max_pitch: int
) -> list[Copy]:
    """The fewest copies (of the two ways) moving ``runs`` of ``names`` names from a step's
    ``[names, step_rows, ...]`` to the host's ``[names, host_rows, ...]``. No pitch exceeds
    ``max_pitch`` bytes (the device's limit)."""
    by_run = names == 1 or host_rows * row_bytes <= max_pitch  # one name: its pitch goes unused
    if by_run and len(runs) <= names:  # every way takes at least a copy per name
        return _copies_per_run(runs, names, step_rows, host_rows, row_bytes)
    series = _series(runs, max_pitch // row_bytes)
    if by_run and len(runs) <= names * len(series):
        return _copies_per_run(runs, names, step_rows, host_rows, row_bytes)
    return [
        Copy((name * host_rows + s.target) * row_bytes, s.step * row_bytes,
             (name * step_rows + s.source) * row_bytes, s.length * row_bytes,
             s.length * row_bytes, s.count)
        for name in range(names)
        for s in series
    ]


def _copies_per_run(
    runs: Runs, names: int, step_rows: int, host_rows: int, row_bytes: int
) -> list[Copy]:
    """One copy per run, its pieces the run of every name (the names' stride apart)."""
    host_pitch = host_rows * row_bytes if names > 1 else 0
    step_pitch = step_rows * row_bytes if names > 1 else 0
    return [
        Copy(target * row_bytes, max(host_pitch, length * row_bytes), source * row_bytes,
             max(step_pitch, length * row_bytes), length * row_bytes, names)
        for source, target, length in zip(
            runs.source.tolist(), runs.target.tolist(), runs.length.tolist()
        )
    ]


def _series(runs: Runs, max_step: int) -> list[Series]:
    """``runs`` gathered into series, greedily in the step's order."""
    whole = _as_one_series(runs, max_step)  # a decode step of requests at one position
    return [whole] if whole is not None else _greedy_series(runs, max_step)


def _greedy_series(runs: Runs, max_step: int) -> list[Series]:
    """:func:`_series`, run after run."""
    source, target, length = runs.source.tolist(), runs.target.tolist(), runs.length.tolist()
    series: list[Series] = []
    first = 0
    while first < len(length):
        size, step, last = length[first], length[first], first
        while last + 1 < len(length):
            following = last + 1
            distance = target[following] - target[last]
            if (
                length[following] != size
                or source[following] != source[last] + size
                or not size <= distance <= max_step
                or (last > first and distance != step)
            ):
                break
            step, last = distance, following
        series.append(Series(source[first], target[first], size, step, last - first + 1))
        first = last + 1
    return series


def _as_one_series(runs: Runs, max_step: int) -> Series | None:
    """All of ``runs`` as the one series :func:`_greedy_series` makes of them, worked out with
    array operations; None where it makes several (or none)."""
    if len(runs) == 0:
        return None
    size = int(runs.length[0])
    distances = np.diff(runs.target)
    step = int(distances[0]) if len(distances) else size
    if (
        (runs.length == size).all()
        and (np.diff(runs.source) == size).all()
        and (distances == step).all()
        and size <= step <= max_step
    ):
        return Series(int(runs.source[0]), int(runs.target[0]), size, step, len(runs))
    return None


class CopyEngines:
    """The CUDA runtime's pitched copy, called on a stream torch made."""

    def __init__(self, runtime: ctypes.PyDLL, device: torch.device) -> None:
        self._copy = runtime.cudaMemcpy2DAsync
        self._copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                               ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._error_text = runtime.cudaGetErrorString
        self._error_text.restype = ctypes.c_char_p
        pitch = ctypes.c_int()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._check(runtime.cudaDeviceGetAttribute(ctypes.byref(pitch), _MAX_PITCH_ATTRIBUTE,
                                                   index))
        self.max_pitch = pitch.value

    def run(self, host: Tensor, rows: Tensor, copies: Sequence[Copy], stream: torch.cuda.Stream
            ) -> None:
        """Queue ``copies`` from ``rows`` (on the GPU) to ``host`` (pinned) on ``stream``."""
        host_base, rows_base, handle = host.data_ptr(), rows.data_ptr(), stream.cuda_stream
        for copy in copies:
            self._check(self._copy(
                host_base + copy.target, copy.target_pitch, rows_base + copy.source,
                copy.source_pitch, copy.width, copy.height, _DEVICE_TO_HOST, handle,
            ))

    def _check(self, error: int) -> None:
        if error:
            text = self._error_text(error).decode()
            raise RuntimeError(f"a copy of kept rows to the host failed: CUDA error {error} "
                               f"({text})")


@functools.cache
def copy_engines(device: torch.device) -> CopyEngines | None:
    """The copy engines of ``device`` through the CUDA runtime torch loaded, or None where
    none can be found."""
    runtime = _cuda_runtime()
    return None if runtime is None else CopyEngines(runtime, device)


@functools.cache
def _cuda_runtime() -> ctypes.PyDLL | None:
    """The CUDA runtime library this process has loaded (torch's own), or None. Its calls keep
    the GIL (``PyDLL``): each only queues a copy into page-locked memory, and a step makes
    dozens of them, each of which would otherwise hand the GIL to vLLM's other threads."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.PyDLL(path)
        except OSError:
            continue
    return None
