"""The engine: vLLM's ``LLM`` built in this process, the requests of a call submitted to it, and
the route to the worker runtime of every rank (:class:`vlens.runtime.worker.WorkerRuntime`).

Each call to the workers goes through ``LLM.collective_rpc``: in-process on one device, vLLM's
own worker processes under tensor parallelism.
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from vlens.engine.arguments import prepare_engine
from vlens.engine.interrupts import WorkerWaits, step_whole_steps
from vlens.engine.prefix_cache import cache_use, skips_reading
from vlens.engine.process_state import (
    FOREIGN_PLUGINS,
    classes_left_as_they_were,
    ensure_expert_group,
    in_process_core,
    keep_process_state_while_others_run,
    own_rotary_embeddings,
    plugins_except,
)
from vlens.runtime.compiled.graph import GraphName
from vlens.runtime.compiled.workers import graph_names_for_workers, with_graph_args
from vlens.runtime.sites.source import Operation
from vlens.runtime.transfer import shared_tensors
from vlens.runtime.transfer.messages import (
    TAG_KEY,
    Handback,
    HookError,
    ModuleRecord,
    PaddedRows,
    RequestCapture,
    RequestPlan,
)
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import Reader
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
        **user_args: Any,
    ) -> None:
        ranks = int(user_args.get("tensor_parallel_size", 1))
        # The engine core runs in this process, so that user hook functions and captured tensors
        # need no serialisation on one device. Read by vLLM when the engine is built.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        graph_hooks = any(name.hook for name in graph_names)
        args = prepare_engine(user_args, bool(graph_names), graph_hooks)
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
            self._llm: Any = LLM(model=model_path, **with_graph_args(args, graph_args))
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

    @property
    def llm(self) -> Any:
        """vLLM's ``LLM``; gone once the engine is closed."""
        if self._llm is None:
            raise RuntimeError(
                "this model was closed (model.close()) and its engine shut down; load it again "
                "with HookedVLLM.from_pretrained"
            )
        return self._llm

    def close(self) -> None:
        """Shut vLLM's engine down (its workers, KV cache and weights go with it); later calls
        raise. Closing twice does nothing."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in."""
        return self.llm.model_config.dtype

    # ---- requests ----------------------------------------------------------------------------

    def run(
        self, prompts: list[list[int]], plans: list[RequestPlan], params: Any, device: str = "cpu"
    ) -> Run:
        """Submit ``prompts`` together, each followed by its plan, with sampling ``params`` (one
        ``SamplingParams``, or one per prompt, alike but for per-prompt fields); the kept values
        come back on ``device``. A failure in one request's hooks is raised after
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

    def check_whole_prefill(self, prompts: list[list[int]], plans: list[RequestPlan]) -> None:
        """Refuse, before anything runs, a call whose hook functions shared by its prompts need
        the call's prefill in one engine step (TransformerLens calls them once with the whole
        padded batch) where vLLM could not schedule it so: more prompts, or more tokens, than
        one step takes, or more KV-cache blocks than the engine has. Names the settings that
        make it fit."""
        if not any(plan.batch_hooked for plan in plans):
            return
        config = self.llm.llm_engine.vllm_config
        scheduler, cache = config.scheduler_config, config.cache_config
        tokens = sum(len(prompt) for prompt in prompts)
        short = []
        if len(prompts) > scheduler.max_num_seqs:
            short.append(f"max_num_seqs >= {len(prompts)} (it has {scheduler.max_num_seqs})")
        if tokens > scheduler.max_num_batched_tokens:
            short.append(f"max_num_batched_tokens >= {tokens} (it has "
                         f"{scheduler.max_num_batched_tokens})")
        blocks = cache.num_gpu_blocks
        needed = sum(-(-len(prompt) // cache.block_size) for prompt in prompts)
        if blocks is not None and needed > blocks:
            short.append(f"a KV cache of at least {needed} blocks of {cache.block_size} tokens "
                         f"(it has {blocks}: raise kv_cache_memory_bytes or "
                         f"gpu_memory_utilization)")
        if short:
            raise ValueError(
                f"this call's {len(prompts)} prompt(s) ({tokens} tokens) cannot prefill in one "
                f"engine step, and a hook function shared by its prompts (fwd_hooks, add_hook) "
                f"sees them as one batch, as TransformerLens's does. Load the model with "
                f"{', '.join(short)}; or pass fewer prompts per call; or give the function to "
                f"each prompt through prompt_hooks, if it treats each prompt alone"
            )

    def _run(
        self, prompts: list[list[int]], plans: list[RequestPlan], params: Any, device: str
    ) -> Run:
        from vllm.inputs import TokensPrompt

        self.check_whole_prefill(prompts, plans)

        call = next(_call_ids)
        tags = [f"{call}:{index}" for index in range(len(prompts))]
        request_params, inputs = [], []
        each = params if isinstance(params, list) else [params] * len(prompts)
        params = each[0]
        for tag, plan, prompt, given in zip(tags, plans, prompts, each):
            # Shallow: vLLM deep-copies each request's parameters itself when it takes them in.
            own = copy.copy(given)
            own.extra_args = {**(given.extra_args or {}), TAG_KEY: tag}
            use = cache_use(plan)
            own.skip_reading_prefix_cache = skips_reading(own, use)
            request_params.append(own)
            salted = {} if use.salt is None else {"cache_salt": use.salt}
            inputs.append(TokensPrompt(prompt_token_ids=prompt, **salted))
        streamed = device == "cpu" and bool(params.max_tokens) and self.streams_to_host()
        if streamed:
            # kept rows are written into the host's cache as steps end
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
        the compiled engine's rows are on the host already, in memory this process maps from worker
        processes (:mod:`vlens.runtime.transfer.host_blocks`). Otherwise worker processes (whose results
        reach this process on the host: ``support.check_cache_device``) on a GPU of this machine
        keep it on their GPU and hand back CUDA IPC handles, which this process opens and copies
        once to the host (:mod:`vlens.runtime.transfer.shared_tensors`); else the worker copies it
        to the host and it crosses through shared memory."""
        on_gpu = not self.in_process and not streamed and self.hands_back_on_gpu()
        return Handback.of_ranks(self._on_workers("finish", tags, "cuda" if on_gpu else device))

    def streams_to_host(self) -> bool:
        """Whether the workers can write a call's kept rows into the host's cache as steps end: in
        this process, or (the compiled engine) in memory of worker processes that this process
        maps."""
        return self.in_process or (self.compiled and self.maps_worker_memory())

    def maps_worker_memory(self) -> bool:
        """Whether this process can take the workers' shared host memory as results (checked
        once with a small block; a ``/proc`` this process may not read, or page-locking that
        fails, rules it out). A worker on another machine passes: its rows are written into its
        own shared memory and cross pickled whole after the call."""
        if self._maps_workers is None:
            self._maps_workers = self._probe(
                "host_block_probe", "kept rows wait on the workers until the call ends, since "
                "this process cannot map their host memory"
            )
        return self._maps_workers

    def hands_back_on_gpu(self) -> bool:
        """Whether worker processes hand results back on their GPU: they run on CUDA devices of
        this machine, and this process opens a tensor one of them hands back (checked once)."""
        if self._gpu_handback is None:
            from vllm.platforms import current_platform

            parallel = self.llm.llm_engine.vllm_config.parallel_config
            self._gpu_handback = (
                current_platform.is_cuda()
                and parallel.distributed_executor_backend == "mp"
                and self._probe("gpu_probe", "results come back through shared memory, since "
                                "CUDA IPC failed here")
            )
        return self._gpu_handback

    def _probe(self, method: str, otherwise: str) -> bool:
        """Whether every worker's ``method`` hands this process ``arange(4)`` that it can read;
        where not, a warning says what happens ``otherwise``."""
        try:
            probes = self._on_workers(method)
            return all(torch.equal(probe, torch.arange(4.0)) for probe in probes)
        except Exception as failure:
            logger.warning("vlens: %s: %r", otherwise, failure)
            return False

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
        through a prefill and a decode step (:mod:`vlens.runtime.sites.probe`)."""
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
        it has none to list (:mod:`vlens.runtime.sites.source`)."""
        return self._on_driver("operations", path)

    def clear_contexts(self) -> None:
        """Forget every hook's ``hook.ctx`` on every rank."""
        self._on_workers("clear_contexts")

    def splice(
        self, key: str, site: Site, read: Reader, sae: SAE | None, use_error_term: bool
    ) -> None:
        """Splice ``sae`` in at ``site`` on every rank (None: take the SAE there out), as
        ``key`` (:mod:`vlens.runtime.sites.splices`)."""
        self._on_workers("splice", key, site, read, sae, use_error_term)

    # ---- the route to the workers ------------------------------------------------------------

    def _on_workers(self, method: str, *args: Any) -> list[Any]:
        """Call ``WorkerRuntime.<method>(*args)`` on every worker; one result per rank.

        A worker in this thread gets the arguments as they are. Worker processes get the name
        of vlens's worker method (:class:`vlens.runtime.worker.WorkerExtension`) and the arguments
        as bytes that vlens cloudpickles here and unpickles there (user hook functions are often
        closures), so vLLM's own channels carry only a string and bytes and need no
        ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Their results come back the same way, large
        tensors through shared memory or as CUDA IPC handles (:mod:`vlens.runtime.transfer.shared_tensors`).
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
