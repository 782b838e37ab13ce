"""HuggingFace reference for GPT-2 (``model.transformer.h[i]``, LayerNorm, learned positions)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.parity.reference import Recorder, Values, after_blocks


def per_head(x: Tensor, d_head: int) -> Tensor:
    return x.reshape(*x.shape[:-1], -1, d_head)


def layer_norm_parts(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """TransformerLens's ``hook_scale`` and ``hook_normalized`` of a LayerNorm reading ``x``."""
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
    scale = (var + eps).sqrt()
    return scale, (x - mean) / scale


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for GPT-2; returns the function that turns one forward's recordings (and its logits)
    into canonical names.

    HuggingFace has no module for some names; they are rebuilt from its tensors by GPT-2's own
    formula: ``ln*.hook_scale``/``hook_normalized`` from the LayerNorm's input with the config's
    eps, ``hook_attn_in`` and ``hook_q/k/v_input`` as the block input repeated per head, and
    ``hook_result`` as HuggingFace's ``z`` times its ``c_proj`` weight per head (a Conv1D,
    ``[in, out]``). q, k and v are the three thirds of ``c_attn``'s output, as HuggingFace splits
    it; the pattern is HuggingFace's own attention weights.
    """
    config = model.config
    eps, heads = config.layer_norm_epsilon, config.num_attention_heads
    d_head = config.hidden_size // heads
    inner = model.transformer
    recorder.output(inner.wte, "embed")
    recorder.output(inner.wpe, "pos_embed")
    for i, block in enumerate(inner.h):
        recorder.inputs(block, f"pre{i}", "hidden_states")
        recorder.output(block.attn.c_attn, f"qkv{i}")
        recorder.inputs(block.attn.c_proj, f"z{i}", "x")
        recorder.output(block.attn, f"attn{i}")
        recorder.inputs(block.ln_2, f"mid{i}", "input")
        recorder.output(block.mlp.c_fc, f"pre_act{i}")
        recorder.output(block.mlp.act, f"post_act{i}")
        recorder.output(block.mlp, f"mlp{i}")
        recorder.output(block, f"post{i}")
    recorder.inputs(inner.ln_f, "final", "input")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"], "hook_pos_embed": seen["pos_embed"]}
        for i, block in enumerate(inner.h):
            name = f"blocks.{i}"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out[f"{name}.hook_resid_pre"] = pre
            for copy in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"):
                out[f"{name}.{copy}"] = pre[:, :, None].expand(-1, -1, heads, -1)
            out[f"{name}.ln1.hook_scale"], out[f"{name}.ln1.hook_normalized"] = layer_norm_parts(
                pre, eps
            )
            q, k, v = seen[f"qkv{i}"].split(config.hidden_size, dim=-1)
            out[f"{name}.attn.hook_q"] = per_head(q, d_head)
            out[f"{name}.attn.hook_k"] = per_head(k, d_head)
            out[f"{name}.attn.hook_v"] = per_head(v, d_head)
            out[f"{name}.attn.hook_pattern"] = attentions[i]
            z = per_head(seen[f"z{i}"], d_head)
            out[f"{name}.attn.hook_z"] = z
            w_o = block.attn.c_proj.weight.reshape(heads, d_head, -1)  # [H, d_head, d_model]
            out[f"{name}.attn.hook_result"] = torch.einsum("bphd,hdm->bphm", z, w_o)
            out[f"{name}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{name}.hook_resid_mid"] = mid
            out[f"{name}.hook_mlp_in"] = mid
            out[f"{name}.ln2.hook_scale"], out[f"{name}.ln2.hook_normalized"] = layer_norm_parts(
                mid, eps
            )
            out[f"{name}.mlp.hook_pre"] = seen[f"pre_act{i}"]
            out[f"{name}.mlp.hook_post"] = seen[f"post_act{i}"]
            out[f"{name}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{name}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, layer_norm_parts(seen["final"], eps), logits)

    return values
