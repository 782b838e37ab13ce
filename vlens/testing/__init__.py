"""What serves development: tiny random checkpoints (:mod:`vlens.testing.tiny`), the embedded
SmolLM2 (:mod:`vlens.testing.embedded`) and the generated tables of the docs."""

from vlens.testing.tiny import tiny_model

__all__ = ["tiny_model"]
