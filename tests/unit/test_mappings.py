"""The mapping registry: mapping files are found by scanning the package, a new one needs no
other edit, and an unserved architecture gets an error that says what to do."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig, MistralConfig, PretrainedConfig

import vlens.mappings
from vlens.mappings import llama, mapping_for, mapping_modules, served
from vlens.mappings._tiny import architecture_of
from vlens.names.mapping import NoExplicitAttention
from vlens.names.tl_versions import HAS_BRIDGE
from vlens.parity.__main__ import default_models
from vlens.parity.reference import recorder_for
from vlens.testing import tiny as testing
from vlens.testing.names_table import names_table

NEW_MAPPING = '''
from transformers import LlamaConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims


def tiny_config():
    return LlamaConfig(**rotary_dims(), architectures=["MyLlamaForCausalLM"])


MAPPING = llama.MAPPING.member("MyLlamaForCausalLM", tiny_configs={TINY: tiny_config})
'''


@pytest.fixture
def extra_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``extra_mapping(module, tiny_name)``: a mapping file written into a folder added to the
    mappings package's path (not the package's own folder, which other processes read); the
    path entry and the imported modules are gone after the test."""
    written = []

    def write(module: str, tiny_name: str) -> None:
        (tmp_path / f"{module}.py").write_text(NEW_MAPPING.replace("TINY", repr(tiny_name)))
        path = vlens.mappings.__path__
        if str(tmp_path) not in path:
            monkeypatch.setattr(vlens.mappings, "__path__", [*path, str(tmp_path)])
        importlib.invalidate_caches()
        written.append(module)

    yield write
    for module in written:
        sys.modules.pop(f"vlens.mappings.{module}", None)
        if hasattr(vlens.mappings, module):
            delattr(vlens.mappings, module)


def config_of(architecture: str) -> PretrainedConfig:
    return LlamaConfig(architectures=[architecture])


@pytest.mark.skipif(not HAS_BRIDGE, reason="the names table lists the Transformers backend's "
                    "architectures, named by TransformerLens 4's adapters")
def test_a_new_mapping_file_is_found_with_no_other_edit(extra_mapping):
    assert "MyLlamaForCausalLM" not in served()
    extra_mapping("my_llama", "my_llama")
    mapping = mapping_for(config_of("MyLlamaForCausalLM"))
    assert mapping is mapping_modules()["my_llama"]
    assert mapping.hook_specs is llama.hook_specs and mapping.weights is llama.WEIGHTS
    assert "my_llama" in testing.ARCHS and "my_llama" in testing.CONFIG_BUILDERS
    assert "my_llama" in default_models()
    assert recorder_for("MyLlamaForCausalLM") is recorder_for("LlamaForCausalLM")
    header = names_table().splitlines()[0]  # one column for the family's identical names
    column = next(cell for cell in header.split("|") if "`LlamaForCausalLM`" in cell)
    assert "`MyLlamaForCausalLM`" in column


def test_a_name_declared_twice_names_both_files(extra_mapping):
    extra_mapping("other_llama", "llama")
    with pytest.raises(ValueError, match=r"mappings/llama\.py and mappings/other_llama\.py"):
        testing.tiny_configs()
    with pytest.raises(ValueError, match="declared by"):
        testing.tiny_model("llama")
    extra_mapping("third_llama", "third_llama")  # the same architecture as other_llama.py
    with pytest.raises(ValueError, match=r"other_llama\.py and mappings/third_llama\.py"):
        mapping_for(config_of("LlamaForCausalLM"))


def test_every_tiny_model_is_served_by_the_file_that_declares_it():
    for module, mapping in mapping_modules().items():
        assert mapping.hf_recorder is not None, module
        for name in mapping.tiny_configs:
            config = AutoConfig.from_pretrained(testing.tiny_model(name))
            assert mapping_for(config) is mapping, (module, name)
            assert architecture_of(config) in mapping.architectures


@pytest.mark.parametrize(
    ("architecture", "nearest", "vllm"),
    [
        # vLLM builds Ministral-3 with its MistralForCausalLM class
        ("Ministral3ForCausalLM", "MistralForCausalLM (mappings/mistral.py)", "natively"),
        # vLLM's Llama4ForCausalLM derives from its LlamaForCausalLM
        ("Llama4ForCausalLM", "LlamaForCausalLM (mappings/llama.py)", "natively"),
        ("OlmoForCausalLM", "", 'through its Transformers backend (model_impl="transformers")'),
        ("Qwen3NewForCausalLM", "Qwen3ForCausalLM", "lists no implementation"),
    ],
)
def test_an_unserved_architecture_names_its_nearest_family(architecture, nearest, vllm):
    with pytest.raises(NotImplementedError) as error:
        mapping_for(config_of(architecture))
    message = str(error.value)
    assert f"vlens has no mapping for {architecture}. Nearest served family: {nearest}" in message
    new_file = architecture.removesuffix("ForCausalLM").lower()
    assert f"write one file, mappings/{new_file}.py" in message and ".MAPPING.member(" in message
    assert vllm in message


def test_a_sliding_window_leaves_out_scores_and_patterns():
    full = llama.hook_specs(MistralConfig(sliding_window=None, max_position_embeddings=512))
    windowed = llama.hook_specs(MistralConfig(sliding_window=64, max_position_embeddings=512))
    assert set(full) - set(windowed) == {
        "blocks.{layer}.attn.hook_attn_scores", "blocks.{layer}.attn.hook_pattern"
    }
    assert isinstance(windowed["blocks.{layer}.attn.hook_result"].hookable, NoExplicitAttention)
    mapping = served()["MistralForCausalLM"]
    assert "sliding window" in mapping.unavailable("blocks.0.attn.hook_pattern")
    assert mapping.unavailable("blocks.0.attn.hook_z") is None
    # A window as long as the context changes nothing.
    whole = MistralConfig(sliding_window=512, max_position_embeddings=512)
    assert set(llama.hook_specs(whole)) == set(full)


@pytest.mark.parametrize(("version", "keys"), [("0.26.0", 8), ("0.28.0", 8), ("0.29.0", 9),
                                               ("0.32.0", 9), ("0.33.1.dev4+cpu", 9)])
def test_cohere2s_window_is_the_one_the_installed_vllm_attends_over(monkeypatch, version, keys):
    """vLLM 0.29 widened Cohere 2's sliding layers to ``sliding_window + 1`` keys; the rebuilt
    scores and the parity reference follow the vLLM that runs."""
    import vllm

    from vlens.mappings import cohere2

    monkeypatch.setattr(vllm, "__version__", version)
    config = cohere2.tiny_config()
    assert cohere2.window_keys(config) == keys
    assert cohere2.layer_windows(config) == (keys, None, keys)
