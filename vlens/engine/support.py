"""What vlens can and cannot serve, checked where the user can act on it: when a model loads
(engine arguments, parallelism, compiled names) and when a call asks for something the engine
was not built for. Each refusal names the reason and what to do instead."""

from __future__ import annotations

from typing import Any

from vlens.names.mapping import ArchitectureMapping

#: How to get an engine that runs any Python hook function on any name.
EAGER = "HookedVLLM.from_pretrained(path) without compiled names (eager mode)"

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
#: part of one is refused (:func:`vlens.runtime.hooks.refuse_part_of_a_prefill`).
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
            "own (vlens.runtime.graph_worker, which traces the declared names into the graph "
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
            f"tensor_parallel_size={parallel}: the {architecture} mapping does not yet mark the "
            f"values vLLM splits over ranks; run it with tensor_parallel_size=1"
        )
    if not compiled:
        return
    if not mapping.compiled_graph:
        raise NotImplementedError(
            f"compiled names are not offered for {architecture} yet: its mapping does not mark "
            f"its names as verified to read the same traced into vLLM's graph as in eager mode "
            f"(ArchitectureMapping.compiled_graph); load it without "
            f"compiled_capture/compiled_steering (eager mode)"
        )


def model_impl_args(mapping: ArchitectureMapping) -> dict[str, Any]:
    """The ``model_impl`` engine argument the mapping's module tree needs (none for vLLM's own)."""
    return {} if mapping.model_impl == "auto" else {"model_impl": mapping.model_impl}


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


def check_raw_location(name: str, compiled: bool, tensor_parallel_size: int) -> None:
    """Raw module locations need hooks added after loading, on one rank's whole values."""
    if compiled:
        raise ValueError(
            f"{name}: raw module locations need {EAGER} (a compiled engine's forward is a traced "
            f"graph; it runs no hooks added after loading)"
        )
    if tensor_parallel_size > 1:
        raise NotImplementedError(
            f"{name}: raw locations are not yet available under tensor parallelism (each rank "
            f"holds its own slice of many modules' values); use canonical names"
        )


def check_cache_device(device: Any, tensor_parallel_size: int) -> None:
    """Under tensor parallelism values reach the user's process from another one, on the CPU."""
    if device.type != "cpu" and tensor_parallel_size > 1:
        raise NotImplementedError(
            f"device={str(device)!r}: under tensor parallelism values come back through "
            f"another process, on the CPU; leave device out"
        )


def refuse_gradients(what: str) -> None:
    """vLLM computes no gradients: say what to use for gradient-based methods."""
    raise NotImplementedError(
        f"{what}: vLLM runs inference only (no autograd graph, no backward pass), so gradients, "
        f"backward hooks and attribution patching are not available. Run those on "
        f"TransformerLens's TransformerBridge over HuggingFace; activation patching (forward "
        f"hooks only) runs here, batched: vlens.patching"
    )


#: What vLLM adds to its default ``splitting_ops`` (a string argument of theirs would otherwise
#: keep Inductor from reusing one compiled piece for every layer).
KV_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")


def hook_site_compilation(user_config: Any) -> dict[str, Any]:
    """vLLM's compilation config for an engine whose graph runs hook functions: the hook sites'
    ops (:mod:`vlens.runtime.hook_sites`) among the ops the graph is split at, beside vLLM's own
    (attention), so that vLLM captures the pieces between them as CUDA graphs and runs the ops
    eagerly in between. Any CUDA graph mode: full graphs break at the ops
    (:mod:`vlens.runtime.graph_breaks`)."""
    from vllm.config import CompilationConfig

    from vlens.runtime.hook_sites import CALL_OP, OP

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
