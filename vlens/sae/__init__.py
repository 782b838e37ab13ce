"""SAELens's sparse autoencoders, read from the folders SAELens saves, run without SAELens.

``SAE.load_from_disk(folder)`` (:mod:`vlens.sae.autoencoder`) reads ``cfg.json``
(:mod:`vlens.sae.config`) and ``sae_weights.safetensors`` (:mod:`vlens.sae.weights`) of the
standard, jumprelu, topk and gated architectures, and computes SAELens's ``encode``,
``decode``, ``forward`` and the values of its ``hook_sae_*`` hook points (``SAE.stages``).
``SAE.from_pretrained(release, sae_id)`` takes SAELens's names for published SAEs
(:mod:`vlens.sae.pretrained`).

The lowest layer of vlens: it imports nothing else of vlens, so that a vLLM worker that unpickles
an SAE loads its numerics alone. What a model does with an SAE is elsewhere: splicing it in
(``HookedVLLM.add_sae``), editing its features as data on a compiled engine
(:class:`vlens.SAESteer`), batches of activations to train one (:func:`vlens.store.activation_batches`).
"""

from vlens.sae.autoencoder import HOOK_NAMES, SAE
from vlens.sae.config import ARCHITECTURES, NORMALIZATIONS, SAEConfig, SAEFormatError
from vlens.sae.pretrained import PretrainedSAEError
from vlens.sae.weights import read_log_sparsity

__all__ = [
    "ARCHITECTURES",
    "HOOK_NAMES",
    "NORMALIZATIONS",
    "PretrainedSAEError",
    "SAE",
    "SAEConfig",
    "SAEFormatError",
    "read_log_sparsity",
]
