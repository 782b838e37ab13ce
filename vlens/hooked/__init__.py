"""TransformerLens's ``HookedTransformer`` surface on a vLLM engine: ``HookedVLLM``
(:mod:`vlens.hooked.model`), a checkpoint plus an engine, and what it answers with: tokens,
``cfg``, module-like views and weights, hook points, added hooks, ``generate``, a forward's return
types, TransformerLens's ``ActivationCache`` and SAELens's ``HookedSAETransformer`` methods. Every
call goes through :mod:`vlens.engine`."""
