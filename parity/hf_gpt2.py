"""HuggingFace reference for GPT-2 (``model.transformer.h[i]``, LayerNorm, learned positions)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.reference import Recorder, Values, after_blocks


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
    eps = config.layer_norm_epsilon
    heads, _, d_head = attention_dimensions(config)
    inner = model.transformer
    recorder.output(inner.wte, "embed")
    recorder.output(inner.wpe, "pos_embed")
    for i, block in enumerate(inner.h):
        recorder.inputs(block, f"pre{i}", "hidden_states")
        recorder.output(block.attn.c_attn, f"qkv{i}")
        recorder.inputs(block.attn.c_proj, f"z{i}", "x")
        recorder.output(block.attn, f"attn{i}")
        recorder.inputs(block.ln_2, f"mid{i}", "input")
        common.record_dense_mlp(recorder, block.mlp, i, gate=None, up="c_fc", down="c_proj")
        recorder.output(block.mlp, f"mlp{i}")
        recorder.output(block, f"post{i}")
    recorder.inputs(inner.ln_f, "final", "input")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"], "hook_pos_embed": seen["pos_embed"]}
        for i, block in enumerate(inner.h):
            name = f"blocks.{i}"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(name, pre, heads, heads)
            out[f"{name}.ln1.hook_scale"], out[f"{name}.ln1.hook_normalized"] = layer_norm_parts(
                pre, eps
            )
            qkv = seen[f"qkv{i}"].split(config.hidden_size, dim=-1)
            out |= common.qkv_heads(f"{name}.attn", d_head, *qkv)
            out[f"{name}.attn.hook_pattern"] = attentions[i]
            w_o = block.attn.c_proj.weight.T  # a Conv1D's [in, out]: a Linear's weight, transposed
            out |= common.z_and_result(f"{name}.attn", seen[f"z{i}"], w_o, heads)
            out[f"{name}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{name}.hook_resid_mid"] = mid
            out[f"{name}.hook_mlp_in"] = mid
            out[f"{name}.ln2.hook_scale"], out[f"{name}.ln2.hook_normalized"] = layer_norm_parts(
                mid, eps
            )
            out |= common.dense_mlp_values(f"{name}.mlp", seen, i)
            out[f"{name}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{name}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, layer_norm_parts(seen["final"], eps), logits)

    return values
