"""vlens: TransformerLens's hook names and habits on models served by vLLM."""

from vlens.hooked import HookedVLLM
from vlens.steering import Steer
from vlens.tree import weightless_model

__all__ = ["HookedVLLM", "Steer", "weightless_model"]
