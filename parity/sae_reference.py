"""Reference values for :mod:`vlens.sae`, computed by SAELens itself.

For each variant below this script builds a seeded random SAE with SAELens's own inference
classes, saves it with SAELens's own ``save_model`` into ``parity/references/sae/<variant>/``
(``cfg.json`` + ``sae_weights.safetensors``, exactly as SAELens writes them) and records, on a
seeded input, what SAELens computes: ``encode``, ``decode``, ``forward`` and every
``hook_sae_*`` value its hook points hold (``run_with_cache`` on the SAE, a HookedRootModule),
once plain and once with ``use_error_term=True`` (set on the SAE; SAELens's
``HookedSAETransformer.add_sae(sae, use_error_term=True)`` computes the same through its
wrapper). They go to ``reference.safetensors`` beside
the SAE:

- ``input``: the input (``[10, d_in]``; ``[10, n_heads, d_head]`` for hook_z);
- ``encode``, ``forward``: ``sae.encode(input)``, ``sae.forward(input)``;
- ``feature_acts`` and ``decode``: seeded sparse non-negative feature activations and
  ``sae.decode(feature_acts)``, called right after ``encode(input)`` (the input normalisations
  that decode undoes read the statistics that the last encode measured);
- ``cache.<hook>``: the cache of ``run_with_cache(input)``;
- ``error_term.forward``, ``error_term.cache.hook_sae_error`` and
  ``error_term.cache.hook_sae_output``: the same with ``use_error_term=True`` (its other hooks
  hold what the plain run's do, which the script asserts).

The file's safetensors metadata holds the SAELens and torch versions.

This script imports only SAELens, torch, safetensors and the standard library, never vlens: it
runs in its own environment, because SAELens requires transformer-lens < 4 and vlens 4.x::

    python3 -m venv /work/saelens-env
    /work/saelens-env/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /work/saelens-env/bin/pip install sae-lens
    /work/saelens-env/bin/python parity/sae_reference.py

The committed references were made with sae-lens 6.54.12, transformer-lens 3.9.0 and
torch 2.13.0+cpu.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sae_lens
import safetensors.torch
import torch
from sae_lens import (
    GatedSAE,
    GatedSAEConfig,
    JumpReLUSAE,
    JumpReLUSAEConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
)
from sae_lens.saes.sae import SAEMetadata

D_IN, D_SAE, ROWS = 64, 96, 10
N_HEADS, D_HEAD = 4, 16
HERE = Path(__file__).resolve().parent / "references" / "sae"

CLASSES: dict[str, tuple[type, type]] = {
    "standard": (StandardSAE, StandardSAEConfig),
    "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
    "topk": (TopKSAE, TopKSAEConfig),
    "gated": (GatedSAE, GatedSAEConfig),
}


@dataclass(frozen=True)
class Variant:
    name: str
    architecture: str
    seed: int
    hook_name: str = "blocks.1.hook_resid_post"
    settings: dict[str, Any] = field(default_factory=dict)


VARIANTS = [
    Variant("standard", "standard", 1),
    Variant(
        "standard_expected_average", "standard", 3,
        settings={"normalize_activations": "expected_average_only_in"},
    ),
    Variant(
        "standard_constant_norm", "standard", 4,
        settings={"normalize_activations": "constant_norm_rescale"},
    ),
    Variant("standard_layer_norm", "standard", 5, settings={"normalize_activations": "layer_norm"}),
    Variant("jumprelu", "jumprelu", 6),
    Variant("topk", "topk", 7, settings={"k": 8}),
    Variant(
        "topk_rescale_no_b_dec_in", "topk", 8,
        settings={"k": 8, "rescale_acts_by_decoder_norm": True, "apply_b_dec_to_input": False},
    ),
    Variant("gated", "gated", 9),
    Variant(
        "hook_z", "standard", 10, hook_name="blocks.1.attn.hook_z",
        settings={"reshape_activations": "hook_z"},
    ),
]


def metadata(hook_name: str) -> SAEMetadata:
    """What SAELens's training runner records about the model an SAE was trained on."""
    return SAEMetadata(
        dataset_path="",
        hook_name=hook_name,
        model_name="tiny-model",
        model_class_name="HookedTransformer",
        hook_head_index=None,
        context_size=128,
        seqpos_slice=(None,),
        model_from_pretrained_kwargs={"center_writing_weights": False},
        prepend_bos=True,
        exclude_special_tokens=False,
        sequence_separator_token="bos",
        disable_concat_sequences=False,
    )


def randomize(sae: Any, architecture: str, gen: torch.Generator) -> None:
    """Replace SAELens's initialisation (zero biases and thresholds, tied encoder) by seeded
    values that make every term matter: biases non-zero, encoder untied from the decoder,
    JumpReLU thresholds that cut some positive pre-activations (a few negative, where only the
    ReLU can zero a unit), TopK biases low enough that some rows have fewer than k positive
    pre-activations, and gate and magnitude paths that disagree."""

    def draw(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale + shift

    with torch.no_grad():
        sae.W_enc.copy_(draw(D_IN, D_SAE, scale=D_IN**-0.5))
        sae.W_dec.copy_(draw(D_SAE, D_IN, scale=D_SAE**-0.5))
        sae.b_dec.copy_(draw(D_IN, scale=0.5))
        if architecture in ("standard", "jumprelu"):
            sae.b_enc.copy_(draw(D_SAE, scale=0.3))
        if architecture == "topk":
            sae.b_enc.copy_(draw(D_SAE, scale=0.3, shift=-3.5))
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(D_SAE, generator=gen) * 1.2 - 0.2)
        if architecture == "gated":
            sae.b_gate.copy_(draw(D_SAE, scale=0.3))
            sae.b_mag.copy_(draw(D_SAE, scale=0.3))
            sae.r_mag.copy_(draw(D_SAE, scale=0.3))


def build(variant: Variant) -> Any:
    sae_class, cfg_class = CLASSES[variant.architecture]
    cfg = cfg_class(
        d_in=D_IN, d_sae=D_SAE, dtype="float32", device="cpu",
        metadata=metadata(variant.hook_name), **variant.settings,
    )
    sae = sae_class(cfg)
    randomize(sae, variant.architecture, torch.Generator().manual_seed(variant.seed))
    return sae.eval()


def inputs(variant: Variant) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded input far from unit scale (so that constant_norm_rescale and layer_norm change
    it), and seeded sparse non-negative feature activations for decode."""
    gen = torch.Generator().manual_seed(1000 + variant.seed)
    shape = (ROWS, N_HEADS, D_HEAD) if variant.hook_name.endswith("hook_z") else (ROWS, D_IN)
    x = torch.randn(*shape, generator=gen) * 3.0 + 0.5
    acts = torch.rand(ROWS, D_SAE, generator=gen) * 2.0
    acts = acts * (torch.rand(ROWS, D_SAE, generator=gen) < 0.1)
    return x, acts


def record(variant: Variant) -> dict[str, torch.Tensor]:
    """Save the SAE as SAELens saves it, load it back with SAELens's load_from_disk (so that
    the values come from the files as SAELens reads them), and record what it computes."""
    folder = HERE / variant.name
    if folder.exists():
        shutil.rmtree(folder)
    build(variant).save_model(folder)
    sae = CLASSES[variant.architecture][0].load_from_disk(folder)
    x, feature_acts = inputs(variant)
    values: dict[str, torch.Tensor] = {"input": x, "feature_acts": feature_acts}
    with torch.no_grad():
        values["encode"] = sae.encode(x)
        values["decode"] = sae.decode(feature_acts)
        values["forward"] = sae.forward(x)
        _, plain = sae.run_with_cache(x)
        values.update({f"cache.{name}": value for name, value in plain.items()})
        sae.use_error_term = True
        values["error_term.forward"] = sae.forward(x)
        _, with_error = sae.run_with_cache(x)
    # The hooks before the output see the same values with and without the error term (its
    # clean pass runs with the hooks off); only the error and the output are kept from it.
    for name, value in plain.items():
        if name != "hook_sae_output":
            assert torch.equal(with_error[name], value), (variant.name, name)
    for name in ("hook_sae_error", "hook_sae_output"):
        values[f"error_term.cache.{name}"] = with_error[name]
    return {name: value.clone().contiguous() for name, value in values.items()}


def describe(variant: Variant, values: dict[str, torch.Tensor]) -> str:
    acts, pre = values["cache.hook_sae_acts_post"], values["cache.hook_sae_acts_pre"]
    active = (acts != 0).sum(-1).tolist()
    positive = (pre > 0).sum(-1).tolist()
    return f"{variant.name:28s} active per row {active}  positive pre-activations {positive}"


def main() -> int:
    warnings.simplefilter("ignore")  # model_from_pretrained_kwargs and use_error_term notices
    torch.manual_seed(0)
    versions = {"sae_lens_version": sae_lens.__version__, "torch_version": torch.__version__}
    for variant in VARIANTS:
        values = record(variant)
        safetensors.torch.save_file(
            values, str(HERE / variant.name / "reference.safetensors"), metadata=versions
        )
        print(describe(variant, values))
    print(json.dumps(versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
