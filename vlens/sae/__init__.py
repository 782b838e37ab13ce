"""SAELens's sparse autoencoders, read from the folders SAELens saves, run without SAELens.

``SAE.load_from_disk(folder)`` (:mod:`vlens.sae.autoencoder`) reads ``cfg.json``
(:mod:`vlens.sae.config`) and ``sae_weights.safetensors`` (:mod:`vlens.sae.weights`) of the
standard, jumprelu, topk and gated architectures, and computes SAELens's ``encode``,
``decode``, ``forward`` and the values of its ``hook_sae_*`` hook points (``SAE.stages``).
"""

from vlens.sae.autoencoder import HOOK_NAMES, SAE
from vlens.sae.config import ARCHITECTURES, NORMALIZATIONS, SAEConfig, SAEFormatError
from vlens.sae.weights import read_log_sparsity

__all__ = [
    "ARCHITECTURES",
    "HOOK_NAMES",
    "NORMALIZATIONS",
    "SAE",
    "SAEConfig",
    "SAEFormatError",
    "read_log_sparsity",
]
