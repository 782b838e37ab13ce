"""Research tools on a ``HookedVLLM``: the logit lens (:mod:`vlens.analysis.lens`). (The
weights TransformerLens's ``ActivationCache`` analysis reads are :mod:`vlens.names.weight_views`.)"""
