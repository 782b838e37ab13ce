"""The user's side of the link to vLLM: building the engine and talking to its workers.

Everything the facade asks of the worker runtime goes through :meth:`Engine.on_workers`, i.e.
``LLM.collective_rpc``: in-process today, vLLM's own worker processes under tensor parallelism.
"""

from __future__ import annotations

import os
from typing import Any

from vlens.process_groups import ensure_expert_group

# Read by vLLM when the engine is built: the engine core runs in this process, so that user hook
# functions and captured tensors need no serialisation on one device.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Engine arguments vlens sets unless the user does; each has a reason in ``REQUIRED``.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True, "enable_prefix_caching": False}

REQUIRED = {
    "enforce_eager": "vlens's sites are Python forward hooks, which fire only in eager mode",
    "enable_prefix_caching": "a prefix-cache hit skips the forward over cached prompt tokens, "
    "so their activations would silently be missing",
}


def engine_args(user_args: dict[str, Any]) -> dict[str, Any]:
    """The user's engine arguments with vlens's defaults, refusing the ones vlens cannot honour."""
    args = {**DEFAULT_ENGINE_ARGS, **user_args}
    for key, needed in DEFAULT_ENGINE_ARGS.items():
        if args[key] != needed:
            raise ValueError(f"{key}={args[key]!r} is not supported: {REQUIRED[key]}.")
    return args


class Engine:
    """An in-process vLLM ``LLM`` plus the route to each worker's vlens runtime."""

    def __init__(self, model_path: str, **user_args: Any) -> None:
        if _on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        ensure_expert_group()
        self.llm = LLM(model=model_path, **engine_args(user_args))

    def on_workers(self, method: str, *args: Any) -> list[Any]:
        """Call ``WorkerRuntime.<method>(*args)`` on every worker; one result per rank."""
        from vlens.runtime.worker import call_runtime

        return self.llm.collective_rpc(call_runtime, args=(method, *args))

    def on_driver(self, method: str, *args: Any) -> Any:
        """Like :meth:`on_workers`, keeping rank 0's result (every rank returns whole values)."""
        return self.on_workers(method, *args)[0]


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
