"""SAELens's HookedSAETransformer API on vlens (:mod:`vlens.hooked.saes`): SAEs spliced into the
forward, their hook points as names, hooks on features, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from vlens.sae import SAE
from vlens.testing.saes import random_sae

TEXTS = ["The cat sat on the mat", "Hello world"]
NAME = "blocks.0.hook_resid_post"
#: fp32 on the CPU: vLLM's kernels against torch's in the user's process
RTOL = 1e-5


def sae_at(folder: Path, name: str, d_in: int, architecture: str = "standard", **kw) -> SAE:
    random_sae(folder, architecture, d_in=d_in, d_sae=48, hook_name=name, seed=3, **kw)
    return SAE.load_from_disk(folder)


def assert_close(ours: Tensor, theirs: Tensor, mask: Tensor) -> None:
    ours, theirs = ours[mask.bool()], theirs[mask.bool()]
    scale = theirs.abs().max().clamp_min(1e-6)
    assert ((ours - theirs).abs().max() / scale).item() <= RTOL


@pytest.fixture(scope="module")
def model(hooked):
    model = hooked("gpt2")
    yield model
    model.reset_saes()
    model.reset_hooks()


@pytest.fixture(scope="module")
def clean(model):
    return model.run_with_cache(TEXTS, names_filter=[NAME, "blocks.1.hook_resid_post"])


def test_names_hold_the_sae_of_the_clean_activation(model, clean, tmp_path):
    _, clean_cache = clean
    sae = sae_at(tmp_path, NAME, model.cfg.d_model)
    _, cache = model.run_with_cache_with_saes(TEXTS, saes=[sae])
    stages = sae.stages(clean_cache[NAME])
    assert [n for n in cache.keys() if ".hook_sae_" in n] == [f"{NAME}.{s}" for s in stages]
    for stage, value in stages.items():
        assert_close(cache[f"{NAME}.{stage}"], value, cache.attention_mask)
    assert model.acts_to_saes == {}
    assert not [name for name in model.hook_names if ".hook_sae_" in name]


def test_the_model_computes_on_with_the_reconstruction(model, tmp_path):
    sae = sae_at(tmp_path, NAME, model.cfg.d_model)
    spliced = model.run_with_saes(TEXTS, saes=[sae])
    by_hook = model.run_with_hooks(TEXTS, fwd_hooks=[(NAME, lambda x, hook: sae.to(x.device)(x))])
    torch.testing.assert_close(spliced, by_hook, rtol=RTOL, atol=1e-5)


def test_the_error_term_keeps_the_clean_model_and_edited_features_survive(model, clean, tmp_path):
    clean_logits, _ = clean
    sae = sae_at(tmp_path, NAME, model.cfg.d_model)
    logits, cache = model.run_with_cache_with_saes(TEXTS, saes=[sae], use_error_term=True)
    assert f"{NAME}.hook_sae_error" in cache.keys()
    assert_close(logits, clean_logits, cache.attention_mask)

    def zero_feature(acts: Tensor, hook) -> None:
        acts[..., :] = 0

    with model.saes(saes=[sae], use_error_term=True):
        edited = model.run_with_hooks(
            TEXTS, fwd_hooks=[(f"{NAME}.hook_sae_acts_post", zero_feature)]
        )
    # every feature off: the output is the decoder bias plus the clean error
    expected = model.run_with_hooks(
        TEXTS,
        fwd_hooks=[(NAME, lambda x, hook: sae.to(x.device).b_dec + (x - sae(x).detach()))],
    )
    torch.testing.assert_close(edited, expected, rtol=RTOL, atol=1e-5)


def test_added_saes_stay_until_reset_and_saes_restores_the_one_replaced(model, tmp_path):
    first = sae_at(tmp_path / "a", NAME, model.cfg.d_model)
    second = sae_at(tmp_path / "b", NAME, model.cfg.d_model, "jumprelu")
    model.add_sae(first)
    try:
        assert model.acts_to_saes == {NAME: first}
        with_first = model(TEXTS)
        with model.saes(saes=[second]):
            assert model.acts_to_saes == {NAME: second}
            assert not torch.allclose(model(TEXTS), with_first)
        assert model.acts_to_saes == {NAME: first}
        torch.testing.assert_close(model(TEXTS), with_first, rtol=0, atol=0)
    finally:
        model.reset_saes()
    assert model.acts_to_saes == {}


def test_refusals_name_the_problem(model, tmp_path):
    wide = sae_at(tmp_path / "wide", NAME, model.cfg.d_model + 1)
    with pytest.raises(ValueError, match="d_in=129"):
        model.add_sae(wide)
    unknown = sae_at(tmp_path / "unknown", "blocks.0.hook_nothing", model.cfg.d_model)
    with pytest.raises(Exception, match="hook_nothing"):
        model.add_sae(unknown)
    with pytest.raises(TypeError, match="SAE.load_from_disk"):
        model.add_sae(object())
    with pytest.raises(ValueError, match="no SAE is spliced in"):
        model.reset_saes(NAME)
    assert model.acts_to_saes == {}


def test_on_a_compiled_engine_at_a_declared_name_as_on_the_eager_one(
    model, graph_hooks_engine, tmp_path
):
    compiled = graph_hooks_engine("gpt2")
    sae = sae_at(tmp_path, NAME, model.cfg.d_model, "topk", k=6)
    stage = f"{NAME}.hook_sae_acts_post"

    def double_feature_2(acts: Tensor, hook) -> None:
        acts[..., 2] *= 2.0

    results = []
    for engine in (model, compiled):
        with engine.saes(saes=[sae], use_error_term=True):
            engine.add_hook(stage, double_feature_2)
            try:
                results.append(engine.run_with_cache(TEXTS, names_filter=[stage]))
            finally:
                engine.reset_hooks()
    (eager_logits, eager_cache), (logits, cache) = results
    assert_close(logits, eager_logits, cache.attention_mask)
    assert_close(cache[stage], eager_cache[stage], cache.attention_mask)
    assert compiled.acts_to_saes == {}


def test_a_compiled_engine_refuses_an_sae_at_an_undeclared_name(hooked, tmp_path):
    compiled = hooked("llama", compiled_capture=("blocks.1.hook_resid_post",))  # test_compiled's
    sae = sae_at(tmp_path, NAME, compiled.cfg.d_model)
    with pytest.raises(ValueError, match=r"compiled_hooks=\['blocks.0.hook_resid_post'\]"):
        compiled.add_sae(sae)


# ---- against SAELens's HookedSAETransformer ------------------------------------------------------

REFERENCES = Path(__file__).parents[2] / "parity" / "references" / "sae_model"
CASES = sorted(path.name for path in REFERENCES.iterdir() if (path / "case.json").is_file())
#: fp32: vLLM's kernels against TransformerLens's HookedTransformer (itself 2.9e-6 from
#: HuggingFace on these models, parity/sae_model_reference.py)
REFERENCE_RTOL = 1e-5


def reference_case(name: str) -> tuple[dict, dict[str, Tensor], list[SAE]]:
    import json

    from safetensors.torch import load_file

    folder = REFERENCES / name
    case = json.loads((folder / "case.json").read_text())
    values = load_file(folder / "reference.safetensors")
    aliases = case.get("same_as", {})
    wanted = {key: values[aliases.get(key, key)] for key in [*values, *aliases]}
    saes = [SAE.load_from_disk((folder / sae["folder"]).resolve()) for sae in case["saes"]]
    return case, wanted, saes


def edit_features(case: dict):
    edit = case["edit"]

    def edit_acts(acts: Tensor, hook) -> None:
        acts[..., edit["zeroed_feature"]] = 0.0
        acts[..., edit["scaled_feature"]] *= edit["scale"]

    return [(name, edit_acts) for name in edit["hooks"]]


def assert_matches(ours: Tensor, theirs: Tensor, what: str) -> None:
    scale = theirs.abs().max().clamp_min(1e-6)
    error = ((ours.to(theirs.dtype) - theirs).abs().max() / scale).item()
    assert error <= REFERENCE_RTOL, f"{what}: {error:.2e} relative to SAELens"


@pytest.mark.parametrize("name", CASES)
def test_every_name_equals_saelens(hooked, name):
    case, reference, saes = reference_case(name)
    model = hooked(case["family"])
    tokens = reference["tokens"]
    runs = {
        "": lambda: model.run_with_cache_with_saes(tokens, saes=saes),
        "error_term.": lambda: model.run_with_cache_with_saes(
            tokens, saes=saes, use_error_term=True
        ),
    }
    for prefix, run in runs.items():
        logits, cache = run()
        assert_matches(logits[:, -1], reference[f"{prefix}logits"], f"{prefix}logits")
        for key in reference:
            if key.startswith(f"{prefix}cache."):
                cached = key.removeprefix(f"{prefix}cache.")
                assert_matches(cache[cached], reference[key], key)
    with model.saes(saes=saes, use_error_term=True), model.hooks(fwd_hooks=edit_features(case)):
        logits, cache = model.run_with_cache(tokens)
    assert_matches(logits[:, -1], reference["edited.logits"], "edited.logits")
    for key in reference:
        if key.startswith("edited.cache."):
            assert_matches(cache[key.removeprefix("edited.cache.")], reference[key], key)
    assert model.acts_to_saes == {}
