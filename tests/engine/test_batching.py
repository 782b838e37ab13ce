"""Per-request narrowing: a prompt's values do not depend on what it was batched with, and values
kept by the user are their own (vLLM reuses its buffers in place)."""

import pytest
import torch

TEXTS = ["A short one", "A much longer prompt that runs on for quite a few more tokens", "Mid size"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_mixed_batch_equals_each_prompt_alone(hooked, arch: str):
    model = hooked(arch)
    batch_logits, batch = model.run_with_cache(TEXTS)
    for index, text in enumerate(TEXTS):
        logits, alone = model.run_with_cache(text)
        length = alone.lengths[0]
        assert batch.lengths[index] == length
        # Batched and solo steps run different GEMM shapes on the CPU backend, which may round
        # differently; 1e-5 relative is far below a wrong-row mistake (errors of order 1).
        for name in model.hook_names:
            torch.testing.assert_close(
                batch.unpadded(name, index), alone[name][0], rtol=1e-5, atol=1e-5, msg=name
            )
        torch.testing.assert_close(batch_logits[index, :length], logits[0], rtol=1e-5, atol=1e-5)


def test_padding_is_zero_and_masked(hooked):
    model = hooked("llama")
    logits, cache = model.run_with_cache(TEXTS)
    lengths = [len(tokens) for tokens in model.token_lists(TEXTS)]
    assert cache.lengths.tolist() == lengths
    assert cache.attention_mask.sum(dim=1).tolist() == lengths
    short = lengths[0]
    assert torch.all(cache["blocks.1.hook_resid_post"][0, short:] == 0)
    assert torch.all(logits[0, short:] == 0)
    assert logits.shape == (3, max(lengths), model.cfg.d_vocab)


def test_kept_values_are_not_aliased(hooked):
    model = hooked("qwen3")
    _, first = model.run_with_cache("Values kept from the first call")
    kept = {name: first[name].clone() for name in first.keys()}
    storages = {first[name].untyped_storage().data_ptr() for name in first.keys()}
    assert len(storages) == len(kept), "two names share one buffer"
    model.run_with_cache(["Another call that reuses vLLM's buffers", "and a second prompt"])
    for name, value in kept.items():
        assert torch.equal(first[name], value), f"{name} changed after a later call"


def test_chunked_prefill_joins_chunks(hooked):
    """A prompt longer than one step's token budget is prefilled over several steps."""
    chunked = hooked("llama", max_num_batched_tokens=16, max_num_seqs=4)
    text = " ".join(["many words in a long prompt"] * 8)
    prompt = chunked.token_lists(text)[0]
    assert len(prompt) > 3 * 16
    logits, cache = chunked.run_with_cache(text)
    whole_logits, whole = hooked("llama").run_with_cache(text)
    for name in ("blocks.0.hook_resid_pre", "blocks.2.hook_resid_post", "ln_final.hook_scale"):
        torch.testing.assert_close(cache[name], whole[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, whole_logits, rtol=1e-5, atol=1e-5)


def test_dropping_one_engine_leaves_the_others_running(hooked):
    import gc

    from vlens import HookedVLLM
    from vlens.testing.tiny import tiny_model

    survivor = hooked("qwen3")
    doomed = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32", max_num_seqs=2)
    doomed.run_with_cache("short-lived")
    del doomed
    gc.collect()
    logits, _ = survivor.run_with_cache("still serving", names_filter=[])
    assert logits.shape[-1] == survivor.cfg.d_vocab
