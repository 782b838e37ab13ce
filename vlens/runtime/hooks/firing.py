"""What a site does when it fires on vLLM's forward (eager engines, and the hook sites of a
compiled one): the step's requests that need it grouped into the batches that run hook functions
together (:mod:`vlens.runtime.hooks.batches`), the hook functions run on each batch's value with
their edits written back (:mod:`vlens.runtime.hooks.calls`), the values asked for kept, and names
no hook touches read once over the whole step (:mod:`vlens.runtime.steps.kept_steps`).

A failure inside a request's hooks is recorded for that request (for every request of its batch)
and stops its hooks; the engine runs on, and the user's process raises it after the call.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from vlens.runtime.hooks.batches import (
    Member,
    StepBatch,
    batched_sites,
    call_of,
    in_batches,
    shape_key,
)
from vlens.runtime.hooks.calls import refuse_part_of_a_prefill, run_hooks, run_hooks_together
from vlens.runtime.sites.splices import Splice
from vlens.runtime.sites.torch_hooks import NarrowedCall, buffers_of, read_rows
from vlens.runtime.steps.kept_steps import KeptSteps, Segment, add_chunk, copy_rows, kept_rows
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.tensor_parallel import TensorParallel
from vlens.runtime.transfer.messages import (
    Chunk,
    HookError,
    NamePlan,
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
    #: whole steps' kept rows of names read without hooks
    kept_steps: KeptSteps = field(default_factory=KeptSteps)
    #: this step's kept rows by the tags that keep them (:func:`kept_rows`), for every name
    step_rows: dict[tuple[str, ...], tuple[slice | Tensor, list[Segment]]] = field(
        default_factory=dict
    )
    #: (call, site) where the call's requests may run their hook functions as one batch
    batched: set[tuple[str, Site]] = field(default_factory=set)
    #: per site: what decides its step's batches (:meth:`refresh`)
    site_keys: dict[Site, tuple[frozenset[str], frozenset[str]]] = field(default_factory=dict)
    #: sites where some request runs a hook function
    hooked_sites: set[Site] = field(default_factory=set)
    #: per hooked site: each request's kind of names there (equal kinds, equal names)
    name_kinds: dict[Site, dict[str, int]] = field(default_factory=dict)
    #: this step's batches, by site key (:meth:`_batches_at`)
    step_batches: dict[tuple[frozenset[str], frozenset[str]], list[StepBatch]] = field(
        default_factory=dict
    )

    def follow(self, requests: dict[str, RequestPlan]) -> None:
        """New requests (already among ``wanted``): where their calls may batch."""
        self.batched |= batched_sites(requests)
        self.refresh()

    def forget(self, tags: list[str]) -> None:
        """Finished requests (already out of ``wanted``): their steps' rows dropped."""
        calls = {call_of(tag) for tag in self.wanted}
        self.batched = {key for key in self.batched if key[0] in calls}
        self.refresh()
        if self.wanted:  # requests overlap (a server): forget only the finished ones
            self.kept_steps.forget(tags)
        else:
            self.kept_steps.clear()

    def new_step(self) -> None:
        self.step_rows.clear()
        self.step_batches.clear()

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
        requests together where they may (:mod:`vlens.runtime.hooks.batches`), every other one alone.
        Worked out once per step for all the sites with the same requests (every layer's
        site, usually), until a request fails."""
        key = self.site_keys.get(site)
        if key is None or site.event == "sampled":
            return self._batches_of(site, self.rows_for(site))
        batches = self.step_batches.get(key)
        if batches is None or any(
            member.capture.error is not None for batch in batches for member in batch.members
        ):
            batches = self.step_batches[key] = self._batches_of(site, self.rows_for(site))
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

    def refresh(self) -> None:
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
        (:func:`~vlens.runtime.hooks.calls.run_hooks_together`); the hook functions still run per
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
        the rows of the requests that keep it (see :mod:`vlens.runtime.steps.kept_steps`)."""
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
                    self.kept_steps.add(name, segments, copy_rows(value, selection))
            except Exception:
                for _, capture in keepers:
                    capture.error = f"while reading {name}:\n{traceback.format_exc()}"
