"""HuggingFace reference for Llama-shaped decoders that differ from Llama in form (``phi3``,
``ernie4_5``, ``glm4``, ``stablelm``, ``granite``, ``apertus``, ``cohere``, ``nemotron``):
``model.model.layers[i]`` with ``self_attn``, ``mlp`` and a norm between them
(``post_attention_layernorm``; ``feedforward_layernorm`` in Apertus), where

- q, k and v may come from one fused ``qkv_proj`` (``[q | k | v]``) and gate and up from one
  ``gate_up_proj`` (``[gate | up]``): they are split here as HuggingFace splits them;
- q and k may be normed per head before the rotary embedding (``q_norm``/``k_norm``: Apertus),
  giving ``hook_q_normed``/``hook_k_normed``, heads first;
- the MLP may be ungated (``up_proj`` alone: Apertus), whose ``up_proj`` output is ``hook_pre``;
- rotary positions are applied by the model's own ``apply_rotary_pos_emb`` (interleaved in
  Ernie 4.5 and GLM-4), to the first ``rotary_dim`` features of each head (partial rotary), the
  rest passing through;
- the norms may be LayerNorms (a config with ``layer_norm_eps``: StableLM; ``norm_eps``: Nemotron's
  LayerNorm1P, which scales by ``1 + weight``), whose
  ``hook_scale``/``hook_normalized`` are those of the centred input;
- attention and MLP may run in parallel on the same normed input (Command-R: no norm between
  them), with no ``hook_resid_mid`` or ``ln2`` and ``hook_mlp_in`` the block's input;
- Granite's multipliers: ``hook_embed`` is the embedding times ``embedding_multiplier``, and
  ``hook_attn_out``, ``hook_mlp_out`` and ``hook_result`` are scaled by ``residual_multiplier``
  (the terms the residual stream receives), as TransformerLens's bridge gives them;
- the attention and MLP outputs may go through norms of their own before the residual add
  (GLM-4's ``post_self_attn_layernorm`` and ``post_mlp_layernorm``): ``hook_attn_out`` and
  ``hook_mlp_out`` are then those norms' outputs, the terms added to the residual stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_gpt2 import layer_norm_parts
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def rotated(
    apply: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """``apply`` (``[batch, heads, pos, d_head]``) on the first ``cos.shape[-1]`` features of each
    head; the rest pass through unrotated."""
    width = cos.shape[-1]
    rot_q, rot_k = apply(q[..., :width], k[..., :width], cos, sin)
    return torch.cat([rot_q, q[..., width:]], -1), torch.cat([rot_k, k[..., width:]], -1)


def norm_parts(config: object) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """TransformerLens's ``hook_scale`` and ``hook_normalized`` of the config's norms: LayerNorms
    where it gives ``layer_norm_eps`` (Nemotron's LayerNorm1P: ``norm_eps``), RMSNorms
    (``rms_norm_eps``) otherwise."""
    eps = getattr(config, "layer_norm_eps", None) or getattr(config, "norm_eps", None)
    if eps is not None:
        return lambda x: layer_norm_parts(x, eps)
    return lambda x: rms_parts(x, config.rms_norm_eps)


def record_projections(recorder: Recorder, layer: nn.Module, i: int) -> None:
    """q, k, v (and their norms) and the MLP's projections of layer ``i``, fused or not, under the
    keys :func:`split_qkv` and :func:`~vlens.parity.common.dense_mlp_values` read."""
    attn, mlp = layer.self_attn, layer.mlp
    common.record_qkv(recorder, attn, i)
    if hasattr(attn, "q_norm"):
        recorder.inputs(attn.q_norm, f"q_norm_in{i}", "hidden_states")
    if hasattr(mlp, "gate_up_proj"):
        recorder.output(mlp.gate_up_proj, f"gate_up{i}")
        recorder.inputs(mlp.down_proj, f"post_act{i}", "input")
    else:
        gate = "gate_proj" if hasattr(mlp, "gate_proj") else None
        common.record_dense_mlp(recorder, mlp, i, gate=gate)


def split_qkv(seen: dict, i: int, q_width: int, kv_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v of layer ``i`` (see :func:`record_projections`)."""
    if f"qkv{i}" in seen:
        q, k, v = seen[f"qkv{i}"].split([q_width, kv_width, kv_width], dim=-1)
        return q, k, v
    q, k, v = (seen[f"{part}{i}"] for part in ("q", "k", "v"))
    return q, k, v


def mlp_norm(layer: nn.Module) -> nn.Module | None:
    """The norm between attention and MLP: ``post_attention_layernorm`` (Apertus:
    ``feedforward_layernorm``); None in a parallel block (Command-R), whose MLP reads the
    attention's normed input."""
    for name in ("post_attention_layernorm", "feedforward_layernorm"):
        norm = getattr(layer, name, None)
        if norm is not None:
            return norm
    return None


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for a Llama-shaped decoder (see the module's docstring); returns the function that
    turns one forward's recordings (and its logits) into canonical names. Rotated q and k and
    per-head results are rebuilt with HuggingFace's own functions and weights; the pattern is
    HuggingFace's own attention weights."""
    config = model.config
    parts = norm_parts(config)
    heads, kv_heads, d_head = attention_dimensions(config)
    embedding_multiplier = getattr(config, "embedding_multiplier", 1.0)
    residual_multiplier = getattr(config, "residual_multiplier", 1.0)
    rotate = partial(rotated, sys.modules[type(model).__module__].apply_rotary_pos_emb)
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        record_projections(recorder, layer, i)
        recorder.inputs(attn.o_proj, f"z{i}", "input")
        recorder.output(getattr(layer, "post_self_attn_layernorm", attn), f"attn{i}")
        norm = mlp_norm(layer)
        if norm is not None:
            recorder.inputs(norm, f"mid{i}", "hidden_states")
        recorder.output(getattr(layer, "post_mlp_layernorm", layer.mlp), f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        positions = torch.arange(logits.shape[1])[None]
        cos, sin = inner.rotary_emb(seen["embed"], positions)
        out = {"hook_embed": seen["embed"] * embedding_multiplier}
        for i, layer in enumerate(inner.layers):
            block, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre = seen[f"pre{i}"]
            out |= common.block_input(block, pre, heads, kv_heads)
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = parts(pre)
            qkv = split_qkv(seen, i, heads * d_head, kv_heads * d_head)
            out |= common.qkv_heads(attn, d_head, *qkv)
            q, k = out[f"{attn}.hook_q"], out[f"{attn}.hook_k"]
            if f"q_norm{i}" in seen:
                q, k = seen[f"q_norm{i}"], seen[f"k_norm{i}"]
                if not torch.equal(seen[f"q_norm_in{i}"], out[f"{attn}.hook_q"]):
                    q, k = q.transpose(1, 2), k.transpose(1, 2)  # normed heads first (Apertus)
                out[f"{attn}.hook_q_normed"] = q.transpose(1, 2)
                out[f"{attn}.hook_k_normed"] = k.transpose(1, 2)
            out |= common.rotated_qk(attn, rotate, q, k, cos, sin)
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], layer.self_attn.o_proj.weight, heads)
            out[f"{attn}.hook_result"] = out[f"{attn}.hook_result"] * residual_multiplier
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"] * residual_multiplier
            if f"mid{i}" in seen:
                mid = seen[f"mid{i}"]
                out[f"{block}.hook_resid_mid"] = mid
                out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = parts(mid)
            out[f"{block}.hook_mlp_in"] = seen.get(f"mid{i}", pre)
            out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"] * residual_multiplier
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, parts(seen["final"]), logits)

    return values
