"""The sparse activation functions of SAELens's architectures, on pre-activations ``h``.

Each keeps SAELens's order of floating-point operations, so that the same weights and input
give the same feature activations bit for bit where the matrix products agree.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


def jump_relu(
    pre: Float[Tensor, "... d_sae"], threshold: Float[Tensor, " d_sae"]
) -> Float[Tensor, "... d_sae"]:
    """``ReLU(h) · [h > θ]``: a feature fires only above its threshold, and the ReLU still
    zeroes negative pre-activations where a threshold is below zero."""
    return torch.relu(pre) * (pre > threshold).to(pre.dtype)


def top_k(pre: Float[Tensor, "... d_sae"], k: int) -> Float[Tensor, "... d_sae"]:
    """The ``k`` largest pre-activations of each vector, through a ReLU, and zeros elsewhere.

    The ReLU comes after the choice, so a vector with fewer than ``k`` positive
    pre-activations keeps fewer than ``k`` features; the result is dense (SAELens's inference
    TopK SAE decodes it with a dense product too).
    """
    values, indices = torch.topk(pre, k=k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())


def gate(
    gate_pre: Float[Tensor, "... d_sae"], magnitude_pre: Float[Tensor, "... d_sae"]
) -> Float[Tensor, "... d_sae"]:
    """A gated SAE's features: ``[π_gate > 0] · ReLU(π_mag)``, the gate path deciding which
    features fire and the magnitude path how strongly."""
    return (gate_pre > 0).to(magnitude_pre.dtype) * torch.relu(magnitude_pre)
