"""Engine-level locations: each step's sampled logits per request, readable and editable for one
request only; finished requests on the result."""

import torch

TEXTS = ["Hello sampler", "Another prompt, a little longer"]


def test_sampled_logits_are_the_last_positions_logits(hooked):
    model = hooked("llama")
    names = ["sampler.hook_logits", "sampler.hook_tokens"]
    logits, cache = model.run_with_cache(TEXTS, names_filter=names, max_new_tokens=4)
    assert cache.sampled_lengths.tolist() == [4, 4]
    assert cache["sampler.hook_tokens"].shape == (2, 4)
    for i in range(2):
        prompt = int(cache.lengths[i]) - 3
        sampled = cache.unpadded("sampler.hook_logits", i)
        torch.testing.assert_close(sampled, logits[i, prompt - 1 : prompt + 3])
        tokens = cache.unpadded("sampler.hook_tokens", i).tolist()
        assert sampled.argmax(-1).tolist() == tokens  # greedy
        assert tokens[:3] == cache.tokens[i, prompt : prompt + 3].tolist()


def test_logit_hook_bans_tokens_for_one_request_only(hooked):
    model = hooked("llama")
    forced = 7

    def force(logits, hook):
        logits[...] = -1e9
        logits[..., forced] = 0.0

    results = model.generate(TEXTS, max_new_tokens=5, do_sample=False, return_type="result",
                             prompt_hooks=[[("sampler.hook_logits", force)], []])
    assert results[0].tokens == [forced] * 5
    alone = model.generate(TEXTS[1], max_new_tokens=5, do_sample=False, return_type="result")[0]
    assert results[1].tokens == alone.tokens
    assert results[1].text == model.to_string(alone.tokens)
    assert results[1].finish_reason == "length"
    assert results[1].prompt_tokens == model.token_lists(TEXTS[1])[0]


def test_sampled_tokens_cannot_carry_a_hook(hooked):
    import pytest

    with pytest.raises(ValueError, match="sampler.hook_tokens cannot carry a hook"):
        hooked("llama").add_hook("sampler.hook_tokens", lambda x, h: None)
