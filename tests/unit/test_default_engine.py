"""Which engine ``HookedVLLM.from_pretrained(path)`` gives without compiled names: on a GPU the
compiled one with hook functions at every name, where the architecture's compiled engine is
offered and ``enforce_eager=True`` is not asked for; on vLLM's CPU backend the eager one."""

from __future__ import annotations

import dataclasses

import pytest

from vlens.engine import arguments
from vlens.mappings import served
from vlens.names.compiled import every_name
from vlens.names.mapping import DEFAULT_GRAPH


@pytest.mark.parametrize(("cpu", "user_args", "offered", "expected"), [
    (False, {}, True, True),
    (False, {"enforce_eager": False}, True, True),
    (False, {"enforce_eager": True}, True, False),
    (False, {}, False, False),
    (False, {}, "when declared", False),
    (True, {}, True, False),
])
def test_the_default_engine_runs_hooks_in_the_graph_on_a_gpu_only(
    monkeypatch, cpu, user_args, offered, expected
) -> None:
    """``offered``: the mapping's compiled engine, or "when declared" (it says why a GPU's
    default engine is not it)."""
    monkeypatch.setattr(arguments, "on_cpu", lambda: cpu)
    mapping = dataclasses.replace(served()["LlamaForCausalLM"], compiled_graph=bool(offered))
    if offered == "when declared":
        mapping = dataclasses.replace(mapping, not_offered={DEFAULT_GRAPH: "not yet run on CUDA"})
    assert arguments.hooks_in_graph_by_default(mapping, user_args) is expected


def test_the_transformers_backend_keeps_a_gpus_default_engine_eager_until_run_on_cuda() -> None:
    mapping = served()["GPTNeoXForCausalLM"]
    assert mapping.compiled_graph and DEFAULT_GRAPH in mapping.not_offered


def test_the_default_engine_declares_every_name() -> None:
    assert every_name("blocks.0.attn.hook_pattern") and every_name("hook_embed")


@pytest.mark.parametrize(("cpu", "cuda", "expected"), [
    (True, False, {}),
    (False, True, {"attention_config": {"flash_attn_version": 2}}),
    (False, False, {}),
])
def test_an_architecture_gets_the_engine_arguments_its_platform_needs(monkeypatch, cpu, cuda, expected):
    """BLOOM's ALiBi needs FlashAttention 2 on CUDA; the user's arguments override the
    architecture's (``{**architecture_args(mapping), **user_args}``)."""
    monkeypatch.setattr(arguments, "on_cpu", lambda: cpu)
    monkeypatch.setattr(arguments, "on_cuda", lambda: cuda)
    assert arguments.architecture_args(served()["BloomForCausalLM"]) == expected
    transformers_backend = arguments.architecture_args(served()["GPTNeoXForCausalLM"])
    assert transformers_backend == {"model_impl": "transformers"}
