"""HuggingFace reference for Gemma 2 and Gemma 3 (text): ``model.model.layers[i]`` with a norm
before and after each sublayer, ``(1 + w)`` RMSNorms, a scaled embedding, rotary positions per
layer type, optional per-head q/k norms (Gemma 3)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from vlens.parity import common
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def norm_parts(norm: str, x: Tensor, eps: float) -> Values:
    """TransformerLens's ``hook_scale`` and ``hook_normalized`` of the RMSNorm ``norm`` reading
    ``x``."""
    scale, normalized = rms_parts(x, eps)
    return {f"{norm}.hook_scale": scale, f"{norm}.hook_normalized": normalized}


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for Gemma 2 / 3; returns the function that turns one forward's recordings (and its
    logits) into canonical names.

    Rotated q and k and per-head results are rebuilt with HuggingFace's ``apply_rotary_pos_emb``
    (each layer's own cos and sin, as its attention received them) and the checkpoint's ``o_proj``
    weight; the pattern is HuggingFace's own attention weights (soft-capped, windowed). Gemma 3's
    q/k norms run on ``[batch, head, pos, d_head]``: their outputs are heads-first already.
    """
    from transformers.models.gemma2.modeling_gemma2 import apply_rotary_pos_emb

    config = model.config
    eps, heads = config.rms_norm_eps, config.num_attention_heads
    kv_heads, d_head = config.num_key_value_heads, config.head_dim
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        recorder.inputs(attn, f"rope{i}", "position_embeddings")
        common.record_qkv(recorder, attn, i)
        recorder.inputs(attn.o_proj, f"z{i}", "input")
        recorder.output(attn, f"attn_raw{i}")
        recorder.output(layer.post_attention_layernorm, f"attn{i}")
        recorder.inputs(layer.pre_feedforward_layernorm, f"mid{i}", "hidden_states")
        common.record_dense_mlp(recorder, layer.mlp, i)
        recorder.output(layer.mlp, f"mlp_raw{i}")
        recorder.output(layer.post_feedforward_layernorm, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(inner.layers):
            block, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(block, pre, heads, kv_heads)
            out |= norm_parts(f"{block}.ln1", pre, eps)
            out |= common.qkv_heads(attn, d_head, *(seen[f"{p}{i}"] for p in ("q", "k", "v")))
            q, k = out[f"{attn}.hook_q"], out[f"{attn}.hook_k"]
            if f"q_norm{i}" in seen:
                q_normed, k_normed = seen[f"q_norm{i}"], seen[f"k_norm{i}"]
                out[f"{attn}.hook_q_normed"], out[f"{attn}.hook_k_normed"] = q_normed, k_normed
                q, k = q_normed.transpose(1, 2), k_normed.transpose(1, 2)
            out |= common.rotated_qk(attn, apply_rotary_pos_emb, q, k, *seen[f"rope{i}"])
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], layer.self_attn.o_proj.weight, heads)
            attn_raw, mlp_raw = seen[f"attn_raw{i}"], seen[f"mlp_raw{i}"]
            out |= norm_parts(f"{block}.ln1_post", attn_raw, eps)
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            out |= norm_parts(f"{block}.ln2", mid, eps)
            out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            out |= norm_parts(f"{block}.ln2_post", mlp_raw, eps)
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values
