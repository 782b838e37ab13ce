"""HuggingFace reference for the Llama-family mixtures of experts (Qwen3-MoE, Mixtral, OLMoE,
Qwen2-MoE: ``model.model.layers[i]`` with RMSNorm, rotary, optional q/k norms, and a MoE block as
``mlp``, or a dense gated MLP on the Qwen MoE models' ``mlp_only_layers``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_deepseek import record_outputs, routing
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def causal_scores(rot_q: Tensor, rot_k: Tensor, scale: float) -> Tensor:
    """``rot_q·rot_kᵀ·scale`` ``[b, H, q, k]`` from heads-first ``[b, H, pos, d_head]``, the
    future masked with -inf."""
    scores = torch.einsum("bhqd,bhkd->bhqk", rot_q, rot_k) * scale
    n = scores.shape[-1]
    return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


def record_layer(recorder: Recorder, layer: nn.Module, i: int) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    recorder.inputs(layer, f"pre{i}", "hidden_states")
    common.record_qkv(recorder, attn, i)
    recorder.inputs(attn.o_proj, f"z{i}", "input")
    recorder.output(attn, f"attn{i}")
    recorder.inputs(layer.post_attention_layernorm, f"mid{i}", "hidden_states")
    if hasattr(mlp, "experts"):
        record_outputs(recorder, mlp.gate, f"router{i}")
        recorder.output(mlp.experts, f"routed{i}")
        if hasattr(mlp, "shared_expert"):
            recorder.output(mlp.shared_expert, f"shared{i}")
            recorder.output(mlp.shared_expert_gate, f"shared_gate{i}")
    else:
        common.record_dense_mlp(recorder, mlp, i)
    recorder.output(mlp, f"mlp{i}")
    recorder.output(layer, f"post{i}")


def attention_values(
    seen: dict[str, Any], i: int, attn: nn.Module, config: Any, rope: tuple[Tensor, Tensor]
) -> Values:
    """Layer ``i``'s attention names (``blocks.{i}.attn.*``), from its projections, norms and z."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, d_head = attention_dimensions(config)
    name = f"blocks.{i}.attn"
    out = common.qkv_heads(name, d_head, *(seen[f"{p}{i}"] for p in ("q", "k", "v")))
    q, k = out[f"{name}.hook_q"], out[f"{name}.hook_k"]
    if f"q_norm{i}" in seen:
        q_normed, k_normed = seen[f"q_norm{i}"], seen[f"k_norm{i}"]
        q, k = common.per_head(q_normed, d_head), common.per_head(k_normed, d_head)
        if q_normed.dim() == 4:  # per-head norms (Qwen3-MoE): heads first
            q_normed, k_normed = q.transpose(1, 2), k.transpose(1, 2)
        out[f"{name}.hook_q_normed"], out[f"{name}.hook_k_normed"] = q_normed, k_normed
    out |= common.rotated_qk(name, apply_rotary_pos_emb, q, k, *rope)
    rot_q, rot_k = (out[f"{name}.hook_rot_{x}"].transpose(1, 2) for x in ("q", "k"))
    shared_k = rot_k.repeat_interleave(heads // kv_heads, dim=1)
    out[f"{name}.hook_attn_scores"] = causal_scores(rot_q, shared_k, attn.scaling)
    out |= common.z_and_result(name, seen[f"z{i}"], attn.o_proj.weight, heads)
    return out


def mlp_values(
    seen: dict[str, Any], i: int, mlp: nn.Module, batch_pos: torch.Size
) -> Values:
    """Layer ``i``'s ``mlp.*`` names: routing (and Qwen2-MoE's shared expert) on a MoE layer,
    the gated MLP's on a dense one."""
    block = f"blocks.{i}"
    if f"router{i}" not in seen:
        return common.dense_mlp_values(f"{block}.mlp", seen, i)
    out = routing(block, mlp.gate, seen[f"router{i}"], batch_pos)
    if f"shared{i}" in seen:
        gate = seen[f"shared_gate{i}"].reshape(*batch_pos, 1).sigmoid()
        out[f"{block}.mlp.hook_shared_gate"] = gate
        out[f"{block}.mlp.hook_shared_out"] = gate * seen[f"shared{i}"].reshape(*batch_pos, -1)
        out[f"{block}.mlp.hook_routed_out"] = seen[f"routed{i}"].reshape(*batch_pos, -1)
    return out


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for the Llama-family MoE models; returns the function that turns one forward's
    recordings (and its logits and attention weights) into canonical names.

    Read off HuggingFace modules: embeddings, block input and output, q/k/v projections, q/k
    norms (per head on Qwen3-MoE, heads first; over the whole projection on OLMoE, as they are),
    ``o_proj``'s input (z), the attention and MLP outputs, the router (``mlp.gate``: logits,
    weights, indices, best first as vlens orders them; HuggingFace's ``topk`` sorts them so),
    Qwen2-MoE's shared expert and its gate (the gated output is ``sigmoid(gate)·shared_expert``,
    as HuggingFace's block forms it; routed: the experts' output) and a dense layer's projections.
    Rebuilt by the model's own formula: rotated q and k (HuggingFace's ``apply_rotary_pos_emb``),
    the attention scores (rotated q and k times the attention module's ``scaling``, causally
    masked), per-head results (z times ``o_proj``'s weight), ``ln*`` scale and normalized, the
    per-head input copies. The pattern is HuggingFace's attention weights.
    """
    config = model.config
    eps, heads = config.rms_norm_eps, config.num_attention_heads
    kv_heads = config.num_key_value_heads
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        record_layer(recorder, layer, i)
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        rope = inner.rotary_emb(seen["embed"], torch.arange(logits.shape[1])[None])
        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(inner.layers):
            block = f"blocks.{i}"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(block, pre, heads, kv_heads)
            ln1 = rms_parts(pre, eps)
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = ln1
            out |= attention_values(seen, i, layer.self_attn, config, rope)
            out[f"{block}.attn.hook_pattern"] = attentions[i]
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            ln2 = rms_parts(mid, eps)
            out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = ln2
            out.update(mlp_values(seen, i, layer.mlp, pre.shape[:2]))
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values
