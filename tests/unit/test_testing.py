"""Tiny checkpoints: deterministic, loadable by transformers, with a working offline tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from vlens.mappings._tiny import BOS_ID, EOS_ID, VOCAB_SIZE
from vlens.testing.tiny import ARCHS, EVERY_ARCH, sweep, tiny_model

SENTENCE = "Hello world, this is a sentence about Zürich's 42 bridges!"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache shared by the module's tests, so that each arch is built once."""
    return tmp_path_factory.mktemp("vlens-cache")


@pytest.fixture
def built(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """``tiny_model`` pointed at the shared test cache."""
    monkeypatch.setenv("VLENS_CACHE", str(cache_dir))
    return tiny_model


def test_unknown_arch_is_rejected(built) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        built("mamba")


def test_second_call_reuses_the_folder(built) -> None:
    first = built("llama")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert built("llama") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name == "llama-seed0-v1"
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")], "temp dir left over"


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_same_seed_gives_identical_bytes(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folders = []
    for name in ("a", "b"):
        monkeypatch.setenv("VLENS_CACHE", str(tmp_path / name))
        folders.append(tiny_model(arch))
    for file in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (folders[0] / file).read_bytes() == (folders[1] / file).read_bytes(), file


def test_other_seed_gives_other_weights(built) -> None:
    a = load_file(built("gpt2", seed=0) / "model.safetensors")
    b = load_file(built("gpt2", seed=1) / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["transformer.wte.weight"], b["transformer.wte.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips(built, arch: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built(arch))
    ids = tokenizer(SENTENCE).input_ids
    assert tokenizer.decode(ids) == SENTENCE
    assert max(ids) < VOCAB_SIZE and len(ids) < len(SENTENCE.encode())  # merges were learned
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    assert len(tokenizer) == VOCAB_SIZE


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_outputs_are_not_degenerate(built, arch: str) -> None:
    folder = built(arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.vocab_size == VOCAB_SIZE
    assert next(model.parameters()).dtype == torch.float32
    ids = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.std(dim=-1).min() > 0.1, "flat logits"
    assert logits.argmax(dim=-1).unique().numel() > 3, "same prediction everywhere"


def test_deepseek_configs_carry_what_vllm_reads(built) -> None:
    v3 = json.loads((built("deepseek_v3") / "config.json").read_text())
    assert (v3["topk_method"], v3["scoring_func"], v3["q_lora_rank"]) == ("noaux_tc", "sigmoid", 64)
    assert (v3["kv_lora_rank"], v3["qk_rope_head_dim"], v3["first_k_dense_replace"]) == (512, 64, 1)
    v2 = json.loads((built("deepseek_v2") / "config.json").read_text())
    assert v2["q_lora_rank"] is None and v2["topk_method"] == "group_limited_greedy"
    weights = load_file(built("deepseek_v3") / "model.safetensors")
    bias = weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0, "router correction bias left at zero"
    assert "model.layers.0.mlp.gate.weight" not in weights, "layer 0 must stay dense"


def test_a_sweep_runs_its_chosen_architectures_or_every_one(monkeypatch: pytest.MonkeyPatch):
    every = ("llama", "gpt2", "qwen3")
    chosen = {"gpt2": "Conv1D"}
    monkeypatch.delenv(EVERY_ARCH, raising=False)
    assert sweep(every, chosen) == ("gpt2",)
    monkeypatch.setenv(EVERY_ARCH, "1")
    assert sweep(every, chosen) == every
    with pytest.raises(ValueError, match=r"\['bloom'\] are not in this sweep"):
        sweep(every, {"bloom": "ALiBi"})
