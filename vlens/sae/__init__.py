"""SAELens's sparse autoencoders, read from the folders SAELens saves, run without SAELens.

``SAE.load_from_disk(folder)`` (:mod:`vlens.sae.autoencoder`) reads ``cfg.json``
(:mod:`vlens.sae.config`) and ``sae_weights.safetensors`` (:mod:`vlens.sae.weights`) of the
standard, jumprelu, topk and gated architectures, and computes SAELens's ``encode``,
``decode``, ``forward`` and the values of its ``hook_sae_*`` hook points (``SAE.stages``).
:func:`activation_batches` (:mod:`vlens.sae.batches`) streams shuffled activation batches from a
live model, for SAELens's ``SAETrainer``. :class:`SAESteer` edits features of an SAE in a compiled
engine's graph (``compiled_saes``), as data.
"""

from typing import Any

from vlens.runtime.steering import SAESteer
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
    "SAESteer",
    "activation_batches",
    "read_log_sparsity",
]


def __getattr__(name: str) -> Any:
    """:func:`activation_batches` on first use: it needs the model's side of vlens, which a
    worker process that unpickles a spliced SAE (this package's numerics only) must not load."""
    if name == "activation_batches":
        from vlens.sae.batches import activation_batches

        return activation_batches
    raise AttributeError(f"module 'vlens.sae' has no attribute {name!r}")
