"""HuggingFace reference for GPT-OSS (``model.model.layers[i]``: RMSNorm, attention with biases,
sinks and a sliding window on ``sliding_attention`` layers, YaRN rotary, a mixture of experts with
a top-k router as ``mlp``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_deepseek import record_outputs, routing
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def windowed_scores(rot_q: Tensor, rot_k: Tensor, scale: float, window: int | None) -> Tensor:
    """``rot_q·rot_kᵀ·scale`` ``[b, H, q, k]`` from heads-first ``[b, H, pos, d_head]``, the
    future and, with a ``window``, keys ``window`` or more positions back masked with -inf (the
    mask HuggingFace adds before the sink joins the softmax)."""
    scores = torch.einsum("bhqd,bhkd->bhqk", rot_q, rot_k) * scale
    n = scores.shape[-1]
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    masked = key > query
    if window is not None:
        masked |= key <= query - window
    return scores.masked_fill(masked, float("-inf"))


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for GPT-OSS; returns the function that turns one forward's recordings (and its
    logits and attention weights) into canonical names.

    Read off HuggingFace modules: embeddings, block input and output, q/k/v projections (with
    their biases), ``o_proj``'s input (z), the attention and MLP outputs, the router (logits,
    weights, indices: HuggingFace's ``topk`` orders them best first, as vlens does). Rebuilt by the
    model's own formula: rotated q and k (GPT-OSS's ``apply_rotary_pos_emb`` with the layer's cos
    and sin), the scores (rotated q and k times the attention's ``scaling``, causally masked and
    windowed on sliding layers, without the sink), per-head results (z times ``o_proj``'s weight),
    ``ln*`` scale and normalized, the per-head input copies. The pattern is HuggingFace's attention
    weights: the softmax with the sink column, which HuggingFace drops.
    """
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    config = model.config
    eps = config.rms_norm_eps
    heads, kv_heads, d_head = attention_dimensions(config)
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        recorder.inputs(attn, f"rope{i}", "position_embeddings")
        common.record_qkv(recorder, attn, i)
        recorder.inputs(attn.o_proj, f"z{i}", "input")
        recorder.output(attn, f"attn{i}")
        recorder.inputs(layer.post_attention_layernorm, f"mid{i}", "hidden_states")
        record_outputs(recorder, mlp.router, f"router{i}")
        recorder.output(mlp, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(inner.layers):
            block, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(block, pre, heads, kv_heads)
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = rms_parts(pre, eps)
            out |= common.qkv_heads(attn, d_head, *(seen[f"{p}{i}"] for p in ("q", "k", "v")))
            q, k = out[f"{attn}.hook_q"], out[f"{attn}.hook_k"]
            out |= common.rotated_qk(attn, apply_rotary_pos_emb, q, k, *seen[f"rope{i}"])
            rot_q, rot_k = (out[f"{attn}.hook_rot_{x}"].transpose(1, 2) for x in ("q", "k"))
            shared_k = rot_k.repeat_interleave(heads // kv_heads, dim=1)
            self_attn = layer.self_attn
            out[f"{attn}.hook_attn_scores"] = windowed_scores(
                rot_q, shared_k, self_attn.scaling, self_attn.sliding_window
            )
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], self_attn.o_proj.weight, heads)
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = rms_parts(mid, eps)
            out |= routing(block, layer.mlp.router, seen[f"router{i}"], pre.shape[:2])
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values
