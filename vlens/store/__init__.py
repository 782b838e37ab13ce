"""Activations of many prompts on disk (``vlens cache``): the store's writer
(:mod:`vlens.store.activations`) and its manifest and checks (:mod:`vlens.store.manifest`)."""
