"""vlens: TransformerLens's hook names and habits on models served by vLLM."""

from vlens.hooked import HookedVLLM

__all__ = ["HookedVLLM"]
