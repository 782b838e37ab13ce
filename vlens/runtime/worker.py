"""The worker side of vlens: one :class:`WorkerRuntime` per vLLM worker, the hub of the leaf.

The user's process hands it, before a call, what each request (by tag) wants: names to keep and
hook functions to run (a :class:`~vlens.runtime.transfer.messages.RequestPlan`). It installs a
torch hook on every site those names need and no other, and follows each step's rows
(:mod:`vlens.runtime.steps.layout`); during the call each site does what its requests ask
(:mod:`vlens.runtime.hooks.firing`); after the call the user's process collects what was kept
(:func:`handed_back`). Sites whose names no request needs any more are removed.

Hooks on attention scores, patterns and per-head results go to :class:`AttentionSites`
(:mod:`vlens.runtime.attention.explicit`), which computes those layers' attention for those
requests; a compiled engine's traced names go to its graph (:mod:`vlens.runtime.compiled.graph`).
"""

from __future__ import annotations

import copy
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from vlens.runtime import orphans
from vlens.runtime.attention.explicit import AttentionSites, unsupported
from vlens.runtime.compiled import hook_sites
from vlens.runtime.compiled.graph import GraphSites
from vlens.runtime.compiled.inline import InlineRequests
from vlens.runtime.hooks.firing import EagerSites
from vlens.runtime.patches import apply_patches
from vlens.runtime.sites import source
from vlens.runtime.sites.probe import ModuleProbe
from vlens.runtime.sites.source import Operation
from vlens.runtime.sites.splices import Splice, splices_of
from vlens.runtime.sites.torch_hooks import (
    find_module,
    install_site,
)
from vlens.runtime.steps.layout import (
    Followed,
    RequestRows,
    StepRows,
    follow_steps,
    mark_sampling,
    tag_of,
)
from vlens.runtime.tensor_parallel import TensorParallel
from vlens.runtime.transfer import host_blocks
from vlens.runtime.transfer.host_stream import Slot
from vlens.runtime.transfer.messages import (
    Chunk,
    Handback,
    ModuleRecord,
    RequestCapture,
    RequestPlan,
)
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import Reader

if TYPE_CHECKING:  # a worker loads vlens.sae only when it unpickles an SAE to splice in
    from vlens.sae.autoencoder import SAE


class WorkerRuntime:
    """Sites, per-step layout and captured values inside one vLLM worker."""

    def __init__(self, runner: Any, graph: GraphSites | None = None) -> None:
        self.runner = runner
        self.graph = graph  # the compiled engine's traced names (:mod:`vlens.runtime.compiled.graph`)
        self.model: nn.Module = runner.get_model()
        self.wanted: dict[str, RequestPlan] = {}
        self.captures: dict[str, RequestCapture] = {}
        self.contexts: dict[str, dict[str, Any]] = {}
        #: SAEs spliced in, by the site of the name each replaces
        #: (:mod:`vlens.runtime.sites.splices`)
        self.splices: dict[Site, Splice] = {}
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
        #: what each site does as it fires (:mod:`vlens.runtime.hooks.firing`)
        self.sites = EagerSites(self.model, self.wanted, self.captures, self.contexts,
                                self.splices, self._rows_for, self.parallel,
                                hands_back=parallel.rank == 0)
        #: a compiled engine's sites where hook functions run inside the graph, fired by it
        #: (:mod:`vlens.runtime.compiled.hook_sites`) rather than by torch hooks installed per call
        self.graph_hook_sites = graph.hook_sites if graph is not None else {}
        self._fired_in_graph: dict[Site, Callable[[tuple, dict, Any], None]] = {}
        if graph is not None:
            graph.run_hook_site = self._graph_hook_site_fired
        #: served requests whose plans came inside the request (no call to start them)
        self.inline = InlineRequests()
        self._wrap_model_forward()
        apply_patches(self.model)

    def follow_inline(self, scheduler_output: Any) -> None:
        """Before a step: forget the served requests that carried their plans, finished, and
        hand nothing back; follow the new ones (:mod:`vlens.runtime.compiled.inline`)."""
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
        the V1 or the V2 model runner (see :mod:`vlens.runtime.steps.layout`)."""
        follow_steps(self.runner, self)

    # ---- called from the user's process ------------------------------------------------------

    def prepare(self, requests: dict[str, RequestPlan]) -> None:
        """Follow these requests (by tag) and install the sites their plans need."""
        refusal = unsupported(self.parallel is not None)
        slots = {
            tag: Slot(plan.index, plan.call_size, plan.positions, plan.shared_host)
            if plan.positions else None
            for tag, plan in requests.items()
        }
        for tag, plan in requests.items():
            self.wanted[tag] = plan
            self.captures[tag] = RequestCapture()
            if self.graph is not None:
                slot = slots[tag]
                try:
                    self.graph.prepare(tag, plan.graph_keep, plan.steering, slot)
                except Exception:  # refused (an SAE's feature table is full): forget the call
                    self.finish([t for t in requests if t in self.captures])
                    raise
            refused = refusal or self._undeclared_attention(plan)
            if plan.attention and refused is not None:
                self.captures[tag].fail(refused)  # raised after the call; its hooks never run
            else:
                self.attention.prepare(tag, plan.index, plan.call_size, plan.attention,
                                       plan.padding_side)
        for site in {site for plan in self.wanted.values() for site in plan.sites}:
            if site not in self.handles and site not in self.graph_hook_sites:
                self.handles[site] = install_site(self.model, site, self.sites.fired(site))
        self.sites.follow(slots)
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
            padded = self.sites.take(tags, kept_names, device)
            if self.graph is not None:
                traced = self.graph.finish(tags, device)
                assert not traced.keys() & padded.keys(), "a traced name was also read eagerly"
                padded.update(traced)
            return Handback(handed_back(captures, device), padded)
        finally:
            for tag in tags:
                self.wanted.pop(tag, None)
            self.sites.forget(tags)
            still_needed = {site for plan in self.wanted.values() for site in plan.sites}
            still_needed |= self.splices.keys()
            for site in list(self.handles):
                if site not in still_needed:
                    self.handles.pop(site).remove()
            self._activate_graph_hook_sites()
            if not self.wanted:
                self.followed.clear()
                self.furthest.clear()
            else:  # requests overlap (a server): forget only the finished ones
                finished = set(tags)
                for req_id, known in list(self.followed.items()):
                    if known is None or known[0] in finished:
                        del self.followed[req_id]
                for tag in tags:
                    self.furthest.pop(tag, None)

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
            stages = {*layer.hooks, *layer.batch_hooks}
            for path in {layer.attention.module_of(s) for s in stages if layer.hooked(s)}:
                if Site(path, "call") not in self.graph_hook_sites:
                    return (f"{next(iter(layer.names.values()))}: this compiled engine computes "
                            f"no attention at {path}; declare the name in compiled_hooks")
        return None

    def _graph_hook_site_fired(self, site: Site, args: tuple, kwargs: dict, output: Any) -> None:
        if site.event == "call":
            self.attention.fired_in_graph(site.path, args, kwargs, output)
            return
        if site not in self._fired_in_graph:
            self._fired_in_graph[site] = self.sites.fired(site)
        self._fired_in_graph[site](args, kwargs, output)

    def splice(self, key: str, site: Site, read: Reader, sae: SAE | None, use_error: bool) -> None:
        """Splice ``sae`` in at ``site`` as ``key`` (:mod:`vlens.runtime.sites.splices`), replacing
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
                self.handles[site] = install_site(self.model, site, self.sites.fired(site))
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
        """Watch which modules run during the next call (see :mod:`vlens.runtime.sites.probe`)."""
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
        self.sites.new_step()
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
        self.sites.new_step()
        mark_sampling(self.layout or (), self.furthest)
        if self.graph is not None:
            self.graph.before_step(self.layout)

    def step_finished(self) -> None:
        self.sites.end_step()
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
#: (:mod:`vlens.runtime.compiled.workers`).
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
        the user's process runs on this ``machine`` (:mod:`vlens.runtime.transfer.shared_tensors`)."""
        import cloudpickle

        from vlens.runtime.transfer import shared_tensors

        shared_tensors.collect_handed_back()
        result = call_runtime(self, method, *cloudpickle.loads(payload))
        return shared_tensors.dumps(result, call, machine)
