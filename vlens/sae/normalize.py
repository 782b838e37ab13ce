"""The input normalisation an SAE applies before encoding, and its inverse after decoding.

SAELens's ``normalize_activations`` modes, as its inference SAEs run them:

- ``none``, ``expected_average_only_in``, ``covariance_whitening``: nothing at run time. The
  last two are dataset statistics (a scaling factor; a whitening map) that SAELens folds into
  the weights at the end of training or when its pretrained registry knows the factor; a
  folder saved with them unfolded expects inputs already transformed, in SAELens as here.
- ``constant_norm_rescale``: each input vector is scaled to norm √d_in,
  ``x · c`` with ``c = √d_in / ‖x‖``, and the reconstruction is divided by the same ``c``.
- ``layer_norm``: ``(x − μ) / (σ + 1e-5)`` with μ and σ the mean and the Bessel-corrected
  standard deviation of each input vector; the reconstruction becomes ``y · σ + μ`` (no ε on
  the way out, as in SAELens).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True, eq=False)
class Restore:
    """Takes a reconstruction back to the scale of the input it came from: ``y / coeff``
    (constant_norm_rescale), ``y · std + mean`` (layer_norm), or ``y`` unchanged."""

    coeff: Float[Tensor, "... 1"] | None = None
    std: Float[Tensor, "... 1"] | None = None
    mean: Float[Tensor, "... 1"] | None = None

    def __call__(self, y: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_in"]:
        if self.coeff is not None:
            return y / self.coeff
        if self.std is not None and self.mean is not None:
            return y * self.std + self.mean
        return y

    def linear(self, change: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_in"]:
        """What a change ``change`` of the reconstruction becomes after :meth:`__call__`: its
        linear part only (a difference loses the mean)."""
        if self.coeff is not None:
            return change / self.coeff
        if self.std is not None:
            return change * self.std
        return change


UNCHANGED = Restore()


def normalize(
    x: Float[Tensor, "... d_in"], mode: str, d_in: int
) -> tuple[Float[Tensor, "... d_in"], Restore]:
    """``x`` as the SAE's encoder expects it under ``mode``, and how to undo that on the
    decoder's output (the statistics are those of this ``x``, vector by vector)."""
    if mode == "constant_norm_rescale":
        coeff = d_in**0.5 / x.norm(dim=-1, keepdim=True)
        return x * coeff, Restore(coeff=coeff)
    if mode == "layer_norm":
        mean = x.mean(dim=-1, keepdim=True)
        centred = x - mean
        std = centred.std(dim=-1, keepdim=True)
        return centred / (std + LAYER_NORM_EPS), Restore(std=std, mean=mean)
    return x, UNCHANGED
