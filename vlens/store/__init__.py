"""Activations of many prompts, for sparse autoencoders and other offline work: on disk
(``vlens cache``: the writer :mod:`vlens.store.activations`, its manifest and checks
:mod:`vlens.store.manifest`, SAELens's cached-activations format :mod:`vlens.store.saelens`, blocks
scheduled on Ray :mod:`vlens.store.on_ray`), or streamed from the engine as shuffled training
batches (:func:`activation_batches`, :mod:`vlens.store.batches`)."""

from vlens.store.batches import activation_batches

__all__ = ["activation_batches"]
