"""Gradients on the twin of the checkpoint: backward hooks, ``incl_bwd`` caches and gradients
through forward hooks equal TransformerLens's bridge's on the same checkpoint (fp32, ≤ 1e-4
relative); the twin's forward equals the engine's, with SAEs added and steering too, and gives
an SAE's feature gradients; calls without gradients stay on vLLM; what the twin cannot honour yet
is refused."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from vlens.hooked.gradients import check_fits

TEXT = "The river ran past the old mill, and every morning"
NAME = "blocks.0.hook_resid_post"
RELATIVE = 1e-4


def metric(logits: Tensor) -> Tensor:
    return logits[0, -1, 3] - logits[0, -1, 4]


def assert_relative(actual: Tensor, expected: Tensor) -> None:
    error = (actual.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= RELATIVE, f"relative error {error:.2e} > {RELATIVE:.0e}"


def zero_head_0(z: Tensor, hook) -> None:
    z[:, :, 0] = 0.0


def gradients(model, tokens, fwd_hooks=()) -> dict[str, Tensor]:
    """The gradient of :func:`metric` at ``NAME`` and ``blocks.1.attn.hook_z``, by backward
    hooks (TransformerLens's way), with ``fwd_hooks`` on the forward."""
    seen: dict[str, Tensor] = {}

    def keeper(name: str):
        def keep(grad: Tensor, hook) -> None:  # the bridge names an alias's hook by its own
            seen[name] = grad.detach().clone()

        return keep

    names = [NAME, "blocks.1.attn.hook_z"]
    with model.hooks(fwd_hooks=list(fwd_hooks), bwd_hooks=[(n, keeper(n)) for n in names]):
        metric(model(tokens)).backward()
    return seen


def test_backward_hooks_give_the_bridges_gradients(hooked, bridge):
    model, reference = hooked("llama"), bridge("llama")
    tokens = model.to_tokens(TEXT)
    ours, theirs = gradients(model, tokens), gradients(reference, tokens)
    assert set(ours) == {NAME, "blocks.1.attn.hook_z"}
    for name in ours:
        assert ours[name].abs().max() > 0
        assert_relative(ours[name], theirs[name])
    assert not model.needs_gradients()  # the block's backward hooks are gone with it
    # and the twin computes the engine's values
    with torch.no_grad():
        twin_logits = model.gradient_twin()(tokens)
    assert_relative(twin_logits, model(tokens))


def test_forward_hooks_run_on_the_twin(hooked, bridge):
    model, reference = hooked("llama"), bridge("llama")
    tokens = model.to_tokens(TEXT)
    ablated = [("blocks.0.attn.hook_z", zero_head_0)]
    ours = gradients(model, tokens, ablated)
    theirs = gradients(reference, tokens, ablated)
    plain = gradients(model, tokens)
    assert_relative(ours[NAME], theirs[NAME])
    assert (ours[NAME] - plain[NAME]).abs().max() > 1e-4, "the ablation changed nothing"


def test_a_cache_with_gradients_equals_the_bridges(hooked, bridge):
    model, reference = hooked("llama"), bridge("llama")
    tokens = model.to_tokens(TEXT)
    names = [NAME, "blocks.1.hook_resid_pre"]
    loss, cache = model.run_with_cache(tokens, names_filter=names, return_type="loss",
                                       incl_bwd=True)
    reference_loss, expected = reference.run_with_cache(
        tokens, names_filter=names, return_type="loss", incl_bwd=True)
    assert_relative(loss.detach(), reference_loss.detach())
    for name in names:
        assert_relative(cache[f"{name}_grad"], expected[f"{name}_grad"])
        assert_relative(cache[name], expected[name])


def test_stop_at_layer_on_the_twin_gives_the_residual_and_its_gradient(hooked, bridge):
    """With a backward hook added, ``run_with_cache(stop_at_layer=k)`` runs on the twin: the
    residual entering block ``k``, differentiable, as the bridge's; ``incl_bwd`` with it is
    refused as the bridge refuses it."""
    model, reference = hooked("llama"), bridge("llama")
    tokens = model.to_tokens(TEXT)
    seen: list[Tensor] = []
    model.add_hook(NAME, lambda grad, hook: seen.append(grad.detach().clone()), dir="bwd")
    try:
        resid, cache = model.run_with_cache(tokens, names_filter=[NAME], stop_at_layer=1)
        resid.sum().backward()
        with pytest.raises(ValueError, match="stop_at_layer"):
            model.run_with_cache(tokens, stop_at_layer=1, return_type="loss", incl_bwd=True)
    finally:
        model.reset_hooks(including_permanent=True)
    expected, expected_cache = reference.run_with_cache(tokens, names_filter=[NAME], stop_at_layer=1)
    assert_relative(resid.detach(), expected.detach())
    assert_relative(cache[NAME], expected_cache[NAME])
    assert len(seen) == 1 and torch.equal(seen[0], torch.ones_like(seen[0]))  # d sum / d resid


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_per_prompt_hooks_on_the_twin_see_and_edit_their_prompt_as_on_the_engine(hooked,
                                                                                  padding_side):
    """``prompt_hooks`` in a call on the twin: each function sees its own prompt's rows
    (``[1, pos_i, ...]``, no padding) and its edit lands there only; the twin's logits equal the
    engine's for the same call, wherever the padding goes."""
    model = hooked("llama")
    texts = [TEXT, "A dog ran"]
    shapes: list[tuple[int, ...]] = []

    def push(value: Tensor, hook) -> Tensor:
        shapes.append(tuple(value.shape))
        return value + 0.5

    def look(value: Tensor, hook) -> None:
        shapes.append(tuple(value.shape))

    own = [[(NAME, push)], [("blocks.1.attn.hook_pattern", look)]]
    engine = model(texts, padding_side=padding_side, prompt_hooks=own)
    plain = model(texts, padding_side=padding_side)
    engine_shapes, shapes[:] = list(shapes), []
    model.add_hook(NAME, lambda grad, hook: None, dir="bwd")
    try:
        twin = model(texts, padding_side=padding_side, prompt_hooks=own)
    finally:
        model.reset_hooks(including_permanent=True)
    assert shapes == engine_shapes
    lengths = [len(tokens) for tokens in model.token_lists(texts)]
    for index, length in enumerate(lengths):
        real = slice(None, length) if padding_side == "right" else slice(-length, None)
        assert_relative(twin[index, real].detach(), engine[index, real])
    assert (engine[0] - plain[0]).abs().max() > 1e-3, "the edit changed nothing"
    assert torch.equal(engine[1], plain[1])


def test_added_backward_hooks_last_until_reset(hooked):
    model = hooked("llama")
    tokens = model.to_tokens(TEXT)
    seen: list[Tensor] = []
    names: list[str] = []
    model.add_hook(NAME, lambda grad, hook: seen.append(grad) or names.append(hook.name),
                   dir="bwd")
    assert model.blocks[0].hook_resid_post.has_hooks(dir="bwd")
    try:
        metric(model(tokens)).backward()
        metric(model(tokens)).backward()
    finally:
        model.reset_hooks()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert names == [NAME, NAME]  # vlens's name, where the bridge's point is blocks.0.hook_out
    assert not model.needs_gradients()
    logits = model(tokens)
    assert not logits.requires_grad  # back on vLLM


def test_an_added_sae_runs_on_the_twin_with_feature_gradients(hooked, tmp_path):
    from vlens.sae import SAE
    from vlens.testing.saes import random_sae

    model = hooked("llama")
    tokens = model.to_tokens(TEXT)
    sae = SAE.load_from_disk(random_sae(tmp_path / "sae", d_in=model.cfg.d_model, hook_name=NAME,
                                        apply_b_dec_to_input=False))
    features = f"{NAME}.hook_sae_acts_post"
    names = [NAME, features, "blocks.1.hook_resid_post"]
    model.add_sae(sae, use_error_term=False)
    try:
        engine_logits, engine = model.run_with_cache(tokens, names_filter=names)
        _, twin = model.run_with_cache(tokens, names_filter=names, return_type="loss",
                                       incl_bwd=True)
        seen: list[Tensor] = []
        with model.hooks(bwd_hooks=[(features, lambda grad, hook: seen.append(grad))]):
            twin_logits = model(tokens)
            metric(twin_logits).backward()
    finally:
        model.reset_saes()
    for name in names:  # the twin computes on with the SAE's output, as the engine does
        assert_relative(twin[name], engine[name])
    assert_relative(twin_logits.detach(), engine_logits)
    # the features' gradient: the spliced name's (the SAE's output) through the decoder
    assert_relative(twin[f"{features}_grad"], twin[f"{NAME}_grad"] @ sae.W_dec.detach().T)
    assert len(seen) == 1 and seen[0].abs().max() > 0
    assert not model.needs_gradients()
    _, plain = model.run_with_cache(tokens, names_filter=[NAME], incl_bwd=True,
                                    return_type="loss")  # the SAE is gone from the twin too
    assert (plain[NAME] - twin[NAME]).abs().max() > 1e-3


def test_steering_runs_on_the_twin(hooked):
    from vlens import Steer

    model = hooked("llama")
    prompts = [model.to_tokens(TEXT)[0, :9].tolist(), model.to_tokens(TEXT)[0, :6].tolist()]
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(model.cfg.d_model, generator=generator)
    steering = [Steer("blocks.1.hook_resid_pre", gain=1.5, positions=slice(1, None, 2))]
    prompt_steering = [[Steer(NAME, add=direction, scale=2.0, positions=[1, 3])],
                       [Steer(NAME, ablate=direction, positions=slice(2, None))]]
    names = [NAME, "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    steers = {"steering": steering, "prompt_steering": prompt_steering,
              "padding_side": "right", "names_filter": names}
    engine_logits, engine = model.run_with_cache(prompts, **steers)
    _, unsteered = model.run_with_cache(prompts, names_filter=names, padding_side="right")
    with model.hooks(bwd_hooks=[(NAME, lambda grad, hook: None)]):
        twin_logits, twin = model.run_with_cache(prompts, **steers)
    assert twin_logits.requires_grad  # on the twin
    for index, prompt in enumerate(prompts):  # the real positions (the twin's batch is padded)
        real = slice(0, len(prompt))
        for name in names:
            assert_relative(twin[name][index, real], engine[name][index, real])
            assert (engine[name][index, real] - unsteered[name][index, real]).abs().max() > 1e-3
        assert_relative(twin_logits[index, real].detach(), engine_logits[index, real])


def test_what_the_twin_cannot_honour_yet_is_refused(hooked):
    from vlens import SAESteer

    model = hooked("llama")
    tokens = model.to_tokens(TEXT)
    with pytest.raises(NotImplementedError, match="max_new_tokens"):
        model.run_with_cache(tokens, incl_bwd=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="compiled_saes"):  # an SAE of the graph: none here
        model.run_with_cache(tokens, incl_bwd=True, return_type="loss",
                             steering=[SAESteer("sae", features=[0], clamp=0.0)])
    with pytest.raises(MemoryError, match="gradient_twin\\(device='cpu'\\)"):
        check_fits(2**60, torch.device("cpu"))


def test_transformer_lens_switches_reach_the_twin(hooked):
    model = hooked("llama")
    twin = model.gradient_twin()
    model.set_use_attn_result(True)
    try:
        assert twin.cfg.use_attn_result
    finally:
        model.set_use_attn_result(False)
    assert not twin.cfg.use_attn_result


def test_close_lets_the_engine_and_the_twin_go_and_other_engines_keep_serving(hooked, engine_args):
    """``model.close()`` (or a ``with`` block) shuts this model's engine down and drops its
    twin; later calls say the model was closed; the session's other engines still answer."""
    from vlens import HookedVLLM
    from vlens.testing.tiny import tiny_model

    with HookedVLLM.from_pretrained(tiny_model("gpt2"), dtype="float32", **engine_args) as model:
        before = model(TEXT)
        model.gradient_twin()
        assert model._twin is not None
    assert model._twin is None and model.engine._llm is None
    with pytest.raises(RuntimeError, match=r"closed \(model.close\(\)\).*from_pretrained"):
        model(TEXT)
    model.close()  # twice: nothing more to do
    other = hooked("gpt2")
    torch.testing.assert_close(other(TEXT), before)
