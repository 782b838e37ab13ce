"""Gemma's attention (soft-capped logits, sliding windows on some layers), its scaled embedding and
post-sublayer norms: scores rebuilt as the layer computes them, edits reaching the model as the
same edit in HuggingFace does, and hooks refused where vlens cannot form the value."""

import functools

import pytest
import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoTokenizer

from vlens.parity.compare import PROMPTS
from vlens.parity.reference import load_hf
from vlens.runtime.attention.arithmetic import causal_scores
from vlens.runtime.vocabulary.readers import LogitsOf, OutputOf
from vlens.testing.tiny import tiny_model

TEXT = "The river ran past the old mill, and every morning the miller opened the gates"


def test_scores_are_soft_capped_then_masked_to_the_window():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 2, 4, generator=generator), torch.randn(6, 1, 4, generator=generator)
    scores = causal_scores(q, k, 2.0, 0, soft_cap=1.5, window=3)
    raw = torch.einsum("qhd,khd->hqk", q, k.expand(-1, 2, -1)) * 2.0
    query, key = torch.arange(6)[:, None], torch.arange(6)[None, :]
    seen = (key <= query) & (key > query - 3)
    expected = (torch.tanh(raw / 1.5) * 1.5).masked_fill(~seen, float("-inf"))
    torch.testing.assert_close(scores, expected)
    # Query rows that start later see the same window, counted from their own positions.
    torch.testing.assert_close(
        causal_scores(q[4:], k, 2.0, 4, soft_cap=1.5, window=3), expected[:, 4:]
    )


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_parity_prompts_outrun_the_sliding_window(arch):
    """The parity suite checks windowed layers only where a prompt is longer than the window."""
    config = AutoConfig.from_pretrained(tiny_model(arch))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(arch))
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    longest = max(len(tokenizer(text)["input_ids"]) for text in PROMPTS)
    assert longest > 2 * config.sliding_window


def test_gemma2_scores_and_patterns_refuse_hooks_with_the_reason(hooked):
    model = hooked("gemma2")
    for name in ("blocks.0.attn.hook_pattern", "blocks.1.attn.hook_attn_scores"):
        with pytest.raises(ValueError, match="soft-caps its logits"):
            model.run_with_hooks(TEXT, fwd_hooks=[(name, lambda x, hook: x)])


def test_gemma1_pattern_hooks_run_the_explicit_attention(hooked):
    """Gemma 1's attention is plain causal attention: a hook on the pattern makes the worker
    compute the layer itself, which gives the model's own values."""
    model = hooked("gemma")
    name = "blocks.1.attn.hook_pattern"
    plain_logits, plain = model.run_with_cache(TEXT, names_filter=name)
    seen: list[Tensor] = []
    logits = model.run_with_hooks(TEXT, fwd_hooks=[(name, lambda x, hook: seen.append(x.clone()))])
    torch.testing.assert_close(seen[0], plain[name], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)


@functools.cache
def gemma2_huggingface() -> nn.Module:
    return load_hf(tiny_model("gemma2"))


def huggingface_module(model: nn.Module, name: str) -> nn.Module:
    """The HuggingFace module whose output is ``name`` in Gemma 2."""
    if name == "hook_embed":
        return model.model.embed_tokens
    layer = model.model.layers[int(name.split(".")[1])]
    if name.endswith("hook_attn_out"):
        return layer.post_attention_layernorm
    return layer.post_feedforward_layernorm


@pytest.mark.parametrize(
    "name", ["hook_embed", "blocks.1.hook_attn_out", "blocks.0.hook_mlp_out"]
)
def test_gemma2_edits_match_huggingface(hooked, name: str):
    model = hooked("gemma2")
    plain_logits, plain = model.run_with_cache(TEXT, names_filter=name)
    vector = torch.randn(plain[name].shape[1:], generator=torch.Generator().manual_seed(5))
    with model.hooks(fwd_hooks=[(name, lambda x, hook: x + vector)]):
        logits, edited = model.run_with_cache(TEXT, names_filter=name)
    torch.testing.assert_close(edited[name], plain[name] + vector)
    assert (plain_logits - logits).abs().max() > 1e-2, "the edit changed nothing"

    reference = gemma2_huggingface()
    handle = huggingface_module(reference, name).register_forward_hook(
        lambda module, args, output: output + vector
    )
    try:
        with torch.no_grad():
            expected = reference(model.to_tokens(TEXT)).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits[0], expected[0], rtol=1e-4, atol=1e-4)


def test_logits_unembed_through_the_embedding_where_the_model_has_no_lm_head():
    """vLLM's Gemma 2 (and Gemma in vLLM 0.26) always tie the unembedding and build no
    ``lm_head``; a model that has one unembeds through it."""
    embedding, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    tied = nn.Module()
    tied.model = nn.Module()
    tied.model.embed_tokens = embedding
    assert LogitsOf(OutputOf()).unembedding(tied) is embedding
    tied.lm_head = head
    assert LogitsOf(OutputOf()).unembedding(tied) is head
