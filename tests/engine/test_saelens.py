"""vlens in SAELens's own environment (TransformerLens 3, SAELens 6): SAELens imports beside
vlens, and SAELens's SAE objects are spliced in as they are, computing what SAELens computes.
Runs where SAELens is installed (CI's second environment, ``install.sh saelens``)."""

from __future__ import annotations

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

from vlens.names.tl_versions import MAJOR  # noqa: E402

TEXTS = ["The cat sat on the mat", "Hello world"]
NAME = "blocks.0.hook_resid_post"
#: fp32 on the CPU: SAELens's torch against vLLM's kernels upstream of the SAE
RTOL = 1e-5


def saelens_sae(architecture: str, d_in: int) -> torch.nn.Module:
    """A seeded random SAE built by SAELens itself, reading ``NAME``."""
    from sae_lens import SAE
    from sae_lens.saes import GatedSAEConfig, JumpReLUSAEConfig, StandardSAEConfig, TopKSAEConfig

    configs = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig,
               "topk": TopKSAEConfig, "gated": GatedSAEConfig}
    extra = {"k": 6} if architecture == "topk" else {}
    cfg = configs[architecture](d_in=d_in, d_sae=40, **extra)
    cfg.metadata.hook_name = NAME
    sae = SAE.from_dict(cfg.to_dict())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        if architecture == "jumprelu":
            sae.threshold.abs_()
    return sae


def test_saelens_runs_beside_vlens_on_transformer_lens_3():
    import transformer_lens

    assert MAJOR == 3
    assert hasattr(transformer_lens, "HookedTransformer")  # what SAELens imports
    assert sae_lens.HookedSAETransformer is not None


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk", "gated"])
def test_an_saelens_sae_is_spliced_in_as_it_is(hooked, architecture):
    model = hooked("gpt2")
    _, clean = model.run_with_cache(TEXTS, names_filter=[NAME])
    sae = saelens_sae(architecture, model.cfg.d_model)
    _, cache = model.run_with_cache_with_saes(TEXTS, saes=[sae])
    mask = cache.attention_mask.bool()
    with torch.no_grad():
        expected = {"hook_sae_acts_post": sae.encode(clean[NAME]),
                    "hook_sae_recons": sae.decode(sae.encode(clean[NAME]))}
    for stage, value in expected.items():
        ours, theirs = cache[f"{NAME}.{stage}"][mask], value[mask]
        scale = theirs.abs().max().clamp_min(1e-6)
        assert ((ours - theirs).abs().max() / scale).item() <= RTOL, stage
    assert model.acts_to_saes == {}
    model.add_sae(sae)
    try:
        assert model.acts_to_saes[NAME].cfg.metadata.hook_name == NAME
    finally:
        model.reset_saes()


def test_from_pretrained_goes_through_saelens_registry(monkeypatch):
    """Where SAELens is installed, its own ``from_pretrained`` resolves and downloads (the same
    cache as a SAELens user's); offline, the error names the folder to load instead."""
    from vlens.sae import SAE
    from vlens.sae.pretrained import PretrainedSAEError

    theirs = saelens_sae("jumprelu", 16)
    asked = []

    def from_pretrained(release, sae_id, **options):
        asked.append((release, sae_id, options))
        return theirs

    monkeypatch.setattr(sae_lens.SAE, "from_pretrained", from_pretrained)
    sae = SAE.from_pretrained("gpt2-small-res-jb", "blocks.8.hook_resid_pre")
    assert asked == [("gpt2-small-res-jb", "blocks.8.hook_resid_pre",
                      {"device": "cpu", "dtype": "float32", "force_download": False,
                       "fold_W_dec_norm": False})]
    assert sae.W_enc.data_ptr() == theirs.W_enc.data_ptr()

    def offline(release, sae_id, **options):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(sae_lens.SAE, "from_pretrained", offline)
    with pytest.raises(PretrainedSAEError, match=r"SAE\.load_from_disk\(folder\)"):
        SAE.from_pretrained("gpt2-small-res-jb", "blocks.8.hook_resid_pre")


def saelens_model(path):
    """SAELens's ``HookedSAETransformer`` on the tiny checkpoint at ``path``, unprocessed, loaded
    by TransformerLens 3's own converters (its ``from_pretrained`` takes official names only)."""
    from vlens.hooked.twin_models import hooked_transformer

    return hooked_transformer(path, torch.device("cpu"), torch.float32,
                              model_class=sae_lens.HookedSAETransformer)


def test_sae_feature_gradients_are_saelens_own(hooked):
    """Beside SAELens the gradient twin is TransformerLens 3's ``HookedTransformer``: an SAE
    added with ``add_sae`` gives its features' gradient (a backward hook on
    ``hook_sae_acts_post``) as SAELens's ``HookedSAETransformer`` does on the same checkpoint,
    and the twin's logits are the engine's."""
    from vlens.testing.tiny import tiny_model

    model = hooked("llama")
    sae = saelens_sae("standard", model.cfg.d_model)
    feature = f"{NAME}.hook_sae_acts_post"
    tokens = model.to_tokens(TEXTS)
    real = tokens != model.tokenizer.pad_token_id
    real[:, 0] = True

    def gradient_of(run, add_hook):
        grads = {}
        add_hook(feature, lambda grad, hook: grads.setdefault(hook.name, grad.detach().clone()))
        logits = run(tokens)
        (logits[real].log_softmax(-1)[:, 7]).sum().backward()
        return logits.detach(), grads[feature]

    engine_logits = model(tokens)
    model.add_sae(sae)
    try:
        ours_logits, ours = gradient_of(model, lambda name, fn: model.add_hook(name, fn, dir="bwd"))
        assert type(model.gradient_twin()).__name__ == "HookedTransformer"
    finally:
        model.reset_hooks(including_permanent=True)
        model.reset_saes()
        model.free_gradient_twin()
    theirs_model = saelens_model(tiny_model("llama"))
    theirs_model.add_sae(sae)
    _, theirs = gradient_of(theirs_model,
                            lambda name, fn: theirs_model.add_hook(name, fn, dir="bwd"))
    with torch.no_grad():
        plain = saelens_model(tiny_model("llama"))(tokens)
    scale = plain[real].abs().max()
    assert ((engine_logits[real] - plain[real]).abs().max() / scale).item() <= 1e-4
    assert theirs.abs().max() > 0
    error = (ours[real] - theirs[real]).abs().max() / theirs[real].abs().max()
    assert error.item() <= 1e-4, error
    assert ours_logits.shape == engine_logits.shape
