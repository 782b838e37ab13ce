"""Full CUDA graphs that call into Python at the hook sites some request uses, and nowhere else.

vLLM replays one CUDA graph for a whole decode step (its FULL mode): attention and every layer
in one launch, Python nowhere. A hook site's op (:mod:`vlens.runtime.compiled.hook_sites`) called while
such a graph is captured would leave nothing in it, so hook functions could never run in those
steps; vLLM's piecewise graphs do call it, but they also run every attention call eagerly, which
costs a decode step about a sixth of its speed on an H200.

:class:`SegmentedGraph` is a CUDA graph that the op can break: while one is being captured, the
op ends the segment captured so far, records the site's call on the segment's buffers and starts
a new segment in the same memory pool. The segments are kept as graphs, not launched one by one:
a replay composes them into one executable graph per run of segments between the sites that are
active in that step (each segment a child graph node of it, built on first use of that set of
active sites and kept), so a step in which no site is active launches one graph, as vLLM's own
replay does, and a step with one active site launches two with the site's Python between them,
on the stream the graph is replayed on. vLLM captures its graphs through ``torch.cuda.CUDAGraph``
and ``torch.cuda.graph``, in both model runners: a worker of an engine with hook sites makes the
former this class (:func:`segment_graphs_at_hook_sites`) before vLLM captures. The composition
uses the CUDA driver's graph API (:mod:`vlens.runtime.compiled.driver_graphs`); with
``VLENS_COMPOSE_GRAPHS=0``, or where the driver refuses it, the segments are launched one by
one, as torch captured them, with only the active sites' calls between them (some 700 launches
a step where every name has a site, against one).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Container
from typing import Any

import torch

from vlens.runtime.compiled import driver_graphs

log = logging.getLogger(__name__)

_capturing = threading.local()
#: torch's own class, which each segment after the first is
_Plain = torch.cuda.CUDAGraph
#: The hook sites active in this process (:mod:`vlens.runtime.compiled.hook_sites`' set)
_active: Container[int] = frozenset()
#: Composed graphs a segmented graph keeps, one per set of active sites (oldest evicted first)
PLANS_KEPT = 8
#: Whether runs of segments are composed into one graph (unless ``VLENS_COMPOSE_GRAPHS=0``);
#: otherwise each segment is launched on its own, and only the active sites' calls run between.
COMPOSE = os.environ.get("VLENS_COMPOSE_GRAPHS", "1") != "0"


def current() -> SegmentedGraph | None:
    """The segmented graph being captured in this thread, if any."""
    return getattr(_capturing, "graph", None)


class SegmentedGraph(_Plain):
    """``torch.cuda.CUDAGraph`` whose capture :meth:`add_site` can break (see the module)."""

    def __new__(cls, keep_graph: bool = False) -> SegmentedGraph:
        return super().__new__(cls, COMPOSE)

    def __init__(self, keep_graph: bool = False) -> None:
        # Composed graphs are built from the captured templates, so they are kept. torch's
        # extension type reads ``keep_graph`` in ``__init__``, not in ``__new__``.
        super().__init__(COMPOSE)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                      **kwargs: Any) -> None:
        self._pieces: list[_Plain] = []
        self._sites: list[tuple[int, Callable[[], Any]]] = []  # site i follows piece i
        self._plans: dict[tuple[int, ...], Plan] = {}
        self._open: _Plain = self
        self._mode = capture_error_mode
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode, **kwargs)
        self._pool = pool if pool is not None else self.pool()
        _capturing.graph = self

    def capture_end(self) -> None:
        _capturing.graph = None
        self._close()

    def add_site(self, site: int, call: Callable[[], Any]) -> None:
        """End the segment being captured, make ``call`` now, and at every replay in which hook
        site ``site`` is active, at this point, and capture what follows as a new segment."""
        self._close()
        call()
        self._sites.append((site, call))
        segment = _Plain(keep_graph=COMPOSE)
        segment.capture_begin(pool=self._pool, capture_error_mode=self._mode)
        self._open = segment

    def _close(self) -> None:
        if self._open is self:
            super().capture_end()
        else:
            self._open.capture_end()
        self._pieces.append(self._open)

    def replay(self) -> None:
        sites = getattr(self, "_sites", ())
        if not sites:
            super().replay()
            return
        active = tuple(i for i, (site, _) in enumerate(sites) if site in _active)
        plan = self._plans.get(active)
        if plan is None:
            plan = self._plan(active)
        plan.run()

    def _plan(self, active: tuple[int, ...]) -> Plan:
        if len(self._plans) >= PLANS_KEPT:
            self._plans.pop(next(iter(self._plans))).close()
        runs, start = [], 0
        for index in active:
            runs.append(self._pieces[start : index + 1])
            start = index + 1
        runs.append(self._pieces[start:])
        calls = [self._sites[index][1] for index in active]
        plan = None
        if COMPOSE:
            try:
                plan = Plan([driver_graphs.compose(raw_graphs(run)) for run in runs], calls)
            except Exception as error:  # the driver's or torch's refusal: the launches below
                log.warning("vlens: hook sites replay segment by segment (%r)", error)
        if plan is None:
            plan = Plan([segment_by_segment(self, run) for run in runs], calls)
        self._plans[active] = plan
        return plan

    def __del__(self) -> None:
        for plan in getattr(self, "_plans", {}).values():
            plan.close()


def raw_graphs(pieces: list[_Plain]) -> list[int]:
    return [piece.raw_cuda_graph() for piece in pieces]


def segment_by_segment(graph: SegmentedGraph, pieces: list[_Plain]) -> Callable[[], None]:
    """Launch ``pieces`` one after the other, as torch instantiates them."""
    launches = [(lambda: _Plain.replay(graph)) if piece is graph else piece.replay
                for piece in pieces]

    def run() -> None:
        for launch in launches:
            launch()

    return run


class Plan:
    """One replay for one set of active sites: a launch per run of segments, the active sites'
    calls between them."""

    def __init__(self, launches: list[Callable[[], None]], calls: list[Callable[[], Any]]) -> None:
        self.launches = launches
        self.calls = calls

    def run(self) -> None:
        for launch, call in zip(self.launches, self.calls):
            launch()
            call()
        self.launches[-1]()

    def close(self) -> None:
        for launch in self.launches:
            if isinstance(launch, driver_graphs.Executable):
                launch.destroy()


def segment_graphs_at_hook_sites(active: Container[int]) -> None:
    """Make every CUDA graph this process captures from now on a :class:`SegmentedGraph`,
    breaking at the hook sites whose numbers ``active`` holds when it is replayed."""
    global _active
    _active = active
    torch.cuda.CUDAGraph = SegmentedGraph  # type: ignore[misc]
