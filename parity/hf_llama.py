"""HuggingFace reference for the Llama family (Llama, Qwen3, Mistral, Qwen2:
``model.model.layers[i]``, RMSNorm, rotary)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for the Llama family (``model.model.layers[i]`` with RMSNorm); returns the function
    that turns one forward's recordings (and its logits) into canonical names.

    Rotated q and k, attention scores and per-head results are not module outputs in
    HuggingFace: they are rebuilt here with HuggingFace's own ``apply_rotary_pos_emb`` and the
    checkpoint's ``o_proj`` weight; the pattern is HuggingFace's own attention weights.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = model.config
    eps = config.rms_norm_eps
    heads, kv_heads, d_head = attention_dimensions(config)
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        common.record_qkv(recorder, attn, i)
        recorder.inputs(attn.o_proj, f"z{i}", "input")
        recorder.output(attn, f"attn{i}")
        recorder.inputs(layer.post_attention_layernorm, f"mid{i}", "hidden_states")
        common.record_dense_mlp(recorder, layer.mlp, i)
        recorder.output(layer.mlp, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        positions = torch.arange(logits.shape[1])[None]
        cos, sin = inner.rotary_emb(seen["embed"], positions)
        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(inner.layers):
            block, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(block, pre, heads, kv_heads)
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = rms_parts(pre, eps)
            out |= common.qkv_heads(attn, d_head, *(seen[f"{p}{i}"] for p in ("q", "k", "v")))
            q, k = out[f"{attn}.hook_q"], out[f"{attn}.hook_k"]
            if f"q_norm{i}" in seen:
                q, k = seen[f"q_norm{i}"], seen[f"k_norm{i}"]
                out[f"{attn}.hook_q_normed"] = q.transpose(1, 2)
                out[f"{attn}.hook_k_normed"] = k.transpose(1, 2)
            out |= common.rotated_qk(attn, apply_rotary_pos_emb, q, k, cos, sin)
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], layer.self_attn.o_proj.weight, heads)
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = rms_parts(mid, eps)
            out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values
