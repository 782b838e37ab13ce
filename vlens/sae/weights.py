"""An SAE's tensors, read from the ``sae_weights.safetensors`` that SAELens saves.

The tensors are named as SAELens names its parameters: every architecture has ``W_enc``
``[d_in, d_sae]``, ``W_dec`` ``[d_sae, d_in]`` and ``b_dec`` ``[d_in]``; standard, jumprelu and
topk add ``b_enc`` ``[d_sae]``; jumprelu adds ``threshold`` ``[d_sae]``; gated has no ``b_enc``
but ``b_gate``, ``b_mag`` and ``r_mag`` ``[d_sae]``. TopK's ``k`` is a setting, in cfg.json.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import Tensor

from vlens.sae.config import SPARSITY_FILENAME, WEIGHTS_FILENAME, SAEConfig, SAEFormatError

_SHARED = ("W_enc", "W_dec", "b_dec")
WEIGHT_NAMES: dict[str, tuple[str, ...]] = {
    "standard": (*_SHARED, "b_enc"),
    "jumprelu": (*_SHARED, "b_enc", "threshold"),
    "topk": (*_SHARED, "b_enc"),
    "gated": (*_SHARED, "b_gate", "b_mag", "r_mag"),
}
ALL_WEIGHT_NAMES = tuple(dict.fromkeys(name for names in WEIGHT_NAMES.values() for name in names))


def weight_shapes(cfg: SAEConfig) -> dict[str, tuple[int, ...]]:
    """The tensors an SAE of ``cfg``'s architecture has, and their shapes."""
    special = {"W_enc": (cfg.d_in, cfg.d_sae), "W_dec": (cfg.d_sae, cfg.d_in), "b_dec": (cfg.d_in,)}
    return {name: special.get(name, (cfg.d_sae,)) for name in WEIGHT_NAMES[cfg.architecture]}


def read_weights(
    folder: Path, cfg: SAEConfig, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """``folder``'s SAE tensors on ``device`` in ``cfg.dtype``, checked against ``cfg``."""
    path = folder / WEIGHTS_FILENAME
    try:
        tensors = safetensors.torch.load_file(path, device=str(device))
    except (SafetensorError, OSError) as error:
        raise SAEFormatError(f"{path} could not be read as safetensors ({error})") from None
    _drop_unit_scaling_factor(tensors)
    check_weights(tensors, cfg, where=str(path))
    return {name: tensor.to(cfg.torch_dtype) for name, tensor in tensors.items()}


def check_weights(tensors: dict[str, Tensor], cfg: SAEConfig, where: str) -> None:
    """Refuse tensors that do not make an SAE of ``cfg``'s architecture and sizes, naming what
    is missing, unexpected or of the wrong shape."""
    shapes = weight_shapes(cfg)
    kind = f"a {cfg.architecture} SAE"
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise SAEFormatError(
            f"{where} lacks {', '.join(missing)}, which {kind} needs (it holds "
            f"{', '.join(sorted(tensors)) or 'no tensors'}); an SAE of this architecture has "
            f"{', '.join(shapes)}: check that cfg.json names the architecture the weights are for"
        )
    unexpected = [name for name in tensors if name not in shapes]
    if unexpected:
        raise SAEFormatError(
            f"{where} holds {', '.join(unexpected)}, which {kind} does not use (it has "
            f"{', '.join(shapes)}); SAELens refuses such a file too: check cfg.json's architecture"
        )
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise SAEFormatError(
                f"{where}: {name} has shape {list(tensors[name].shape)}, but {kind} with "
                f"d_in={cfg.d_in} and d_sae={cfg.d_sae} needs {list(shape)}"
            )


def read_log_sparsity(folder: str | Path, device: str | torch.device = "cpu") -> Tensor | None:
    """The ``[d_sae]`` log10 firing frequencies that SAELens's training saves beside an SAE
    (``sparsity.safetensors``), or None when the folder has none."""
    path = Path(folder) / SPARSITY_FILENAME
    if not path.is_file():
        return None
    return safetensors.torch.load_file(path, device=str(device))["sparsity"]


def _drop_unit_scaling_factor(tensors: dict[str, Tensor]) -> None:
    """Files from before SAELens 6 may carry a ``scaling_factor`` of ones (to allclose), which
    scales nothing and which SAELens drops too; any other value is a fine-tuning factor that
    SAELens 6 refuses, and so does vlens (as an unexpected tensor)."""
    factor = tensors.get("scaling_factor")
    if factor is not None and torch.allclose(factor, torch.ones_like(factor)):
        del tensors["scaling_factor"]
