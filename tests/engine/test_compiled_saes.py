"""SAEs in a compiled engine's graph (``compiled_saes``): feature edits as data (``SAESteer``)
equal the same edit as a hook function on the eager engine's spliced SAE, for every SAE
architecture and input setting; rows no steer edits stay bit for bit; the top-k feature
activations captured per position equal the SAE's encode of the captured activation; refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from vlens import HookedVLLM, SAESteer
from vlens.sae import SAE
from vlens.testing.saes import random_sae
from vlens.testing.tiny import tiny_model

TEXTS = ["The cat sat on the mat", "Hello world, this is"]
GREEDY = dict(do_sample=False, stop_at_eos=False, return_type="result")
#: fp32: the compiled graph's kernels (and the SAE's edit as ``x + (f' − f)·W_dec``) against the
#: eager engine's, which decodes the edited features and adds the clean error term
TOLERANCE = dict(rtol=1e-4, atol=1e-4)
TOP_K = 5

#: SAE name -> (architecture, hook name, settings): every architecture, every run-time input
#: normalisation, a hook_z SAE and a TopK SAE with decoder-norm rescaling
SAES = {
    "std": ("standard", "blocks.0.hook_resid_post", {}),
    "jump": ("jumprelu", "blocks.1.hook_mlp_out", {"normalize_activations": "layer_norm"}),
    "topk": ("topk", "blocks.2.attn.hook_z", {"rescale_acts_by_decoder_norm": True}),
    "gated": ("gated", "blocks.2.hook_resid_post",
              {"normalize_activations": "constant_norm_rescale"}),
}


@pytest.fixture(scope="module")
def saes(tmp_path_factory) -> dict[str, SAE]:
    folder = tmp_path_factory.mktemp("saes")
    loaded = {}
    for seed, (name, (architecture, hook, settings)) in enumerate(SAES.items()):
        path = random_sae(folder / name, architecture, d_in=128, d_sae=48, hook_name=hook,
                          seed=seed, **settings)
        loaded[name] = SAE.load_from_disk(path)
    return loaded


@pytest.fixture(scope="module")
def compiled(saes, engine_args) -> HookedVLLM:
    return HookedVLLM.from_pretrained(
        tiny_model("llama"), dtype="float32", compiled_saes=saes, compiled_sae_top_k=TOP_K,
        compiled_capture=[hook for _, hook, _ in SAES.values()], compiled_sae_slots=8,
        **engine_args,
    )


@pytest.fixture(scope="module")
def eager(hooked) -> HookedVLLM:
    return hooked("llama")


def edit_hook(steer: SAESteer, start: int = 0):
    """``steer``'s edit as a hook function on ``hook_sae_acts_post`` of the eager engine."""
    multipliers, offsets = steer.multipliers_and_offsets()
    features = list(steer.features)

    def edit(acts: Tensor, hook) -> None:
        rows = hook.positions >= start
        chosen = acts[rows]
        m = torch.tensor(multipliers, dtype=acts.dtype, device=acts.device)
        a = torch.tensor(offsets, dtype=acts.dtype, device=acts.device)
        chosen[:, features] = chosen[:, features] * m + a
        acts[rows] = chosen

    return edit


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("std", dict(clamp=[6.0, 0.0])),
        ("jump", dict(scale=3.0, add=0.5)),
        ("topk", dict(clamp=4.0)),
        ("gated", dict(add=[2.0, -1.0])),
    ],
)
def test_a_feature_edit_equals_the_eager_engines_hook_on_the_spliced_sae(
    compiled, eager, saes, name, edit
):
    steer = SAESteer(name, features=[3, 17], positions=slice(2, None), **edit)
    hook = SAES[name][1]
    logits, cache = compiled.run_with_cache(TEXTS, steering=[steer], names_filter=[hook])
    with eager.saes(saes=[saes[name]], use_error_term=True):
        expected = eager.run_with_hooks(
            TEXTS, fwd_hooks=[(f"{hook}.hook_sae_acts_post", edit_hook(steer, start=2))]
        )
    plain, _ = compiled.run_with_cache(TEXTS, names_filter=[hook])
    mask = cache.attention_mask.bool()
    torch.testing.assert_close(logits[mask], expected[mask], **TOLERANCE)
    assert (logits[mask] - plain[mask]).abs().max() > 1e-2, "the edit changed nothing"

    ours = compiled.generate(TEXTS, max_new_tokens=6, steering=[steer], **GREEDY)
    with eager.saes(saes=[saes[name]], use_error_term=True):
        theirs = eager.generate(
            TEXTS, max_new_tokens=6, fwd_hooks=[(f"{hook}.hook_sae_acts_post",
                                                 edit_hook(steer, start=2))], **GREEDY
        )
    assert ours == theirs


def test_rows_no_steer_edits_stay_bit_for_bit(compiled):
    """Prompt 1 beside a steered prompt 0: its values at and after every SAE's name equal
    those of the same call with nothing steered, exactly."""
    names = [hook for _, hook, _ in SAES.values()]
    steers = [[SAESteer(name, features=[1, 2, 5], clamp=9.0) for name in SAES], []]
    _, steered = compiled.run_with_cache(TEXTS, prompt_steering=steers, names_filter=names)
    _, plain = compiled.run_with_cache(TEXTS, names_filter=names)
    for name in names:
        assert torch.equal(steered[name][1], plain[name][1]), name
        assert not torch.equal(steered[name][0], plain[name][0]), name


def test_top_k_features_are_the_saes_encode_of_the_activation(compiled, saes):
    names = [f"{hook}.hook_sae_acts_post.top_k_{part}"
             for _, hook, _ in SAES.values() for part in ("values", "indices")]
    _, cache = compiled.run_with_cache(TEXTS, names_filter=names + [h for _, h, _ in SAES.values()])
    rows = cache.attention_mask.bool()
    for name, (_, hook, _) in SAES.items():
        values = cache[f"{hook}.hook_sae_acts_post.top_k_values"]
        indices = cache[f"{hook}.hook_sae_acts_post.top_k_indices"]
        assert values.shape[-1] == indices.shape[-1] == TOP_K
        assert indices.dtype == torch.int32
        features = saes[name].encode(cache[hook])
        expected, _ = features.topk(TOP_K, dim=-1)
        torch.testing.assert_close(values[rows], expected[rows], **TOLERANCE)
        found = features.gather(-1, indices.long())
        torch.testing.assert_close(found[rows], values[rows], **TOLERANCE)


def test_top_k_features_see_the_edit(compiled):
    hook = SAES["std"][1]
    name = f"{hook}.hook_sae_acts_post.top_k_"
    steer = SAESteer("std", features=[11], clamp=50.0)
    _, cache = compiled.run_with_cache(TEXTS[:1], steering=[steer],
                                       names_filter=[name + "values", name + "indices"])
    assert torch.all(cache[name + "indices"][0, :, 0] == 11)
    assert torch.all(cache[name + "values"][0, :, 0] == 50.0)


def test_refusals_name_the_fix(compiled, eager, saes, tmp_path: Path):
    with pytest.raises(ValueError, match="no SAE of that name.*compiled_saes"):
        compiled.generate(TEXTS, steering=[SAESteer("nope", features=[1], clamp=1.0)])
    with pytest.raises(ValueError, match="add_sae"):
        eager.generate(TEXTS, steering=[SAESteer("std", features=[1], clamp=1.0)])
    with pytest.raises(ValueError, match=r"features \[48\] are not among the SAE's 48"):
        compiled.generate(TEXTS, steering=[SAESteer("std", features=[48], clamp=1.0)])
    with pytest.raises(ValueError, match="takes no scale"):
        SAESteer("std", features=[1], clamp=1.0, scale=2.0)
    with pytest.raises(ValueError, match="changes nothing"):
        SAESteer("std", features=[1])
    with pytest.raises(ValueError, match="2 values for 1 features"):
        SAESteer("std", features=[1], add=[1.0, 2.0])
    with pytest.raises(ValueError, match="edit 12 distinct features.*compiled_sae_slots=12"):
        compiled.generate(TEXTS, prompt_steering=[[SAESteer("std", features=list(range(6)), clamp=1.0)],
                                         [SAESteer("std", features=list(range(6, 12)), clamp=1.0)]])
    # the engine serves on after the refusal, with the slots freed
    compiled.generate(TEXTS, steering=[SAESteer("std", features=list(range(40, 48)), clamp=1.0)])
    wrong = SAE.load_from_disk(random_sae(tmp_path / "wrong", d_in=64,
                                          hook_name="blocks.0.hook_resid_post"))
    with pytest.raises(ValueError, match="d_in=64"):
        HookedVLLM.from_pretrained(tiny_model("llama"), compiled_saes={"w": wrong})
