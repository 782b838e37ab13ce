"""The name vocabulary on the user's side: what a hook name means and where it is read.

The mapping files (``mappings/``) are written in :mod:`vlens.names.mapping`; a name the user
types is resolved to a canonical one in :mod:`vlens.names.resolve`; names computed after the
forward (attention patterns, per-head results) are :mod:`vlens.names.derived`; raw vLLM
locations are :mod:`vlens.names.raw`; a compiled engine's declared names are
:mod:`vlens.names.compiled`; checkpoint tensors the names need are :mod:`vlens.names.checkpoint`.
"""
