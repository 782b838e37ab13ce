"""HuggingFace reference for OPT (``model.model.decoder.layers[i]``, pre-norm LayerNorms, learned
positions).

HuggingFace runs each layer's MLP half on the rows flattened to ``[batch·pos, d_model]``; those
values are given back as ``[batch, pos, ...]``. ``hook_q`` is ``q_proj``'s output, before
HuggingFace multiplies it by ``1/sqrt(d_head)``; ``hook_attn_scores`` are q and k times that
scale, the future masked with -inf; ``hook_mlp_out`` is ``fc2``'s output.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from vlens.names.mapping import attention_dimensions
from vlens.parity import common
from vlens.parity.hf_gpt2 import layer_norm_parts
from vlens.parity.hf_moe import causal_scores
from vlens.parity.reference import Recorder, Values, after_blocks


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for OPT; returns the function that turns one forward's recordings (and its logits)
    into canonical names (see the module's docstring; ``hook_result`` is HuggingFace's z times
    ``out_proj``'s weight per head; the pattern is HuggingFace's own attention weights)."""
    config = model.config
    eps = model.model.decoder.final_layer_norm.eps
    heads, _, d_head = attention_dimensions(config)
    decoder = model.model.decoder
    recorder.output(decoder.embed_tokens, "embed")
    recorder.output(decoder.embed_positions, "pos_embed")
    for i, layer in enumerate(decoder.layers):
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        common.record_qkv(recorder, layer.self_attn, i)
        recorder.inputs(layer.self_attn.out_proj, f"z{i}", "input")
        recorder.output(layer.self_attn, f"attn{i}")
        recorder.inputs(layer.final_layer_norm, f"mid{i}", "input")
        common.record_dense_mlp(recorder, layer, i, gate=None, up="fc1", down="fc2")
        recorder.output(layer.fc2, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(decoder.final_layer_norm, "final", "input")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        batch, positions = logits.shape[:2]

        def rows(key: str) -> Tensor:
            """A value HuggingFace computed on flattened rows, as ``[batch, pos, ...]``."""
            return seen[key].reshape(batch, positions, -1)

        out = {"hook_embed": seen["embed"], "hook_pos_embed": seen["pos_embed"]}
        for i, layer in enumerate(decoder.layers):
            name, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre, mid = seen[f"pre{i}"], rows(f"mid{i}")
            out |= common.block_input(name, pre, heads, heads)
            out[f"{name}.ln1.hook_scale"], out[f"{name}.ln1.hook_normalized"] = layer_norm_parts(
                pre, eps
            )
            out |= common.qkv_heads(attn, d_head, *(seen[f"{p}{i}"] for p in "qkv"))
            q, k = (out[f"{attn}.hook_{x}"].transpose(1, 2) for x in "qk")
            out[f"{attn}.hook_attn_scores"] = causal_scores(q, k, layer.self_attn.scaling)
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], layer.self_attn.out_proj.weight, heads)
            out[f"{name}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{name}.hook_resid_mid"] = mid
            out[f"{name}.hook_mlp_in"] = mid
            out[f"{name}.ln2.hook_scale"], out[f"{name}.ln2.hook_normalized"] = layer_norm_parts(
                mid, eps
            )
            out[f"{name}.mlp.hook_pre"] = rows(f"up{i}")
            out[f"{name}.mlp.hook_post"] = rows(f"post_act{i}")
            out[f"{name}.hook_mlp_out"] = rows(f"mlp{i}")
            out[f"{name}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, layer_norm_parts(seen["final"], eps), logits)

    return values
