"""Random SAEs in SAELens's saved format, for tests that must not need SAELens.

``random_sae(folder, "jumprelu", d_in=64, d_sae=96, hook_name="blocks.0.hook_resid_post")``
writes ``cfg.json`` and ``sae_weights.safetensors`` as SAELens 6's ``save_model`` writes them:
the same keys in the same order (the architecture's settings at the top level, what it knows
about the model under ``metadata``, the metadata keys of SAELens's training runner), weights
named as SAELens names them. The weights are seeded and drawn so that every term matters:
non-zero biases, an encoder untied from the decoder, JumpReLU thresholds that cut some positive
pre-activations, gate and magnitude paths that disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from vlens.sae.config import ARCHITECTURES, CFG_FILENAME, WEIGHTS_FILENAME, SAEConfig
from vlens.sae.weights import weight_shapes

# The SAELens release whose layout this writes; a version of 6 or more also tells readers
# (SAELens's and vlens's) that settings and metadata are where SAELens 6 puts them.
SAE_LENS_FORMAT_VERSION = "6.54.12"


def random_sae(
    folder: str | Path,
    architecture: str = "standard",
    d_in: int = 64,
    d_sae: int = 96,
    hook_name: str = "blocks.0.hook_resid_post",
    seed: int = 0,
    *,
    k: int = 8,
    apply_b_dec_to_input: bool = True,
    normalize_activations: str = "none",
    rescale_acts_by_decoder_norm: bool = False,
    hook_head_index: int | None = None,
    model_name: str = "tiny-model",
    dtype: str = "float32",
) -> Path:
    """Write a seeded random SAE to ``folder`` (created if needed) and return its path.

    ``k`` and ``rescale_acts_by_decoder_norm`` are TopK settings, written for topk only; a
    ``hook_name`` ending in ``hook_z`` gives ``reshape_activations="hook_z"``, as SAELens's
    training does for attention-head SAEs.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    reshape = "hook_z" if hook_name.endswith("hook_z") else "none"
    cfg: dict[str, Any] = {
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": dtype,
        "device": "cpu",
        "apply_b_dec_to_input": apply_b_dec_to_input,
        "normalize_activations": normalize_activations,
        "reshape_activations": reshape,
        "metadata": _metadata(hook_name, hook_head_index, model_name),
    }
    if architecture == "topk":
        cfg["k"] = k
        cfg["rescale_acts_by_decoder_norm"] = rescale_acts_by_decoder_norm
    cfg["architecture"] = architecture
    parsed = SAEConfig.from_dict(cfg)  # refuses what vlens (and SAELens) would not load

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = _random_weights(parsed, torch.Generator().manual_seed(seed))
    safetensors.torch.save_file(weights, str(folder / WEIGHTS_FILENAME))
    (folder / CFG_FILENAME).write_text(json.dumps(cfg))
    return folder


def _metadata(hook_name: str, hook_head_index: int | None, model_name: str) -> dict[str, Any]:
    """What SAELens's training runner records about the model, after the two versions that
    every SAELens 6 config carries."""
    return {
        "sae_lens_version": SAE_LENS_FORMAT_VERSION,
        "sae_lens_training_version": SAE_LENS_FORMAT_VERSION,
        "dataset_path": "",
        "hook_name": hook_name,
        "model_name": model_name,
        "model_class_name": "HookedTransformer",
        "hook_head_index": hook_head_index,
        "context_size": 128,
        "seqpos_slice": [None],
        "model_from_pretrained_kwargs": {"center_writing_weights": False},
        "prepend_bos": True,
        "exclude_special_tokens": False,
        "sequence_separator_token": "bos",
        "disable_concat_sequences": False,
    }


def _random_weights(cfg: SAEConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def normal(shape: tuple[int, ...], scale: float, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale + shift

    shapes = weight_shapes(cfg)
    weights = {
        "W_enc": normal(shapes["W_enc"], cfg.d_in**-0.5),
        "W_dec": normal(shapes["W_dec"], cfg.d_sae**-0.5),
        "b_dec": normal(shapes["b_dec"], 0.5),
    }
    for name in ("b_enc", "b_gate", "b_mag", "r_mag"):
        if name in shapes:
            weights[name] = normal(shapes[name], 0.3)
    if cfg.architecture == "topk":
        # Low enough that an input of unit scale has around k positive pre-activations, so
        # that both the choice and the ReLU after it matter.
        weights["b_enc"] = normal(shapes["b_enc"], 0.3, shift=-1.0)
    if "threshold" in shapes:
        # Mostly positive (a cut above zero), a few negative (where only the ReLU zeroes).
        weights["threshold"] = torch.rand(shapes["threshold"], generator=gen) * 1.2 - 0.2
    return {name: tensor.to(cfg.torch_dtype).contiguous() for name, tensor in weights.items()}
