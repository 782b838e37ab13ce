"""The logit lens: what each layer's residual stream would predict if the model stopped there.

Each layer's ``hook_resid_post`` goes through the final norm (with its weight) and the unembedding,
both read from the checkpoint, exactly as the model treats its last layer's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from vlens.hooked import HookedVLLM
from vlens.mapping import rms
from vlens.weights import CheckpointWeights


@dataclass(frozen=True)
class LensView:
    """Top tokens per layer (rows) and position (columns) for one prompt."""

    tokens: list[str]
    top_tokens: list[list[str]]  # [layer][position]
    top_probs: Float[Tensor, "layer pos"]


def logit_lens(model: HookedVLLM, prompt: str, weights: CheckpointWeights) -> LensView:
    names = [f"blocks.{layer}.hook_resid_post" for layer in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(prompt, names_filter=names, return_type=None)
    resid = torch.stack([cache[name][0] for name in names]).float()  # [layer, pos, d_model]
    norm_weight = weights["model.norm.weight"].float()
    unembed = weights["lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"]
    normed = resid / rms(resid, model.hf_config.rms_norm_eps) * norm_weight
    probs = (normed @ unembed.float().T).softmax(-1)
    top_probs, top_ids = probs.max(-1)
    ids = model.token_lists(prompt)[0]
    return LensView(
        tokens=[model.to_string([token]) for token in ids],
        top_tokens=[[model.to_string([t]) for t in row] for row in top_ids.tolist()],
        top_probs=top_probs,
    )


def format_lens(view: LensView, width: int = 10) -> str:
    """A plain-text table: one row per layer, one column per prompt position."""

    def cell(text: str) -> str:
        shown = repr(text)[1:-1]
        return shown[:width].ljust(width)

    header = "layer | " + " ".join(cell(token) for token in view.tokens)
    lines = [header, "-" * len(header)]
    for layer, row in enumerate(view.top_tokens):
        lines.append(f"{layer:>5} | " + " ".join(cell(token) for token in row))
    return "\n".join(lines)
