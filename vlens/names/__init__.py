"""The vocabulary: what TransformerLens's names mean on a checkpoint, and what an engine can do
at each.

The mapping files (``mappings/``) are written in :mod:`vlens.names.mapping`; what a user types
is resolved to canonical names in one place (:mod:`vlens.names.resolve`); what an engine can read
and hook at each name, with its refusals, is :mod:`vlens.names.rules`; names computed after the
forward (attention patterns, per-head results) are :mod:`vlens.names.derived` and
:mod:`vlens.names.lazy_patterns`; raw vLLM locations are :mod:`vlens.names.raw`; a compiled
engine's declared names are :mod:`vlens.names.compiled`; the checkpoint's tensors
(:mod:`vlens.names.weights`) and TransformerLens's weight names on them
(:mod:`vlens.names.weight_views`).
"""
