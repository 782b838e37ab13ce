"""HuggingFace reference for Cohere 2 (``Cohere2ForCausalLM``): Command R's recorder
(``hf_decoder.py``), with q and k left unrotated on the full-attention layers (HuggingFace's
Cohere2 rotates only its sliding layers), and HuggingFace's model run with the window vLLM attends
over: from vLLM 0.29 on ``sliding_window + 1`` keys where HuggingFace's own mask keeps
``sliding_window`` (``mappings/cohere2.py`` says why and how far the two differ).
``hook_attn_scores`` are the rotated q and k (each key/value head repeated for its query heads)
times ``d_head^-½``, the future and the keys outside a sliding layer's window masked with -inf, as
that run's mask masks them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.mappings import cohere2
from vlens.names.mapping import attention_dimensions
from vlens.parity import hf_decoder
from vlens.parity.reference import Recorder, Values


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """:func:`hf_decoder.record` on ``model`` with vLLM's window; returns the function turning one
    forward's recordings into canonical names."""
    # HuggingFace builds the sliding layers' mask from the config at each forward.
    config = model.config
    config.sliding_window = cohere2.window_keys(config)
    heads, kv_heads, d_head = attention_dimensions(config)
    decoder_values = hf_decoder.record(model, recorder)

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        out = decoder_values(logits, attentions)
        for i, kind in enumerate(config.layer_types):
            attn = f"blocks.{i}.attn"
            window = config.sliding_window if kind == "sliding_attention" else None
            if window is None:
                out[f"{attn}.hook_rot_q"] = out[f"{attn}.hook_q"]
                out[f"{attn}.hook_rot_k"] = out[f"{attn}.hook_k"]
            rot_k = out[f"{attn}.hook_rot_k"].repeat_interleave(heads // kv_heads, dim=1)
            out[f"{attn}.hook_attn_scores"] = windowed_scores(
                out[f"{attn}.hook_rot_q"], rot_k, d_head**-0.5, window
            )
        return out

    return values


def windowed_scores(rot_q: Tensor, rot_k: Tensor, scale: float, window: int | None) -> Tensor:
    """``rot_q·rot_kᵀ·scale`` ``[H, q, k]`` from ``[pos, H, d_head]``, the future and keys ``window``
    or more positions back (where ``window`` is not None) masked with -inf."""
    scores = torch.einsum("qhd,khd->hqk", rot_q, rot_k) * scale
    query, key = torch.arange(scores.shape[-2])[:, None], torch.arange(scores.shape[-1])[None]
    hidden = key > query
    if window is not None:
        hidden |= key <= query - window
    return scores.masked_fill(hidden, float("-inf"))
