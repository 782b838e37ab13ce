"""The worker side of vlens: one :class:`WorkerRuntime` per vLLM worker.

The user's process hands it, before a call, what each request (by tag) wants: names to keep and
hook functions to run (a :class:`~vlens.runtime.messages.RequestPlan`). It installs a torch hook on
every site those names need and no other; during the call each site narrows the step to each
followed request's rows, runs the hook functions (which may edit) — once on a call's batch where
its requests run together (:mod:`vlens.runtime.batches`), else per request — and keeps the values
asked for; after the call the user's process collects them. Sites whose names no request needs any
more are removed. A failure inside a request's hooks is recorded for that request (for every
request of a batch) and stops its hooks; the engine runs on, and the user's process raises it
after the call.

Hooks on attention scores, patterns and per-head results go to :class:`AttentionSites`
(:mod:`vlens.runtime.attention`), which computes those layers' attention for those requests.
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from vlens.runtime import hook_sites, host_blocks, orphans, source
from vlens.runtime.attention import AttentionSites, unsupported
from vlens.runtime.batches import (
    Member,
    StepBatch,
    batched_sites,
    call_of,
    in_batches,
    shape_key,
)
from vlens.runtime.graph import GraphSites
from vlens.runtime.hooks import refuse_part_of_a_prefill, run_hooks, run_hooks_together
from vlens.runtime.host_stream import Slot
from vlens.runtime.inline import InlineRequests
from vlens.runtime.layout import (
    Followed,
    RequestRows,
    StepRows,
    follow_steps,
    mark_sampling,
    tag_of,
)
from vlens.runtime.locations import Site
from vlens.runtime.messages import (
    Chunk,
    Handback,
    HookError,
    ModuleRecord,
    NamePlan,
    RequestCapture,
    RequestPlan,
)
from vlens.runtime.patches import apply_cpu_patches
from vlens.runtime.probe import ModuleProbe
from vlens.runtime.readers import Reader
from vlens.runtime.sites import NarrowedCall, buffers_of, find_module, install_site, read_rows
from vlens.runtime.source import Operation
from vlens.runtime.splices import Splice, splices_of
from vlens.runtime.step_store import Segment, StepStore, add_chunk, copy_rows, kept_rows
from vlens.runtime.tensor_parallel import TensorParallel

if TYPE_CHECKING:  # a worker loads vlens.sae only when it unpickles an SAE to splice in
    from vlens.sae.autoencoder import SAE


class WorkerRuntime:
    """Sites, per-step layout and captured values inside one vLLM worker."""

    def __init__(self, runner: Any, graph: GraphSites | None = None) -> None:
        self.runner = runner
        self.graph = graph  # the compiled engine's traced names (:mod:`vlens.runtime.graph`)
        self.model: nn.Module = runner.get_model()
        self.wanted: dict[str, RequestPlan] = {}
        self.captures: dict[str, RequestCapture] = {}
        self.store = StepStore()  # whole steps' kept rows of names read without hooks
        #: this step's kept rows by the tags that keep them (:func:`kept_rows`), for every name
        self.step_rows: dict[tuple[str, ...], tuple[slice | Tensor, list[Segment]]] = {}
        self.contexts: dict[str, dict[str, Any]] = {}
        #: (call, site) where the call's requests may run their hook functions as one batch
        self.batched: set[tuple[str, Site]] = set()
        #: per site: what decides its step's batches (:meth:`_refresh_site_keys`)
        self.site_keys: dict[Site, tuple[frozenset[str], frozenset[str]]] = {}
        #: sites where some request runs a hook function
        self.hooked_sites: set[Site] = set()
        #: SAEs spliced in, by the site of the name each replaces (:mod:`vlens.runtime.splices`)
        self.splices: dict[Site, Splice] = {}
        #: per hooked site: each request's kind of names there (equal kinds, equal names)
        self.name_kinds: dict[Site, dict[str, int]] = {}
        #: this step's batches, by site key (:meth:`_batches_at`)
        self.step_batches: dict[tuple[frozenset[str], frozenset[str]], list[StepBatch]] = {}
        self.handles: dict[Site, Any] = {}
        self.followed: dict[str, Followed] = {}
        #: tag -> the end of the request's furthest rows so far (:func:`mark_sampling`)
        self.furthest: dict[str, int] = {}
        self.layout: StepRows | None = None
        self.last_step: list[RequestRows] = []
        self.probe: ModuleProbe | None = None
        # layers whose attention is computed here, for hooks on scores, patterns and results
        self.attention = AttentionSites(
            self.model, lambda: self.layout, self.captures, self.contexts,
            in_graph=graph is not None,
        )
        parallel = TensorParallel.of_this_worker()
        self.parallel = parallel if parallel.size > 1 else None
        self.hands_back = parallel.rank == 0  # one rank hands results back
        #: a compiled engine's sites where hook functions run inside the graph, fired by it
        #: (:mod:`vlens.runtime.hook_sites`) rather than by torch hooks installed per call
        self.graph_hook_sites = graph.hook_sites if graph is not None else {}
        self._fired_in_graph: dict[Site, Callable[[tuple, dict, Any], None]] = {}
        if graph is not None:
            graph.run_hook_site = self._graph_hook_site_fired
        #: served requests whose plans came inside the request (no call to start them)
        self.inline = InlineRequests()
        self._wrap_model_forward()
        apply_cpu_patches(self.model)

    def follow_inline(self, scheduler_output: Any) -> None:
        """Before a step: forget the served requests that carried their plans, finished, and
        hand nothing back; follow the new ones (:mod:`vlens.runtime.inline`)."""
        # one that captures is finished by the server's call, which hands its rows back (and
        # may have come first)
        finished = [tag for tag in self.inline.finished(scheduler_output)
                    if tag in self.wanted and not self.wanted[tag].graph_keep]
        if finished:
            self.finish(finished)
        plans = self.inline.new_plans(scheduler_output, tag_of)
        if plans:
            self.prepare(plans)

    def _wrap_model_forward(self) -> None:
        """Read the step's row layout right before each real forward (not warm-up dummies), from
        the V1 or the V2 model runner (see :mod:`vlens.runtime.layout`)."""
        follow_steps(self.runner, self)

    # ---- called from the user's process ------------------------------------------------------

    def prepare(self, requests: dict[str, RequestPlan]) -> None:
        """Follow these requests (by tag) and install the sites their plans need."""
        refusal = unsupported(self.parallel is not None)
        for tag, plan in requests.items():
            self.wanted[tag] = plan
            self.captures[tag] = RequestCapture()
            if self.graph is not None:
                slot = (
                    Slot(plan.index, plan.call_size, plan.positions, plan.shared_host)
                    if plan.positions
                    else None
                )
                try:
                    self.graph.prepare(tag, plan.graph_keep, plan.steering, slot)
                except Exception:  # refused (an SAE's feature table is full): forget the call
                    self.finish([t for t in requests if t in self.captures])
                    raise
            refused = refusal or self._undeclared_attention(plan)
            if plan.attention and refused is not None:
                self.captures[tag].error = refused  # raised after the call; its hooks never run
            else:
                self.attention.prepare(tag, plan.index, plan.call_size, plan.attention)
        self.batched |= batched_sites(requests)
        for site in {site for plan in self.wanted.values() for site in plan.sites}:
            if site not in self.handles and site not in self.graph_hook_sites:
                self.handles[site] = install_site(self.model, site, self._site_fired(site))
        self._refresh_site_keys()
        self._activate_graph_hook_sites()

    def finish(self, tags: list[str], device: str = "cpu") -> Handback:
        """Hand back (on ``device``) and forget what these requests captured; drop sites nobody
        needs now. The requests are forgotten even when handing back fails. A tag not followed
        (a served request that carried its plan and never ran) has nothing to hand back."""
        tags = [tag for tag in tags if tag in self.captures]
        captures = {tag: self.captures.pop(tag) for tag in tags}
        kept_names = {tag: self.wanted[tag].kept_names() for tag in tags if tag in self.wanted}
        try:
            for tag, formed in self.attention.finish(tags, device).items():
                captures[tag].formed.update(formed)
            padded = self.store.take(tags, kept_names, device)
            if self.graph is not None:
                traced = self.graph.finish(tags, device)
                assert not traced.keys() & padded.keys(), "a traced name was also read eagerly"
                padded.update(traced)
            return Handback(handed_back(captures, device), padded)
        finally:
            for tag in tags:
                self.wanted.pop(tag, None)
            calls = {call_of(tag) for tag in self.wanted}
            self.batched = {key for key in self.batched if key[0] in calls}
            still_needed = {site for plan in self.wanted.values() for site in plan.sites}
            still_needed |= self.splices.keys()
            for site in list(self.handles):
                if site not in still_needed:
                    self.handles.pop(site).remove()
            self._refresh_site_keys()
            self._activate_graph_hook_sites()
            if not self.wanted:
                self.followed.clear()
                self.furthest.clear()
                self.store.clear()
            else:  # requests overlap (a server): forget only the finished ones
                finished = set(tags)
                for req_id, known in list(self.followed.items()):
                    if known is None or known[0] in finished:
                        del self.followed[req_id]
                for tag in tags:
                    self.furthest.pop(tag, None)
                self.store.forget(tags)

    def _activate_graph_hook_sites(self) -> None:
        """Let the graph's hook sites that the requests being served need call in; the others
        return at once."""
        if not self.graph_hook_sites:
            return
        needed = {site for plan in self.wanted.values() for site in plan.sites}
        needed |= self.splices.keys()
        needed |= {Site(path, "call") for path in self.attention.paths()}
        for site, number in self.graph_hook_sites.items():
            hook_sites.activate((number,), site in needed)

    def _undeclared_attention(self, plan: RequestPlan) -> str | None:
        """On a compiled engine, why a plan's attention cannot be computed: a layer whose
        sites were not declared (the user's side refuses such hooks before they get here)."""
        if self.graph is None:
            return None
        for layer in plan.attention:
            for path in {layer.attention.module_of(stage) for stage, on in layer.hooks.items() if on}:
                if Site(path, "call") not in self.graph_hook_sites:
                    return (f"{next(iter(layer.names.values()))}: this compiled engine computes "
                            f"no attention at {path}; declare the name in compiled_hooks")
        return None

    def _graph_hook_site_fired(self, site: Site, args: tuple, kwargs: dict, output: Any) -> None:
        if site.event == "call":
            self.attention.fired_in_graph(site.path, args, kwargs, output)
            return
        if site not in self._fired_in_graph:
            self._fired_in_graph[site] = self._site_fired(site)
        self._fired_in_graph[site](args, kwargs, output)

    def splice(self, key: str, site: Site, read: Reader, sae: SAE | None, use_error: bool) -> None:
        """Splice ``sae`` in at ``site`` as ``key`` (:mod:`vlens.runtime.splices`), replacing
        any SAE there; None takes the SAE at ``site`` out."""
        splices = splices_of(self.model)
        old = self.splices.pop(site, None)
        for name, module in list(splices.items()):
            if module is old:
                del splices[name]
        if sae is not None:
            device = next(self.model.parameters()).device
            if sae.device != device:  # a copy: the user's SAE stays where it is
                sae = copy.deepcopy(sae).to(device)
            splices[key] = self.splices[site] = Splice(sae, read, use_error)
            if site not in self.handles and site not in self.graph_hook_sites:
                self.handles[site] = install_site(self.model, site, self._site_fired(site))
        elif site in self.handles and not any(site in p.sites for p in self.wanted.values()):
            self.handles.pop(site).remove()
        self._activate_graph_hook_sites()

    def holds(self) -> dict[str, int]:
        """How many requests this worker follows and holds captures of, and how many sites are
        installed: all zero once every request has finished (the server's status)."""
        graph = len(self.graph.call.kept_names) if self.graph is not None else 0
        return {"requests": len(self.wanted), "captures": len(self.captures),
                "sites": len(self.handles), "graph_requests": graph,
                "inline_requests": len(self.inline.tags)}

    def module_tree(self) -> str:
        return repr(self.model)

    def operations(self, path: str) -> list[Operation] | str:
        """The operations of the forward of the module at ``path`` (``PATH.source``), or why
        it has none to list."""
        try:
            return source.operations(find_module(self.model, path))
        except LookupError as error:
            return str(error)

    def start_probe(self) -> None:
        """Watch which modules run during the next call (see :mod:`vlens.runtime.probe`)."""
        self.probe = ModuleProbe(self.model)
        self.probe.start(lambda: self.layout)

    def finish_probe(self) -> dict[str, ModuleRecord]:
        records = self.probe.stop()
        self.probe = None
        return records

    def forget_interrupted_step(self) -> None:
        """After an interrupt inside a step: drop the step's layout and any half-run model
        output vLLM's runner kept for sampling (it would refuse the next step)."""
        self.layout = None
        self.step_rows.clear()
        if getattr(self.runner, "execute_model_state", None) is not None:
            self.runner.execute_model_state = None

    def leave_interrupts_to_the_user(self) -> None:
        """In a worker process of its own: ignore SIGINT, which a Ctrl-C sends to the user's
        whole process group and on which vLLM's workers exit; the user's process stops the call
        (:mod:`vlens.engine.interrupts`). The worker still ends with the engine (vLLM's shutdown, or
        the user's process ending)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def exit_with_the_user(self) -> None:
        """In a worker process of its own: exit once the user's process is gone, killed from
        outside (:mod:`vlens.runtime.orphans`)."""
        orphans.exit_with_parent()

    def gpu_probe(self) -> Tensor:
        """A small tensor on this worker's device: whether the user's process can open what
        this worker hands back on its GPU (``Engine.hands_back_on_gpu``)."""
        return torch.arange(4.0, device=next(self.model.parameters()).device)

    def host_block_probe(self) -> Tensor:
        """A small tensor in this worker's shared host memory (page-locked where the model is on
        a GPU): whether the user's process can map what a call's kept rows are written into
        (``Engine.maps_worker_memory``)."""
        on_gpu = next(self.model.parameters()).device.type == "cuda"
        blocks = host_blocks.pool()
        probe = blocks.take((4,), torch.float32, register=on_gpu)
        probe.copy_(torch.arange(4.0))
        blocks.end_call([probe])
        return probe

    def clear_contexts(self) -> None:
        """Forget every ``hook.ctx`` (TransformerLens's ``reset_hooks(clear_contexts=True)``)."""
        self.contexts.clear()

    # ---- around and inside the forward -------------------------------------------------------

    def step_started(self) -> None:
        self.step_rows.clear()
        self.step_batches.clear()
        mark_sampling(self.layout or (), self.furthest)
        if self.graph is not None:
            self.graph.before_step(self.layout)

    def step_finished(self) -> None:
        if self.graph is not None:
            self.graph.after_step(self.layout)

    def _rows_for(self, site: Site) -> list[RequestRows]:
        """The rows a site's call covers: the forward's token rows, or, for a ``sampled`` site
        (called once per step after the forward), one row per request that samples a token."""
        if site.event != "sampled":
            return self.layout or []
        if self.layout is not None:  # vlens's own logits reader, inside the forward
            return []
        return [row for rows in self.last_step if (row := rows.sampled_row()) is not None]

    def _site_fired(self, site: Site):
        sampled = site.event == "sampled"

        def on_call(args: tuple, kwargs: dict, output: Any) -> None:
            if sampled and output is None:  # logits live on another rank
                return
            splice = self.splices.get(site)
            if splice is not None:
                splice.apply(NarrowedCall(self.model, None, args, kwargs, output, self.parallel))
            batches = self._batches_at(site)
            if not batches:
                return
            if not sampled and site not in self.hooked_sites:
                whole = NarrowedCall(self.model, None, args, kwargs, output, self.parallel)
                self._read_whole_step(site, batches, whole)
                return
            buffers = buffers_of(args, kwargs, output)  # to tell a reader's views from new values
            whole = NarrowedCall(self.model, None, args, kwargs, output, self.parallel, buffers)
            for group in self._alike(site, batches):
                if len(group) == 1:
                    self._serve(site, group[0], whole, sampled)
                else:
                    self._serve_together(site, group, whole, sampled)

        return on_call

    def _batches_at(self, site: Site) -> list[StepBatch]:
        """The requests served at a site this step, as they run its hook functions: a call's
        requests together where they may (:mod:`vlens.runtime.batches`), every other one alone.
        Worked out once per step for all the sites with the same requests (every layer's
        site, usually), until a request fails."""
        key = self.site_keys.get(site)
        if key is None or site.event == "sampled":
            return self._batches_of(site, self._rows_for(site))
        batches = self.step_batches.get(key)
        if batches is None or any(
            member.capture.error is not None for batch in batches for member in batch.members
        ):
            batches = self.step_batches[key] = self._batches_of(site, self._rows_for(site))
        return batches

    def _batches_of(self, site: Site, step: list[RequestRows]) -> list[StepBatch]:
        served = []
        for rows in step:
            plan = self.wanted.get(rows.tag)
            capture = self.captures.get(rows.tag)
            if plan is not None and plan.sites.get(site) and capture is not None:
                if capture.error is None:
                    served.append(Member(rows, plan, capture))
        if not self.batched:
            return [StepBatch.of([member]) for member in served]

        def key(member: Member) -> tuple[str, int, bool] | None:
            rows = member.rows
            return shape_key(rows) if (call_of(rows.tag), site) in self.batched else None

        groups = in_batches(served, key, lambda m: m.plan.call_size, lambda m: m.plan.index)
        return [StepBatch.of(group) for group in groups]

    def _refresh_site_keys(self) -> None:
        """For each site some request needs: which requests it serves and which calls batch
        there (what decides its step's batches), and whether a hook function runs there."""
        tags: dict[Site, set[str]] = {}
        self.hooked_sites = set()
        for tag, plan in self.wanted.items():
            for site, names in plan.sites.items():
                if names:
                    tags.setdefault(site, set()).add(tag)
                if any(name.hooks for name in names):
                    self.hooked_sites.add(site)
        batched: dict[Site, set[str]] = {}
        for call, site in self.batched:
            batched.setdefault(site, set()).add(call)
        self.site_keys = {
            site: (frozenset(served), frozenset(batched.get(site, ())))
            for site, served in tags.items()
        }
        self.name_kinds = {site: self._kinds_at(site) for site in self.hooked_sites}
        self.step_batches.clear()

    def _kinds_at(self, site: Site) -> dict[str, int]:
        """Each request's names at ``site`` as a number, equal where the names (hook functions
        included) are: requests of one kind may be read and written together."""
        kinds: dict[tuple[NamePlan, ...], int] = {}
        found = {}
        for tag, plan in self.wanted.items():
            names = plan.sites.get(site)
            if names:
                found[tag] = kinds.setdefault(names, len(kinds))
        return found

    def _alike(self, site: Site, batches: list[StepBatch]) -> list[list[StepBatch]]:
        """``batches`` grouped by their requests' kind of names at ``site``, each group in the
        order of the step's rows (one span, where they are consecutive)."""
        kinds = self.name_kinds.get(site, {})
        groups: dict[int, list[StepBatch]] = {}
        for batch in batches:
            groups.setdefault(kinds.get(batch.rows[0].tag, -1 - len(groups)), []).append(batch)
        return [sorted(group, key=lambda batch: batch.rows[0].start) for group in groups.values()]

    def _serve(self, site: Site, batch: StepBatch, whole: NarrowedCall, sampled: bool) -> None:
        """Run the names of a site, in order, for the requests of ``batch`` (one, or a call's
        batch, all with the same names): hook functions on their value (batched), then their
        kept rows. A failure is recorded for every request of the batch and stops their hooks
        here. ``sampled``: the site is the sampler's (one row per sampled token, no prefill)."""
        for name in batch.members[0].plan.sites[site]:
            try:
                if name.hooks:
                    if name.shared and not sampled:
                        refuse_part_of_a_prefill(name.name, name.hooks, batch)
                    run_hooks(name, batch, whole, self.contexts)
                if name.keep:
                    self._keep(name, batch, whole)
            except Exception as error:
                self._record(batch, name.name, error)
                break

    def _serve_together(
        self, site: Site, batches: list[StepBatch], whole: NarrowedCall, sampled: bool
    ) -> None:
        """:meth:`_serve` for batches whose requests carry the same names at ``site`` (the
        prompts of a call that do not run as one batch in this step, each alone): each name's
        value is read, copied and written back once for all of them
        (:func:`~vlens.runtime.hooks.run_hooks_together`); the hook functions still run per
        batch, on views of their rows. A batch that fails stops there; the others go on."""
        live = list(batches)
        for name in live[0].members[0].plan.sites[site]:
            if name.hooks:
                refuse = None if sampled or not name.shared else refuse_part_of_a_prefill
                try:
                    failures = run_hooks_together(name, live, whole, self.contexts, refuse)
                except Exception as error:
                    failures = {id(batch): error for batch in live}
                for batch in live:
                    if id(batch) in failures:
                        self._record(batch, name.name, failures[id(batch)])
                live = [batch for batch in live if id(batch) not in failures]
            if name.keep:
                for batch in list(live):
                    try:
                        self._keep(name, batch, whole)
                    except Exception as error:
                        self._record(batch, name.name, error)
                        live.remove(batch)
            if not live:
                return

    def _keep(self, name: NamePlan, batch: StepBatch, whole: NarrowedCall) -> None:
        """Capture ``name``'s value (as the hooks left it) for each request of ``batch``."""
        for own, member in zip(batch.rows, batch.members):
            # Every rank reads (a split value is gathered, a collective); one hands back, so
            # that results come back once.
            value = read_rows(dataclasses.replace(whole, rows=own), name.read)
            if self.hands_back and value is not None:
                add_chunk(member.capture.chunks[name.name], Chunk(own.first_position, value))

    @staticmethod
    def _record(batch: StepBatch, name: str, error: BaseException) -> None:
        """A failure at ``name``, for every request of ``batch``."""
        for member in batch.members:
            if isinstance(error, HookError):
                member.capture.error, member.capture.cause = str(error), error.__cause__
            else:
                member.capture.error = f"while reading {name}:\n" + "".join(
                    traceback.format_exception(error)
                )

    def _read_whole_step(self, site: Site, batches: list[StepBatch], call: NarrowedCall) -> None:
        """No hook runs here this step: read each name once over the whole step and copy out
        the rows of the requests that keep it (see :mod:`vlens.runtime.step_store`)."""
        by_name: dict[str, tuple[NamePlan, list[tuple[RequestRows, RequestCapture]]]] = {}
        for batch in batches:
            for rows, plan, capture in batch.members:
                for name in plan.sites[site]:
                    by_name.setdefault(name.name, (name, []))[1].append((rows, capture))
        for name, (plan, keepers) in by_name.items():
            try:
                value = plan.read(call)  # every rank reads: a split value is gathered
                if self.hands_back:
                    requests = [rows for rows, _ in keepers]
                    tags = tuple(rows.tag for rows in requests)
                    if tags not in self.step_rows:
                        self.step_rows[tags] = kept_rows(requests, value.device)
                    selection, segments = self.step_rows[tags]
                    self.store.add(name, segments, copy_rows(value, selection))
            except Exception:
                for _, capture in keepers:
                    capture.error = f"while reading {name}:\n{traceback.format_exc()}"


def handed_back(
    captures: dict[str, RequestCapture], device: str = "cpu"
) -> dict[str, RequestCapture]:
    """``captures`` as handed back to the user's process: each name's chunks joined wherever
    their positions run on (a gap, e.g. a prefix-cache hit, stays a gap for the user's side to
    report), and on ``device``.

    The CPU by default: under tensor parallelism the user's process receives the values from
    another process, and on CUDA vLLM has claimed most of the GPU's memory for its KV cache.
    One copy per run of positions, not one per engine step, and one synchronisation for all.
    """
    from_cuda = False
    for capture in captures.values():
        for name, chunks in capture.chunks.items():
            runs: list[list[Chunk]] = []
            end = None  # the position after the last chunk's rows
            for chunk in sorted(chunks, key=lambda chunk: chunk.first_position):
                if chunk.first_position == end:
                    runs[-1].append(chunk)
                else:
                    runs.append([chunk])
                end = chunk.first_position + len(chunk.value)
            joined = []
            for run in runs:
                value = run[0].value if len(run) == 1 else torch.cat([c.value for c in run])
                from_cuda |= value.is_cuda
                joined.append(Chunk(run[0].first_position, value.to(device, non_blocking=True)))
            capture.chunks[name] = joined
    if from_cuda:
        torch.cuda.synchronize()
    return captures


#: Where a compiled engine's worker keeps its :class:`GraphSites` from load time on
#: (:mod:`vlens.runtime.graph_worker`).
GRAPH_ATTRIBUTE = "_vlens_graph"


#: Where a worker keeps its :class:`WorkerRuntime`.
RUNTIME_ATTRIBUTE = "_vlens_runtime"


def runtime_of(worker: Any) -> WorkerRuntime:
    """The worker's runtime, created on first use."""
    runtime = getattr(worker, RUNTIME_ATTRIBUTE, None)
    if runtime is None:
        runtime = WorkerRuntime(worker.model_runner, getattr(worker, GRAPH_ATTRIBUTE, None))
        setattr(worker, RUNTIME_ATTRIBUTE, runtime)
    return runtime


def call_runtime(worker: Any, method: str, *args: Any) -> Any:
    """Entry point of ``collective_rpc``: run ``method`` of this worker's runtime."""
    return getattr(runtime_of(worker), method)(*args)


class WorkerExtension:
    """Mixed into vLLM's worker class (the ``worker_extension_cls`` engine argument): the entry
    point of worker processes, called by name with bytes, so that vLLM's channels never carry
    a pickled callable."""

    def vlens_call(self, method: str, payload: bytes, call: str, machine: str) -> bytes:
        """Run ``WorkerRuntime.<method>`` with the arguments vlens cloudpickled in the user's
        process (plans, and user hook functions, which are often closures); the result goes back
        pickled, its large tensors through shared memory in files named after ``call`` where
        the user's process runs on this ``machine`` (:mod:`vlens.runtime.shared_tensors`)."""
        import cloudpickle

        from vlens.runtime import shared_tensors

        shared_tensors.collect_handed_back()
        result = call_runtime(self, method, *cloudpickle.loads(payload))
        return shared_tensors.dumps(result, call, machine)
