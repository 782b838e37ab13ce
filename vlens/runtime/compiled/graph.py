"""A compiled engine's sites: traced into vLLM's compiled model, reading and steering through
buffers (:mod:`vlens.runtime.compiled.buffers`).

In vLLM's default mode the model's forward is traced once by torch.compile (and, on CUDA,
replayed from CUDA graphs): Python hooks added later never run. A forward hook that exists when
the trace is taken is traced into the graph instead, and if it only touches tensors that live as
long as the engine, the graph (and a CUDA graph replaying it) keeps doing what it did. So the
names declared when the engine is built get such hooks, installed right after the weights load
and before vLLM's first (compiling) forward:

- a captured name copies the whole step's value into a preallocated ``[max_tokens, ...]``
  buffer; after each step the runtime takes each request's rows from it (by the runner's own row
  map, :mod:`vlens.runtime.steps.layout`) and keeps only what requests asked for: CUDA-graph padding
  rows are never read;
- a steered name applies ``(v − (v·û)û) ⊙ gain + add`` with one row of ``add``/``gain``/``û``
  per token row, from buffers the runtime fills before each step from the steered requests'
  rows. Every other row holds the neutral terms (0, 1, 0), which leave it bit for bit;
- a compiled SAE edits features and captures its top-k features the same way, with its own
  per-row terms (:mod:`vlens.runtime.compiled.saes`).

Python in the forward is the traced hook only: no per-request work happens inside the graph.
Under tensor parallelism every rank traces the same hooks (:mod:`vlens.runtime.compiled.workers`
installs them in each worker): a value vLLM splits over ranks is gathered inside the graph before
it is copied or steered, a steered one is written back as each rank's slice, and each captured
name's rows are kept by one of the ranks for the user's process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vlens.runtime.compiled.buffers import (
    SAE_NEUTRAL,
    STEER_NEUTRAL,
    SteeringBuffers,
    TermTable,
)
from vlens.runtime.compiled.hook_sites import install_hook_site
from vlens.runtime.compiled.saes import CompiledSAE, SAEStage, top_k_of
from vlens.runtime.patches import apply_patches
from vlens.runtime.sites.torch_hooks import NarrowedCall, install_site
from vlens.runtime.steps.kept_steps import (
    KeptSteps,
    Segment,
    copy_rows,
    kept_rows,
    row_index,
    segments_of,
)
from vlens.runtime.steps.layout import RequestRows, StepRows
from vlens.runtime.tensor_parallel import TensorParallel
from vlens.runtime.transfer.host_stream import HostStream, Slot, joined, taken
from vlens.runtime.transfer.messages import PaddedRows
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import LogitsOf, Reader
from vlens.runtime.vocabulary.steering import AnySteer, SAESteer, steered


@dataclass(frozen=True)
class GraphName:
    """A name traced into the graph: read at ``site`` by ``read``, captured and/or steered.
    ``trailing`` is the per-position shape of what the graph computes (:attr:`traced_read`)."""

    name: str
    site: Site
    read: Reader | None  # None: a ``call`` site, where a layer's attention is computed
    trailing: tuple[int, ...]
    capture: bool
    steer: bool
    #: Python hook functions may run at the name's site (:mod:`vlens.runtime.compiled.hook_sites`)
    hook: bool = False
    #: the compiled SAE whose feature edits (``steer``; the name is :attr:`CompiledSAE.target`)
    #: or top-k features (``capture``) this is, computed from ``read``'s value
    sae: CompiledSAE | None = None
    #: the captured rows' dtype (None: the engine's)
    dtype: torch.dtype | None = None

    @property
    def width(self) -> int:
        return int(torch.Size(self.trailing).numel())

    @property
    def traced_read(self) -> Reader:
        """What the graph computes: the logits name keeps the final norm's rows, and the
        (vocabulary-wide) logits are computed from them after the step, for kept rows only."""
        return self.read.source if isinstance(self.read, LogitsOf) else self.read


@dataclass
class CallState:
    """What the requests being served asked of the graph (cleared when they finish)."""

    #: tag -> the names it keeps
    kept_names: dict[str, frozenset[str]] = field(default_factory=dict)
    #: tag -> target -> (its entry in that target's table, the steer)
    steering: dict[str, dict[str, tuple[int, AnySteer]]] = field(default_factory=dict)
    #: target (a name, or a compiled SAE's) -> every followed steer's terms, on the device
    tables: dict[str, TermTable] = field(default_factory=dict)
    kept_steps: KeptSteps = field(default_factory=KeptSteps)
    #: the call's kept rows written into the host's cache as steps end (:mod:`host_stream`),
    #: where the call gave each request its :class:`Slot`; else they wait in :attr:`kept_steps`
    stream: HostStream | None = None


@dataclass(frozen=True)
class Asked:
    """What the requests being served ask, derived from their :class:`CallState` once per
    change of them (:attr:`GraphSites.revision`) rather than every step."""

    #: every name some request keeps
    kept: frozenset[str]
    #: names some steer changes at chosen positions only (its rows move with the positions)
    positional: frozenset[str]
    #: the kept logits names (every rank computes them: a collective)
    logits: tuple[str, ...]
    #: the other names kept on this rank, by shape
    by_shape: tuple[tuple[str, ...], ...]


class GraphSites:
    """The traced hooks of one engine, their buffers, and the per-step work around them."""

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[GraphName],
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.names = {graph_name.name: graph_name for graph_name in names}
        #: the compiled SAEs, by the name steers call them
        self.saes = {
            g.sae.name: SAEStage(g.sae, device) for g in names if g.sae is not None and g.steer
        }
        self.device = device
        parallel = TensorParallel.of_this_worker()
        #: under tensor parallelism: values split over ranks are gathered inside the graph (a
        #: collective every rank runs), steering is written back as each rank's own slice, and
        #: each captured name's rows are handed back by one rank to the user's process (every rank
        #: holds the whole value), the names dealt out in turn: under CUDA each rank hands its
        #: share back from its own GPU, and the copies to the host run side by side
        self.parallel = parallel if parallel.size > 1 else None
        captured = sorted(g.name for g in names if g.capture)
        self.handed_back_here = frozenset(captured[parallel.rank :: parallel.size])
        #: every rank copies out every captured name, handed back here or not: a value gathered over
        #: the ranks that one rank left unused would lose its gather to the compiler there, and
        #: the ranks' collectives would no longer match
        self.captured = {
            g.name: torch.zeros(max_tokens, *g.trailing, device=device, dtype=g.dtype or dtype)
            for g in names
            if g.capture
        }
        self.steering = {
            # an SAE's terms in fp32: a clamp value keeps its digits in a bf16 engine
            g.name: SteeringBuffers.allocate(max_tokens, g.width, device, torch.float32, SAE_NEUTRAL)
            if g.sae is not None
            else SteeringBuffers.allocate(max_tokens, g.width, device, dtype, STEER_NEUTRAL)
            for g in names
            if g.steer
        }
        #: the sites where hook functions run, by their op's number; installed first, they run
        #: first at a site (the traced capture and steering see what the hook functions left)
        self.hook_sites = {
            site: install_hook_site(model, site, self._hook_site_handler(site))
            for site in sorted(dict.fromkeys(g.site for g in names if g.hook),
                               key=lambda site: site.event != "call")  # attention's first
        }
        by_site: dict[Site, list[GraphName]] = defaultdict(list)
        saes_by_site: dict[Site, list[GraphName]] = defaultdict(list)
        for graph_name in names:
            if graph_name.sae is None and (graph_name.capture or graph_name.steer):
                by_site[graph_name.site].append(graph_name)
            elif graph_name.sae is not None and graph_name.steer:  # its top-k names go with it
                saes_by_site[graph_name.site].append(graph_name)
        for site in dict.fromkeys([*by_site, *saes_by_site]):
            hook = self._traced_hook(tuple(by_site[site]), tuple(saes_by_site[site]))
            install_site(model, site, hook)
        #: what runs at a hook site (the worker runtime's handler of a fired site); set by the
        #: worker runtime, which exists once the engine is running
        self.run_hook_site: Callable[[Site, tuple, dict, Any], None] | None = None
        self.call = CallState()
        #: counts the changes of what the requests being served asked (prepare, finish)
        self.revision = 0
        self._asked_for: tuple[int, Asked] | None = None  # (revision, what was asked then)
        #: the last step's (key, revision) and its kept rows' selection
        self._selection: tuple[tuple | None, slice | Tensor] = (None, slice(0))
        #: views of the captured buffers' rows of that selection, by the names read together
        self._row_views: dict[tuple[str, ...], list[Tensor]] = {}

    # ---- inside the graph --------------------------------------------------------------------

    def _hook_site_handler(self, site: Site) -> Callable[[tuple, dict, Any], None]:
        def handle(args: tuple, kwargs: dict, output: Any) -> None:
            if self.run_hook_site is not None:
                self.run_hook_site(site, args, kwargs, output)

        return handle

    def _traced_hook(self, at_site: tuple[GraphName, ...], saes: tuple[GraphName, ...]):
        """At one site: the steers, then the SAEs' feature edits, then the captures (which see
        the value the model computes on)."""

        def on_call(args: tuple, kwargs: dict, output: Any) -> None:
            call = NarrowedCall(self.model, None, args, kwargs, output, self.parallel)
            for graph_name in at_site:
                value = graph_name.traced_read(call)
                rows = value.shape[0]
                if tuple(value.shape[1:]) != graph_name.trailing:  # settled when traced
                    raise ValueError(
                        f"{graph_name.name}: vLLM's value has per-position shape "
                        f"{tuple(value.shape[1:])}, the declaration expected "
                        f"{graph_name.trailing}; read it on an eager engine"
                    )
                if graph_name.steer:
                    add, gain, ablate = (t[:rows] for t in self.steering[graph_name.name].terms)
                    new = steered(value.reshape(rows, -1), add, gain, ablate)
                    graph_name.read.write(call, new.to(value.dtype).reshape(value.shape))
            for graph_name in saes:
                self._run_sae(call, graph_name)
            for graph_name in at_site:
                if graph_name.capture:
                    value = graph_name.traced_read(call)
                    self.captured[graph_name.name][: value.shape[0]].copy_(value)

        return on_call

    def _run_sae(self, call: NarrowedCall, graph_name: GraphName) -> None:
        """A compiled SAE's feature edits written back, its top-k features captured."""
        compiled = graph_name.sae
        assert compiled is not None
        value = graph_name.read(call)
        rows = value.shape[0]
        multiplier, offset = (t[:rows] for t in self.steering[graph_name.name].terms)
        new, every = self.saes[compiled.name](value, multiplier, offset)
        graph_name.read.write(call, new)
        if compiled.top_k is not None:
            assert every is not None
            values, indices = top_k_of(every, compiled.top_k)
            names = compiled.captured_names
            self.captured[names[0]][:rows].copy_(values)
            self.captured[names[1]][:rows].copy_(indices)

    # ---- around each step (called by the worker runtime) -------------------------------------

    def prepare(
        self, tag: str, keep: frozenset[str], steers: Sequence[AnySteer], slot: Slot | None = None
    ) -> None:
        """Follow request ``tag``: the names it keeps and its steering terms; with a ``slot``
        (its place in its call, which keeps its cache on the host), its kept rows go to the host
        as steps end."""
        self.revision += 1
        self.call.kept_names[tag] = keep
        others = bool(self.call.kept_steps.entries) or len(self.call.kept_names) > 1
        self.call.stream = joined(self.call.stream, tag, slot, self.device, others)
        own = {}
        self.call.steering[tag] = own
        for steer in steers:
            if isinstance(steer, SAESteer):
                terms = self.saes[steer.sae].terms(tag, steer)
            else:
                terms = steer.terms(self.names[steer.name].width)
            table = self.call.tables.get(steer.target)
            if table is None:
                table = TermTable(self.steering[steer.target].terms, self._to_device)
                self.call.tables[steer.target] = table
            own[steer.target] = (table.add(terms), steer)

    def before_step(self, layout: StepRows | None) -> None:
        """Put the steered requests' terms on their rows of this step; every other row neutral.
        A step with the last one's rows (:class:`StepRows`' key) and requests needs nothing."""
        step = None if layout is None else (layout.key, self.revision)
        positional = self.asked().positional
        for name, buffers in self.steering.items():
            if step is not None and buffers.placed_for == step:
                continue
            rows, sources = self._steered_rows(name, layout or ())
            table = self.call.tables.get(name) if len(rows) else None
            version = None if table is None else (id(table), table.version)
            if not buffers.holds(rows, sources, version):
                buffers.reset()
                if table is not None:
                    buffers.set_rows(self._index(rows), table.rows, self._index(sources))
                    buffers.placed = (rows, sources, version)
            if name not in positional:
                buffers.placed_for = step

    def _steered_rows(
        self, name: str, layout: Sequence[RequestRows]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's rows that ``name``'s steers change, and the entry of its table each
        takes: a request steered at every position takes all its rows."""
        starts: list[int] = []
        lengths: list[int] = []
        entries: list[int] = []
        for request in layout:
            entry = self.call.steering.get(request.tag, {}).get(name)
            if entry is None:
                continue
            index, steer = entry
            count = request.stop - request.start
            if steer.positions is None:
                starts.append(request.start)
                lengths.append(count)
                entries.append(index)
                continue
            for offset in steer.offsets(request.first_position, count):
                starts.append(request.start + offset)
                lengths.append(1)
                entries.append(index)
        length = np.array(lengths, dtype=np.int64)
        rows = row_index(np.array(starts, dtype=np.int64), length).numpy()
        return rows, np.repeat(np.array(entries, dtype=np.int64), length)

    def after_step(self, layout: StepRows | None) -> None:
        """Copy out the rows of the requests that keep something from this step: each name's
        own, and names of one shape side by side (``[names, rows, ...]``, one copy for all)."""
        asked = self.asked()
        if not asked.kept or layout is None:
            return
        kept_names = self.call.kept_names
        keepers = [request for request in layout if kept_names.get(request.tag)]
        if not keepers:
            return
        step = (layout.key, self.revision)
        stream = self.call.stream
        if self._selection[0] == step:  # the last step's rows again
            selection = self._selection[1]
            # whose rows they are: the host stream works it out for itself
            segments = [] if stream is not None else segments_of(keepers)
        else:
            selection, segments = kept_rows(keepers, self.device)
            self._selection = (step, selection)
            self._row_views = {}
        if stream is not None:
            stream.begin_step(keepers)
        for name in asked.logits:
            read = self.names[name].read
            assert isinstance(read, LogitsOf)
            rows = read.logits(self.model, copy_rows(self.captured[name], selection))
            if name in self.handed_back_here:
                self._keep_rows([name], rows[None], segments)
        for shape_names in asked.by_shape:
            rows = self._selected_rows(shape_names, selection)
            if stream is not None and self.device.type == "cpu":
                # scattered before the next step: views (or gathers) of the buffers do
                self._keep_rows(shape_names, rows, segments)
            else:  # side by side in a tensor of their own: one copy for all
                self._keep_rows(shape_names, torch.stack(rows), segments)
        if stream is not None:
            stream.end_step()

    def asked(self) -> Asked:
        """What the requests being served ask (see :class:`Asked`)."""
        if self._asked_for is None or self._asked_for[0] != self.revision:
            kept = frozenset().union(*self.call.kept_names.values())
            positional = frozenset(
                name
                for own in self.call.steering.values()
                for name, (_, steer) in own.items()
                if steer.positions is not None
            )
            logits: list[str] = []
            by_shape: dict[tuple, list[str]] = defaultdict(list)
            for name in sorted(kept & self.captured.keys()):
                if isinstance(self.names[name].read, LogitsOf):
                    logits.append(name)
                elif name in self.handed_back_here:
                    graph_name = self.names[name]
                    by_shape[(graph_name.trailing, graph_name.dtype)].append(name)
            shapes = tuple(tuple(names) for names in by_shape.values())
            self._asked_for = (self.revision, Asked(kept, positional, tuple(logits), shapes))
        return self._asked_for[1]

    def _selected_rows(self, names: tuple[str, ...], selection: slice | Tensor) -> list[Tensor]:
        """The step's selected rows of each of ``names``: views of their buffers where the
        rows are a slice, made once while the selection stands (decode steps of an unchanged
        batch: a tensor operation fewer per name and step), else gathers."""
        if not isinstance(selection, slice):
            return [self.captured[name][selection] for name in names]
        if names not in self._row_views:
            self._row_views[names] = [self.captured[name][selection] for name in names]
        return self._row_views[names]

    def _keep_rows(self, names: Sequence[str], rows: Sequence[Tensor], segments: list[Segment]) -> None:
        """One step's ``rows[i]`` of ``names[i]``, to the host or into the call's kept steps."""
        if self.call.stream is not None:
            self.call.stream.write(names, rows)
            return
        for name, name_rows in zip(names, rows):
            self.call.kept_steps.add(name, segments, name_rows)

    def finish(self, tags: Sequence[str], device: str = "cpu") -> dict[str, PaddedRows]:
        """The finished requests' kept rows, on ``device`` (see :class:`KeptSteps`). Forgets
        the call once no request is left, even when handing back fails."""
        try:
            return taken(self.call.stream, self.call.kept_steps, tags, self.call.kept_names,
                         device)
        finally:
            self.revision += 1
            for tag in tags:
                self.call.kept_names.pop(tag, None)
                for target, (index, _) in self.call.steering.pop(tag, {}).items():
                    self.call.tables[target].remove(index)
                for stage in self.saes.values():
                    stage.release(tag)
            if not self.call.kept_names:
                if self.call.stream is not None:
                    self.call.stream.end_call()
                self.call = CallState()
                for buffers in self.steering.values():
                    buffers.reset()
            else:  # requests overlap (a server): forget only what the finished ones held
                self.call.kept_steps.forget(tags)

    # ---- helpers -----------------------------------------------------------------------------

    def _index(self, values: np.ndarray) -> Tensor:
        return self._to_device(torch.from_numpy(values))

    def _to_device(self, host: Tensor) -> Tensor:
        """``host`` on the engine's device without waiting for the GPU: a copy from pageable
        memory would wait for the steps queued before it, and the CPU would no longer prepare
        the next step while the GPU runs this one (the pinned block is not reused before the
        copy is done: torch's host allocator records the copy)."""
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)


def install_graph_sites(runner: Any, names: Sequence[GraphName]) -> GraphSites:
    """Trace-ready hooks for ``names`` on the runner's freshly loaded model (and vlens's
    workarounds of vLLM bugs, which must be in place before the trace too)."""
    model = runner.get_model()
    apply_patches(model)
    config = runner.vllm_config
    max_tokens = int(config.scheduler_config.max_num_batched_tokens)
    device = next(model.parameters()).device
    return GraphSites(model, names, max_tokens, device, config.model_config.dtype)
