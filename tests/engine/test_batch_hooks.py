"""TransformerLens's batch semantics for hook functions shared by a call's prompts.

A hook function added with ``add_hook`` or given as ``fwd_hooks`` runs once per site and engine step
on the call's batch, ``[batch, pos, ...]`` in the prompts' order, padded on the call's padding side
whatever the prompts' lengths; ``prompt_hooks`` run per prompt. TransformerLens's notebook patching
code (its
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


# ---- prompts of unequal lengths: TransformerLens's padded batch -----------------------------------

TEXTS = ["Short", "A somewhat longer prompt", "The longest prompt of the three, by far"]


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llama(request, hooked, graph_hooks_engine):
    """The tiny Llama on the eager engine, and on a compiled one running hook functions at every
    name inside its graph: the same contract on both."""
    return hooked("llama") if request.param == "eager" else graph_hooks_engine("llama")


def padding_mask(lengths: list[int], side: str) -> Tensor:
    """``[batch, pos]``: True at each prompt's real positions, padded on ``side``."""
    longest = max(lengths)
    offsets = torch.arange(longest)[None]
    sizes = torch.tensor(lengths)[:, None]
    return offsets >= longest - sizes if side == "left" else offsets < sizes


def assert_equal_at_real(ours: Tensor, theirs: Tensor, mask: Tensor) -> None:
    """Logits equal TransformerLens's at every real position (TransformerLens also computes its
    padding, from pad tokens; vLLM never computes it)."""
    assert ours.shape == theirs.shape
    assert_close_relative(ours[mask], theirs[mask])


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_shared_hook_sees_the_padded_batch_whatever_the_lengths(llama, side):
    model = llama
    lengths = [len(tokens) for tokens in model.token_lists(TEXTS)]
    seen: list[tuple] = []

    def record(value: Tensor, hook) -> None:
        seen.append((hook.name, tuple(value.shape[:2]), hook.request, hook.requests,
                     hook.lengths, hook.attention_mask.cpu()))

    hooks = [("blocks.1.hook_resid_post", record), ("blocks.1.attn.hook_pattern", record)]
    model.run_with_hooks(TEXTS, fwd_hooks=hooks, padding_side=side)
    longest, everyone = max(lengths), (0, 1, 2)
    assert [entry[:5] for entry in seen] == [
        ("blocks.1.attn.hook_pattern", (3, model.cfg.n_heads), None, everyone, tuple(lengths)),
        ("blocks.1.hook_resid_post", (3, longest), None, everyone, tuple(lengths)),
    ]
    for entry in seen:
        assert torch.equal(entry[5], padding_mask(lengths, side))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batch_indexed_edits_equal_transformer_lens(llama, hooked, bridge, arch, side):
    """``x[0] += v`` edits prompt 0 alone, ``x[2, 1:4] += v`` three positions of prompt 2, and a
    statistic over the batch's real rows: each equals TransformerLens's bridge, at every real
    position, with the batch padded on either side (on GPT-2 on the eager engine)."""
    model, reference = (llama if arch == "llama" else hooked(arch)), bridge(arch)
    lengths = [len(tokens) for tokens in model.token_lists(TEXTS)]
    mask = padding_mask(lengths, side)
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3)) * 4

    def first_prompt(x: Tensor, hook) -> None:
        x[0] += vector.to(x.device)

    def three_positions(x: Tensor, hook) -> None:
        x[2, 1:4] += vector.to(x.device)

    def centred(x: Tensor, hook) -> Tensor:
        real = mask.to(x.device)[..., None]
        mean = (x * real).sum((0, 1)) / real.sum()
        return x - 0.5 * mean * real

    name = "blocks.1.hook_resid_pre"
    plain = model(TEXTS, padding_side=side)
    for edit in (first_prompt, three_positions, centred):
        ours = model.run_with_hooks(TEXTS, fwd_hooks=[(name, edit)], padding_side=side)
        with torch.no_grad():
            theirs = reference.run_with_hooks(TEXTS, fwd_hooks=[(name, edit)], padding_side=side)
        assert_equal_at_real(ours, theirs, mask)
        changed = [not torch.equal(ours[i][mask[i]], plain[i][mask[i]]) for i in range(3)]
        assert changed == {first_prompt: [True, False, False],
                           three_positions: [False, False, True],
                           centred: [True, True, True]}[edit]


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_cache_is_padded_as_the_call_asks(hooked, bridge, side):
    """The cache, the logits and a hook's batch share one layout: a clean cache's values patched
    into a hook's batch line up, as in TransformerLens's notebooks."""
    model, reference = hooked("llama"), bridge("llama")
    lengths = [len(tokens) for tokens in model.token_lists(TEXTS)]
    mask = padding_mask(lengths, side)
    name = "blocks.1.attn.hook_z"
    logits, cache = model.run_with_cache(TEXTS, padding_side=side, names_filter=name)
    with torch.no_grad():
        _, theirs = reference.run_with_cache(TEXTS, padding_side=side, names_filter=name)
    assert torch.equal(cache.attention_mask, mask)
    assert_equal_at_real(cache[name], theirs[name], mask)
    assert not cache[name][~mask].any() and not logits[~mask].any()
    for index, length in enumerate(lengths):
        assert cache.unpadded(name, index).shape[0] == length
        assert torch.equal(cache.tokens[index][mask[index]],
                           torch.tensor(model.token_lists(TEXTS)[index]))
    seen: list[Tensor] = []
    model.run_with_hooks(TEXTS, padding_side=side,
                         fwd_hooks=[(name, lambda z, hook: seen.append(z.cpu().clone()))])
    torch.testing.assert_close(seen[0], cache[name], rtol=0, atol=0)
    pattern = "blocks.1.attn.hook_pattern"
    _, patterns = model.run_with_cache(TEXTS, padding_side=side, names_filter=pattern)
    with torch.no_grad():
        _, their_patterns = reference.run_with_cache(TEXTS, padding_side=side, names_filter=pattern)
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    pair = pair.expand_as(patterns[pattern])
    assert_close_relative(patterns[pattern][pair], their_patterns[pattern][pair])


@pytest.mark.parametrize("side", ["right", "left"])
def test_pattern_patching_of_unequal_prompts_equals_transformer_lens(llama, bridge, side):
    """The notebook's head-pattern patching, on a batch of unequal prompts: the clean cache's
    pattern, padded as the hook's batch is, patched into it."""
    model, reference = llama, bridge("llama")
    lengths = [len(tokens) for tokens in model.token_lists(TEXTS)]
    mask = padding_mask(lengths, side)
    corrupted = [text.replace("prompt", "text") for text in TEXTS]
    assert [len(t) for t in model.token_lists(corrupted)] == lengths
    name = utils.get_act_name("pattern", 1, "attn")
    _, cache = model.run_with_cache(TEXTS, padding_side=side)
    with torch.no_grad():
        _, their_cache = reference.run_with_cache(TEXTS, padding_side=side)
    ours = model.run_with_hooks(corrupted, padding_side=side, fwd_hooks=[
        (name, partial(patch_head_pattern, head_index=1, clean_cache=cache))])
    with torch.no_grad():
        theirs = reference.run_with_hooks(corrupted, padding_side=side, fwd_hooks=[
            (name, partial(patch_head_pattern, head_index=1, clean_cache=their_cache))])
    assert_equal_at_real(ours, theirs, mask)
    assert not torch.allclose(ours[mask], model(corrupted, padding_side=side)[mask])


@pytest.mark.parametrize("side", ["right", "left"])
def test_patching_of_padded_token_batches_equals_transformer_lens(hooked, bridge, side):
    """``transformer_lens.patching`` and ``vlens.patching`` on prompts of unequal lengths given
    as a padded token tensor (as its functions take them: pad tokens run as tokens, on both
    sides) equal TransformerLens's bridge."""
    from vlens import patching as vlens_patching

    model, reference = hooked("llama"), bridge("llama")
    clean = model.to_tokens(TEXTS, padding_side=side)
    corrupted = model.to_tokens([text.replace("prompt", "text") for text in TEXTS],
                                padding_side=side)
    assert torch.equal(clean, reference.to_tokens(TEXTS, padding_side=side))

    def last_logit(logits: Tensor) -> Tensor:
        return logits[:, -1, 7].mean()

    _, cache = model.run_with_cache(clean)
    with torch.no_grad():
        _, their_cache = reference.run_with_cache(clean)
        theirs = tl_patching.get_act_patch_resid_pre(reference, corrupted, their_cache, last_logit)
    ours = tl_patching.get_act_patch_resid_pre(model, corrupted, cache, last_logit)
    batched = vlens_patching.get_act_patch_resid_pre(model, corrupted, cache, last_logit)
    assert_close_relative(ours, theirs)
    assert_close_relative(batched, theirs)
    assert theirs.std() > 1e-3, "the patches must move the metric for the test to mean anything"


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


def test_a_shared_hook_runs_on_the_batch_before_a_prompts_own(hooked):
    """A prompt's own hook at the name of a shared one: the shared function once on the call's
    batch, then the prompt's own on its rows, seeing the shared edit."""
    model = hooked("llama")
    _, corrupted = prompts()
    seen: list[tuple] = []
    name = "blocks.0.hook_resid_post"

    def shared(value: Tensor, hook) -> None:
        seen.append(("shared", hook.requests))
        value += 1.0

    def own(value: Tensor, hook) -> None:
        seen.append(("own", hook.requests, value.shape[0]))

    model.run_with_hooks(corrupted, fwd_hooks=[(name, shared)],
                         prompt_hooks=[[(name, own)]] + [[]] * (BATCH - 1))
    assert seen == [("shared", tuple(range(BATCH))), ("own", (0,), 1)]


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
                             fwd_hooks=hooks, return_type="result")
    d_model, everyone = model.cfg.d_model, tuple(range(BATCH))
    assert shapes[0] == ((BATCH, LENGTH, d_model), everyone)
    assert shapes[1:] == [((BATCH, 1, d_model), everyone)] * 4
    alone = [
        model.generate(prompt[None], max_new_tokens=5, do_sample=False, stop_at_eos=False,
                       fwd_hooks=hooks, return_type="result")[0]
        for prompt in clean
    ]
    assert batched == alone
    plain = model.generate(clean, max_new_tokens=5, do_sample=False, stop_at_eos=False,
                           return_type="result")
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
                             fwd_hooks=[(name, uniform)], return_type="result")
    heads = model.cfg.n_heads
    assert shapes == [(BATCH, heads, LENGTH, LENGTH), (BATCH, heads, 1, LENGTH + 1),
                      (BATCH, heads, 1, LENGTH + 2)]
    alone = model.generate(clean, max_new_tokens=3, do_sample=False, stop_at_eos=False,
                           prompt_hooks=[[(name, uniform)]] * BATCH, return_type="result")
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


def test_a_prompt_whose_hook_failed_stops_while_the_others_run_on(hooked):
    """A prompt's own hook raising at one layer: its hooks at later layers never run, in that
    step or after, every other prompt's run at every step, and the caller gets the error."""
    model = hooked("llama")
    clean, _ = prompts(seed=3)
    seen: list[tuple[str, int | None]] = []

    def broken(value: Tensor, hook) -> None:
        raise ValueError("boom")

    def record(value: Tensor, hook) -> None:
        seen.append((hook.name, hook.request))

    later = "blocks.1.hook_resid_post"
    hooks = [[("blocks.0.hook_resid_post", broken), (later, record)]]
    hooks += [[(later, record)]] * (BATCH - 1)
    with pytest.raises(HookError, match=r"prompt 0: .*broken on blocks.0.hook_resid_post raised"):
        model.generate(clean, max_new_tokens=3, do_sample=False, stop_at_eos=False,
                       prompt_hooks=hooks)
    steps = 3  # the prefill and two decode steps
    assert sorted(seen, key=lambda s: s[1]) == [
        (later, prompt) for prompt in range(1, BATCH) for _ in range(steps)
    ]


def test_prompts_of_different_lengths_decode_as_one_batch(llama):
    """Decode steps give every prompt one row: a shared hook runs once per step on the whole
    call, each prompt at its own position (``hook.first_positions``, ``hook.positions``), with
    the tokens of each prompt generated alone; ``x[0]`` steers prompt 0 alone."""
    model = llama
    texts = ["Short", "A somewhat longer prompt", "The longest prompt of the three, by far"]
    lengths = [len(tokens) for tokens in model.token_lists(texts)]
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(6)) * 3
    seen: list[tuple] = []

    def steer_late_rows(x: Tensor, hook) -> None:
        seen.append((tuple(x.shape[:2]), hook.requests, hook.first_positions,
                     hook.positions.tolist()))
        x[hook.positions >= 4] += vector.to(x.device)

    name = "blocks.1.hook_resid_post"
    kwargs = dict(max_new_tokens=4, do_sample=False, stop_at_eos=False, return_type="result")
    together = model.generate(texts, fwd_hooks=[(name, steer_late_rows)], **kwargs)
    prefill, decodes = seen[0], seen[1:]
    assert prefill[:3] == ((3, max(lengths)), (0, 1, 2), (0, 0, 0))
    assert [entry[:2] for entry in decodes] == [((3, 1), (0, 1, 2))] * 3
    for step, (_, _, starts, positions) in enumerate(decodes):
        assert starts == tuple(n + step for n in lengths)
        assert positions == [[n + step] for n in lengths]
    alone = [model.generate(text, fwd_hooks=[(name, steer_late_rows)], **kwargs)[0]
             for text in texts]
    assert together == alone

    def first_prompt(x: Tensor, hook) -> None:
        x[0] += vector.to(x.device)

    edited = model.generate(texts, fwd_hooks=[(name, first_prompt)], **kwargs)
    plain = model.generate(texts, **kwargs)
    assert edited[0] == model.generate(texts[0], fwd_hooks=[(name, first_prompt)], **kwargs)[0]
    assert edited[0] != plain[0] and edited[1:] == plain[1:]

    def needs_one_start(x: Tensor, hook) -> None:
        hook.first_position  # noqa: B018 - reading it is the test

    with pytest.raises(HookError, match=r"different positions .* use hook.first_positions"):
        model.generate(texts, fwd_hooks=[(name, needs_one_start)], **kwargs)
