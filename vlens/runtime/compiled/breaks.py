"""Full CUDA graphs that call into Python at the hook sites.

vLLM replays one CUDA graph for a whole decode step (its FULL mode): attention and every layer
in one launch, Python nowhere. A hook site's op (:mod:`vlens.runtime.compiled.hook_sites`) called while
such a graph is captured would leave nothing in it, so hook functions could never run in those
steps; vLLM's piecewise graphs do call it, but they also run every attention call eagerly, which
costs a decode step about a sixth of its speed on an H200.

:class:`SegmentedGraph` is a CUDA graph that the op can break: while one is being captured, the
op ends the segment captured so far, records the site's call on the segment's buffers and starts
a new segment in the same memory pool; replay runs the segments and the calls in order, on the
stream the graph is replayed on. Everything between two sites (attention included) stays one
captured segment, and a site whose hooks are idle returns at once. vLLM captures its graphs
through ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``, in both model runners: a worker of an
engine with hook sites makes the former this class (:func:`segment_graphs_at_hook_sites`)
before vLLM captures. It is the same idea as vLLM's breakable CUDA graphs
(``VLLM_USE_BREAKABLE_CUDAGRAPH``), which break only piecewise captures and turn torch.compile
off; here Inductor's compiled code is what is captured, and only the hook sites break it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_capturing = threading.local()
#: torch's own class, which each segment after the first is
_Plain = torch.cuda.CUDAGraph


def current() -> SegmentedGraph | None:
    """The segmented graph being captured in this thread, if any."""
    return getattr(_capturing, "graph", None)


class SegmentedGraph(_Plain):
    """``torch.cuda.CUDAGraph`` whose capture :meth:`add_eager` can break (see the module)."""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                      **kwargs: Any) -> None:
        self._segments: list[Callable[[], Any]] = []
        self._open: _Plain = self
        self._mode = capture_error_mode
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode, **kwargs)
        self._pool = pool if pool is not None else self.pool()
        _capturing.graph = self

    def capture_end(self) -> None:
        _capturing.graph = None
        self._close()

    def add_eager(self, call: Callable[[], Any]) -> None:
        """End the segment being captured, make ``call`` now and at every replay at this point,
        and capture what follows as a new segment."""
        self._close()
        call()
        self._segments.append(call)
        segment = _Plain()
        segment.capture_begin(pool=self._pool, capture_error_mode=self._mode)
        self._open = segment

    def _close(self) -> None:
        if self._open is self:
            super().capture_end()
        else:
            self._open.capture_end()
            self._segments.append(self._open.replay)

    def replay(self) -> None:
        super().replay()
        for step in getattr(self, "_segments", ()):
            step()


def segment_graphs_at_hook_sites() -> None:
    """Make every CUDA graph this process captures from now on a :class:`SegmentedGraph`."""
    torch.cuda.CUDAGraph = SegmentedGraph  # type: ignore[misc]
