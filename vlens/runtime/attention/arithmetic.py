"""The arithmetic of one layer's attention, done explicitly (TransformerLens's order of operations):
scores ``q·kᵀ·scale`` (optionally soft-capped) causally masked to -inf (optionally to a sliding
window), their softmax, ``pattern·v``, and each head's output through ``W_O``. Pure functions of
tensors, plus reading ``W_O`` off vLLM's output projection.

Grouped keys and values are shared by consecutive query heads, as vLLM and TransformerLens share
them: query head ``h`` reads key/value head ``h // (heads / kv_heads)``.
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn


def shared_heads(x: Float[Tensor, "k kv d"], heads: int) -> Float[Tensor, "k head d"]:
    """Key/value heads repeated for the query heads that read them."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def causal_scores(
    q: Float[Tensor, "q head d"],
    keys: Float[Tensor, "k kv d"],
    scale: float,
    first_position: int,
    *,
    soft_cap: float | None = None,
    window: int | None = None,
    alibi: tuple[float, ...] | None = None,
) -> Float[Tensor, "head q k"]:
    """``q·kᵀ·scale`` in float32, with the keys after each query's own position (the query rows
    sit at positions ``first_position`` on, the keys at ``0..k-1``) at -inf.

    ``soft_cap``: the scores become ``soft_cap·tanh(scores / soft_cap)`` before masking (Gemma 2's
    ``attn_logit_softcapping``). ``window``: each query sees only the ``window`` latest keys, its
    own included (a sliding window: keys ``window`` or more positions back are at -inf too).
    ``alibi``: each query head's ALiBi slope; ``slope·key_position`` is added to its scores
    (BLOOM's bias, as HuggingFace adds it: by the key's absolute position, which differs from a
    bias by the distance ``key − query`` only by a constant per query row)."""
    k = shared_heads(keys, q.shape[1])
    scores = einsum(q.float(), k.float(), "q h d, k h d -> h q k") * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    queries = torch.arange(first_position, first_position + q.shape[0], device=q.device)
    keys_at = torch.arange(keys.shape[0], device=q.device)[None, :]
    if alibi is not None:
        slopes = torch.tensor(alibi, dtype=torch.float32, device=q.device)
        scores = scores + slopes[:, None, None] * keys_at.float()
    masked = keys_at > queries[:, None]
    if window is not None:
        masked |= keys_at <= queries[:, None] - window
    return scores.masked_fill(masked[None], float("-inf"))


def softmax_pattern(
    scores: Float[Tensor, "head q k"], sinks: Float[Tensor, " head"] | None = None
) -> Float[Tensor, "head q k"]:
    """Softmax over keys in float32; a row with every key at -inf becomes zeros (as
    TransformerLens turns its NaNs into zeros). ``sinks``: each head's attention-sink logit
    (GPT-OSS), one more key in the softmax's denominator that is then dropped, so a row sums to
    less than one (the rest is the sink's share)."""
    if sinks is None:
        return scores.float().softmax(dim=-1).nan_to_num(0.0)
    column = sinks.float().to(scores.device)[:, None, None].expand(-1, scores.shape[1], 1)
    with_sink = torch.cat([scores.float(), column], dim=-1)
    return with_sink.softmax(dim=-1)[..., :-1].nan_to_num(0.0)


def mixed_values(
    pattern: Float[Tensor, "head q k"], values: Float[Tensor, "k kv d_v"]
) -> Float[Tensor, "q head d_v"]:
    """z: each head's values weighted by its pattern, in float32."""
    v = shared_heads(values, pattern.shape[0])
    return einsum(pattern.float(), v.float(), "h q k, k h d -> q h d")


def per_head_results(
    z: Float[Tensor, "pos head d_v"], weight: Float[Tensor, "in d_model"]
) -> Float[Tensor, "pos head d_model"]:
    """Each head's z through its rows of ``W_O`` (``weight`` is ``[heads·d_v, d_model]``), no bias,
    in float32."""
    w = rearrange(weight, "(h d) m -> h d m", h=z.shape[1])
    return einsum(z.float(), w.float(), "p h d, h d m -> p h m")


def _element(result: object, element: int | None) -> Tensor:
    return result if element is None else result[element]  # type: ignore[index]


@torch.no_grad()
def projection_weights(
    module: nn.Module, width: int, element: int | None, like: Tensor, block: int = 1024
) -> tuple[Float[Tensor, "width d_model"], Float[Tensor, " d_model"]]:
    """``W_O`` (``[width, d_model]``: row ``i`` is what input channel ``i`` adds) and ``b_O`` (zeros
    without a bias) of vLLM's output projection, read off the module itself by applying it to the
    identity and to zeros: vLLM's CPU backend repacks linear weights and leaves no usable
    ``.weight``.

    Exact: the identity's rows select weight rows without rounding, and where the module has a
    vLLM ``quant_method`` the weight is applied without the bias (applying it with the bias and
    subtracting would round). Called with the module's ``forward`` directly, so that no hook on the
    module sees these calls. Needs the whole module on this rank (no tensor parallelism).
    """
    zero = like.new_zeros(1, width)
    bias = _element(module.forward(zero), element)[0]
    apply = getattr(getattr(module, "quant_method", None), "apply", None)
    rows = []
    for start in range(0, width, block):
        eye = torch.eye(width, dtype=like.dtype, device=like.device)[start : start + block]
        if apply is not None:
            rows.append(apply(module, eye, None))
        else:
            rows.append(_element(module.forward(eye), element) - bias)
    return torch.cat(rows), bias
