"""TransformerLens's batch semantics for hook functions shared by a call's prompts.

A hook function added with ``add_hook`` or given as ``fwd_hooks`` runs once per site and engine step
on the call's batch, ``[batch, pos, ...]`` in the prompts' order, wherever all the call's prompts
run together with rows alike (equal lengths); elsewhere per prompt, ``[1, pos, ...]``, and
``prompt_hooks`` always per prompt. TransformerLens's notebook patching code (its
Exploratory_Analysis_Demo: residual, head and pattern patching, indexing the clean cache's batch)
and ``transformer_lens.patching`` run unchanged on a vlens engine and equal TransformerLens's
``TransformerBridge`` on the same checkpoint (≤ 1e-4 relative). Prompts are token tensors.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import transformer_lens.patching as tl_patching
from torch import Tensor
from transformer_lens import utilities as utils

from vlens import HookError

BRIDGE_RTOL = 1e-4
BATCH, LENGTH = 4, 7
ANSWERS = torch.tensor([[3, 4], [7, 5], [11, 12], [20, 9]])  # (correct, incorrect) per prompt


def prompts(seed: int = 0) -> tuple[Tensor, Tensor]:
    """Four clean prompts of one length and their corrupted versions, BOS first."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(2, 500, (BATCH, LENGTH), generator=generator)
    clean[:, 0] = 0
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 500
    corrupted[:, LENGTH - 2] = (corrupted[:, LENGTH - 2] + 7) % 500
    return clean, corrupted


def logit_diff(logits: Tensor) -> Tensor:
    """The mean over prompts of correct minus incorrect logit at the last position."""
    final = logits[:, -1].gather(-1, ANSWERS.to(logits.device))
    return (final[:, 0] - final[:, 1]).mean()


def assert_close_relative(ours: Tensor, theirs: Tensor, rtol: float = BRIDGE_RTOL) -> None:
    assert ours.shape == theirs.shape
    scale = theirs.abs().max().clamp_min(1e-6)
    assert ((ours.cpu() - theirs.cpu()).abs().max() / scale).item() <= rtol


# ---- the notebook's hook functions, verbatim ------------------------------------------------------


def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):
    clean_value = clean_cache[hook.name][:, pos, :].clone()
    corrupted_residual_component = corrupted_residual_component.clone()
    corrupted_residual_component[:, pos : pos + 1, :] = clean_value.unsqueeze(1)
    return corrupted_residual_component


def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):
    clean_value = clean_cache[hook.name][:, :, head_index, :].clone()
    corrupted_head_vector = corrupted_head_vector.clone()
    corrupted_head_vector[:, :, head_index : head_index + 1, :] = clean_value.unsqueeze(2)
    return corrupted_head_vector


def patch_head_pattern(corrupted_head_pattern, hook, head_index, clean_cache):
    clean_value = clean_cache[hook.name][:, head_index, :, :].clone()
    corrupted_head_pattern = corrupted_head_pattern.clone()
    corrupted_head_pattern[:, head_index : head_index + 1, :, :] = clean_value.unsqueeze(1)
    return corrupted_head_pattern


# ---- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request, clean_runs):
    """The engine, TransformerLens's bridge, this module's prompts and each side's clean cache."""
    return clean_runs(request.param, *prompts())


def both_patched(setup, name: str, patch, **where) -> tuple[Tensor, Tensor, list]:
    """The corrupted batch's logits with ``patch`` on ``name`` on each side (each with its own
    clean cache), and what vlens's hook saw: (shape, request, requests) per call."""
    model, reference, _, corrupted, cache, reference_cache = setup
    seen: list[tuple[tuple[int, ...], int | None, tuple[int, ...]]] = []

    def recorded(value: Tensor, hook):
        seen.append((tuple(value.shape), hook.request, hook.requests))
        return patch(value, hook, clean_cache=cache, **where)

    ours = model.run_with_hooks(corrupted, fwd_hooks=[(name, recorded)])
    with torch.no_grad():
        theirs = reference.run_with_hooks(
            corrupted, fwd_hooks=[(name, partial(patch, clean_cache=reference_cache, **where))]
        )
    return ours, theirs, seen


# ---- the notebook's patching equals TransformerLens's ---------------------------------------------


@pytest.mark.parametrize("layer, pos", [(0, 2), (1, LENGTH - 2), (2, LENGTH - 1)])
def test_residual_patching_equals_transformer_lens(setup, layer, pos):
    name = utils.get_act_name("resid_pre", layer)
    ours, theirs, seen = both_patched(setup, name, patch_residual_component, pos=pos)
    d_model = setup[0].cfg.d_model
    assert seen == [((BATCH, LENGTH, d_model), None, (0, 1, 2, 3))]
    assert_close_relative(ours, theirs)
    corrupted_logits = setup[0](setup[3])
    assert not torch.allclose(ours, corrupted_logits), "the patch must change the logits"


@pytest.mark.parametrize("layer, head", [(0, 1), (2, 3)])
def test_head_z_patching_equals_transformer_lens(setup, layer, head):
    model = setup[0]
    name = utils.get_act_name("z", layer, "attn")
    ours, theirs, seen = both_patched(setup, name, patch_head_vector, head_index=head)
    assert seen == [((BATCH, LENGTH, model.cfg.n_heads, model.cfg.d_head), None, (0, 1, 2, 3))]
    assert_close_relative(ours, theirs)


def test_head_v_patching_equals_transformer_lens(setup):
    name = utils.get_act_name("v", 1, "attn")
    ours, theirs, seen = both_patched(setup, name, patch_head_vector, head_index=1)
    assert len(seen) == 1 and seen[0][0][:2] == (BATCH, LENGTH) and seen[0][2] == (0, 1, 2, 3)
    assert_close_relative(ours, theirs)


@pytest.mark.parametrize("layer, head", [(0, 0), (1, 2)])
def test_pattern_patching_equals_transformer_lens(setup, layer, head):
    model = setup[0]
    name = utils.get_act_name("pattern", layer, "attn")
    ours, theirs, seen = both_patched(setup, name, patch_head_pattern, head_index=head)
    assert seen == [((BATCH, model.cfg.n_heads, LENGTH, LENGTH), None, (0, 1, 2, 3))]
    assert_close_relative(ours, theirs)


def test_in_place_batch_edit_equals_transformer_lens(setup):
    """An edit in place, returning None, indexing the batch: prompt 2 only, head 1 knocked out."""
    model, reference, _, corrupted, _, _ = setup

    def knock_out(z: Tensor, hook) -> None:
        z[2, :, 1] = 0

    name = utils.get_act_name("z", 1, "attn")
    ours = model.run_with_hooks(corrupted, fwd_hooks=[(name, knock_out)])
    with torch.no_grad():
        theirs = reference.run_with_hooks(corrupted, fwd_hooks=[(name, knock_out)])
    assert_close_relative(ours, theirs)
    plain = model(corrupted)
    torch.testing.assert_close(ours[[0, 1, 3]], plain[[0, 1, 3]], rtol=0, atol=0)
    assert not torch.allclose(ours[2], plain[2])


def test_transformer_lens_patching_runs_on_vlens(setup):
    model, reference, _, corrupted, cache, reference_cache = setup
    ours = tl_patching.get_act_patch_resid_pre(model, corrupted, cache, logit_diff)
    with torch.no_grad():
        theirs = tl_patching.get_act_patch_resid_pre(
            reference, corrupted, reference_cache, logit_diff
        )
    assert ours.shape == (model.cfg.n_layers, LENGTH)
    assert_close_relative(ours, theirs)
    assert ours.std() > 0.01, "the patches must change the metric for the test to mean anything"


# ---- where the batch is not whole: per prompt ------------------------------------------------------


def test_prompts_of_different_lengths_run_per_prompt(hooked):
    model = hooked("llama")
    texts = ["Short", "A somewhat longer prompt", "The longest prompt of the three, by far"]
    lengths = [len(tokens) for tokens in model.token_lists(texts)]
    seen: list[tuple[str, tuple[int, ...], int | None, tuple[int, ...]]] = []

    def record(value: Tensor, hook) -> None:
        seen.append((hook.name, tuple(value.shape[:3]), hook.request, hook.requests))

    hooks = [("blocks.1.hook_resid_post", record), ("blocks.1.attn.hook_pattern", record)]
    model.run_with_hooks(texts, fwd_hooks=hooks)
    heads = model.cfg.n_heads
    expected = {
        ("blocks.1.hook_resid_post", (1, n, model.cfg.d_model), i, (i,))
        for i, n in enumerate(lengths)
    } | {("blocks.1.attn.hook_pattern", (1, heads, n), i, (i,)) for i, n in enumerate(lengths)}
    assert len(seen) == 2 * len(texts) and set(seen) == expected


def test_prompt_hooks_stay_per_prompt(hooked):
    """The same function given to every prompt through ``prompt_hooks`` is still one per prompt."""
    model = hooked("llama")
    _, corrupted = prompts()
    seen: list[tuple[tuple[int, ...], int | None, tuple[int, ...]]] = []

    def record(value: Tensor, hook) -> None:
        seen.append((tuple(value.shape[:2]), hook.request, hook.requests))

    hooks = [("blocks.0.hook_resid_post", record)]
    model.run_with_hooks(corrupted, prompt_hooks=[hooks] * BATCH)
    assert sorted(seen, key=lambda s: s[1]) == [((1, LENGTH), i, (i,)) for i in range(BATCH)]


def test_a_prompt_with_its_own_hook_keeps_the_call_per_prompt(hooked):
    """A shared hook where one prompt also has its own at the same site runs per prompt."""
    model = hooked("llama")
    _, corrupted = prompts()
    seen: list[tuple[int, ...]] = []
    shared = [("blocks.0.hook_resid_post", lambda value, hook: seen.append(hook.requests))]
    own = [[("blocks.0.hook_resid_post", lambda value, hook: None)]] + [[]] * (BATCH - 1)
    model.run_with_hooks(corrupted, fwd_hooks=shared, prompt_hooks=own)
    assert sorted(seen) == [(i,) for i in range(BATCH)]


# ---- generation ------------------------------------------------------------------------------------


def test_generate_runs_a_shared_hook_on_the_batch_at_decode_steps(hooked):
    model = hooked("llama")
    clean, _ = prompts(seed=1)
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(5)) * 3
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def steer(resid: Tensor, hook) -> Tensor:
        shapes.append((tuple(resid.shape), hook.requests))
        return resid + vector.to(resid.device)

    hooks = [("blocks.1.hook_resid_post", steer)]
    batched = model.generate(clean, max_new_tokens=5, do_sample=False, stop_at_eos=False,
                             fwd_hooks=hooks, return_type="tokens")
    d_model, everyone = model.cfg.d_model, tuple(range(BATCH))
    assert shapes[0] == ((BATCH, LENGTH, d_model), everyone)
    assert shapes[1:] == [((BATCH, 1, d_model), everyone)] * 4
    alone = [
        model.generate(prompt[None], max_new_tokens=5, do_sample=False, stop_at_eos=False,
                       fwd_hooks=hooks, return_type="tokens")[0]
        for prompt in clean
    ]
    assert batched == alone
    plain = model.generate(clean, max_new_tokens=5, do_sample=False, stop_at_eos=False,
                           return_type="tokens")
    assert batched != plain, "the steer must change the tokens for the test to mean anything"


def test_generate_pattern_hook_on_the_batch_at_decode_steps(hooked):
    """Explicit attention: the batch of one key length at every step, ``[b, head, 1, keys]``."""
    model = hooked("gpt2")
    clean, _ = prompts(seed=2)
    shapes: list[tuple[int, ...]] = []

    def uniform(pattern: Tensor, hook) -> Tensor:
        shapes.append(tuple(pattern.shape))
        keys = pattern.shape[-1]
        causal = torch.ones_like(pattern).tril(diagonal=keys - pattern.shape[-2])
        return causal / causal.sum(-1, keepdim=True)

    name = "blocks.1.attn.hook_pattern"
    batched = model.generate(clean, max_new_tokens=3, do_sample=False, stop_at_eos=False,
                             fwd_hooks=[(name, uniform)], return_type="tokens")
    heads = model.cfg.n_heads
    assert shapes == [(BATCH, heads, LENGTH, LENGTH), (BATCH, heads, 1, LENGTH + 1),
                      (BATCH, heads, 1, LENGTH + 2)]
    alone = model.generate(clean, max_new_tokens=3, do_sample=False, stop_at_eos=False,
                           prompt_hooks=[[(name, uniform)]] * BATCH, return_type="tokens")
    assert batched == alone


# ---- errors ----------------------------------------------------------------------------------------


def test_an_exception_in_a_batch_call_reaches_the_caller(hooked):
    model = hooked("llama")
    _, corrupted = prompts()

    def broken(value: Tensor, hook) -> None:
        if hook.requests == tuple(range(BATCH)):
            raise ValueError("boom")

    with pytest.raises(HookError, match=r"prompt 0: .*broken on blocks.1.hook_resid_pre raised"):
        model.run_with_hooks(corrupted, fwd_hooks=[("blocks.1.hook_resid_pre", broken)])
    with pytest.raises(HookError, match=r"returned shape \(4, 7, 3\); expected \(4, 7, 128\)"):
        model.run_with_hooks(corrupted, fwd_hooks=[("blocks.1.hook_resid_pre",
                                                    lambda x, h: x[..., :3])])
    assert model(corrupted).shape[0] == BATCH  # the engine keeps serving


def test_prompts_of_different_lengths_decode_as_one_batch(hooked):
    """Decode steps give every prompt one row: a shared hook runs once per step on the whole
    call, each prompt at its own position (``hook.first_positions``, ``hook.positions``), with
    the tokens of each prompt generated alone."""
    model = hooked("llama")
    texts = ["Short", "A somewhat longer prompt", "The longest prompt of the three, by far"]
    lengths = [len(tokens) for tokens in model.token_lists(texts)]
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(6)) * 3
    seen: list[tuple] = []

    def steer_late_rows(x: Tensor, hook) -> None:
        seen.append((tuple(x.shape[:2]), hook.requests, hook.first_positions,
                     hook.positions.tolist()))
        x[hook.positions >= 4] += vector.to(x.device)

    name = "blocks.1.hook_resid_post"
    kwargs = dict(max_new_tokens=4, do_sample=False, stop_at_eos=False, return_type="tokens")
    together = model.generate(texts, fwd_hooks=[(name, steer_late_rows)], **kwargs)
    decodes = seen[len(texts):]
    assert [entry[:2] for entry in decodes] == [((3, 1), (0, 1, 2))] * 3
    for step, (_, _, starts, positions) in enumerate(decodes):
        assert starts == tuple(n + step for n in lengths)
        assert positions == [[n + step] for n in lengths]
    alone = [model.generate(text, fwd_hooks=[(name, steer_late_rows)], **kwargs)[0]
             for text in texts]
    assert together == alone

    def needs_one_start(x: Tensor, hook) -> None:
        hook.first_position  # noqa: B018 - reading it is the test

    with pytest.raises(HookError, match=r"different positions .* use hook.first_positions"):
        model.generate(texts, fwd_hooks=[(name, needs_one_start)], **kwargs)
