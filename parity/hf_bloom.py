"""HuggingFace reference for BLOOM (``model.transformer``: an embedding LayerNorm, then
``h[i]`` with ``input_layernorm``, ``self_attention``, ``post_attention_layernorm``, ``mlp``).

HuggingFace's attention and MLP add the residual inside their forward (``dropout_add``), so
``hook_attn_out`` and ``hook_mlp_out`` are the outputs of their last projections (``dense``,
``dense_4h_to_h``), the terms added to the stream. q, k and v are ``query_key_value``'s output as
HuggingFace splits it, each head's ``[q k v]`` side by side. ``hook_attn_scores`` are
``q·kᵀ/sqrt(d_head)`` plus HuggingFace's own ALiBi tensor (``build_alibi_tensor``: each head's
slope times the key's position), the future masked with -inf; ``hook_pattern`` is HuggingFace's
own attention weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vlens.parity import common
from vlens.parity.hf_gpt2 import layer_norm_parts
from vlens.parity.hf_moe import causal_scores
from vlens.parity.reference import Recorder, Values, after_blocks


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for BLOOM; returns the function that turns one forward's recordings (and its
    logits) into canonical names (see the module's docstring; ``hook_result`` is HuggingFace's z
    times ``dense``'s weight per head)."""
    config = model.config
    eps = config.layer_norm_epsilon
    heads = config.n_head
    d_head = config.hidden_size // heads
    inner = model.transformer
    recorder.inputs(inner.word_embeddings_layernorm, "embed_raw", "input")
    recorder.output(inner.word_embeddings_layernorm, "embed")
    for i, block in enumerate(inner.h):
        attn = block.self_attention
        recorder.inputs(block, f"pre{i}", "hidden_states")
        recorder.output(attn.query_key_value, f"qkv{i}")
        recorder.inputs(attn.dense, f"z{i}", "input")
        recorder.output(attn.dense, f"attn{i}")
        recorder.inputs(block.post_attention_layernorm, f"mid{i}", "input")
        common.record_dense_mlp(
            recorder, block.mlp, i, gate=None, up="dense_h_to_4h", down="dense_4h_to_h"
        )
        recorder.output(block.mlp.dense_4h_to_h, f"mlp{i}")
        recorder.output(block, f"post{i}")
    recorder.inputs(inner.ln_f, "final", "input")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        length = logits.shape[1]
        mask = torch.ones(1, length, dtype=torch.long)
        alibi = inner.build_alibi_tensor(mask, heads, torch.float32).view(1, heads, 1, length)
        out = {"hook_embed": seen["embed"]}
        out["embed_ln.hook_scale"], out["embed_ln.hook_normalized"] = layer_norm_parts(
            seen["embed_raw"], eps
        )
        for i, block in enumerate(inner.h):
            name, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out |= common.block_input(name, pre, heads, heads)
            out[f"{name}.ln1.hook_scale"], out[f"{name}.ln1.hook_normalized"] = layer_norm_parts(
                pre, eps
            )
            q, k, v = seen[f"qkv{i}"].unflatten(-1, (heads, 3, d_head)).unbind(-2)
            out |= common.qkv_heads(attn, d_head, q, k, v)
            scores = causal_scores(q.transpose(1, 2), k.transpose(1, 2), d_head**-0.5)
            out[f"{attn}.hook_attn_scores"] = scores + alibi
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], block.self_attention.dense.weight, heads)
            out[f"{name}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{name}.hook_resid_mid"] = mid
            out[f"{name}.hook_mlp_in"] = mid
            out[f"{name}.ln2.hook_scale"], out[f"{name}.ln2.hook_normalized"] = layer_norm_parts(
                mid, eps
            )
            out |= common.dense_mlp_values(f"{name}.mlp", seen, i)
            out[f"{name}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{name}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, layer_norm_parts(seen["final"], eps), logits)

    return values
