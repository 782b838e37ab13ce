"""TransformerLens's ``HookedTransformer`` surface on a vLLM engine: ``HookedVLLM``
(:mod:`vlens.hooked.model`) and what it answers with, tokens, ``cfg``, module-like views, hook
points, added hooks, ``generate`` and a forward's return types. It delegates every call to
:mod:`vlens.engine`."""
