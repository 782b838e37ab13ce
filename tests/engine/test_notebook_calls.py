"""The model calls of TransformerLens's demo notebooks (``demos/Main_Demo.ipynb``,
``demos/Exploratory_Analysis_Demo.ipynb``), written out as tests: each computes what the
notebook computes, on vlens and on TransformerLens's bridge of the same checkpoint, and the two
agree. (``tools/notebooks/run_notebook.py`` runs the notebooks themselves from a snapshot.)

Tiny checkpoints tokenize names into several tokens, so answers are token ids here."""

from __future__ import annotations

from functools import partial

import einops
import pytest
import torch
import transformer_lens.utilities as utils

from vlens import HookedVLLM

CLOSE = {"rtol": 1e-4, "atol": 1e-4}
CLEAN = "After John and Mary went to the store, Mary gave a bottle of milk to"
ANSWERS = (43, 46)  # (correct, incorrect) token ids


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def models(request, hooked, bridge) -> tuple[HookedVLLM, object]:
    return hooked(request.param), bridge(request.param)


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, ANSWERS[0]] - logits[:, -1, ANSWERS[1]]).mean()


def test_main_demo_loss_cache_and_ablation(models):
    """Cells 9-14: a text's loss, a cache without its batch axis, a cache stopped after layer 0,
    and a value-head ablation's loss."""
    model, bridge = models
    for each in (model, bridge):
        each.reset_hooks()
    torch.testing.assert_close(
        model(CLEAN, return_type="loss"), bridge(CLEAN, return_type="loss"), **CLOSE
    )
    tokens = model.to_tokens(CLEAN)
    assert torch.equal(tokens, bridge.to_tokens(CLEAN))
    _, cache = model.run_with_cache(tokens, remove_batch_dim=True)
    _, stopped = model.run_with_cache(
        tokens, remove_batch_dim=True, stop_at_layer=1, names_filter=["blocks.0.attn.hook_pattern"]
    )
    assert torch.allclose(stopped["blocks.0.attn.hook_pattern"], cache["pattern", 0])

    def head_ablation_hook(value, hook):
        value[:, :, 1, :] = 0.0
        return value

    ablation = [(utils.get_act_name("v", 0), head_ablation_hook)]
    torch.testing.assert_close(
        model.run_with_hooks(tokens, return_type="loss", fwd_hooks=ablation),
        bridge.run_with_hooks(tokens, return_type="loss", fwd_hooks=ablation),
        **CLOSE,
    )


def residual_stream_patching(model, clean_cache, corrupted_tokens) -> torch.Tensor:
    """Main_Demo cell 16, as written there (one patched forward per layer and position)."""

    def residual_stream_patching_hook(resid_pre, hook, position):
        resid_pre[:, position, :] = clean_cache[hook.name][:, position, :]
        return resid_pre

    positions = corrupted_tokens.shape[1]
    result = torch.zeros((model.cfg.n_layers, positions), device=model.cfg.device)
    for layer in range(model.cfg.n_layers):
        for position in range(positions):
            hook = partial(residual_stream_patching_hook, position=position)
            patched = model.run_with_hooks(
                corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook)]
            )
            result[layer, position] = logit_diff(patched)
    return result


def test_main_demo_residual_stream_patching(models):
    model, bridge = models
    results = []
    for each in (model, bridge):
        clean_tokens = each.to_tokens(CLEAN)
        corrupted_tokens = clean_tokens.clone()
        corrupted_tokens[0, 5] = ANSWERS[1]  # one token swapped, as the notebook swaps a name
        _, clean_cache = each.run_with_cache(clean_tokens)
        results.append(residual_stream_patching(each, clean_cache, corrupted_tokens))
    torch.testing.assert_close(results[0], results[1], **CLOSE)


def induction_scores(model, repeated_tokens, seq_len: int) -> torch.Tensor:
    """Main_Demo cell 19: a hook on every layer's pattern, over a batch of repeated tokens."""
    store = torch.zeros((model.cfg.n_layers, model.cfg.n_heads), device=model.cfg.device)

    def induction_score_hook(pattern, hook):
        stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
        store[hook.layer(), :] = einops.reduce(stripe, "batch head pos -> head", "mean")

    model.run_with_hooks(
        repeated_tokens,
        return_type=None,
        fwd_hooks=[(lambda name: name.endswith("pattern"), induction_score_hook)],
    )
    return store


def test_main_demo_induction_on_repeated_tokens(models):
    """Cells 18-19: per-position loss of repeated random tokens, and induction scores."""
    model, bridge = models
    seq_len = 12
    random_tokens = torch.randint(100, 400, (4, seq_len), generator=torch.Generator().manual_seed(0))
    repeated = einops.repeat(random_tokens, "batch seq -> batch (2 seq)").to(model.cfg.device)
    ours = model.loss_fn(model(repeated), repeated, per_token=True)
    theirs = bridge.loss_fn(bridge(repeated), repeated, per_token=True)
    torch.testing.assert_close(ours, theirs, **CLOSE)
    torch.testing.assert_close(
        induction_scores(model, repeated, seq_len), induction_scores(bridge, repeated, seq_len), **CLOSE
    )


def test_main_demo_weights_and_circuits(models):
    """Cells 26-51: the unembedding bias, tokens as strings, OV circuits as FactoredMatrix."""
    model, bridge = models
    torch.testing.assert_close(model.unembed.b_U, bridge.unembed.b_U)
    assert model.to_string(256) == bridge.to_string(256)
    assert model("Hello World", prepend_bos=False).shape == bridge("Hello World", prepend_bos=False).shape
    ours = (model.embed.W_E @ model.OV @ model.unembed.W_U).eigenvalues
    theirs = (bridge.embed.W_E @ bridge.OV @ bridge.unembed.W_U).eigenvalues
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)  # eigensolver on fp32


def ioi_batch(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Exploratory_Analysis_Demo cells 6-18: clean prompts and their pairs swapped. The slot
    takes words that are one token on this tokenizer, so that every prompt has one length."""
    template = "When John and Mary went to the shops,{} gave the bag to"
    candidates = [" the", " a", " to", " and", " of", " in", " is", " it"]
    words = [w for w in candidates if len(model.to_tokens(w, prepend_bos=False)[0]) == 1][:4]
    prompts = [template.format(word) for word in words]
    corrupted = [prompts[i + 1 - 2 * (i % 2)] for i in range(len(prompts))]
    return model.to_tokens(prompts, prepend_bos=True), model.to_tokens(corrupted, prepend_bos=True)


def test_exploratory_demo_attribution_and_patching(models):
    """The logit lens of the residual stream, per-head attribution, and patching of residual
    streams and head outputs with the notebook's own hooks (whole-batch clean values)."""
    model, bridge = models
    results = []
    for each in (model, bridge):
        tokens, corrupted = ioi_batch(each)
        assert tokens.shape == corrupted.shape == (4, tokens.shape[1])
        logits, cache = each.run_with_cache(tokens)
        direction = each.tokens_to_residual_directions(torch.tensor(ANSWERS))
        direction = direction[0] - direction[1]
        accumulated = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
        lens = cache.apply_ln_to_stack(accumulated, layer=-1, pos_slice=-1) @ direction
        heads = cache.stack_head_results(layer=-1, pos_slice=-1)
        per_head = cache.apply_ln_to_stack(heads, layer=-1, pos_slice=-1) @ direction

        def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):
            clean_value = clean_cache[hook.name][:, :, head_index, :].clone()
            corrupted_head_vector = corrupted_head_vector.clone()
            corrupted_head_vector[:, :, head_index : head_index + 1, :] = clean_value.unsqueeze(2)
            return corrupted_head_vector

        patched_heads = torch.zeros(each.cfg.n_layers, each.cfg.n_heads)
        for layer in range(each.cfg.n_layers):
            for head in range(each.cfg.n_heads):
                hook = partial(patch_head_vector, head_index=head, clean_cache=cache)
                patched = each.run_with_hooks(
                    corrupted, fwd_hooks=[(utils.get_act_name("z", layer, "attn"), hook)]
                )
                patched_heads[layer, head] = logit_diff(patched)
        results.append((logit_diff(logits), lens, per_head, patched_heads))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, **CLOSE)


@pytest.mark.slow
def test_ioi_patching_on_smollm2(smollm2, bridge_smollm2):
    """Main_Demo's IOI residual patching on the real model the notebooks were run with here."""
    results = []
    for each in (smollm2, bridge_smollm2):
        clean_tokens = each.to_tokens(CLEAN)
        corrupted_tokens = each.to_tokens(CLEAN.replace("Mary gave", "John gave"))
        _, clean_cache = each.run_with_cache(clean_tokens)

        def hook(resid_pre, hook, position):
            resid_pre[:, position, :] = clean_cache[hook.name][:, position, :]
            return resid_pre

        john, mary = each.to_single_token(" John"), each.to_single_token(" Mary")
        row = []
        for position in range(clean_tokens.shape[1]):
            patched = each.run_with_hooks(
                corrupted_tokens,
                fwd_hooks=[("blocks.6.hook_resid_pre", partial(hook, position=position))],
            )
            row.append(patched[0, -1, john] - patched[0, -1, mary])
        results.append(torch.stack(row))
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-3)
