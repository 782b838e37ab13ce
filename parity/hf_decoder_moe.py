"""HuggingFace reference for Llama-shaped mixtures of experts that ``hf_moe.py`` does not read:
GraniteMoe and GraniteMoeShared (the MoE block is the layer's ``block_sparse_moe``, its router
``router`` returns ``(indices, weights, logits)``; Granite's multipliers; GraniteMoeShared's
ungated-sum shared MLP is the layer's ``shared_mlp``) and Ernie 4.5 MoE (interleaved rotary, a
router whose selection adds ``moe_statics.e_score_correction_bias`` to the softmax, ungated
``shared_experts`` inside the block, dense layers outside ``moe_layer_start_index`` ..
``moe_layer_end_index``).

Read off HuggingFace modules: embeddings, block input and output, q/k/v projections, ``o_proj``'s
input (z), the attention output, the norm input between attention and MLP, the router's logits,
weights and indices (ordered best selection score first, as vlens orders them), the shared
expert's and the routed experts' outputs, the MoE block's output, a dense layer's projections.
Rebuilt by the model's own formula: rotated q and k (the modeling file's own
``apply_rotary_pos_emb``), the attention scores (rotated q and k times the attention module's
``scaling``, causally masked), per-head results (z times ``o_proj``'s weight), ``ln*`` scale and
normalized, the per-head input copies. The pattern is HuggingFace's attention weights.

Granite's multipliers give the names TransformerLens's meaning (as ``hf_decoder.py``):
``hook_embed`` is the embedding times ``embedding_multiplier``; ``hook_attn_out``, ``hook_result``
and ``hook_mlp_out`` are scaled by ``residual_multiplier`` (the terms the residual stream
receives), and so are GraniteMoeShared's ``mlp.hook_shared_out`` and ``mlp.hook_routed_out``, the
two terms of ``hook_mlp_out``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_decoder import rotated
from vlens.parity.hf_deepseek import record_outputs
from vlens.parity.hf_moe import causal_scores
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def moe_block(layer: nn.Module) -> nn.Module:
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def router_of(block: nn.Module) -> nn.Module | None:
    """The MoE block's router (Granite: ``router``; Ernie: ``gate``), or None on a dense MLP."""
    return getattr(block, "router", None) or (block.gate if hasattr(block, "experts") else None)


def routing(block: str, router: nn.Module, recorded: tuple[Tensor, ...], batch_pos: torch.Size) -> Values:
    """The router's logits, weights and indices ``[b, p, ...]``, best selection score first
    (softmax probability, plus the correction bias where the router has one)."""
    indices = next(x for x in recorded if not x.is_floating_point())
    # Granite's router returns (indices, weights, logits), Ernie's (logits, weights, indices):
    # the logits are the float output over every expert, the weights the one over top_k.
    floats = sorted((x for x in recorded if x.is_floating_point()), key=lambda x: x.shape[-1])
    weights, logits = floats
    logits, weights, indices = (x.reshape(*batch_pos, -1) for x in (logits, weights, indices))
    selection = logits.float().softmax(dim=-1)
    statics = getattr(router, "moe_statics", None)
    if statics is not None:
        selection = statics(selection)
    order = selection.gather(-1, indices).argsort(dim=-1, descending=True)
    return {
        f"{block}.mlp.hook_router_logits": logits,
        f"{block}.mlp.hook_expert_weights": weights.gather(-1, order),
        f"{block}.mlp.hook_expert_indices": indices.gather(-1, order),
    }


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for GraniteMoe, GraniteMoeShared and Ernie 4.5 MoE (see the module's docstring);
    returns the function that turns one forward's recordings (and its logits and attention
    weights) into canonical names."""
    config = model.config
    eps = config.rms_norm_eps
    heads, kv_heads, d_head = attention_dimensions(config)
    embedding_multiplier = getattr(config, "embedding_multiplier", 1.0)
    residual_multiplier = getattr(config, "residual_multiplier", 1.0)
    rotate = partial(rotated, sys.modules[type(model).__module__].apply_rotary_pos_emb)
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        attn, block = layer.self_attn, moe_block(layer)
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        common.record_qkv(recorder, attn, i)
        recorder.inputs(attn.o_proj, f"z{i}", "input")
        recorder.output(attn, f"attn{i}")
        recorder.inputs(layer.post_attention_layernorm, f"mid{i}", "hidden_states")
        router = router_of(block)
        if router is None:
            common.record_dense_mlp(recorder, block, i)
        else:
            record_outputs(recorder, router, f"router{i}")
            recorder.output(block.experts, f"routed{i}")
        shared = getattr(layer, "shared_mlp", None) or getattr(block, "shared_experts", None)
        if shared is not None:
            recorder.output(shared, f"shared{i}")
        recorder.output(block, f"block{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        positions = torch.arange(logits.shape[1])[None]
        cos, sin = inner.rotary_emb(seen["embed"], positions)
        out = {"hook_embed": seen["embed"] * embedding_multiplier}
        for i, layer in enumerate(inner.layers):
            block, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            batch_pos = pre.shape[:2]
            out |= common.block_input(block, pre, heads, kv_heads)
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = rms_parts(pre, eps)
            q, k, v = (seen[f"{p}{i}"] for p in ("q", "k", "v"))
            out |= common.qkv_heads(attn, d_head, q, k, v)
            out |= common.rotated_qk(attn, rotate, out[f"{attn}.hook_q"], out[f"{attn}.hook_k"], cos, sin)
            rot_q, rot_k = (out[f"{attn}.hook_rot_{x}"].transpose(1, 2) for x in ("q", "k"))
            shared_k = rot_k.repeat_interleave(heads // kv_heads, dim=1)
            scaling = layer.self_attn.scaling
            out[f"{attn}.hook_attn_scores"] = causal_scores(rot_q, shared_k, scaling)
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], layer.self_attn.o_proj.weight, heads)
            out[f"{attn}.hook_result"] = out[f"{attn}.hook_result"] * residual_multiplier
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"] * residual_multiplier
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = rms_parts(mid, eps)
            moe = moe_block(layer)
            if f"router{i}" in seen:
                out |= routing(block, router_of(moe), seen[f"router{i}"], batch_pos)
            else:
                out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            mlp_out = seen[f"block{i}"].reshape(*batch_pos, -1)
            if f"shared{i}" in seen:
                shared = seen[f"shared{i}"].reshape(*batch_pos, -1) * residual_multiplier
                routed = seen[f"routed{i}"].reshape(*batch_pos, -1) * residual_multiplier
                out[f"{block}.mlp.hook_shared_out"] = shared
                out[f"{block}.mlp.hook_routed_out"] = routed
                if hasattr(layer, "shared_mlp"):  # outside the block: HuggingFace adds it after
                    mlp_out = mlp_out + seen[f"shared{i}"].reshape(*batch_pos, -1)
            out[f"{block}.hook_mlp_out"] = mlp_out * residual_multiplier
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values
