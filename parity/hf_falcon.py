"""HuggingFace reference for Falcon-7B's layout (``model.transformer.h[i]``: one LayerNorm before
attention and MLP in parallel, one key/value head, rotary positions).

q, k and v are the parts of ``query_key_value``'s output as HuggingFace splits it for
multi-query attention (``[q | k | v]``: H heads, one, one); ``hook_rot_q``/``hook_rot_k`` are
them rotated by HuggingFace's own ``apply_rotary_pos_emb`` with the model's rotary embedding;
``hook_attn_scores`` are those times ``1/sqrt(d_head)``, the future masked with -inf.
HuggingFace adds the attention's output into the MLP's in place once the MLP returns, so
``hook_mlp_out`` is a copy taken as it returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_gpt2 import layer_norm_parts
from vlens.parity.hf_moe import causal_scores
from vlens.parity.reference import Recorder, Values, after_blocks


def keep_copy(recorder: Recorder, module: nn.Module, key: str) -> None:
    """Keep a copy of ``module``'s output (one the caller then changes in place)."""

    def hook(_m: nn.Module, _args: tuple, output: Tensor) -> None:
        recorder.seen[key] = output.clone()

    recorder.handles.append(module.register_forward_hook(hook))


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for Falcon; returns the function that turns one forward's recordings (and its logits)
    into canonical names (see the module's docstring; ``hook_result`` is HuggingFace's z times
    ``dense``'s weight per head; the pattern is HuggingFace's own attention weights)."""
    config = model.config
    eps = config.layer_norm_epsilon
    heads, kv_heads, d_head = attention_dimensions(config)
    inner = model.transformer
    recorder.output(inner.word_embeddings, "embed")
    for i, layer in enumerate(inner.h):
        attn = layer.self_attention
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        recorder.output(attn.query_key_value, f"qkv{i}")
        recorder.inputs(attn.dense, f"z{i}", "input")
        recorder.output(attn, f"attn{i}")
        common.record_dense_mlp(
            recorder, layer.mlp, i, gate=None, up="dense_h_to_4h", down="dense_4h_to_h"
        )
        keep_copy(recorder, layer.mlp, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.ln_f, "final", "input")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        positions = torch.arange(logits.shape[1])[None]
        cos, sin = inner.rotary_emb(seen["embed"], positions)
        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(inner.h):
            name, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre = seen[f"pre{i}"]
            out |= common.block_input(name, pre, heads, kv_heads)
            out[f"{name}.ln1.hook_scale"], out[f"{name}.ln1.hook_normalized"] = layer_norm_parts(
                pre, eps
            )
            widths = [heads * d_head, kv_heads * d_head, kv_heads * d_head]
            out |= common.qkv_heads(attn, d_head, *seen[f"qkv{i}"].split(widths, dim=-1))
            out |= common.rotated_qk(
                attn, apply_rotary_pos_emb, out[f"{attn}.hook_q"], out[f"{attn}.hook_k"], cos, sin
            )
            rot_q, rot_k = (out[f"{attn}.hook_rot_{x}"].transpose(1, 2) for x in "qk")
            out[f"{attn}.hook_attn_scores"] = causal_scores(rot_q, rot_k, d_head**-0.5)
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(
                attn, seen[f"z{i}"], layer.self_attention.dense.weight, heads
            )
            out[f"{name}.hook_attn_out"] = seen[f"attn{i}"]
            out |= common.dense_mlp_values(f"{name}.mlp", seen, i)
            out[f"{name}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{name}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, layer_norm_parts(seen["final"], eps), logits)

    return values
