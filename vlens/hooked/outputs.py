"""What a TransformerLens forward returns: logits, the language-model loss, both, nothing, or (with
``stop_at_layer``) the residual stream where the forward stopped."""

from __future__ import annotations

from typing import Literal

from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities import lm_cross_entropy_loss

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


def stopping_layer(stop_at_layer: int, n_layers: int) -> int:
    """TransformerLens's ``stop_at_layer`` (negative counts from the end) as a block index:
    the forward runs blocks ``0 .. k-1`` and returns the residual stream entering block ``k``."""
    layer = n_layers + stop_at_layer if stop_at_layer < 0 else stop_at_layer
    if not 0 <= layer <= n_layers:
        raise ValueError(f"stop_at_layer={stop_at_layer} is outside [-{n_layers}, {n_layers}]")
    return layer


def residual_entering(layer: int, n_layers: int) -> str:
    """The name of the residual stream entering block ``layer`` (after the last: the final one)."""
    if layer < n_layers:
        return f"blocks.{layer}.hook_resid_pre"
    return f"blocks.{n_layers - 1}.hook_resid_post"


def computed_before(name: str, layer: int) -> bool:
    """Whether a forward stopped before block ``layer`` computes ``name``: the embeddings and
    the names of earlier blocks."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) < layer
    return name.startswith(("hook_embed", "hook_pos_embed"))
