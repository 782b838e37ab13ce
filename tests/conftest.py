"""One engine per tiny architecture for the whole session: engines are the slow part."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from vlens import HookedVLLM
from vlens.engine.arguments import on_cpu
from vlens.names.compiled import every_name
from vlens.testing.tiny import tiny_model

#: A KV cache the size of what the tests run (vlens's CPU default is 1 GiB per engine, and the
#: session holds a few dozen engines).
TINY_KV_CACHE = {"kv_cache_memory_bytes": 64 * 2**20}


def engine_args_of_tests() -> dict[str, object]:
    """Engine arguments of every test engine: the tiny KV cache, and ``VLENS_TEST_ENGINE_ARGS``."""
    return {**TINY_KV_CACHE, **json.loads(os.environ.get("VLENS_TEST_ENGINE_ARGS", "{}"))}


@pytest.fixture
def mapped_references(monkeypatch) -> list[tuple]:
    """Every reference to a worker's shared host memory this process maps during the test
    (:func:`vlens.runtime.transfer.host_blocks.open_reference`): rows handed back uncopied."""
    from vlens.runtime.transfer import host_blocks

    mapped: list[tuple] = []
    opened = host_blocks.open_reference
    monkeypatch.setattr(host_blocks, "open_reference",
                        lambda reference, into: mapped.append(reference) or opened(reference, into))
    return mapped


@pytest.fixture(scope="session")
def engine_args() -> dict[str, object]:
    """:func:`engine_args_of_tests`, for tests that build engines of their own."""
    return engine_args_of_tests()


@pytest.fixture(scope="session")
def hooked() -> Callable[..., HookedVLLM]:
    """``hooked("qwen3", **engine_args)``: the session's fp32 engine for a tiny model, built
    once: engines are the slow part of the suite. Without compiled names or ``enforce_eager=True``
    it is the default engine (eager on the CPU; on a GPU compiled, with hook functions at every
    name). ``VLENS_TEST_ENGINE_ARGS`` (JSON) adds engine
    arguments to every engine, e.g. ``{"gpu_memory_utilization": 0.2}`` where two suites share
    a GPU. ``VLENS_TEST_GRAPH_HOOKS=1`` makes each eager engine a compiled one on which hook
    functions run at every name (``compiled_hooks``): the eager engine's hook tests then run
    on the graph's hook sites."""
    engines: dict[tuple, HookedVLLM] = {}
    extra = engine_args_of_tests()
    graph_hooks = os.environ.get("VLENS_TEST_GRAPH_HOOKS") == "1"

    def get(arch: str, **engine_args: object) -> HookedVLLM:
        eager = bool(engine_args.get("enforce_eager"))
        if graph_hooks and not eager and not any(key.startswith("compiled_") for key in engine_args):
            engine_args = {**engine_args, "compiled_hooks": every_name}
        if eager and on_cpu():  # the CPU's default engine is the eager one: the same engine
            engine_args = {key: value for key, value in engine_args.items() if key != "enforce_eager"}
        key = (arch, *sorted(engine_args.items()))
        if key not in engines:
            engines[key] = HookedVLLM.from_pretrained(
                tiny_model(arch), **{"dtype": "float32", **extra, **engine_args}
            )
        return engines[key]

    return get


@pytest.fixture(scope="session")
def graph_hooks_engine(hooked) -> Callable[[str], HookedVLLM]:
    """``graph_hooks_engine("llama")``: the session's compiled fp32 engine of a tiny model on which
    hook functions run at every name that can carry them (``compiled_hooks``), built once."""
    return lambda arch: hooked(arch, compiled_hooks=every_name)


@pytest.fixture(scope="session")
def bridge() -> Callable[[str], object]:
    """``bridge("llama")``: TransformerLens's ``TransformerBridge`` on the same tiny checkpoint
    as ``hooked("llama")`` (HuggingFace numerics, HookedTransformer names), built once."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    bridges: dict[str, object] = {}

    def get(arch: str) -> object:
        if arch not in bridges:
            booted = TransformerBridge.boot_transformers(
                str(tiny_model(arch)), device="cpu", dtype=torch.float32
            )
            booted.enable_compatibility_mode(no_processing=True)
            bridges[arch] = booted
        return bridges[arch]

    return get


@pytest.fixture(scope="session")
def smollm2() -> HookedVLLM:
    """The embedded SmolLM2-135M (a real trained model) in vLLM, fp32, built once."""
    from vlens.testing.embedded import smollm2_path

    return HookedVLLM.from_pretrained(
        smollm2_path(), dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 * 2**20
    )


@pytest.fixture(scope="session")
def bridge_smollm2() -> object:
    """TransformerLens's ``TransformerBridge`` on the embedded SmolLM2, built once."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    from vlens.testing.embedded import smollm2_path

    booted = TransformerBridge.boot_transformers(str(smollm2_path()), device="cpu", dtype=torch.float32)
    booted.enable_compatibility_mode(no_processing=True)
    return booted


@pytest.fixture(scope="session")
def clean_runs(hooked, bridge) -> Callable[..., tuple]:
    """``clean_runs(arch, clean, corrupted)``: the engine and TransformerLens's bridge of a tiny
    model, the prompts, and each side's cache of the clean prompts (for patching tests)."""
    import torch

    def run(arch: str, clean: object, corrupted: object) -> tuple:
        model, reference = hooked(arch), bridge(arch)
        _, cache = model.run_with_cache(clean)
        with torch.no_grad():
            _, reference_cache = reference.run_with_cache(clean)
        return model, reference, clean, corrupted, cache, reference_cache

    return run
