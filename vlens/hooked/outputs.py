"""What a TransformerLens forward returns: logits, the language-model loss, both, nothing, or (with
``stop_at_layer``) the residual stream where the forward stopped."""

from __future__ import annotations

from typing import Literal

from jaxtyping import Bool, Float, Int
from torch import Tensor

from vlens.names.tl_versions import lm_cross_entropy_loss

ReturnType = Literal["logits", "loss", "both"] | None
RETURN_TYPES: tuple[ReturnType, ...] = ("logits", "loss", "both", None)
Output = Tensor | tuple[Tensor, Tensor] | None


def check_return_type(return_type: object) -> None:
    if return_type not in RETURN_TYPES:
        raise ValueError(
            f"return_type must be one of {', '.join(map(repr, RETURN_TYPES))}, not {return_type!r}"
        )


def model_output(
    return_type: ReturnType,
    logits: Float[Tensor, "batch pos d_vocab"] | None,
    tokens: Int[Tensor, "batch pos"],
    mask: Bool[Tensor, "batch pos"],
    loss_per_token: bool = False,
) -> Output:
    """TransformerLens's result for ``return_type``. The loss is TransformerLens's own
    next-token cross-entropy over real positions (``mask``): padding is never predicted."""
    if return_type is None:
        return None
    assert logits is not None
    if return_type == "logits":
        return logits
    loss = lm_cross_entropy_loss(
        logits, tokens.to(logits.device), mask.to(logits.device), per_token=loss_per_token
    )
    return loss if return_type == "loss" else (logits, loss)
