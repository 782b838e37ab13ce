"""vlens: TransformerLens's hook names and habits on models served by vLLM."""

from vlens.hooked import HookedVLLM
from vlens.tree import weightless_model

__all__ = ["HookedVLLM", "weightless_model"]
