"""HuggingFace reference for the architectures vLLM serves through its Transformers backend
(``mappings/_transformers.py``), read off the modules that TransformerLens's adapter names.

Values HuggingFace forms outside any module are rebuilt from its tensors with its own code: q, k
and v split from a joint projection as the architecture's attention splits it, rotated q and k
with the model's rotary embedding and ``apply_rotary_pos_emb``, norm scales from the norm's input,
per-head results from ``z`` and the output projection's weight. The pattern is HuggingFace's own
attention weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.mappings import served
from vlens.mappings._rotary import modeling_module, rotary_of, rotate_part, uses_rotary
from vlens.mappings._transformers import DETAILS, Layout, layout_of, norm_eps
from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_gpt2 import layer_norm_parts
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks on the modules of ``layout_of(model.config)``; returns the function turning one
    forward's recordings (and its logits and attention weights) into canonical names."""
    config = model.config
    layout = layout_of(config)
    served()  # imports every mapping file, which declares its architectures' details
    eps = norm_eps(config, DETAILS[config.architectures[0]])
    norm_parts = rms_parts if layout.norm == "RMS" else layer_norm_parts
    heads, kv_heads, d_head = attention_dimensions(config)
    inner = getattr(model, layout.base)
    layers = inner.get_submodule(layout.layers)
    recorder.output(inner.get_submodule(layout.embed), "embed")
    for i, layer in enumerate(layers):
        attn, mlp = layer.get_submodule(layout.attn), layer.get_submodule(layout.mlp)
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        for part in ("q", "k", "v", "qkv"):
            if getattr(layout, part) is not None:
                recorder.output(attn.get_submodule(getattr(layout, part)), f"{part}{i}")
        for part in ("q_norm", "k_norm"):
            if getattr(layout, part) is not None:
                recorder.output(attn.get_submodule(getattr(layout, part)), f"{part}{i}")
        recorder.inputs(attn.get_submodule(layout.o), f"z{i}", "input")
        recorder.output(attn, f"attn{i}")
        for part in ("ln1_post", "ln2_post"):
            if getattr(layout, part) is not None:
                norm = layer.get_submodule(getattr(layout, part))
                recorder.inputs(norm, f"{part}_in{i}", "hidden_states")
                recorder.output(norm, f"{part}_out{i}")
        if layout.ln2 is not None:
            recorder.inputs(layer.get_submodule(layout.ln2), f"mid{i}", "hidden_states")
        else:
            recorder.inputs(mlp, f"mid{i}", "hidden_states")
        common.record_dense_mlp(recorder, mlp, i, layout.mlp_gate, layout.mlp_in, layout.mlp_out)
        recorder.output(mlp, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.get_submodule(layout.ln_final), "final", "hidden_states")
    modeling = modeling_module(config)

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        positions = torch.arange(logits.shape[1])[None]

        def rotate(x: Tensor, layer: int) -> Tensor:  # [b, p, h, d]
            if not uses_rotary(config, layer):
                return x
            cos, sin = rotary_of(inner.rotary_emb, config, layer, seen["embed"], positions)
            return rotate_part(modeling, x.transpose(1, 2), cos, sin).transpose(1, 2)

        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(layers):
            block, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(block, pre, heads, kv_heads)
            if layout.ln1 is not None:
                out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = norm_parts(
                    pre, eps
                )
            out |= common.qkv_heads(attn, d_head, *split_qkv(seen, i, layout, d_head))
            q, k = out[f"{attn}.hook_q"], out[f"{attn}.hook_k"]
            if layout.q_norm is not None:
                out[f"{attn}.hook_q_normed"] = seen[f"q_norm{i}"]
                out[f"{attn}.hook_k_normed"] = seen[f"k_norm{i}"]
                q, k = (common.per_head(seen[f"{x}_norm{i}"], d_head) for x in ("q", "k"))
            out[f"{attn}.hook_rot_q"] = rotate(q, i)
            out[f"{attn}.hook_rot_k"] = rotate(k, i)
            out[f"{attn}.hook_pattern"] = attentions[i]
            w_o = layer.get_submodule(f"{layout.attn}.{layout.o}").weight
            out |= common.z_and_result(attn, seen[f"z{i}"], w_o, heads)
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"]
            if not layout.parallel:
                out[f"{block}.hook_resid_mid"] = mid
            if not layout.parallel or layout.ln2 is not None:
                out[f"{block}.hook_mlp_in"] = mid
            if layout.ln2 is not None:
                out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = norm_parts(
                    mid, eps
                )
            out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"]
            # A norm after a sublayer (before the residual add) gives the sublayer's term.
            for norm, term in (("ln1_post", "hook_attn_out"), ("ln2_post", "hook_mlp_out")):
                if getattr(layout, norm) is not None:
                    scale, normalized = norm_parts(seen[f"{norm}_in{i}"], eps)
                    out[f"{block}.{norm}.hook_scale"] = scale
                    out[f"{block}.{norm}.hook_normalized"] = normalized
                    out[f"{block}.{term}"] = seen[f"{norm}_out{i}"]
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, norm_parts(seen["final"], eps), logits)

    return values


def split_qkv(
    seen: dict[str, Tensor], i: int, layout: Layout, d_head: int
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v per head ``[b, p, h, d]``: the separate projections' outputs, or a joint
    projection's split as GPT-NeoX's attention splits it (each head's ``[q | k | v]``)."""
    if layout.qkv is None:
        return tuple(common.per_head(seen[f"{part}{i}"], d_head) for part in ("q", "k", "v"))
    qkv = seen[f"qkv{i}"]
    return common.per_head(qkv, 3 * d_head).chunk(3, dim=-1)
