"""HuggingFace reference for the Llama-family mixtures of experts (Qwen3-MoE, Mixtral, OLMoE,
Qwen2-MoE: ``model.model.layers[i]`` with RMSNorm, rotary, optional q/k norms, and a MoE block as
``mlp``, or a dense gated MLP on the Qwen MoE models' ``mlp_only_layers``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vlens.parity.hf_deepseek import record_outputs, routing
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def per_head(x: Tensor, d_head: int) -> Tensor:
    """``[b, p, H·d_head]`` or ``[b, p, H, d_head]`` as ``[b, p, H, d_head]``."""
    return x.reshape(*x.shape[:2], -1, d_head)


def causal_scores(rot_q: Tensor, rot_k: Tensor, scale: float) -> Tensor:
    """``rot_q·rot_kᵀ·scale`` ``[b, H, q, k]`` from heads-first ``[b, H, pos, d_head]``, the
    future masked with -inf."""
    scores = torch.einsum("bhqd,bhkd->bhqk", rot_q, rot_k) * scale
    n = scores.shape[-1]
    return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


def record_layer(recorder: Recorder, layer: nn.Module, i: int) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    recorder.inputs(layer, f"pre{i}", "hidden_states")
    for part in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
        if hasattr(attn, part):
            recorder.output(getattr(attn, part), f"{part}{i}")
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
        recorder.output(mlp.gate_proj, f"gate{i}")
        recorder.output(mlp.up_proj, f"up{i}")
        recorder.inputs(mlp.down_proj, f"post_act{i}", "input")
    recorder.output(mlp, f"mlp{i}")
    recorder.output(layer, f"post{i}")


def attention_values(
    seen: dict[str, Any], i: int, attn: nn.Module, config: Any, rope: tuple[Tensor, Tensor]
) -> Values:
    """Layer ``i``'s attention names (``attn.*``), from its projections, norms and z."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d_head = getattr(config, "head_dim", None) or config.hidden_size // heads
    q, k, v = (per_head(seen[f"{p}_proj{i}"], d_head) for p in ("q", "k", "v"))
    out = {"hook_q": q, "hook_k": k, "hook_v": v}
    if f"q_norm{i}" in seen:
        q_normed, k_normed = seen[f"q_norm{i}"], seen[f"k_norm{i}"]
        q, k = per_head(q_normed, d_head), per_head(k_normed, d_head)
        if q_normed.dim() == 4:  # per-head norms (Qwen3-MoE): heads first
            q_normed, k_normed = q.transpose(1, 2), k.transpose(1, 2)
        out["hook_q_normed"], out["hook_k_normed"] = q_normed, k_normed
    rot_q, rot_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rope)
    out["hook_rot_q"], out["hook_rot_k"] = rot_q.transpose(1, 2), rot_k.transpose(1, 2)
    shared_k = rot_k.repeat_interleave(heads // kv_heads, dim=1)
    out["hook_attn_scores"] = causal_scores(rot_q, shared_k, attn.scaling)
    z = per_head(seen[f"z{i}"], d_head)
    w_o = attn.o_proj.weight.reshape(-1, heads, d_head)  # [d_model, H, d_head]
    out["hook_z"] = z
    out["hook_result"] = torch.einsum("bphd,mhd->bphm", z, w_o)
    return out


def mlp_values(
    seen: dict[str, Any], i: int, mlp: nn.Module, batch_pos: torch.Size
) -> Values:
    """Layer ``i``'s ``mlp.*`` names: routing (and Qwen2-MoE's shared expert) on a MoE layer,
    the gated MLP's on a dense one."""
    block = f"blocks.{i}"
    if f"router{i}" not in seen:
        return {
            f"{block}.mlp.hook_pre": seen[f"gate{i}"],
            f"{block}.mlp.hook_pre_linear": seen[f"up{i}"],
            f"{block}.mlp.hook_post": seen[f"post_act{i}"],
        }
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
            out[f"{block}.hook_resid_pre"] = pre
            for name, n in (("attn_in", heads), ("q_input", heads), ("k_input", kv_heads),
                            ("v_input", kv_heads)):
                out[f"{block}.hook_{name}"] = pre[:, :, None].expand(-1, -1, n, -1)
            ln1 = rms_parts(pre, eps)
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = ln1
            for name, value in attention_values(seen, i, layer.self_attn, config, rope).items():
                out[f"{block}.attn.{name}"] = value
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
