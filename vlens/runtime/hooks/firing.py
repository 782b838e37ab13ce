"""What a site does when it fires on vLLM's forward (eager engines, and the hook sites of a
compiled one): the step's requests that need it grouped by call, the hook functions a call's
prompts share run once on the call's padded batch and each prompt's own on its rows
(:mod:`vlens.runtime.hooks.batches`, :mod:`vlens.runtime.hooks.calls`), with their edits written
back, the values asked for kept, and names no hook touches read once over the whole step: into
the host's cache as the step ends where the call keeps it there and says how far each request
runs (:mod:`vlens.runtime.transfer.host_stream`, on a GPU by the copy engines while later steps
compute), else kept on the device until the requests finish
(:mod:`vlens.runtime.steps.kept_steps`).

At each name of a site, in forward order: the shared functions, then each prompt's own, then
the kept value. A failure inside a shared function is recorded for every prompt of its call in
the step, one inside a prompt's own for that prompt; either stops the failed prompts' hooks, the
engine runs on, and the user's process raises it after the call.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from vlens.runtime.hooks.batches import HookBatch, Member, call_of
from vlens.runtime.hooks.calls import (
    refuse_part_of_a_prefill,
    run_hooks,
    run_hooks_together,
)
from vlens.runtime.sites.splices import Splice
from vlens.runtime.sites.torch_hooks import NarrowedCall, buffers_of, read_rows
from vlens.runtime.steps.kept_steps import KeptSteps, Segment, add_chunk, copy_rows, kept_rows
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.tensor_parallel import TensorParallel
from vlens.runtime.transfer.host_stream import HostStream, Slot, StepStage, joined, taken
from vlens.runtime.transfer.messages import (
    Chunk,
    HookError,
    NamePlan,
    PaddedRows,
    RequestCapture,
    RequestPlan,
)
from vlens.runtime.vocabulary.locations import Site


@dataclass(eq=False)
class EagerSites:
    """The sites of one worker's followed requests, as they fire. It shares the worker's
    requests (``wanted``, by tag), their ``captures``, the hooks' ``contexts`` and the SAEs
    ``splices`` in, and reads each site's rows of the step with ``rows_for``; one rank
    ``hands_back`` what is kept."""

    model: nn.Module
    wanted: dict[str, RequestPlan]
    captures: dict[str, RequestCapture]
    contexts: dict[str, dict[str, Any]]
    splices: dict[Site, Splice]
    rows_for: Callable[[Site], list[RequestRows]]
    parallel: TensorParallel | None
    hands_back: bool
    #: whole steps' kept rows of names read without hooks, where the call gave no :class:`Slot`
    kept_steps: KeptSteps = field(default_factory=KeptSteps)
    #: the same written into the host's cache as steps end, where it did
    stream: HostStream | None = None
    #: the requests :attr:`stream` follows that keep something
    stream_keepers: set[str] = field(default_factory=set)
    #: this step's rows of those requests, once :attr:`stream` began the step
    stream_rows: slice | Tensor | None = None
    #: on a GPU, this step's rows of the names :attr:`stream` keeps, until the step ends
    stage: StepStage = field(default_factory=StepStage)
    #: this step's kept rows by the tags that keep them (:func:`kept_rows`), for every name
    step_rows: dict[tuple[str, ...], tuple[slice | Tensor, list[Segment]]] = field(
        default_factory=dict
    )
    #: per site: the requests it serves (what decides its step's calls, :meth:`refresh`)
    site_keys: dict[Site, frozenset[str]] = field(default_factory=dict)
    #: sites where some request runs a hook function
    hooked_sites: set[Site] = field(default_factory=set)
    #: (call, site) where some request of the call runs hook functions of its own
    own_hooks: set[tuple[str, Site]] = field(default_factory=set)
    #: this step's requests by call, by site key (:meth:`_calls_at`), with the count of failed
    #: captures when they were worked out
    step_calls: dict[frozenset[str], tuple[int, list[list[Member]]]] = field(
        default_factory=dict
    )
    #: each of this step's calls laid out as its hook functions' batch, by ``id`` of its list of
    #: requests in :attr:`step_calls`, beside that list (made once for every layer's site)
    step_batches: dict[int, tuple[list[Member], HookBatch]] = field(default_factory=dict)

    def follow(self, slots: dict[str, Slot | None]) -> None:
        """New requests joined ``wanted``, each with its :class:`Slot` where its call keeps its
        cache on the host (:func:`~vlens.runtime.transfer.host_stream.joined`); one rank hands
        back, so only it streams."""
        device = next(self.model.parameters()).device
        others = bool(self.kept_steps.entries) or bool(self.wanted.keys() - slots.keys())
        for tag, slot in slots.items():
            self.stream = joined(self.stream, tag, slot if self.hands_back else None, device,
                                 others)
            if self.stream is not None and self.wanted[tag].kept_names():
                self.stream_keepers.add(tag)
        self.refresh()

    def forget(self, tags: list[str]) -> None:
        """Finished requests (already out of ``wanted``): their steps' rows dropped."""
        self.refresh()
        if self.wanted:  # requests overlap (a server): forget only the finished ones
            self.kept_steps.forget(tags)
            return
        self.kept_steps.clear()
        if self.stream is not None:
            self.stream.end_call()
            self.stream = None
            self.stream_keepers.clear()
            self.stream_rows = None
            self.stage.clear()

    def take(
        self, tags: list[str], kept_names: dict[str, frozenset[str]], device: str
    ) -> dict[str, PaddedRows]:
        """The whole steps' kept rows of these finished requests, on ``device``."""
        return taken(self.stream, self.kept_steps, tags, kept_names, device)

    def new_step(self) -> None:
        self.end_step()  # a step that raised did not end
        self.step_rows.clear()
        self.step_calls.clear()
        self.step_batches.clear()

    def end_step(self) -> None:
        """The step's forward is over: its rows are on their way to the host."""
        if self.stream_rows is not None:
            self.stream_rows = None
            assert self.stream is not None
            self.stage.write(self.stream)
            self.stream.end_step()

    def fired(self, site: Site) -> Callable[[tuple, dict, Any], None]:
        """What the site does when vLLM calls its module: for the requests of this step that
        need it, the SAE spliced there, then hook functions and kept rows."""
        sampled = site.event == "sampled"

        def on_call(args: tuple, kwargs: dict, output: Any) -> None:
            if sampled and output is None:  # logits live on another rank
                return
            splice = self.splices.get(site)
            if splice is not None:
                splice.apply(NarrowedCall(self.model, None, args, kwargs, output, self.parallel))
            calls = self._calls_at(site)
            if not calls:
                return
            if not sampled and site not in self.hooked_sites:
                whole = NarrowedCall(self.model, None, args, kwargs, output, self.parallel)
                self._read_whole_step(site, calls, whole)
                return
            buffers = buffers_of(args, kwargs, output)  # to tell a reader's views from new values
            whole = NarrowedCall(self.model, None, args, kwargs, output, self.parallel, buffers)
            for members in calls:
                self._serve(site, members, whole, sampled)

        return on_call

    def _calls_at(self, site: Site) -> list[list[Member]]:
        """The requests served at a site this step, by call, each call's in its order. Worked
        out once per step for all the sites with the same requests (every layer's site,
        usually), until a request fails: its cost at each later site is then a lookup, whatever
        the number of requests."""
        key = self.site_keys.get(site)
        if key is None or site.event == "sampled":
            return self._calls_of(site, self.rows_for(site))
        failures, calls = self.step_calls.get(key, (-1, []))
        if failures != RequestCapture.failures:
            failures = RequestCapture.failures
            calls = self._calls_of(site, self.rows_for(site))
            self.step_calls[key] = failures, calls
        return calls

    def _calls_of(self, site: Site, step: list[RequestRows]) -> list[list[Member]]:
        by_call: dict[str, list[Member]] = {}
        for rows in step:
            plan = self.wanted.get(rows.tag)
            capture = self.captures.get(rows.tag)
            if plan is not None and plan.sites.get(site) and capture is not None:
                if capture.error is None:
                    by_call.setdefault(call_of(rows.tag), []).append(Member(rows, plan, capture))
        return [sorted(members, key=lambda member: member.plan.index)
                for members in by_call.values()]

    def refresh(self) -> None:
        """For each site some request needs: which requests it serves (what decides its step's
        calls), and whether a hook function runs there."""
        tags: dict[Site, set[str]] = {}
        self.hooked_sites, self.own_hooks = set(), set()
        for tag, plan in self.wanted.items():
            for site, names in plan.sites.items():
                if names:
                    tags.setdefault(site, set()).add(tag)
                if any(name.hooks for name in names):
                    self.own_hooks.add((call_of(tag), site))
                if any(name.hooks or name.batch_hooks for name in names):
                    self.hooked_sites.add(site)
        self.site_keys = {site: frozenset(served) for site, served in tags.items()}
        self.step_calls.clear()
        self.step_batches.clear()

    def _serve(self, site: Site, members: list[Member], whole: NarrowedCall, sampled: bool) -> None:
        """Run the names of a site, in order, for one call's requests in this step (all with the
        same names there): the call's shared hook functions once on its padded batch, each
        request's own on its rows, then the kept rows. ``sampled``: the site is the sampler's
        (one row per sampled token, no prefill)."""
        live = members
        batch: HookBatch | None = None
        own_hooks = (call_of(members[0].rows.tag), site) in self.own_hooks
        for slot, first in enumerate(members[0].plan.sites[site]):
            if first.batch_hooks:
                batch = batch or self._batch_of(live)
                try:
                    if not sampled:
                        refuse_part_of_a_prefill(first.name, first.batch_hooks, batch)
                    run_hooks(first, first.batch_hooks, batch, whole, self.contexts)
                except Exception as error:
                    self._record(live, first.name, error)
                    return
            failed: set[int] = set()
            if own_hooks:
                own = [member for member in live if member.plan.sites[site][slot].hooks]
                failed = {id(member) for member in self._run_own(site, slot, own, whole)}
            if first.keep:  # a call's requests keep the same names
                for member in live:
                    if id(member) not in failed:
                        try:
                            self._keep(first, member, whole)
                        except Exception as error:
                            self._record([member], first.name, error)
                            failed.add(id(member))
            if failed:
                live = [member for member in live if id(member) not in failed]
                batch = None
                if not live:
                    return

    def _batch_of(self, members: list[Member]) -> HookBatch:
        """``members`` (one call's, in this step) laid out as its batch; once per step for the
        lists of :attr:`step_calls`."""
        known = self.step_batches.get(id(members))
        if known is not None and known[0] is members:
            return known[1]
        batch = HookBatch.of_call(members)
        self.step_batches[id(members)] = (members, batch)
        return batch

    def _run_own(
        self, site: Site, slot: int, members: list[Member], whole: NarrowedCall
    ) -> list[Member]:
        """Each request's own hook functions at a site's ``slot``-th name, on its own rows;
        requests with the same functions are read, copied and written together
        (:func:`~vlens.runtime.hooks.calls.run_hooks_together`). The requests that failed."""
        failed = []
        by_functions: dict[tuple, list[Member]] = {}
        for member in members:
            by_functions.setdefault(member.plan.sites[site][slot].hooks, []).append(member)
        for alike in by_functions.values():
            name = alike[0].plan.sites[site][slot]
            if len(alike) == 1:
                try:
                    run_hooks(name, name.hooks, HookBatch.of_request(alike[0]), whole,
                              self.contexts)
                except Exception as error:
                    self._record(alike, name.name, error)
                    failed.extend(alike)
                continue
            alike.sort(key=lambda member: member.rows.start)
            batches = [HookBatch.of_request(member) for member in alike]
            try:
                failures = run_hooks_together(name, batches, whole, self.contexts)
            except Exception as error:
                failures = {id(batch): error for batch in batches}
            for member, batch in zip(alike, batches):
                if id(batch) in failures:
                    self._record([member], name.name, failures[id(batch)])
                    failed.append(member)
        return failed

    def _keep(self, name: NamePlan, member: Member, whole: NarrowedCall) -> None:
        """Capture ``name``'s value (as the hooks left it) for ``member`` (``name`` read as any
        request of its call reads it)."""
        # Every rank reads (a split value is gathered, a collective); one hands back, so that
        # results come back once.
        value = read_rows(dataclasses.replace(whole, rows=member.rows), name.read)
        if self.hands_back and value is not None:
            add_chunk(member.capture.chunks[name.name], Chunk(member.rows.first_position, value))

    @staticmethod
    def _record(members: list[Member], name: str, error: BaseException) -> None:
        """A failure at ``name``, for each of ``members``."""
        for member in members:
            if isinstance(error, HookError):
                member.capture.fail(str(error), error.__cause__)
            else:
                member.capture.fail(f"while reading {name}:\n"
                                    + "".join(traceback.format_exception(error)))

    def _read_whole_step(
        self, site: Site, calls: list[list[Member]], call: NarrowedCall
    ) -> None:
        """No hook runs here this step: read each name once over the whole step and copy out
        the rows of the requests that keep it (see :mod:`vlens.runtime.steps.kept_steps`). A
        call's requests keep the same names, so the names come from each call's first request:
        a step of many requests costs no more Python per site than one of a few."""
        by_name: dict[str, tuple[NamePlan, list[list[Member]]]] = {}
        for members in calls:
            for name in members[0].plan.sites[site]:
                if name.keep:
                    by_name.setdefault(name.name, (name, []))[1].append(members)
        for name, (plan, keepers) in by_name.items():
            try:
                value = plan.read(call)  # every rank reads: a split value is gathered
                if self.stream is not None:
                    self._stream_rows(site, name, value)
                elif self.hands_back:
                    requests = [member.rows for members in keepers for member in members]
                    tags = tuple(rows.tag for rows in requests)
                    if tags not in self.step_rows:
                        self.step_rows[tags] = kept_rows(requests, value.device)
                    selection, segments = self.step_rows[tags]
                    self.kept_steps.add(name, segments, copy_rows(value, selection))
            except Exception:
                message = f"while reading {name}:\n{traceback.format_exc()}"
                for members in keepers:
                    for member in members:
                        member.capture.fail(message)

    def _stream_rows(self, site: Site, name: str, value: Tensor) -> None:
        """One step's rows of ``name`` into the host's cache: the rows of every request the
        stream follows that keeps something (a request's rows of a name it does not keep are
        zeroed as it is taken), worked out at the step's first such name. On a GPU they are
        staged with the step's other names and go over as the step ends (:class:`StepStage`)."""
        stream = self.stream
        assert stream is not None
        if self.stream_rows is None:
            requests = [rows for rows in self.rows_for(site) if rows.tag in self.stream_keepers]
            self.stream_rows = kept_rows(requests, value.device)[0]
            stream.begin_step(requests)
        if value.is_cuda:  # a copy the step no longer changes, for the copy engines
            self.stage.add(name, value, self.stream_rows)
        else:  # scattered at once
            stream.write([name], [value[self.stream_rows]])
