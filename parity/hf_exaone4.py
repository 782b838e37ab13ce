"""HuggingFace reference for EXAONE 4 (``Exaone4ForCausalLM``): ``model.model.layers[i]`` with
no norm before its sublayers, a norm after each (``post_attention_layernorm``,
``post_feedforward_layernorm``) whose output is added to the stream, per-head q/k norms before the
rotary embedding, and rotary positions only on the layers the model rotates (sliding layers of a
hybrid model; every layer of one without sliding layers).

Rotated q and k are rebuilt with HuggingFace's ``apply_rotary_pos_emb`` on the normed q and k
(left as they are on the layers HuggingFace does not rotate), per-head results from ``z`` and the
checkpoint's ``o_proj`` weight; the pattern is HuggingFace's own attention weights.
"""

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
    """Hooks for EXAONE 4; returns the function turning one forward's recordings (and its logits
    and attention weights) into canonical names."""
    from transformers.models.exaone4.modeling_exaone4 import apply_rotary_pos_emb

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
        for norm, key in ((layer.post_attention_layernorm, "attn"), (layer.post_feedforward_layernorm, "mlp")):
            recorder.inputs(norm, f"{key}_raw{i}", "hidden_states")
            recorder.output(norm, f"{key}{i}")
        recorder.inputs(layer.mlp, f"mid{i}", "x")
        common.record_dense_mlp(recorder, layer.mlp, i)
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
            out |= common.qkv_heads(attn, d_head, *(seen[f"{p}{i}"] for p in ("q", "k", "v")))
            q_normed, k_normed = seen[f"q_norm{i}"], seen[f"k_norm{i}"]  # [b, H, pos, d_head]
            out[f"{attn}.hook_q_normed"], out[f"{attn}.hook_k_normed"] = q_normed, k_normed
            q, k = q_normed.transpose(1, 2), k_normed.transpose(1, 2)
            hf_attn = layer.self_attn
            if hf_attn.sliding_window is None or hf_attn.is_sliding:
                out |= common.rotated_qk(attn, apply_rotary_pos_emb, q, k, cos, sin)
            else:
                out[f"{attn}.hook_rot_q"], out[f"{attn}.hook_rot_k"] = q, k
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], hf_attn.o_proj.weight, heads)
            for norm, key in (("ln1_post", "attn"), ("ln2_post", "mlp")):
                scale, normalized = rms_parts(seen[f"{key}_raw{i}"], eps)
                out[f"{block}.{norm}.hook_scale"] = scale
                out[f"{block}.{norm}.hook_normalized"] = normalized
                out[f"{block}.hook_{key}_out"] = seen[f"{key}{i}"]
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values
