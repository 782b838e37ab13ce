"""vlens.sae against SAELens itself: the SAEs in parity/references/sae/ were built, saved and run
by SAELens (parity/sae_reference.py); vlens loads the same folders and must compute the same
values. SAELens is not needed here.

Tolerance: 1e-6 of the largest magnitude of each compared tensor. vlens keeps SAELens's order of
floating-point operations, so on one machine the values agree bit for bit; what may differ
elsewhere is the summation order of a matrix product (64 or 96 float32 terms, each rounding at
~6e-8 of the running sum), which stays far below 1e-6 of the tensor's scale. The sparsity
pattern (which features fire) is compared exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from vlens.sae import HOOK_NAMES, SAE, SAEConfig, SAEFormatError
from vlens.testing.saes import random_sae

REFERENCES = Path(__file__).resolve().parents[2] / "parity" / "references" / "sae"
VARIANTS = [
    "standard",
    "standard_expected_average",
    "standard_constant_norm",
    "standard_layer_norm",
    "jumprelu",
    "topk",
    "topk_rescale_no_b_dec_in",
    "gated",
    "hook_z",
]
RTOL = 1e-6


def reference(variant: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(REFERENCES / variant / "reference.safetensors")


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    scale = want.abs().max().clamp(min=1e-30)
    error = ((got - want).abs().max() / scale).item()
    assert error <= RTOL, f"{what}: differs from SAELens by {error:.2e} of its largest value"


def copy_variant(variant: str, tmp_path: Path) -> Path:
    folder = tmp_path / variant
    shutil.copytree(REFERENCES / variant, folder)
    return folder


def rewrite_cfg(folder: Path, change) -> None:
    path = folder / "cfg.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def test_every_reference_variant_is_tested() -> None:
    assert sorted(p.name for p in REFERENCES.iterdir() if p.is_dir()) == sorted(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_saelens(variant: str) -> None:
    want = reference(variant)
    sae = SAE.load_from_disk(REFERENCES / variant)
    x = want["input"]

    encoded = sae.encode(x)
    assert_matches(encoded, want["encode"], "encode")
    assert torch.equal(encoded != 0, want["encode"] != 0), "a different set of features fires"
    # decode right after encode, as the reference did: it undoes that input's normalisation
    assert_matches(sae.decode(want["feature_acts"]), want["decode"], "decode")
    assert_matches(sae(x), want["forward"], "forward")

    stages = sae.stages(x)
    assert list(stages) == [name for name in HOOK_NAMES if name != "hook_sae_error"]
    for name, value in stages.items():
        assert_matches(value, want[f"cache.{name}"], name)

    sae.use_error_term = True
    assert_matches(sae(x), want["error_term.forward"], "forward with the error term")
    stages = sae.stages(x)
    assert list(stages) == list(HOOK_NAMES)
    for name in ("hook_sae_error", "hook_sae_output"):
        assert_matches(stages[name], want[f"error_term.cache.{name}"], f"{name} (error term)")
    for name in ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons"):
        assert_matches(stages[name], want[f"cache.{name}"], f"{name} (error term)")


def test_config_read_from_saelens_folders() -> None:
    topk = SAEConfig.read(REFERENCES / "topk_rescale_no_b_dec_in")
    assert (topk.architecture, topk.k, topk.rescale_acts_by_decoder_norm) == ("topk", 8, True)
    assert (topk.d_in, topk.d_sae, topk.dtype) == (64, 96, "float32")
    assert topk.apply_b_dec_to_input is False
    assert topk.hook_name == "blocks.1.hook_resid_post"  # under metadata in SAELens 6
    assert topk.model_name == "tiny-model"
    hook_z = SAEConfig.read(REFERENCES / "hook_z")
    assert (hook_z.reshape_activations, hook_z.hook_name) == ("hook_z", "blocks.1.attn.hook_z")
    sae = SAE.load_from_disk(REFERENCES / "gated")
    assert sae.b_enc is None and sae.threshold is None
    assert {name for name, _ in sae.named_parameters()} == {
        "W_enc", "W_dec", "b_dec", "b_gate", "b_mag", "r_mag"
    }


def saelens_5_layout(cfg: dict) -> dict:
    """The same SAE as an SAELens 5 cfg.json: everything at the top level, older key names."""
    metadata = cfg.pop("metadata")
    return {
        **{key: value for key, value in cfg.items() if key != "reshape_activations"},
        "activation_fn_str": "relu",
        "activation_fn_kwargs": {},
        "finetuning_scaling_factor": False,
        "hook_point": metadata["hook_name"],
        "hook_point_layer": 1,
        "hook_point_head_index": None,
        "model_name": metadata["model_name"],
        "dtype": "torch.float32",
        "normalize_activations": False,
        "sae_lens_training_version": "5.9.1",
    }


def test_reads_configs_from_before_saelens_6(tmp_path: Path) -> None:
    folder = copy_variant("standard", tmp_path)
    rewrite_cfg(folder, saelens_5_layout)
    sae = SAE.load_from_disk(folder)
    assert (sae.cfg.hook_name, sae.cfg.normalize_activations, sae.cfg.dtype) == (
        "blocks.1.hook_resid_post", "none", "float32"
    )
    want = reference("standard")
    assert_matches(sae(want["input"]), want["forward"], "forward")

    # TopK before SAELens 6: a standard architecture whose activation function is topk.
    folder = copy_variant("topk", tmp_path)
    rewrite_cfg(folder, lambda cfg: {
        **saelens_5_layout(cfg), "architecture": "standard",
        "activation_fn_str": "topk", "activation_fn_kwargs": {"k": cfg["k"]},
    })
    sae = SAE.load_from_disk(folder)
    assert (sae.cfg.architecture, sae.cfg.k) == ("topk", 8)
    want = reference("topk")
    assert_matches(sae.encode(want["input"]), want["encode"], "encode")


def test_dtype_and_device_of_load() -> None:
    sae = SAE.load_from_disk(REFERENCES / "jumprelu", device="cpu", dtype="float64")
    assert sae.dtype == torch.float64 and sae.cfg.dtype == "float64"
    assert SAE.load_from_disk(REFERENCES / "jumprelu", dtype=torch.bfloat16).W_dec.dtype == (
        torch.bfloat16
    )
    want = reference("jumprelu")
    got = sae.encode(want["input"])  # the input is cast to the SAE's dtype, as in SAELens
    assert got.dtype == torch.float64
    assert torch.allclose(got.float(), want["encode"], rtol=1e-5, atol=1e-5)


def test_decode_needs_what_encode_measured() -> None:
    sae = SAE.load_from_disk(REFERENCES / "standard_constant_norm")
    with pytest.raises(RuntimeError, match="call encode first"):
        sae.decode(torch.zeros(2, 96))
    hook_z = SAE.load_from_disk(REFERENCES / "hook_z")
    with pytest.raises(RuntimeError, match="pass d_head"):
        hook_z.decode(torch.zeros(2, 96))
    assert hook_z.decode(torch.zeros(2, 96), d_head=16).shape == (2, 4, 16)
    with pytest.raises(ValueError, match=r"n_heads × d_head = d_in \(64\)"):
        hook_z.encode(torch.zeros(2, 64))


def test_error_term_gives_the_input_back() -> None:
    want = reference("topk")
    sae = SAE.load_from_disk(REFERENCES / "topk")
    sae.use_error_term = True
    assert torch.allclose(sae(want["input"]), want["input"], atol=1e-5)


# --- refusals -----------------------------------------------------------------------------


def test_refuses_a_folder_that_is_not_an_sae(tmp_path: Path) -> None:
    with pytest.raises(SAEFormatError) as caught:
        SAE.load_from_disk(tmp_path)
    message = str(caught.value)
    assert "no cfg.json and no sae_weights.safetensors" in message
    assert "a SAELens SAE folder holds cfg.json" in message and "save_model" in message

    folder = copy_variant("standard", tmp_path)
    (folder / "sae_weights.safetensors").unlink()
    with pytest.raises(SAEFormatError, match="has no sae_weights.safetensors; a SAELens SAE"):
        SAE.load_from_disk(folder)
    with pytest.raises(SAEFormatError, match="is not a folder"):
        SAE.load_from_disk(tmp_path / "nowhere")


def test_refuses_an_unknown_architecture(tmp_path: Path) -> None:
    folder = copy_variant("standard", tmp_path)
    rewrite_cfg(folder, lambda cfg: {**cfg, "architecture": "matryoshka"})
    with pytest.raises(SAEFormatError) as caught:
        SAE.load_from_disk(folder)
    message = str(caught.value)
    assert "'matryoshka' is not supported" in message
    assert "standard, jumprelu, topk, gated" in message and "cfg.json" in message


def test_refuses_missing_weights(tmp_path: Path) -> None:
    folder = copy_variant("standard", tmp_path)  # standard weights: no threshold
    rewrite_cfg(folder, lambda cfg: {**cfg, "architecture": "jumprelu"})
    with pytest.raises(SAEFormatError) as caught:
        SAE.load_from_disk(folder)
    message = str(caught.value)
    assert "lacks threshold, which a jumprelu SAE needs" in message
    assert "check that cfg.json names the architecture" in message


def test_refuses_unexpected_or_misshapen_weights(tmp_path: Path) -> None:
    folder = copy_variant("jumprelu", tmp_path)
    rewrite_cfg(folder, lambda cfg: {**cfg, "architecture": "standard"})
    with pytest.raises(SAEFormatError, match="holds threshold, which a standard SAE does not use"):
        SAE.load_from_disk(folder)
    folder = copy_variant("standard", tmp_path)
    rewrite_cfg(folder, lambda cfg: {**cfg, "d_sae": 95})
    with pytest.raises(SAEFormatError, match=r"W_enc has shape \[64, 96\].*needs \[64, 95\]"):
        SAE.load_from_disk(folder)


def test_refuses_unsupported_settings(tmp_path: Path) -> None:
    folder = copy_variant("standard", tmp_path)
    rewrite_cfg(folder, lambda cfg: {**cfg, "normalize_activations": "batch_norm"})
    with pytest.raises(SAEFormatError) as caught:
        SAE.load_from_disk(folder)
    assert "'batch_norm' is not supported" in str(caught.value)
    assert "none, expected_average_only_in" in str(caught.value)
    assert "constant_norm_rescale, layer_norm" in str(caught.value)

    folder = copy_variant("topk", tmp_path / "k")
    rewrite_cfg(folder, lambda cfg: {**cfg, "k": 200})
    with pytest.raises(SAEFormatError, match=r"needs k, the number of features kept, between 1"):
        SAE.load_from_disk(folder)


# --- random SAEs in SAELens's format ------------------------------------------------------


def cfg_keys(folder: Path) -> tuple[list[str], list[str]]:
    cfg = json.loads((folder / "cfg.json").read_text())
    return list(cfg), list(cfg["metadata"])


@pytest.mark.parametrize(
    ("architecture", "saved_by_saelens"),
    [("standard", "standard"), ("jumprelu", "jumprelu"), ("topk", "topk"), ("gated", "gated")],
)
def test_random_sae_writes_saelens_layout(
    architecture: str, saved_by_saelens: str, tmp_path: Path
) -> None:
    hook_name = "blocks.1.hook_resid_post"
    folder = random_sae(tmp_path / architecture, architecture, hook_name=hook_name)
    assert cfg_keys(folder) == cfg_keys(REFERENCES / saved_by_saelens)
    sae = SAE.load_from_disk(folder)
    assert (sae.cfg.architecture, sae.cfg.hook_name) == (architecture, hook_name)
    saved = safetensors.torch.load_file(REFERENCES / saved_by_saelens / "sae_weights.safetensors")
    written = safetensors.torch.load_file(folder / "sae_weights.safetensors")
    assert {name: t.shape for name, t in written.items()} == {
        name: t.shape for name, t in saved.items()
    }
    acts = sae.encode(torch.randn(5, 64, generator=torch.Generator().manual_seed(0)))
    assert 0 < int((acts != 0).sum(-1).min()) < 96  # some features fire, not all


def test_random_hook_z_sae(tmp_path: Path) -> None:
    folder = random_sae(tmp_path / "z", hook_name="blocks.1.attn.hook_z", seed=3)
    assert cfg_keys(folder) == cfg_keys(REFERENCES / "hook_z")
    sae = SAE.load_from_disk(folder)
    x = torch.randn(3, 5, 4, 16, generator=torch.Generator().manual_seed(1))
    stages = sae.stages(x)
    assert stages["hook_sae_input"].shape == (3, 5, 64)
    assert stages["hook_sae_acts_post"].shape == (3, 5, 96)
    assert stages["hook_sae_output"].shape == x.shape


def test_metadata_reads_as_saelens_reads_it(tmp_path: Path) -> None:
    """``cfg.metadata.hook_name`` and ``cfg.metadata["hook_name"]`` alike, None for a key the
    file lacks, ``in`` and ``get`` seeing only those it has (SAELens's ``SAEMetadata``)."""
    sae = SAE.load_from_disk(random_sae(tmp_path / "sae", hook_name="blocks.1.hook_resid_pre"))
    metadata = sae.cfg.metadata
    assert metadata.hook_name == metadata["hook_name"] == "blocks.1.hook_resid_pre"
    assert metadata.no_such_key is None and metadata["no_such_key"] is None
    assert "hook_name" in metadata and "no_such_key" not in metadata
    assert metadata.get("no_such_key", 3) == 3
    assert metadata.to_dict()["hook_name"] == "blocks.1.hook_resid_pre"
    by_hand = SAEConfig("standard", 4, 8, metadata={"hook_name": "x"})
    assert by_hand.metadata.hook_name == "x"


class _SAELensLike(torch.nn.Module):
    """SAELens 6's public surface of an SAE, as ``SAE.of`` reads it."""

    def __init__(self, sae: SAE) -> None:
        super().__init__()
        raw = {"architecture": sae.cfg.architecture, "d_in": sae.cfg.d_in, "d_sae": sae.cfg.d_sae,
               "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
               "normalize_activations": "none", "reshape_activations": "none",
               "metadata": {"hook_name": sae.cfg.hook_name, "sae_lens_version": "6.54.12"}}
        self.cfg = type("Cfg", (), {"to_dict": lambda _: raw})()
        self.use_error_term = True
        for name, value in sae.named_parameters():
            self.register_parameter(name, torch.nn.Parameter(value.detach().clone()))


def test_an_saelens_sae_is_taken_as_it_is(tmp_path: Path) -> None:
    """``SAE.of`` reads SAELens's object through its config and parameters: the same numbers,
    the same tensors (shared), its ``use_error_term``; what is not an SAE is refused."""
    ours = SAE.load_from_disk(random_sae(tmp_path / "sae", "jumprelu", d_in=16, d_sae=32))
    theirs = _SAELensLike(ours)
    taken = SAE.of(theirs)
    assert taken.use_error_term and taken.cfg.architecture == "jumprelu"
    assert taken.W_enc.data_ptr() == theirs.W_enc.data_ptr()
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(taken.encode(x), ours.encode(x), rtol=0, atol=0)
    assert SAE.of(ours) is ours
    with pytest.raises(TypeError, match="SAE.load_from_disk"):
        SAE.of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("architecture", ["standard", "jumprelu"])
def test_folding_the_decoder_norm_keeps_the_output(tmp_path: Path, architecture: str) -> None:
    sae = SAE.load_from_disk(random_sae(tmp_path / "sae", architecture, d_in=16, d_sae=32))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    before = sae(x)
    sae.fold_W_dec_norm()
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(32))
    torch.testing.assert_close(sae(x), before, rtol=1e-5, atol=1e-5)


def test_folding_a_topk_sae_is_refused(tmp_path: Path) -> None:
    sae = SAE.load_from_disk(random_sae(tmp_path / "sae", "topk", d_in=16, d_sae=32, k=4))
    with pytest.raises(NotImplementedError, match="which features"):
        sae.fold_W_dec_norm()


def test_from_pretrained_reads_a_hub_repository_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    """Without SAELens, ``release`` is a HuggingFace repository and ``sae_id`` the folder in it;
    HuggingFace's cache is asked first, and a download only for what it lacks."""
    from vlens.sae import pretrained

    monkeypatch.setattr(pretrained, "sae_lens_installed", lambda: False)
    random_sae(tmp_path / "repo" / "layer_0", "standard", d_in=16, d_sae=32)
    asked: list[dict] = []

    def snapshot_download(repo_id: str, **options) -> str:
        asked.append({"repo_id": repo_id, **options})
        return str(tmp_path / "repo")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    sae = SAE.from_pretrained("owner/saes", "layer_0", fold_W_dec_norm=True)
    assert sae.cfg.d_sae == 32
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(32))
    assert asked == [{"repo_id": "owner/saes", "local_files_only": True,
                      "allow_patterns": ["layer_0/cfg.json", "layer_0/sae_weights.safetensors"]}]
    with pytest.raises(pretrained.PretrainedSAEError, match="sae_id names the folder"):
        SAE.from_pretrained("owner/saes", "layer_9")


def test_from_pretrained_offline_names_the_folder_to_load(monkeypatch) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vlens.sae import pretrained

    monkeypatch.setattr(pretrained, "sae_lens_installed", lambda: False)

    def offline(repo_id: str, **options) -> str:
        raise LocalEntryNotFoundError("no connection and not in the cache")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(pretrained.PretrainedSAEError, match=r"SAE\.load_from_disk\(folder\)"):
        SAE.from_pretrained("owner/saes", "layer_0")
    with pytest.raises(pretrained.PretrainedSAEError, match="install.sh saelens"):
        SAE.from_pretrained("gpt2-small-res-jb", "blocks.8.hook_resid_pre")
